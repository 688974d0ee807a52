"""What a server process's native libraries read from the environment as they load, set before
they do: the C allocator told to keep what torch frees (``PSGRAD_KEEP_FREED_MEMORY``), torch's
CPU tensors on transparent huge pages, and OpenBLAS's idle threads put to sleep at once.

**Freed memory kept.** torch's CPU tensors come from the C library's ``malloc``. glibc's own
settings hand a freed block back to the kernel when it is past the mmap threshold (128 KiB,
raised as blocks are freed up to 32 MiB) or sits at the top of the heap, and a thread's arena
holds at most 64 MiB, so the blocks of a model's size (a per-sample gradient, the plan check's
direction) are mapped afresh on every call and each page faults in zeroed. On a 2-core CPU
machine that was half of BERT-base's plan check in a new worker (docs/operations.md, "Memory a
process keeps"). Kept, every block comes from one heap shared by the process's threads (so a
worker thread reuses what the main thread freed as the model loaded) and is reused as it is:
the process's resident memory stays at its largest peak instead of falling back between calls.
glibc reads these settings (its tunables) once, as a process starts, and the arenas' limit holds
only for threads that have not allocated yet (numpy's and torch's imports start some).

**Idle BLAS threads.** numpy and scipy each load their own OpenBLAS (faiss a third), and after
each call an OpenBLAS thread spins for about 2^28 cycles (a tenth of a second) before it sleeps,
holding a core that torch's threads or the other library's need next: on a 2-core host a store
query (torch makes the query's sketches, numpy scores the rows, scipy solves ``trak``'s system)
took 1.1-2 times as long (docs/operations.md, "Idle BLAS threads").
``OPENBLAS_THREAD_TIMEOUT=4`` (2^4 cycles, OpenBLAS's least) puts them to sleep at once; each
library reads it as it loads.

``psgrad serve`` and ``psgrad worker`` call :func:`configure` first, which restarts the process
in place where the environment lacked what is read at load (``psgrad``'s command line has
loaded numpy by then); the benchmarks' processes that time a server's work call it too. Only
glibc has the allocator's settings; elsewhere they change nothing.
"""

from __future__ import annotations

import os
import platform
import sys

BLAS_THREAD_TIMEOUT = "4"  # an idle OpenBLAS thread spins 2^4 cycles, then sleeps
KEPT = 2**31 - 1  # bytes: a block past it is mapped and handed back as before
TUNABLES = ("glibc.malloc.arena_max=1", f"glibc.malloc.mmap_threshold={KEPT}",
            f"glibc.malloc.trim_threshold={KEPT}")


def kept() -> bool:
    """Whether this process started with glibc told to keep freed memory."""
    return set(TUNABLES) <= set(os.environ.get("GLIBC_TUNABLES", "").split(":"))


def keep_freed_memory() -> None:
    """Restart this process with glibc told to keep freed memory, unless it already runs so or
    its C library is not glibc (:func:`restart`)."""
    if kept() or platform.libc_ver()[0] != "glibc":
        return
    given = os.environ.get("GLIBC_TUNABLES", "")
    os.environ["GLIBC_TUNABLES"] = ":".join([*filter(None, given.split(":")), *TUNABLES])
    restart()


def restart() -> None:
    """Restart this process (``exec``: the same pid and command line) with its environment as
    it is now. Call it before the process starts any work: nothing of this run survives but its
    environment."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def configure() -> None:
    """A server process's environment, set before torch allocates: transparent huge pages for
    torch's CPU tensors (``THP_MEM_ALLOC_ENABLE``) and idle OpenBLAS threads asleep at once
    (``OPENBLAS_THREAD_TIMEOUT``), each unless the environment says otherwise, and freed memory
    kept where ``PSGRAD_KEEP_FREED_MEMORY`` says so (the default). Restarts the process in
    place where a library that reads the environment at load has loaded without it."""
    from service.config import get_settings

    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    blas_unset = "OPENBLAS_THREAD_TIMEOUT" not in os.environ
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", BLAS_THREAD_TIMEOUT)
    if get_settings().keep_freed_memory:
        keep_freed_memory()
    if blas_unset and {"numpy", "scipy", "faiss"} & sys.modules.keys():
        restart()
