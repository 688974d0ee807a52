"""``wait_ready`` (sync and async) and ``psgrad ready``: wait for ``/readyz`` over real HTTP, while
a server's workers warm up (held open here by an event), where nothing listens yet, or where
the answer is not "not ready"."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import psgrad
from psgrad._cli import main as cli
from service.api import create_app
from service.worker import loop
from tests.support.api import serving, settings
from tests.support.client import free_port


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Workers whose start-up warm-up waits for the event this yields (set at the end)."""
    gate, made = threading.Event(), loop.warm_kernels

    def warm() -> None:
        assert gate.wait(60), "the test never let the warm-up end"
        made()

    monkeypatch.setattr(loop, "warm_kernels", warm)
    yield gate
    gate.set()


@contextmanager
def warming(gate: threading.Event) -> Iterator[str]:
    """A server whose workers warm up until ``gate`` is set; set when the block ends, whatever
    failed, before the server stops (it joins its workers)."""
    with serving(create_app(settings())) as url:
        try:
            yield url
        finally:
            gate.set()


def test_waits_for_the_warm_up_then_returns(held: threading.Event) -> None:
    with warming(held) as url, psgrad.Client(url) as client:
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (client.wait_ready(30), done.set()))
        waiter.start()
        assert not done.wait(1.0), "ready while its workers were still warming up"
        held.set()
        waiter.join(30)
        assert done.is_set()
        td0 = client.td0("linear-value", [[2.0, 1.0, -2.0]], [2.0], [[1.0, 2.0, 0.0]],
                         weights={"theta": [0.2, -0.2, 0.1]}, gamma=1.0)
        assert td0.td_errors.tolist() == pytest.approx([1.8])


def test_async_waits_and_says_what_it_last_heard(held: threading.Event) -> None:
    async def scenario(url: str) -> None:
        async with psgrad.AsyncClient(url) as client:
            started = time.monotonic()
            with pytest.raises(psgrad.APITimeoutError, match=r"not ready within 0\.5 s") as info:
                await client.wait_ready(0.5)
            assert time.monotonic() - started < 5
            assert "answered 503" in info.value.message and '"ready":false' in info.value.message
            waiting = asyncio.create_task(client.wait_ready(30))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            held.set()
            await asyncio.wait_for(waiting, 30)

    with warming(held) as url:
        asyncio.run(scenario(url))


def test_a_server_not_up_yet_is_waited_for_until_within() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with psgrad.Client(url) as client, pytest.raises(psgrad.APITimeoutError) as info:
        client.wait_ready(0.3)
    assert "could not be reached" in info.value.message and url in info.value.message


def test_no_worker_is_ready_only_without_need_worker() -> None:
    with serving(create_app(settings(workers=0))) as url, psgrad.Client(url) as client:
        client.wait_ready(5, need_worker=False)  # jobs can be queued
        with pytest.raises(psgrad.APITimeoutError, match="answered 503"):
            client.wait_ready(0.3)


def test_an_answer_other_than_not_ready_raises_at_once() -> None:
    with serving(create_app(settings())) as url, psgrad.Client(f"{url}/no/such") as client:
        started = time.monotonic()
        with pytest.raises(psgrad.NotFound):
            client.wait_ready(30)
        assert time.monotonic() - started < 5


def test_the_command_waits_and_exits_1_on_time_out(
        held: threading.Event, capsys: pytest.CaptureFixture[str]) -> None:
    with warming(held) as url:
        assert cli(["ready", "--url", url, "--within", "0.3"]) == 1
        assert "not ready within 0.3 s" in capsys.readouterr().err
        held.set()
        assert cli(["ready", "--url", url, "--within", "30"]) == 0
        assert capsys.readouterr().out == "ready\n"
