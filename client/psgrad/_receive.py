"""Receiving a safetensors answer straight from the connection's socket into its arrays.

httpx hands a body over in 64 KiB ``bytes`` that its HTTP parser (h11) has copied twice on the
way; for an answer of hundreds of MB those copies and the Python work per 64 KiB cost several
times the transfer itself. Over a plain TCP connection (no TLS, no content encoding, a
``Content-Length``), once the parser has handed over what it already holds, the rest of the body
is received with ``recv_into`` straight into the answer's arrays, as a bare socket would. The
parser never sees those bytes, so the connection is closed afterwards instead of reused (one new
connection per large answer). Anything else (TLS, HTTP/2, an ASGI or mock transport, small
answers) reads through httpx as before; so does :class:`psgrad.AsyncClient`, whose socket
belongs to its event loop.
"""

from __future__ import annotations

import socket
from collections.abc import Generator
from typing import cast

import httpx

from psgrad._answer_reader import AnswerReader

__all__ = ["receive_answer"]

DIRECT_MIN_BYTES = 1 << 20  # smaller answers: through httpx (a new connection costs more)
_SCRATCH = 64 << 10  # header bytes are received into a scratch buffer and fed


def receive_answer(response: httpx.Response, reader: AnswerReader) -> None:
    """Feed the whole body of ``response`` to ``reader``, in place where the connection allows."""
    sock = _plain_socket(response)
    length = _content_length(response)
    if sock is None or length is None or length < DIRECT_MIN_BYTES:
        for piece in response.iter_bytes():
            reader.feed(piece)
        return
    got = 0
    parsed = cast(Generator[bytes, None, None], response.iter_raw())
    try:
        for piece in parsed:  # what the parser read with the headers (or its first read)
            reader.feed(piece)
            got += len(piece)
            break
        scratch = memoryview(bytearray(_SCRATCH))
        while got < length:
            target = reader.space()
            if target is None:  # the header is still incomplete (or the header says less)
                n = _recv_into(sock, scratch[:length - got], response)
                reader.feed(scratch[:n])
            else:
                n = _recv_into(sock, target[:length - got], response)
                reader.wrote(n)
            got += n
    finally:
        parsed.close()  # httpcore closes the connection: its parser never saw the rest


def _plain_socket(response: httpx.Response) -> socket.socket | None:
    """The response's TCP socket, if its body arrives on it as is (no TLS, no encoding)."""
    if response.headers.get("content-encoding", "identity").lower() != "identity":
        return None
    stream = response.extensions.get("network_stream")
    if stream is None or stream.get_extra_info("ssl_object") is not None:
        return None
    sock = stream.get_extra_info("socket")
    return sock if isinstance(sock, socket.socket) else None


def _content_length(response: httpx.Response) -> int | None:
    if "transfer-encoding" in response.headers:
        return None
    try:
        return int(response.headers["content-length"])
    except (KeyError, ValueError):
        return None


def _recv_into(sock: socket.socket, view: memoryview, response: httpx.Response) -> int:
    """One ``recv_into``, with httpx's errors (the client's retries treat them as httpx's)."""
    try:
        n = sock.recv_into(view)
    except TimeoutError as exc:  # socket.timeout: the read timeout httpx set on the socket
        raise httpx.ReadTimeout(str(exc) or "timed out", request=response.request) from exc
    except OSError as exc:
        raise httpx.ReadError(str(exc), request=response.request) from exc
    if n == 0:
        raise httpx.RemoteProtocolError(
            "the server closed the connection before the whole answer arrived",
            request=response.request)
    return n
