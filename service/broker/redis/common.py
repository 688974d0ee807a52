"""What both sides of the Redis broker share: reading replies, Redis's own limits and
failures, and the framing of an answer's bytes (neither side imports the other).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["DEFAULT_MAX_VALUE_BYTES", "LINE_READ", "RETRY_AFTER_DOWN_S", "answer_size",
           "command_parts", "pieces", "redis_unavailable", "text", "text_hash", "texts",
           "value_limit"]

RETRY_AFTER_DOWN_S = 2.0  # Retry-After while Redis is unreachable
_UNAVAILABLE_REPLIES = ("OOM", "MISCONF", "READONLY", "LOADING", "MASTERDOWN", "NOGROUP")
DEFAULT_MAX_VALUE_BYTES = 512 * 1024 * 1024  # Redis's proto-max-bulk-len unless configured
# (requests are one value and stay under it; answers travel in pieces and have no such cap)
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
    return DEFAULT_MAX_VALUE_BYTES


def text(value: Any) -> str:
    """A reply's bytes (or a view of them) as text, whether or not the client decodes
    responses; anything else as ``str`` has it."""
    return bytes(value).decode() if isinstance(value, (bytes, memoryview)) else str(value)


def texts(values: Iterable[Any]) -> list[str]:
    """Each of a reply's values as :func:`text`."""
    return [text(v) for v in values]


def text_hash(raw: Mapping[Any, Any] | list[Any]) -> dict[str, str]:
    """A hash as text: ``HGETALL``'s reply, a mapping or (from a script) a flat list of fields
    and values."""
    pairs = raw.items() if isinstance(raw, Mapping) else zip(raw[::2], raw[1::2], strict=True)
    return {text(k): text(v) for k, v in pairs}


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
