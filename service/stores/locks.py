"""The lock a store's commit holds: one writer of a store's manifest at a time.

A commit reads the manifest, checks the batch's ids against it and writes the next one; two
commits of one store at once would each write a manifest that forgets the other's shards. In
embedded mode one process writes, and a :class:`ThreadLocks` lock per store suffices. In Redis
mode every api replica may append, so :class:`RedisLocks` holds a lease in Redis (``SET NX PX``
with a token, released only by its holder), long enough for one commit and freed by itself if
its holder dies.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any, Protocol

from psgrad._errors import Overloaded
from service import keys

LEASE_MS = 60_000  # a commit writes one manifest and one Gram matrix: well under this
WAIT_S = 30.0

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Locks(Protocol):
    def hold(self, name: str) -> contextlib.AbstractContextManager[None]: ...


class ThreadLocks:
    """One lock per store name, within this process."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    @contextlib.contextmanager
    def hold(self, name: str) -> Iterator[None]:
        with self._guard:
            lock = self._locks.setdefault(name, threading.Lock())
        if not lock.acquire(timeout=WAIT_S):
            raise _busy(name)
        try:
            yield
        finally:
            lock.release()


class RedisLocks:
    """One lease per store name in Redis, shared by every api process."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.r = client
        self.prefix = prefix
        self._release = client.register_script(_RELEASE)

    @contextlib.contextmanager
    def hold(self, name: str) -> Iterator[None]:
        key, token = keys.store_lock(self.prefix, name), uuid.uuid4().hex
        until = time.monotonic() + WAIT_S
        while not self.r.set(key, token, nx=True, px=LEASE_MS):
            if time.monotonic() > until:
                raise _busy(name)
            time.sleep(0.01)
        try:
            yield
        finally:
            self._release(keys=[key], args=[token])


def _busy(name: str) -> Overloaded:
    return Overloaded(f"store '{name.rpartition('~')[2]}' is being written by another request "
                      f"for more than {WAIT_S:g} s; retry later", retry_after=1)
