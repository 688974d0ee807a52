"""For the Redis tests: a unique key prefix per test (its keys deleted after), private Redis
servers, ``psgrad worker`` processes or a worker loop in a thread, waiting, and Prometheus
samples."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from service.broker.redis.api import RedisBroker
from service.broker.redis.worker import RedisJobSource
from service.config import Settings
from service.registry import make_registry
from service.storage import open_storage
from service.worker.events import Events
from service.worker.loop import Worker
from service.worker.recorder import WorkerStatus
from tests.support.client import free_port

SHARED_URL = os.environ.get("PSGRAD_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ROOT = Path(__file__).resolve().parents[2]


def redis_or_skip(url: str = SHARED_URL) -> redis.Redis:
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError:
        pytest.skip(f"no Redis at {url}")
    return client


@contextlib.contextmanager
def prefix_on(client: redis.Redis) -> Iterator[str]:
    """A fresh key prefix; every key under it is deleted afterwards."""
    prefix = f"psgrad-test-{uuid.uuid4().hex[:10]}"
    try:
        yield prefix
    finally:
        with contextlib.suppress(redis.RedisError):
            doomed = list(client.scan_iter(match=f"{prefix}:*", count=1000))
            if doomed:
                client.delete(*doomed)


@contextlib.asynccontextmanager
async def queue(settings: Settings) -> AsyncIterator[tuple[RedisBroker, RedisJobSource]]:
    """The api's broker and a worker's source (consumer ``w``) on ``settings``, closed after."""
    broker, source = RedisBroker(settings), RedisJobSource(settings, name="w")
    try:
        yield broker, source
    finally:
        source.close()
        await broker.close()


@contextlib.contextmanager
def worker_loop(settings: Settings, name: str, events: Events | None = None,
                status: WorkerStatus | None = None, block_s: float | None = None
                ) -> Iterator[RedisJobSource]:
    """One worker loop on a Redis job source named ``name``, in a thread of this process, wired
    as ``psgrad worker`` wires it (its own storage and registry, the source's heartbeat
    publishing ``status``), until the block ends; ``block_s`` as ``Worker.run`` takes it."""
    storage = open_storage(settings)
    source = RedisJobSource(settings, name=name)
    if status is not None:
        source.status = status.snapshot_json
    work = Worker(source, make_registry(settings, storage.models), settings, events or Events(),
                  name=name, storage=storage)
    stop = threading.Event()
    loop = threading.Thread(target=work.run, args=(stop,), name="psgrad-worker-loop",
                            kwargs={} if block_s is None else {"block_s": block_s}, daemon=True)
    source.start()
    loop.start()
    try:
        yield source
    finally:
        stop.set()
        loop.join(30)
        source.close()
        storage.close()


def fresh_prefix() -> Iterator[str]:
    """A fixture's body (``prefix = pytest.fixture(fresh_prefix)``): a fresh prefix on the shared
    Redis, its keys deleted after; the test skips without a Redis."""
    client = redis_or_skip()
    with prefix_on(client) as p:
        yield p
    client.close()


def quick_settings() -> Iterator[Settings]:
    """A fixture's body: settings on the shared Redis under a fresh prefix, with a short result
    TTL and heartbeat and a 1 ms batching window (a test's worker loop answers at once)."""
    shared = redis_or_skip()
    with prefix_on(shared) as prefix:
        yield Settings(redis_url=SHARED_URL, redis_prefix=prefix, result_ttl_s=30,
                       heartbeat_s=0.2, batch_max_delay_ms=1.0, device="cpu")
    shared.close()


class OwnRedis:
    """A private redis-server on a free port, to stop and restart without touching 6379.

    ``password``: it asks for one. ``unix_socket``: it also listens on a socket file in ``tmp``,
    and :attr:`url` names that (docker-compose.yml's ``redis-answers``, reached so).
    """

    def __init__(self, tmp: Path, *options: str, password: str | None = None,
                 unix_socket: bool = False, binary: str = "redis-server") -> None:
        if shutil.which(binary) is None:
            pytest.skip(f"{binary} is not installed")
        self.binary = binary  # another server speaking the protocol, e.g. valkey-server
        self.port = free_port()
        self.dir = tmp
        self.password = password
        self.socket = tmp / f"redis-{self.port}.sock" if unix_socket else None
        self.options = [  # more redis-server options, e.g. "--proto-max-bulk-len", "1mb"
            *options, *(["--requirepass", password] if password else []),
            *(["--unixsocket", str(self.socket), "--unixsocketperm", "700"] if self.socket
              else [])]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f"password={self.password}" if self.password else ""
        if self.socket:
            return f"unix://{self.socket}?db=0" + (f"&{auth}" if auth else "")
        return f"redis://127.0.0.1:{self.port}/0" + (f"?{auth}" if auth else "")

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), *self.options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, password=self.password, socket_timeout=1)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError("own redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def worker_process(settings_env: dict[str, str], device: str = "cpu",
                   **popen: Any) -> subprocess.Popen[bytes]:
    """``psgrad worker`` as a real process (through the module, so no PATH lookup)."""
    env = {**os.environ, **settings_env, "THP_MEM_ALLOC_ENABLE": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "service.cli", "worker", "--device", device],
        env=env, cwd=ROOT, **popen)


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def metric(text: str, name: str) -> float:
    """One sample's value from a Prometheus text page (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


async def result_of(state: Any) -> dict[str, Any] | None:
    """A job state's result: whole (embedded) or read from its answer's pieces (Redis)."""
    from service.jobs import read_answer

    if state.answer is not None:
        return await read_answer(state.answer)
    return state.result  # type: ignore[no-any-return]
