"""Server processes start with what their native libraries read as they load
(service/process_env.py): they keep the memory torch frees (``PSGRAD_KEEP_FREED_MEMORY``), so a
block one thread freed is what another thread's next tensor of that size gets, with no page
faulted in afresh (switched off, glibc maps it anew); and numpy's OpenBLAS loads with its idle
threads told to sleep at once, either way.

Each case is a fresh process (glibc reads its settings as a process starts, and ``psgrad``
restarts itself in place with them): ``psgrad serve``, embedded, up to where uvicorn would serve,
or ``psgrad worker`` (real Redis, its own prefix) up to its loop's thread. There one thread
touches and frees 96 MiB, then a new thread allocates and touches 64 MiB, and the resident set's
growth is read (96, not 64: a small allocation of another thread, such as the worker's heartbeat,
may take a piece of the freed block first, as one did on CI). The environment the process
started with (``/proc/self/environ``: what numpy's OpenBLAS read as it loaded) is read too.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.redis import SHARED_URL, prefix_on, redis_or_skip

ROOT = Path(__file__).resolve().parents[2]
BLOCK_MIB = 64
FREED_MIB = 96  # more than the block: other threads' small allocations may take a piece of it
CHILD = f"""
import sys, threading
import torch
import uvicorn
from service.process_env import kept
from service.cli import main
from service.worker.loop import Worker

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

def measure(*_):
    block = torch.ones({FREED_MIB} << 20, dtype=torch.uint8)
    del block
    before = resident()
    grown = []
    def loop():
        again = torch.ones({BLOCK_MIB} << 20, dtype=torch.uint8)
        grown.append(resident() - before)
    thread = threading.Thread(target=loop)
    thread.start()
    thread.join()
    with open("/proc/self/environ", "rb") as f:
        started = f.read().split(b"\\0")
    print("blas", b"OPENBLAS_THREAD_TIMEOUT=4" in started, flush=True)
    print("kept", kept(), "grown", grown[0] >> 20, flush=True)

uvicorn.Server.run = Worker.run = measure
assert main(["serve"] if sys.argv[1] == "serve" else ["worker", "--device", "cpu"]) == 0
"""

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                                reason="glibc's settings (mallopt) only")


def grown_mib(command: str, keep: bool, tmp_path: Path) -> int:
    """How far the resident set grew as the second thread touched its block."""
    env = {**os.environ, "PSGRAD_KEEP_FREED_MEMORY": str(keep).lower(),
           "PSGRAD_MODEL_DIR": str(tmp_path / "models"), "PSGRAD_DATA_DIR": str(tmp_path / "data")}
    env.pop("PSGRAD_REDIS_URL", None)
    env.pop("OPENBLAS_THREAD_TIMEOUT", None)
    on_redis = prefix_on(redis_or_skip()) if command == "worker" else contextlib.nullcontext("")
    with on_redis as prefix:
        if prefix:
            env.update(PSGRAD_REDIS_URL=SHARED_URL, PSGRAD_REDIS_PREFIX=prefix)
        done = subprocess.run([sys.executable, "-c", CHILD, command], capture_output=True,
                              text=True, cwd=ROOT, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"kept {keep} " in done.stdout  # restarted with glibc's tunables, or not
    assert "blas True" in done.stdout  # numpy's OpenBLAS loaded with its idle threads asleep
    return int(done.stdout.split("grown")[-1])


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_a_thread_reuses_what_another_freed(command: str, tmp_path: Path) -> None:
    assert grown_mib(command, True, tmp_path) < BLOCK_MIB // 4


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_switched_off_the_freed_block_is_mapped_afresh(command: str, tmp_path: Path) -> None:
    assert grown_mib(command, False, tmp_path) >= BLOCK_MIB * 3 // 4
