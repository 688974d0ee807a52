"""The lock a store's commit holds: one writer of a store's manifest at a time.

A commit reads the manifest, checks the batch's ids against it and writes the next one; two
commits of one store at once would each write a manifest that forgets the other's shards. In
embedded mode one process writes, and a :class:`ThreadLocks` lock per store suffices. In Redis
mode every api replica may append, so :class:`RedisLocks` holds a lease in Redis (``SET NX PX``
with a token, released only by its holder), renewed while its commit runs (a commit on a slow
object store may outlast one lease) and freed by itself if its holder dies.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any, Protocol

from redis.exceptions import RedisError

from psgrad._errors import Overloaded
from service import redis_keys
from service.tenants import owned_name

log = logging.getLogger(__name__)

# a commit writes one manifest and one Gram matrix, well under this, and renews it each third:
# the lease of an api that died while it held one frees inside a waiting commit's WAIT_S
LEASE_MS = 20_000
WAIT_S = 30.0

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
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
            raise _busy(name, 1.0)
        try:
            yield
        finally:
            lock.release()


class RedisLocks:
    """One lease per store name in Redis, shared by every api process."""

    def __init__(self, client: Any, prefix: str, lease_ms: int = LEASE_MS) -> None:
        self.r = client
        self.prefix = prefix
        self.lease_ms = lease_ms
        self._release = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)

    @contextlib.contextmanager
    def hold(self, name: str) -> Iterator[None]:
        key, token = redis_keys.store_lock(self.prefix, name), uuid.uuid4().hex
        until = time.monotonic() + WAIT_S
        while not self.r.set(key, token, nx=True, px=self.lease_ms):
            if time.monotonic() > until:
                raise _busy(name, max(1.0, self.r.pttl(key) / 1000))
            time.sleep(0.01)
        done = threading.Event()
        keeper = threading.Thread(target=self._keep, args=(key, token, done), daemon=True,
                                  name="psgrad-store-lease")
        keeper.start()
        try:
            yield
        finally:
            done.set()
            keeper.join()
            self._release(keys=[key], args=[token])

    def _keep(self, key: str, token: str, done: threading.Event) -> None:
        """Renew the lease every third of it until ``done``."""
        while not done.wait(self.lease_ms / 3000):
            try:
                if not self._renew(keys=[key], args=[token, self.lease_ms]):
                    log.error("the commit lease %s was lost while its commit ran (held past "
                              "%d ms with Redis unreachable?)", key, self.lease_ms)
                    return
            except RedisError as exc:  # the next third may reach it: the lease still holds
                log.warning("renewing the commit lease %s failed: %s", key, exc)


def _busy(name: str, retry_after: float) -> Overloaded:
    """The 503 for a store whose lock stayed held past :data:`WAIT_S`; ``retry_after``: when
    it may be free (a lease's time left: its holder may be writing still, or have died)."""
    return Overloaded(f"store '{owned_name(name)}' has been written by another request for "
                      f"more than {WAIT_S:g} s; retry in {retry_after:.0f} s",
                      retry_after=retry_after)
