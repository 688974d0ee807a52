"""The C allocator told to keep what torch frees, so that a server process's next call reuses
memory it has already touched instead of faulting fresh pages in (``PSGRAD_KEEP_FREED_MEMORY``).

torch's CPU tensors come from the C library's ``malloc``. glibc's own settings hand a freed
block back to the kernel when it is past the mmap threshold (128 KiB, raised as blocks are freed
up to 32 MiB) or sits at the top of the heap, and a thread's arena holds at most 64 MiB, so
the blocks of a model's size (a per-sample gradient, the plan check's direction) are mapped
afresh on every call and each page faults in zeroed. On a 2-core CPU machine that was half of
BERT-base's plan check in a new worker (docs/operations.md, "Memory a process keeps"). Kept,
every block comes from one heap shared by the process's threads (so a worker thread reuses what
the main thread freed as the model loaded) and is reused as it is: the process's resident
memory stays at its largest peak instead of falling back between calls.

glibc reads these settings (its tunables) once, as a process starts, and the arenas' limit holds
only for threads that have not allocated yet (numpy's and torch's imports start some), so
:func:`keep_freed_memory` restarts the process in place with them. Only glibc has them;
elsewhere nothing changes. ``psgrad serve`` and ``psgrad worker`` call :func:`configure` first,
and the benchmarks' processes that time a server's work call it too.
"""

from __future__ import annotations

import os
import platform
import sys

KEPT = 2**31 - 1  # bytes: a block past it is mapped and handed back as before
TUNABLES = ("glibc.malloc.arena_max=1", f"glibc.malloc.mmap_threshold={KEPT}",
            f"glibc.malloc.trim_threshold={KEPT}")


def kept() -> bool:
    """Whether this process started with glibc told to keep freed memory."""
    return set(TUNABLES) <= set(os.environ.get("GLIBC_TUNABLES", "").split(":"))


def keep_freed_memory() -> None:
    """Restart this process (``exec``: the same pid and command line) with glibc told to keep
    freed memory, unless it already runs so or its C library is not glibc. Call it before the
    process starts any work: nothing of this run survives but its environment."""
    if kept() or platform.libc_ver()[0] != "glibc":
        return
    given = os.environ.get("GLIBC_TUNABLES", "")
    os.environ["GLIBC_TUNABLES"] = ":".join([*filter(None, given.split(":")), *TUNABLES])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def configure() -> None:
    """A server process's allocator, set before torch allocates: transparent huge pages for
    torch's CPU tensors (``THP_MEM_ALLOC_ENABLE``, unless the environment says otherwise), and
    freed memory kept where ``PSGRAD_KEEP_FREED_MEMORY`` says so (the default)."""
    from service.config import get_settings

    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if get_settings().keep_freed_memory:
        keep_freed_memory()
