"""Answers through Redis in pieces: written by the worker (this module) as a stream, relayed by
the api (:mod:`service.broker.redis.reader`).

One value in Redis holds at most ``proto-max-bulk-len`` (512 MiB by default), and a result passed
whole through a Lua script is copied several times and waits until it is complete. Here the
worker writes the answer's safetensors file in two streams: its header (every size is known up
front) to the job's answer stream (:func:`keyspace.job_answer`), with a push to the job's
notify list that wakes the api at once; the tensors' bytes, in pieces of at most
:data:`keyspace.ANSWER_PIECE_BYTES`, to the attempt's pieces stream
(:func:`keyspace.job_pieces`), each a plain ``XADD`` of a view of the arrays (never a Lua
argument, never a copy of the whole answer).
The pieces stream may live in another Redis (``PSGRAD_ANSWER_REDIS_URL``): one without
persistence, so that an append-only file kept for the queue's sake does not receive every byte of
every answer too.

Whole or nothing: the delivery that owns a running job writes its header under its attempt
number (``BEGIN_LUA``, with the small header; the data never passes through Lua); only the
worker's end script (``FINISH_LUA``) marks the answer whole, after the last piece, by naming the
attempt in the state hash and appending an ``end`` entry to the answer stream. The api relays
every piece but the last as it lands and the last only after that mark; if the job leaves
``running`` without it (canceled, taken over, its worker dead) or the pieces are gone, the reader
raises :class:`service.jobs.AnswerLost` first: a half answer is never served as whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis

from psgrad._wire import RESPONSE_KEY, safetensors_parts
from service.broker.redis import keyspace
from service.broker.redis.common import command_parts, pieces
from service.broker.redis.lua import BEGIN_LUA

__all__ = ["AnswerWriter"]


class AnswerWriter:
    """Writes one attempt's answer (worker side, synchronous): its header and end mark to the
    queue's Redis ``r``, its bytes to the answers' Redis ``pr`` (the same one by default)."""

    def __init__(self, r: redis.Redis, pr: redis.Redis, keys: keyspace.JobKeys, attempt: int,
                 *, ttl_s: int, result_ttl_s: int | None = None,
                 piece_bytes: int = keyspace.ANSWER_PIECE_BYTES) -> None:
        self.r = r
        self.pr = pr
        self.keys = keys
        self.key = keys.pieces(attempt)
        self.attempt = str(attempt)
        self.ttl_s = ttl_s  # while the job may still run
        self.result_ttl_s = result_ttl_s or ttl_s  # once written: as the job's end sets its keys
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
        cut = pieces(data, self.piece_bytes)
        self.open(next(cut, b""))
        if not self.begin(bytes(head)):
            self.pr.delete(self.key)
            return False
        conn = self.pr.connection_pool.get_connection()
        try:
            sent = 0
            for piece in cut:
                conn.send_packed_command(command_parts(*self._xadd(), piece), check_health=False)
                sent += 1
            conn.send_packed_command(command_parts(
                b"EXPIRE", self.key.encode(), b"%d" % self.result_ttl_s), check_health=False)
            sent += 1
            for _ in range(sent):  # a piece after a cancel adds nothing (NOMKSTREAM: a nil)
                conn.read_response()
        except BaseException:
            conn.disconnect()  # replies may be left unread: the socket is never lent again
            raise
        finally:
            self.pr.connection_pool.release(conn)
        return True

    def open(self, first: bytes | memoryview) -> None:
        """Create the pieces stream with the first piece, and its TTL. Before the header: the
        api, woken by the header, finds the stream; every later piece only appends to it
        (``NOMKSTREAM``), so a cancel, which deletes it, stops the rest."""
        with self.pr.pipeline(transaction=False) as pipe:
            pipe.execute_command(b"XADD", self.key.encode(), b"*", b"d", first)
            pipe.expire(self.key, self.ttl_s)
            pipe.execute()

    def begin(self, head: bytes) -> bool:
        """Drop what an earlier attempt left, write the header (a few hundred bytes of names
        and shapes) and wake the api, if the job still runs as this attempt."""
        k = self.keys
        return bool(self.r.eval(BEGIN_LUA, 3, k.state, k.answer, k.notify, self.attempt, head,
                                self.ttl_s))

    def add(self, piece: bytes | memoryview) -> None:
        """One piece by one command (what :meth:`write_parts` sends for each)."""
        self.pr.execute_command(*self._xadd(), piece)

    def _xadd(self) -> list[bytes]:
        # NOMKSTREAM: a piece never re-creates a stream a cancel deleted (nor one that expired),
        # so no key outlives the job and the TTL set by open() covers every piece
        return [b"XADD", self.key.encode(), b"NOMKSTREAM", b"*", b"d"]
