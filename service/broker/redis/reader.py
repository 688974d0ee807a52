"""An answer as the api relays it: read from its streams as the worker's pieces land.

How an answer travels (whole or nothing): :mod:`service.broker.redis.writer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
import redis.asyncio as aioredis

from psgrad._memory import unreferenced
from service.broker.redis import keyspace
from service.broker.redis.common import (
    LINE_READ,
    answer_size,
    command_parts,
    text,
    text_hash,
    texts,
)
from service.jobs import AnswerLost, JobStatus

__all__ = ["RedisAnswer"]

POLL_MS = 1000  # a reader waiting for the next piece checks the job's state this often
READ_COUNT = 8  # pieces per XREAD: one batch is relayed while the next is read
KEEP_BUFFERS = 3 * READ_COUNT  # pieces a reader receives into again: a batch read, a batch
# relayed, and what the server's socket still holds
# Answers at least this large are read over a plain socket of their own (see RawStreamReader);
# smaller ones share the api's client: one socket and one blocked thread per answer would starve
# many concurrent small requests (the default executor has a few threads on a small host).
RAW_MIN_BYTES = 64 << 20


@dataclass
class RedisAnswer:
    """One attempt's answer as the api reads it (a :class:`service.jobs.Answer`)."""

    r: aioredis.Redis  # the queue's Redis, a client without a socket timeout: XREAD blocks
    pr: aioredis.Redis  # the answers' Redis (may be ``r``), the same kind of client
    keys: keyspace.JobKeys
    attempt: str
    head_id: bytes
    head: bytes
    complete: bool = False  # a whole answer written inline: the head entry is the whole file

    def __post_init__(self) -> None:
        self.size = answer_size(self.head)

    @classmethod
    def found(cls, r: aioredis.Redis, pr: aioredis.Redis, keys: keyspace.JobKeys,
              state: Mapping[str, str], first: list[Any]) -> RedisAnswer | None:
        """The answer a state hash and the answer stream's first entry show, if it is readable:
        the named whole one of a succeeded job, or the one a running job is writing now."""
        if not first:
            return None
        entry_id, fields = first[0]
        f = {text(k): v for k, v in fields.items()}
        attempt, kind = texts([f.get("a", b""), f.get("k", b"")])
        status = state.get("status")
        whole = status == JobStatus.SUCCEEDED.value and state.get("answer") == attempt
        writing = status == JobStatus.RUNNING.value and state.get("attempts") == attempt
        if kind != "head" or not (whole or writing):
            return None
        head = bytes(f["d"])
        return cls(r, pr, keys, attempt, entry_id, head,
                   complete=whole and len(head) >= answer_size(head))

    async def pieces(self, *, consume: bool = False) -> AsyncIterator[bytes | memoryview]:
        """The header, then each piece as it lands; the last only once the answer is whole.

        ``consume``: entries leave the stream once read (XTRIM MINID): Redis then stores the
        pieces still to come in the memory of those relayed, where a whole answer kept until
        it is forgotten takes new memory each time (a page fault per 4 KiB in Redis).
        """
        yield self.head
        if self.complete:  # a small answer, whole in its one entry: nothing more to read
            return
        left = self.size - len(self.head)
        held: bytes | memoryview = b""  # sent once the next piece (or the end mark) is seen
        raw = (await asyncio.to_thread(RawStreamReader.open, self.pr)
               if self.size >= RAW_MIN_BYTES else None)
        key = self.keys.pieces(self.attempt)
        async with contextlib.aclosing(self._batches(raw, key, consume)) as batches:
            async for batch in batches:
                for piece in batch:
                    if held:
                        yield held
                    held = piece
                    left -= len(held)
                if left <= 0:
                    break
        if left < 0:  # more bytes than the header promised: never served as this answer
            raise AnswerLost(self.keys.id)
        await self._ended()
        yield held

    async def _batches(self, raw: RawStreamReader | None, key: str, consume: bool
                       ) -> AsyncGenerator[list[bytes | memoryview], None]:
        """Batches of the pieces stream's pieces, until the caller stops; closes ``raw``.

        The next batch is already being read (the raw reader in a thread) while the caller
        relays this one: Redis's reply and the client's transfer overlap.
        """
        last: Any = b"0-0"
        ended = False  # the job had ended at the last check: no piece can still come
        pending = asyncio.ensure_future(self._xread(raw, key, last))
        try:
            while True:
                reply = await pending
                entries = reply[0][1] if reply else []
                if not entries:
                    if ended:  # the job ended with pieces missing: expired, or Redis lost them
                        raise AnswerLost(self.keys.id)
                    ended = await self._check()
                    pending = asyncio.ensure_future(self._xread(raw, key, last))
                    continue
                last = entries[-1][0]
                pending = asyncio.ensure_future(self._xread(raw, key, last))
                if consume:  # read into memory here: Redis may reuse theirs
                    await self.pr.xtrim(key, minid=bytes(last), approximate=False)
                yield [_pairs(fields)[b"d"] for _, fields in entries]
        finally:
            if raw is not None:
                raw.shutdown()  # the read under way (blocked up to POLL_MS) ends now
            else:
                pending.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await pending
            if raw is not None:
                raw.close()

    async def _xread(self, raw: RawStreamReader | None, key: str, last: Any) -> Any:
        if raw is not None:
            return await asyncio.to_thread(raw.xread, key, bytes(last), READ_COUNT, POLL_MS)
        return await self.pr.xread({key: last}, count=READ_COUNT, block=POLL_MS)

    async def _ended(self) -> None:
        """Every byte is in: wait for the end mark that names this attempt's answer whole."""
        key = self.keys.answer
        while True:
            reply: Any = await self.r.xread({key: self.head_id}, count=1, block=POLL_MS)
            if not reply:
                if await self._check():  # named whole in the state (its mark expired first)
                    return
                continue
            _, fields = reply[0][1][0]
            f = text_hash(fields)
            if f.get("a") != self.attempt or f.get("k") != "end":  # another attempt's header
                raise AnswerLost(self.keys.id)
            return

    async def _check(self) -> bool:
        """No news for a while: go on waiting only while this attempt may still finish.
        True when it has finished (its answer named whole), False while it still runs."""
        status, attempts, answer = await self.r.hmget(
            self.keys.state, ["status", "attempts", "answer"])
        status, attempts, answer = (None if v is None else text(v)
                                    for v in (status, attempts, answer))
        if status == JobStatus.RUNNING.value and attempts == self.attempt:
            return False
        if status == JobStatus.SUCCEEDED.value and answer == self.attempt:
            return True
        raise AnswerLost(self.keys.id)


