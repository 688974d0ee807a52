"""For the api tests: an app on the embedded broker with its lifespan run, its httpx client, an
app served over real HTTP, request bodies in both wire forms, the engine called directly on
the same request, and a DP run's keyed steps checked through any api."""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import uvicorn
from fastapi import FastAPI

from psgrad._wire import REQUEST_KEY, RESPONSE_KEY, fields_from_safetensors, fields_to_safetensors
from service import engine
from service.api import create_app
from service.api.body import decode_json_body
from service.config import Settings
from service.registry import ModelRegistry
from service.validate import parse_request
from tests.support.client import free_port

SAFETENSORS = "application/x-safetensors"
# The MindSpore tutorial's TD(0) example, checked by hand in docs/requests.md ("TD(0) semantics"):
# V(s) = 0, V(s') = -0.2, delta 1.8, updates [3.6, 1.8, -3.6], grads [-7.2, -3.6, 7.2].
TD0 = {
    "model": "linear-value",
    "inputs": [[2.0, 1.0, -2.0]],
    "next_inputs": [[1.0, 2.0, 0.0]],
    "rewards": [2.0],
    "gamma": 1.0,
    "weights": {"theta": [0.2, -0.2, 0.1]},
}


def settings(**overrides: Any) -> Settings:
    base: dict[str, Any] = {
        "redis_url": None,
        "model_dir": None,
        "batch_max_delay_ms": 2.0,
        "request_timeout_s": 120.0,
        "api_keys": "",
        "admin_keys": "",
        "device": "cpu",
        # gradient stores: never the user's own data directory
        "data_dir": str(Path(tempfile.gettempdir()) / f"psgrad-test-data-{os.getpid()}"),
    }
    return Settings(**{**base, **overrides})


@asynccontextmanager
async def open_client(**overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A client of a fresh app (own broker, registry and metrics) with its lifespan running."""
    app = create_app(settings(**overrides))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://psgrad.test", timeout=120
        ) as client,
    ):
        client.app = app  # type: ignore[attr-defined]
        yield client


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """``app`` under uvicorn on a free loopback port, in a thread, its lifespan running; yields
    its URL and stops it after."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(600):
        if server.started or not thread.is_alive():
            break
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def app_of(client: httpx.AsyncClient) -> FastAPI:
    app: FastAPI = client.app  # type: ignore[attr-defined]
    return app


def safetensors_body(doc: dict[str, Any]) -> bytes:
    """The safetensors form of a JSON request document (tensors as float32/int64 arrays)."""
    fields = decode_json_body(doc, max_elements=1 << 24)
    return fields_to_safetensors(fields, REQUEST_KEY)


async def post_st(
    client: httpx.AsyncClient, doc: dict[str, Any], path: str = "/per-sample-grads"
) -> tuple[httpx.Response, dict[str, Any]]:
    r = await client.post(
        path,
        content=safetensors_body(doc),
        headers={"content-type": SAFETENSORS, "accept": SAFETENSORS},
    )
    fields = fields_from_safetensors(r.content, RESPONSE_KEY) if r.status_code == 200 else {}
    return r, fields


def in_process(doc: dict[str, Any], registry: ModelRegistry | None = None) -> dict[str, Any]:
    """The engine called directly on the same request: numpy per output name."""
    registry = registry or ModelRegistry()
    fields = decode_json_body(doc, max_elements=1 << 24)
    parsed = parse_request(fields, registry)
    out = engine.compute(parsed.model, parsed.batch, parsed.opts)[0]
    return {k: _np(v) for k, v in out.items() if k != "meta"}


def _np(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _np(v) for k, v in value.items()}
    return value.detach().cpu().numpy()


def assert_outputs(got: dict[str, Any], want: dict[str, Any], *, exact: bool = False) -> None:
    """Every output in ``want`` equals ``got`` (lists from JSON or arrays from safetensors)."""
    for name, ref in want.items():
        value = got[name]
        if isinstance(ref, dict):
            assert set(value) == set(ref), name
            pairs = [(np.asarray(value[k], dtype=np.float32), ref[k]) for k in ref]
        else:
            pairs = [(np.asarray(value, dtype=np.float32), ref)]
        for a, b in pairs:
            assert a.shape == b.shape, name
            if exact:
                np.testing.assert_array_equal(a, b, err_msg=name)
            else:
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


async def finished_job(c: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    """``GET /jobs/{id}`` once the job is neither queued nor running (at most 12 s)."""
    for _ in range(600):
        body: dict[str, Any] = (await c.get(f"/jobs/{job_id}")).json()
        if body["status"] not in ("queued", "running"):
            return body
        await asyncio.sleep(0.02)
    raise AssertionError(f"job {job_id} did not finish")


async def until_ready(c: httpx.AsyncClient, within_s: float = 60.0) -> httpx.Response:
    """``GET /readyz`` once it answers 200, or its last answer after ``within_s``: the workers'
    start-up warm-ups (seconds in a fresh process) end before a server is ready."""
    end = time.monotonic() + within_s
    while (r := await c.get("/readyz")).status_code != 200 and time.monotonic() < end:
        await asyncio.sleep(0.05)
    return r


async def keyed_steps_answer_their_first_try(c: httpx.AsyncClient, run_body: dict[str, Any],
                                             step: dict[str, Any]) -> None:
    """A DP run made from ``run_body``, its steps (``step`` with the run's ``dp_run``) sent
    under ``Idempotency-Key`` s: each try of a key answers its first try's noisy mean, two
    tries at once included, counted once, kept where ``Content-Location`` says until deleted;
    another key is another step, and the key sent with another body a 422."""
    run = (await c.post("/dp-runs", json=run_body)).json()
    body = {**step, "dp_run": run["id"]}
    key = {"Idempotency-Key": "step-1"}

    async def sent(after_s: float) -> httpx.Response:
        await asyncio.sleep(after_s)
        return await c.post("/per-sample-grads", json=body, headers=key)

    tries = list(await asyncio.gather(sent(0.0), sent(0.2)))  # the first waiting already
    tries.append(await c.post("/per-sample-grads", json=body, headers=key))
    assert [r.status_code for r in tries] == [200] * 3, tries[0].text
    first = tries[0].json()
    assert first["dp"]["steps"] == 1 and all(r.json() == first for r in tries)
    kept = tries[0].headers["content-location"]  # where the answer is kept: /jobs/{id}
    assert kept.startswith("/jobs/") and {r.headers["content-location"] for r in tries} == {kept}
    job = (await c.get(kept)).json()
    assert job["status"] == "succeeded" and job["result"]["clipped_mean"] == first["clipped_mean"]
    binary = await c.post("/per-sample-grads", json=body, headers={**key, "accept": SAFETENSORS})
    for name, value in fields_from_safetensors(binary.content, RESPONSE_KEY)["clipped_mean"
                                                                              ].items():
        np.testing.assert_array_equal(value, np.asarray(first["clipped_mean"][name], np.float32))
    other = await c.post("/per-sample-grads", json={**body, "targets": body["targets"][::-1]},
                         headers=key)
    assert other.status_code == 422 and "Idempotency-Key" in other.text, other.text
    second = (await c.post("/per-sample-grads", json=body,
                           headers={"Idempotency-Key": "step-2"})).json()
    assert second["dp"]["steps"] == 2 and second["clipped_mean"] != first["clipped_mean"]
    assert (await c.get(f"/dp-runs/{run['id']}")).json()["steps"] == 2
    assert (await c.delete(kept)).status_code == 200  # released: the key names no job now
    assert (await c.get(kept)).status_code == 404
