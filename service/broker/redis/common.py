"""What both sides of the Redis broker share: reading replies, Redis's own limits and
failures, and the framing of an answer's bytes (neither side imports the other).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from service import redis_keys

__all__ = ["LINE_READ", "RETRY_AFTER_DOWN_S", "answer_size", "command_parts", "pieces",
           "redis_unavailable", "value_limit"]

RETRY_AFTER_DOWN_S = 2.0  # Retry-After while Redis is unreachable
_UNAVAILABLE_REPLIES = ("OOM", "MISCONF", "READONLY", "LOADING", "MASTERDOWN", "NOGROUP")
LINE_READ = 4096  # bytes per read of reply lines (what follows them is the next piece's start)


def redis_unavailable(exc: BaseException) -> bool:
    """Errors that mean "Redis cannot serve now" (503 and retry), not a bug of ours."""
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError)):
        return True
    return isinstance(exc, ResponseError) and str(exc).upper().startswith(_UNAVAILABLE_REPLIES)


def value_limit(config: Mapping[Any, Any] | None) -> int:
    """The longest string Redis takes (``CONFIG GET proto-max-bulk-len``); Redis cuts the
    connection on a longer one. Where CONFIG is disabled (managed Redis): the default."""
    for value in (config or {}).values():
        return int(value)
    return redis_keys.DEFAULT_MAX_VALUE_BYTES


def command_parts(*args: bytes | memoryview) -> list[bytes | memoryview]:
    """``args`` as one RESP command: small ones joined, a large one left as it is (a view of
    the answer's memory, sent without a copy)."""
    parts: list[bytes | memoryview] = []
    small = [b"*%d\r\n" % len(args)]
    for arg in args:
        small.append(b"$%d\r\n" % len(arg))
        if len(arg) < LINE_READ:
            small += [bytes(arg), b"\r\n"]
            continue
        parts += [b"".join(small), arg]
        small = [b"\r\n"]
    return [*parts, b"".join(small)]


def pieces(parts: list[bytes | memoryview], size: int) -> Iterator[bytes | memoryview]:
    """The parts cut into pieces of at most ``size`` bytes (views: nothing is copied)."""
    for part in parts:
        for start in range(0, len(part), size):
            yield part[start:start + size]


def answer_size(head: bytes) -> int:
    """Bytes of the whole safetensors file whose header (length prefix included) is ``head``."""
    (n,) = struct.unpack("<Q", head[:8])
    header = json.loads(head[8:8 + n])
    ends = [spec["data_offsets"][1] for name, spec in header.items() if name != "__metadata__"]
    return 8 + n + max(ends, default=0)