def _pairs(fields: Any) -> dict[bytes, Any]:
    """Entry fields as a dict (redis-py gives one; the raw reader a flat list)."""
    if isinstance(fields, dict):
        return fields
    return {bytes(fields[i]): fields[i + 1] for i in range(0, len(fields), 2)}


class RawStreamReader:
    """``XREAD`` over a plain socket, each piece received straight into its own buffer.

    redis-py's parsers copy a large reply three or four times (its asyncio one also in 64 KiB
    steps of the event loop); measured here on 128 MiB of 8 MiB pieces, this reader took a
    third of the time. ``redis://`` and ``unix://`` URLs; TLS keeps redis-py. Blocking: call it
    in a thread.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self._buffers: list[tuple[int, np.ndarray]] = []  # pieces' buffers, lent again once free

    @classmethod
    def open(cls, client: aioredis.Redis) -> RawStreamReader | None:
        kwargs = client.connection_pool.connection_kwargs
        kind = client.connection_pool.connection_class
        if kind is aioredis.Connection:
            sock = socket.create_connection((kwargs.get("host", "localhost"),
                                             kwargs.get("port", 6379)), timeout=30)
        elif kind is aioredis.UnixDomainSocketConnection:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(30)
            try:
                sock.connect(kwargs["path"])
            except OSError:
                sock.close()
                raise
        else:
            return None
        reader = cls(sock)
        try:
            if kwargs.get("password"):
                user = kwargs.get("username")
                reader.call(b"AUTH", *([user.encode()] if user else []),
                            str(kwargs["password"]).encode())
            if kwargs.get("db"):
                reader.call(b"SELECT", str(kwargs["db"]).encode())
        except Exception:
            reader.close()
            raise
        return reader

    def shutdown(self) -> None:
        """End a read blocked in another thread (closing alone does not wake it)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()

    def xread(self, key: str, last: bytes, count: int, block_ms: int) -> Any:
        """Redis's reply to ``XREAD COUNT n BLOCK ms STREAMS key last`` (None: nothing new)."""
        return self.call(b"XREAD", b"COUNT", str(count).encode(), b"BLOCK",
                         str(block_ms).encode(), b"STREAMS", key.encode(), last)

    def call(self, *args: bytes) -> Any:
        self.sock.sendall(b"".join(command_parts(*args)))
        return self._value()

    def _value(self) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._value() for _ in range(n)]
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self._bulk(n)
        if kind == b"-":
            raise redis.ResponseError(rest.decode(errors="replace"))
        return rest

    def _line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            chunk = self.sock.recv(LINE_READ)
            if not chunk:
                raise redis.ConnectionError("Redis closed the connection")
            self.buf += chunk
        line = bytes(self.buf[:end])
        del self.buf[:end + 2]
        return line

    def _bulk(self, n: int) -> memoryview:
        view = self._buffer(n + 2).data
        have = min(len(self.buf), n + 2)
        view[:have] = self.buf[:have]
        del self.buf[:have]
        while have < n + 2:
            got = self.sock.recv_into(view[have:])
            if not got:
                raise redis.ConnectionError("Redis closed the connection")
            have += got
        return view[:n]

    def _buffer(self, size: int) -> np.ndarray:
        """A buffer a relayed piece no longer needs (its pages are written already: new
        memory costs a page fault per 4 KiB, more than receiving into it), else a new one."""
        for entry in self._buffers:
            if entry[1].nbytes == size and unreferenced(entry):
                return entry[1]
        buffer = np.empty(size, np.uint8)  # not zeroed first, as bytearray(n) is
        if len(self._buffers) < KEEP_BUFFERS:
            self._buffers.append((0, buffer))
        return buffer
