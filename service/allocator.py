"""The C allocator told to keep what torch frees, so that a server process's next call reuses
memory it has already touched instead of faulting fresh pages in (``PSGRAD_KEEP_FREED_MEMORY``).

torch's CPU tensors come from the C library's ``malloc``. glibc's own settings hand a freed
block back to the kernel when it is past the mmap threshold (128 KiB, raised as blocks are freed
up to 32 MiB) or sits at the top of the heap, and a thread's arena holds at most 64 MiB, so
the blocks of a model's size (a per-sample gradient, the plan check's direction) are mapped
afresh on every call and each page faults in zeroed. On a 2-core CPU machine that was a sixth of
BERT-base's steady ``norms`` call and half of its plan check (docs/operations.md, "Memory").
Kept, every block comes from one heap shared by the process's threads (so a worker thread reuses
what the main thread freed as the model loaded) and is reused as it is: the process's resident
memory stays at its largest peak instead of falling back between calls.

Only glibc has these settings (``mallopt``); elsewhere nothing changes. They are the process's,
and the arenas' limit holds only for threads started after it: ``psgrad serve`` and ``psgrad
worker`` apply them as they start, before any thread.
"""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger("psgrad.allocator")

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
KEPT = 2**31 - 1  # bytes: the largest a C int holds; a block past it is mapped as before


def keep_freed_memory() -> bool:
    """Tell glibc to keep freed blocks in the process (False: not glibc, or it refused)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    kept = all([mallopt(M_ARENA_MAX, 1), mallopt(M_MMAP_THRESHOLD, KEPT),
                mallopt(M_TRIM_THRESHOLD, KEPT)])
    if not kept:
        log.warning("glibc refused to keep freed memory (mallopt): calls fault fresh memory in")
    return kept
