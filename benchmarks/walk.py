"""The rooms one request walks: how often its path returns to a module it has already left.

    python benchmarks/walk.py [--outputs norms,clipped_mean]

A room is a top-level entry of ``service/`` (a module or a package: ``api``, ``validate``,
``fast_stats``, ...) or the client package ``psgrad``. One ``POST /per-sample-grads`` to the zoo's
``mlp`` (B=2) is traced in embedded mode after a warm-up request, every Python call on every
thread (``sys.setprofile``), the engine's computation (``engine.compute`` and everything under
it) as one stop. Per thread (the api's event loop, the worker's), the rooms in the order they
are entered (a stop each time the room changes) and the returns: stops at a room this thread
had already left. A return is a hop back up or across the layers: the fewer, the fewer rooms a
reader holds to follow a request. Counts, not times: the same on every run of one commit.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SERVICE = f"{ROOT}/service/"
ENGINE = f"{ROOT}/service/engine.py"


def room_of(path: str) -> str | None:
    """The room of a source file, or None outside the project's code."""
    if path.startswith(SERVICE):
        return path[len(SERVICE):].split("/")[0].removesuffix(".py")
    if "/psgrad/" in path and "/client/" in path:
        return "psgrad"
    return None


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
        if event != "call" or not self.on:
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


async def trace(outputs: list[str]) -> Walk:
    from tests.support.api import open_client

    doc = {"model": "mlp", "inputs": [[0.1] * 784] * 2, "targets": [1, 2], "outputs": outputs,
           "clip_norm": 1.0, "seed": 3}
    walk = Walk()
    threading.setprofile(walk)
    sys.setprofile(walk)
    try:
        async with open_client() as client:
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
    args = parser.parse_args()
    walk = asyncio.run(trace(args.outputs.split(",")))
    print("| thread | stops | returns | rooms in order |")
    print("|---|---|---|---|")
    for thread, seq in walk.rooms.items():
        print(f"| {thread} | {len(seq)} | {returns(seq)} | {' > '.join(seq)} |")
    stops = sum(len(s) for s in walk.rooms.values())
    print(f"| all | {stops} | {sum(returns(s) for s in walk.rooms.values())} | |")


if __name__ == "__main__":
    main()
