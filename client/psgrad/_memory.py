"""Memory of answers the caller has dropped, lent again to the client's next answers.

Writing an answer into newly allocated memory takes a page fault per 4 KiB page the first time
each page is written. On a virtual machine that hands freed memory back to its host, that costs
more than the transfer itself: measured on a shared 2-core VM, 293 MB of fresh arrays took
0.4-1 s to fill, the same bytes into memory already written once about 0.1 s. A client in a
loop drops each answer once it has the next one (``res = client.per_sample_grads(...)`` holds
the previous answer while the next arrives), so the client keeps the large tensors of its last
:data:`KEPT_ANSWERS` answers and reads a new answer into those nothing refers to any more.

Nothing the caller still holds is ever written: a buffer is lent again only while no array
refers to it (no tensor of the answer, no view or slice of one, no torch tensor made from one),
which CPython's reference count shows exactly. Elsewhere (no ``sys.getrefcount``) nothing is
reused. ``Client.close()`` lets the memory go.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["AnswerMemory", "unreferenced"]

KEPT_ANSWERS = 2  # answers whose buffers are kept: the one the caller holds and the one before
MIN_BYTES = 1 << 20  # smaller tensors are allocated as usual (their first touch is cheap)
SLACK = 4  # a buffer serves a tensor of at least (SLACK - 1) / SLACK of its size

Empty = Callable[[Sequence[int], str], np.ndarray]


def _refs(entry: tuple[int, np.ndarray]) -> int:
    return sys.getrefcount(entry[1])


# The count of a buffer only the pool refers to, taken the way the pool takes it
_ALONE = _refs((0, np.empty(0, np.uint8))) if hasattr(sys, "getrefcount") else -1


def unreferenced(entry: tuple[int, np.ndarray]) -> bool:
    """Only the ``(tag, buffer)`` entry of a pool's list refers to the buffer: nothing made
    from it (an array, a view, a memoryview a server still holds to send) is alive. Always
    False where reference counts cannot be read."""
    return _ALONE >= 0 and _refs(entry) <= _ALONE


class AnswerMemory:
    """Buffers of the last answers, each lent to one tensor of a later answer once unused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._answers = 0  # answers begun
        self._buffers: list[tuple[int, np.ndarray]] = []  # (the answer it serves, buffer)

    def allocator(self) -> Empty:
        """``np.empty`` for one new answer's tensors: large ones in memory the caller dropped."""
        with self._lock:
            self._answers += 1
            answer = self._answers
            self._buffers = [e for e in self._buffers if e[0] >= answer - KEPT_ANSWERS]

        def empty(shape: Sequence[int], dtype: str) -> np.ndarray:
            dt = np.dtype(dtype)
            size = math.prod(shape) * dt.itemsize
            if size < MIN_BYTES or _ALONE < 0:
                return np.empty(shape, dt)
            buffer = self._lend(size, answer)
            return buffer[:size].view(dt).reshape(shape)

        return empty

    def release(self) -> None:
        """Let every kept buffer go (those the caller holds stay the caller's)."""
        with self._lock:
            self._buffers = []

    def _lend(self, size: int, answer: int) -> np.ndarray:
        with self._lock:
            free = [i for i, e in enumerate(self._buffers)
                    if e[0] < answer and unreferenced(e)
                    and size <= e[1].nbytes <= size + size // (SLACK - 1)]
            if free:
                i = min(free, key=lambda j: self._buffers[j][1].nbytes)
                buffer = self._buffers[i][1]
                self._buffers[i] = (answer, buffer)
                return buffer
        buffer = np.empty(size, np.uint8)
        with self._lock:
            self._buffers.append((answer, buffer))
        return buffer
