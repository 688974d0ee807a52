"""For the SDK tests: the real app in-process for the sync client, ``psgrad serve``, free ports.

httpx's ``ASGITransport`` is async-only; :class:`SyncASGITransport` runs it (and the app's
lifespan) on an event loop in a background thread so ``psgrad.Client`` can call the real app
in-process, without starlette's TestClient.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from anyio.from_thread import BlockingPortal, start_blocking_portal


class SyncASGITransport(httpx.BaseTransport):
    """``httpx.ASGITransport`` for a sync ``httpx.Client``, through a blocking portal."""

    def __init__(self, app: Any, portal: BlockingPortal) -> None:
        self._inner = httpx.ASGITransport(app=app)
        self._portal = portal

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        async def call() -> httpx.Response:
            response = await self._inner.handle_async_request(request)
            content = await response.aread()
            return httpx.Response(response.status_code, headers=response.headers,
                                  content=content, request=request)

        return self._portal.call(call)


@contextlib.contextmanager
def running_app(app: Any) -> Iterator[SyncASGITransport]:
    """The app with its lifespan entered (broker and worker threads up), as a sync transport."""
    with start_blocking_portal() as portal, \
            portal.wrap_async_context_manager(app.router.lifespan_context(app)):
        yield SyncASGITransport(app, portal)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The ``psgrad`` command as installed (the client's console script, which the server's entry
# point extends), beside this interpreter.
PSGRAD_SCRIPT = str(Path(sys.executable).with_name("psgrad"))


@contextlib.contextmanager
def psgrad_serve(env: Mapping[str, str] | None = None, *, startup_s: float = 90.0,
                 cwd: Path | None = None, command: Sequence[str] | None = None) -> Iterator[str]:
    """``psgrad serve`` in a subprocess on a free loopback port; yields its URL.

    ``command`` runs it (default ``python -m service.cli``), in ``cwd``."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    full_env = {**os.environ, "PSGRAD_WORKERS": "1", **(env or {})}
    full_env.pop("PSGRAD_REDIS_URL", None)
    proc = subprocess.Popen(
        [*(command or (sys.executable, "-m", "service.cli")), "serve", "--port", str(port),
         "--log-level", "warning"],
        env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
    )
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                out = proc.stdout.read() if proc.stdout else ""
                raise RuntimeError(f"psgrad serve exited with {proc.returncode}:\n{out}")
            try:
                if httpx.get(f"{url}/readyz", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"psgrad serve did not become ready within {startup_s} s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
