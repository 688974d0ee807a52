"""The rooms one request walks: how often its path returns to a module it has already left.

    python benchmarks/walk.py [--outputs norms,clipped_mean] [--redis redis://127.0.0.1:6379/0]

A room is a top-level entry of ``service/`` (a module or a package: ``api``, ``validate``,
``fast_stats``, ...) or the client package ``psgrad``. One ``POST /per-sample-grads`` to the zoo's
``mlp`` (B=2) is traced in embedded mode after a warm-up request, every Python call on every
thread (``sys.setprofile``), the engine's computation (``engine.compute`` and everything under
it) as one stop, a list, set or dict comprehension as its function's own code (Python 3.12
inlines them). Per thread (the api's event loop, the worker's), the rooms in the order they
are entered (a stop each time the room changes) and the returns: stops at a room this thread
had already left. A return is a hop back up or across the layers: the fewer, the fewer rooms a
reader holds to follow a request. A coroutine or generator resumed after an ``await`` or a
``yield`` is not entered again: a reader follows the awaiting call once, where the event loop
resumes it (and every frame it awaits through, the middleware first) as often as a wait
happens to end. Counts, not times: the same on every run of one commit in embedded mode.

With ``--redis``, in Redis mode instead: the api on a Redis broker (under a fresh key prefix,
deleted after) and one worker loop on a Redis job source in this process, as ``psgrad worker``
runs it; the threads that only keep time (the source's heartbeat) are left out. The api relays
the answer as its pieces arrive, so its count there moves with how many reads that takes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dis
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SERVICE = f"{ROOT}/service/"
KEEPING = {"psgrad-keeper"}  # threads that keep time, not a request's path
ENGINE = f"{ROOT}/service/engine.py"
RESUME = dis.opmap["RESUME"]
# list, set and dict comprehensions: their function's own code, inlined from Python 3.12 on
# (PEP 709); 3.11 runs each as a call of its own, which a reader does not follow
INLINE = {"<listcomp>", "<setcomp>", "<dictcomp>"}


def room_of(path: str) -> str | None:
    """The room of a source file, or None outside the project's code."""
    if path.startswith(SERVICE):
        return path[len(SERVICE):].split("/")[0].removesuffix(".py")
    if "/psgrad/" in path and "/client/" in path:
        return "psgrad"
    return None


def resumed(frame: FrameType) -> bool:
    """Whether a call event resumes a suspended generator or coroutine rather than enters it."""
    code, at = frame.f_code.co_code, frame.f_lasti
    return at >= 0 and code[at] == RESUME and code[at + 1] != 0


class Walk:
    """Each thread's rooms, in the order entered, while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.rooms: dict[str, list[str]] = {}
        self._engine = threading.local()  # the depth of engine.compute calls on this thread

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        computing = code.co_name == "compute" and code.co_filename == ENGINE
        depth = getattr(self._engine, "depth", 0)
        if event == "return" and computing and depth:
            self._engine.depth = depth - 1
        if event != "call" or not self.on or resumed(frame) or code.co_name in INLINE:
            return
        if computing:
            self._engine.depth = depth + 1
        room = room_of(code.co_filename)
        if room is None or (depth and not computing):
            return
        seq = self.rooms.setdefault(threading.current_thread().name, [])
        if not seq or seq[-1] != room:
            seq.append(room)


def returns(seq: list[str]) -> int:
    """Stops at a room already left."""
    seen: set[str] = set()
    count = 0
    for room in seq:
        count += room in seen
        seen.add(room)
    return count


@contextlib.contextmanager
def redis_worker(url: str) -> Iterator[dict[str, Any]]:
    """Redis mode's settings for the api, under a fresh prefix, with one worker loop serving
    them in a thread of this process until the block ends."""
    import redis

    from service.broker.redis.worker import consumer_name
    from service.config import Settings
    from tests.support.redis import prefix_on, worker_loop

    client = redis.Redis.from_url(url)
    with prefix_on(client) as prefix:
        fields = {"redis_url": url, "redis_prefix": prefix, "device": "cpu",
                  "batch_max_delay_ms": 1.0, "heartbeat_s": 5.0}
        with worker_loop(Settings(**fields), consumer_name("cpu")):
            yield fields
    client.close()


async def trace(outputs: list[str], redis_url: str | None = None) -> Walk:
    from tests.support.api import open_client

    doc = {"model": "mlp", "inputs": [[0.1] * 784] * 2, "targets": [1, 2], "outputs": outputs,
           "clip_norm": 1.0, "seed": 3}
    walk = Walk()
    threading.setprofile(walk)  # before any thread of the walk starts
    sys.setprofile(walk)
    try:
        mode: contextlib.AbstractContextManager[dict[str, Any]] = (
            redis_worker(redis_url) if redis_url else contextlib.nullcontext({}))
        with mode as settings:
            async with open_client(**settings) as client:
                for on in (False, True):  # the first request warms up
                    walk.on = on
                    r = await client.post("/per-sample-grads", json=doc)
                    assert r.status_code == 200, r.text
                    walk.on = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return walk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outputs", default="norms,clipped_mean")
    parser.add_argument("--redis", metavar="URL", help="Redis mode, on this Redis")
    args = parser.parse_args()
    walk = asyncio.run(trace(args.outputs.split(","), args.redis))
    rooms = {t: seq for t, seq in walk.rooms.items() if t not in KEEPING}
    print("| thread | stops | returns | rooms in order |")
    print("|---|---|---|---|")
    for thread, seq in rooms.items():
        print(f"| {thread} | {len(seq)} | {returns(seq)} | {' > '.join(seq)} |")
    stops = sum(len(s) for s in rooms.values())
    print(f"| all | {stops} | {sum(returns(s) for s in rooms.values())} | |")


if __name__ == "__main__":
    main()
