"""A thread-safe least-recently-used cache: the per-sample functions, the fast-statistics plans
and the loaded models each keep one.

Values are built outside the lock (building one can take seconds: a model, a probe), so two
threads that miss the same key at once may both build it; the first stored wins and both get
it. ``None`` is a value like any other (a plan may be "no plan").
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_MISSING = object()


class LockedLRU(Generic[K, V]):
    """At most ``size`` entries, and with ``weigh`` at most ``budget`` of their total weight
    (bytes, say; the newest entry stays even if it alone is heavier); ``hits`` and ``misses``
    count :meth:`get_or_make` lookups. An entry is weighed when stored: :meth:`put` it again
    where its weight has changed (a value that grows)."""

    def __init__(self, size: int, *, budget: int | None = None,
                 weigh: Callable[[V], int] | None = None) -> None:
        self.size = size
        self.budget = budget
        self.weigh = weigh
        self.weight = 0
        self.hits = 0
        self.misses = 0
        self._data: OrderedDict[K, V] = OrderedDict()
        self._weights: dict[K, int] = {}  # each entry's weight as it was stored
        self._lock = threading.Lock()

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        """The cached value for ``key``, or ``make()`` stored under it."""
        with self._lock:
            found = self._data.get(key, _MISSING)
            if found is not _MISSING:
                self.hits += 1
                self._data.move_to_end(key)
                return found  # type: ignore[return-value]
            self.misses += 1
        value = make()
        with self._lock:
            return self._store(key, value, keep_first=True)

    def find(self, key: K) -> V | None:
        """The cached value for ``key`` (None where there is none), as the most recently used;
        counts no hit or miss."""
        with self._lock:
            if key not in self._data:
                return None
            self._data.move_to_end(key)
            return self._data[key]

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._store(key, value, keep_first=False)

    def drop(self, keep: Callable[[K], bool]) -> None:
        """Remove every entry whose key ``keep`` rejects."""
        with self._lock:
            for key in [k for k in self._data if not keep(k)]:
                self._remove(key)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._weights.clear()
            self.weight = 0

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def _store(self, key: K, value: V, *, keep_first: bool) -> V:
        if keep_first and key in self._data:
            self._data.move_to_end(key)
            return self._data[key]
        if key in self._data:
            self._remove(key)
        self._data[key] = value
        self._weights[key] = 0 if self.weigh is None else self.weigh(value)
        self.weight += self._weights[key]
        while len(self._data) > self.size or (
                self.budget is not None and self.weight > self.budget and len(self._data) > 1):
            self._remove(next(iter(self._data)))
        return value

    def _remove(self, key: K) -> None:
        del self._data[key]
        self.weight -= self._weights.pop(key)
