"""Answers through Redis in pieces: written by the worker as a stream, relayed by the api.

One value in Redis holds at most ``proto-max-bulk-len`` (512 MiB by default), and a result passed
whole through a Lua script is copied several times and waits until it is complete. Here the
worker writes the answer's safetensors file to the job's answer stream (:func:`keys.job_answer`):
the header first (every size is known up front), then the tensors' bytes in pieces of at most
:data:`keys.ANSWER_PIECE_BYTES`, each a plain ``XADD`` of a view of the arrays (never a Lua
argument, never a copy of the whole answer). Every piece renews the stream's TTL, and a push to
the job's notify list wakes the api as soon as the header lands, so it relays the answer while it
is written.

Whole or nothing: the delivery that owns a running job rewrites the stream from scratch under its
attempt number (``BEGIN_LUA``, with the small header; the data never passes through Lua); only the
worker's end script (``FINISH_LUA``) marks the answer whole, after the last piece, by naming the
attempt in the state hash and appending an ``end`` entry. A reader that sees another attempt's
pieces, or its job leave ``running`` without that mark, raises :class:`service.jobs.AnswerLost`
before the last piece: a half answer is never served as whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
import redis.asyncio as aioredis

from psgrad._memory import unreferenced
from psgrad._wire import RESPONSE_KEY, safetensors_parts
from service import keys
from service.jobs import AnswerLost, JobStatus

__all__ = ["AnswerWriter", "RedisAnswer", "answer_size"]

POLL_MS = 1000  # a reader waiting for the next piece checks the job's state this often
READ_COUNT = 8  # pieces per XREAD: one batch is relayed while the next is read
LINE_READ = 4096  # bytes per read of reply lines (what follows them is the next piece's start)
KEEP_BUFFERS = 3 * READ_COUNT  # pieces a reader receives into again: a batch read, a batch
# relayed, and what the server's socket still holds
# Answers at least this large are read over a plain socket of their own (see RawStreamReader);
# smaller ones share the api's client: one socket and one blocked thread per answer would starve
# many concurrent small requests (the default executor has a few threads on a small host).
RAW_MIN_BYTES = 64 << 20

# KEYS: state, answer, notify. ARGV: attempt, header bytes, ttl. Only the delivery that owns an
# unfinished job starts its answer (a stale one, its job taken over or ended, writes nothing).
BEGIN_LUA = """
local st = redis.call('HGET', KEYS[1], 'status')
if st ~= 'running' and st ~= 'queued' then return 0 end
if redis.call('HGET', KEYS[1], 'attempts') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[2])
redis.call('XADD', KEYS[2], '*', 'a', ARGV[1], 'k', 'head', 'd', ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('RPUSH', KEYS[3], 'answer')
redis.call('EXPIRE', KEYS[3], ARGV[3])
return 1
"""


class AnswerWriter:
    """Writes one attempt's answer to the job's stream (worker side, synchronous)."""

    def __init__(self, r: redis.Redis, prefix: str, job_id: str, attempt: int, *,
                 ttl_s: int, piece_bytes: int = keys.ANSWER_PIECE_BYTES) -> None:
        self.r = r
        self.prefix = prefix
        self.job_id = job_id
        self.key = keys.job_answer(prefix, job_id)
        self.notify = keys.job_notify(prefix, job_id)
        self.attempt = str(attempt)
        self.ttl_s = ttl_s
        self.piece_bytes = max(1, piece_bytes)

    def write(self, result: Mapping[str, Any]) -> bool:
        """The whole answer, pipelined: pieces land (and are relayed) while later ones go out.

        False when the job is no longer this attempt's to answer (ended, or taken over).
        """
        head, *data = safetensors_parts(result, RESPONSE_KEY)
        return self.write_parts(head, data)

    def write_parts(self, head: bytes | memoryview, data: list[bytes | memoryview]) -> bool:
        """:meth:`write` of an answer already cut into its header and its tensors' bytes.

        The commands are packed here, each piece sent as the view it is: redis-py's pipeline
        (with hiredis, its packer) copies every argument into one buffer first, which made
        writing an answer take twice as long as sending it.
        """
        if not self.begin(bytes(head)):
            return False
        conn = self.r.connection_pool.get_connection()
        try:
            sent = 0
            for piece in pieces(data, self.piece_bytes):
                conn.send_packed_command(command_parts(*self._xadd(), piece), check_health=False)
                sent += 1
            for _ in range(sent):  # a piece after a cancel adds nothing (NOMKSTREAM: a nil)
                conn.read_response()
        except BaseException:
            conn.disconnect()  # replies may be left unread: the socket is never lent again
            raise
        finally:
            self.r.connection_pool.release(conn)
        return True

    def begin(self, head: bytes) -> bool:
        """Drop what an earlier attempt left, write the header (a few hundred bytes of names
        and shapes) and wake the api, if the job still runs as this attempt."""
        state = keys.job_state(self.prefix, self.job_id)
        return bool(self.r.eval(BEGIN_LUA, 3, state, self.key, self.notify,
                                self.attempt, head, self.ttl_s))

    def add(self, r: redis.Redis, piece: bytes | memoryview) -> None:
        """One piece by one command (what :meth:`write_parts` sends for each)."""
        r.execute_command(*self._xadd(), piece)

    def _xadd(self) -> list[bytes]:
        # NOMKSTREAM: a piece never re-creates a stream a cancel deleted (nor one that expired),
        # so no key outlives the job and the TTL set by BEGIN_LUA covers every piece
        return [b"XADD", self.key.encode(), b"NOMKSTREAM", b"*", b"a", self.attempt.encode(),
                b"k", b"data", b"d"]


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


def _text(value: Any) -> str:
    return bytes(value).decode() if isinstance(value, (bytes, memoryview)) else str(value)


@dataclass
class RedisAnswer:
    """One attempt's answer as the api reads it (a :class:`service.jobs.Answer`)."""

    r: aioredis.Redis  # a client without a socket timeout: XREAD blocks
    prefix: str
    job_id: str
    attempt: str
    head_id: bytes
    head: bytes
    complete: bool = False  # a whole answer written inline: the head entry is the whole file

    def __post_init__(self) -> None:
        self.size = answer_size(self.head)

    @classmethod
    def found(cls, r: aioredis.Redis, prefix: str, job_id: str, state: Mapping[str, str],
              first: list[Any]) -> RedisAnswer | None:
        """The answer a state hash and the stream's first entry show, if it is readable: the
        named whole one of a succeeded job, or the one a running job is writing now."""
        if not first:
            return None
        entry_id, fields = first[0]
        f = {_text(k): v for k, v in fields.items()}
        attempt = _text(f.get("a", b""))
        status = state.get("status")
        whole = status == JobStatus.SUCCEEDED.value and state.get("answer") == attempt
        writing = status == JobStatus.RUNNING.value and state.get("attempts") == attempt
        if _text(f.get("k", b"")) != "head" or not (whole or writing):
            return None
        head = bytes(f["d"])
        return cls(r, prefix, job_id, attempt, entry_id, head,
                   complete=whole and len(head) >= answer_size(head))

    async def pieces(self, *, consume: bool = False) -> AsyncIterator[bytes | memoryview]:
        """The header, then each piece as it lands; the last only once the answer is whole.

        ``consume``: entries leave the stream once read (XTRIM MINID): Redis then stores the
        pieces still to come in the memory of those relayed, where a whole answer kept until
        it is forgotten takes new memory each time (a page fault per 4 KiB in Redis).
        """
        key = keys.job_answer(self.prefix, self.job_id)
        yield self.head
        if self.complete:  # a small answer, whole in its one entry: nothing more to read
            return
        held: bytes | memoryview | None = None  # sent once the next piece (or end) is seen
        raw = (await asyncio.to_thread(RawStreamReader.open, self.r)
               if self.size >= RAW_MIN_BYTES else None)
        entries_of = self._entries(raw, key, self.head_id, consume)
        async with contextlib.aclosing(entries_of) as batches:
            async for entries in batches:
                for _, fields in entries:
                    f = {_text(k): v for k, v in fields.items()}
                    attempt = int(_text(f.get("a", b"0")))
                    if attempt > int(self.attempt):  # taken over: this answer will never end
                        raise AnswerLost(self.job_id)
                    if attempt < int(self.attempt):  # a stale delivery still writing: not ours
                        continue
                    if _text(f.get("k", b"")) == "end":
                        if held is not None:
                            yield held
                        return
                    if held is not None:
                        yield held
                    held = f["d"]

    async def _entries(self, raw: RawStreamReader | None, key: str, last: Any, consume: bool
                       ) -> AsyncGenerator[list[tuple[bytes, dict[bytes, Any]]], None]:
        """Batches of new entries after ``last``, until the caller stops; closes ``raw``.

        The next batch is already being read (the raw reader in a thread) while the caller
        relays this one: Redis's reply and the client's transfer overlap.
        """
        pending = asyncio.ensure_future(self._xread(raw, key, last))
        try:
            while True:
                reply = await pending
                entries = reply[0][1] if reply else []
                if not entries:
                    await self._check()
                    pending = asyncio.ensure_future(self._xread(raw, key, last))
                    continue
                last = entries[-1][0]
                pending = asyncio.ensure_future(self._xread(raw, key, last))
                if consume:  # read into memory here: Redis may reuse theirs
                    await self.r.xtrim(key, minid=bytes(last), approximate=False)
                yield [(bytes(eid), _pairs(fields)) for eid, fields in entries]
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
        return await self.r.xread({key: last}, count=READ_COUNT, block=POLL_MS)

    async def _check(self) -> None:
        """No piece for a while: go on waiting only while this attempt may still finish."""
        status, attempts, answer = await self.r.hmget(
            keys.job_state(self.prefix, self.job_id), ["status", "attempts", "answer"])
        status, attempts, answer = (None if v is None else _text(v)
                                    for v in (status, attempts, answer))
        if status == JobStatus.RUNNING.value and attempts == self.attempt:
            return
        if status == JobStatus.SUCCEEDED.value and answer == self.attempt:
            return
        raise AnswerLost(self.job_id)


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
