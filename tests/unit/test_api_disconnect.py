"""Issue 53, finding 8: an answer whose client went away mid-transfer is released at once.

A real uvicorn server streams a gradients answer of about 21 MB; the client reads its first
bytes and hangs up. The answer's arrays must die then, not when the cyclic garbage collector
next runs (which, with nothing else allocating, was the next request: a 2 GiB answer kept the
api 2 GB larger until then). The collector is off while the test waits, so only references
dropped for real count.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from starlette.requests import Request

from service.api import create_app
from service.api.body import encode_result
from service.api.routes import grads as grads_route
from tests.support.api import SAFETENSORS, serving, settings

BATCH = 8  # mlp's 669,706 parameters: 21 MB of float32 gradients, far past the socket buffers


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("accept", ["application/json", SAFETENSORS])
def test_finding_8_a_dropped_answer_is_released_at_once(
    accept: str, monkeypatch: pytest.MonkeyPatch, no_collector: None
) -> None:
    answers: list[weakref.ref[np.ndarray]] = []
    encode = grads_route.encode_result

    async def watched(request: Any, result: dict[str, Any], **kw: Any) -> Any:
        answers.extend(weakref.ref(a) for a in result["grads"].values())
        return await encode(request, result, **kw)

    monkeypatch.setattr(grads_route, "encode_result", watched)
    rng = np.random.default_rng(0)
    body = json.dumps({
        "model": "mlp",
        "inputs": rng.standard_normal((BATCH, 784)).astype(np.float32).tolist(),
        "targets": [i % 10 for i in range(BATCH)],
        "outputs": ["grads"],
    }).encode()
    with serving(create_app(settings(workers=1))) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(b"POST /per-sample-grads HTTP/1.1\r\nhost: psgrad.test\r\n"
                      b"content-type: application/json\r\n"
                      + f"accept: {accept}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                      + body)
            head = s.recv(65536)
            assert head.startswith(b"HTTP/1.1 200"), head[:200]
            assert answers and all(a() is not None for a in answers)  # still being sent
        deadline = time.monotonic() + 5.0
        while any(a() is not None for a in answers) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = sum(a() is not None for a in answers)
        assert alive == 0, f"{alive} of {len(answers)} answer arrays outlived their client"


@pytest.mark.parametrize("accept", ["application/json", SAFETENSORS])
async def test_finding_8_released_when_the_hang_up_lands_in_a_write(
    accept: str, no_collector: None
) -> None:
    """The other order of the same race: the hang-up is seen while a write waits for the
    socket, so the stream is cancelled outside the body's iterator, which is left suspended."""
    grads = {"w": np.ones((64, 1 << 18), np.float32)}  # 64 MiB
    answer = weakref.ref(grads["w"])
    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "headers": [
        (b"accept", accept.encode())]}
    response = await encode_result(Request(scope), {"grads": grads})
    del grads
    writing = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            writing.set()
            await asyncio.Event().wait()  # a client that never reads

    async def receive() -> dict[str, Any]:
        await writing.wait()
        return {"type": "http.disconnect"}

    await response(scope, receive, send)
    del response
    assert answer() is None, "the answer outlived its client"


def test_a_client_that_leaves_mid_upload_is_a_499_not_a_500(
        caplog: pytest.LogCaptureFixture) -> None:
    """A client that sends half its body and hangs up: one info line, counted as 499 (it was
    an ERROR with ClientDisconnect's traceback and a 500 in psgrad_requests_total, which the
    documented 'server errors' alert reads as a bug)."""
    import httpx

    with serving(create_app(settings(workers=1))) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(b"POST /per-sample-grads HTTP/1.1\r\nhost: psgrad.test\r\n"
                      b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
                      b'{"model": "mlp", "inputs": [[0.5')
            time.sleep(0.3)
        deadline = time.monotonic() + 10
        metrics = ""
        while 'status="499"' not in metrics and time.monotonic() < deadline:
            time.sleep(0.1)
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'route="/per-sample-grads",status="499"' in metrics.replace('method="POST",', ""), (
        [line for line in metrics.splitlines() if "requests_total" in line])
    assert 'route="/per-sample-grads",status="500"' not in metrics.replace('method="POST",', "")
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
