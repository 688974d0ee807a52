"""The sync SDK receives a large safetensors answer straight from the socket into its arrays.

A response is built as httpcore hands it over: the bytes its parser read with the headers come
through the response stream, the rest waits on the connection's socket (a socketpair here, fed
by a thread), so every split of the body between the two is exercised.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from psgrad import _receive
from psgrad._answer_reader import AnswerReader
from psgrad._errors import BadRequest
from psgrad._wire import RESPONSE_KEY, fields_to_safetensors

RESULT = {"model": "x", "grads": {"w": np.arange(600_000, dtype=np.float32).reshape(200, 3000),
                                  "b": np.linspace(-1, 1, 200, dtype=np.float32)},
          "norms": np.ones(200, np.float32)}
BODY = fields_to_safetensors(RESULT, RESPONSE_KEY)  # 2.4 MB


class Parsed(httpx.SyncByteStream):
    """What the HTTP parser already holds: handed over as the first piece(s) of the body."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def __iter__(self) -> Iterator[bytes]:
        yield from self.pieces


class Network:
    """httpcore's ``network_stream`` extension: the connection's socket, no TLS."""

    def __init__(self, sock: socket.socket, tls: bool = False) -> None:
        self.sock, self.tls = sock, tls

    def get_extra_info(self, info: str) -> Any:
        return {"socket": self.sock, "ssl_object": object() if self.tls else None}.get(info)


@contextlib.contextmanager
def respond(first: bytes, rest: bytes, *, length: int | None = None, tls: bool = False,
            hang: bool = False) -> Iterator[httpx.Response]:
    """A response whose parser holds ``first``; a thread sends ``rest`` on its socket, then
    closes it (or, with ``hang``, keeps it open until the test is done)."""
    ours, theirs = socket.socketpair()
    ours.settimeout(10)
    done = threading.Event()

    def send() -> None:
        with contextlib.suppress(OSError):
            for start in range(0, len(rest), 100_003):  # odd pieces: tensors straddle reads
                theirs.sendall(rest[start:start + 100_003])
        if hang:
            done.wait(30)
        theirs.close()

    sender = threading.Thread(target=send)
    sender.start()
    headers = {"content-type": "application/x-safetensors",
               "content-length": str(len(first) + len(rest) if length is None else length)}
    try:
        yield httpx.Response(200, headers=headers, stream=Parsed([first] if first else []),
                             extensions={"network_stream": Network(ours, tls)},
                             request=httpx.Request("POST", "http://psgrad.test/per-sample-grads"))
    finally:
        done.set()
        ours.close()
        sender.join()


@pytest.mark.parametrize("split", [0, 5, 60, 2_000, len(BODY) - 7, len(BODY)],
                         ids=["nothing-parsed", "in-length", "in-header", "in-data", "all-but-7",
                              "all-parsed"])
def test_the_answer_is_whole_and_equal_wherever_the_parser_stopped(split: int) -> None:
    reader = AnswerReader(RESPONSE_KEY)
    with respond(BODY[:split], BODY[split:]) as response:
        _receive.receive_answer(response, reader)
    fields = reader.fields()
    for name in ("w", "b"):
        np.testing.assert_array_equal(fields["grads"][name], RESULT["grads"][name])
        assert fields["grads"][name].flags.c_contiguous
    np.testing.assert_array_equal(fields["norms"], RESULT["norms"])


def test_a_body_cut_short_raises_a_transport_error_never_a_short_answer() -> None:
    reader = AnswerReader(RESPONSE_KEY)
    with (respond(BODY[:1000], BODY[1000:len(BODY) // 2], length=len(BODY)) as response,
          pytest.raises(httpx.RemoteProtocolError, match="before the whole answer")):
        _receive.receive_answer(response, reader)
    with pytest.raises(BadRequest, match="ended before"):
        reader.fields()


def test_a_body_longer_than_its_header_says_is_refused() -> None:
    with (respond(BODY[:1000], BODY[1000:] + b"\0" * 64) as response,
          pytest.raises(BadRequest, match="longer than its header")):
        _receive.receive_answer(response, AnswerReader(RESPONSE_KEY))


def test_a_stalled_server_is_a_read_timeout() -> None:
    with respond(BODY[:1000], BODY[1000:2_000_000], length=len(BODY), hang=True) as response:
        response.extensions["network_stream"].sock.settimeout(0.2)
        with pytest.raises(httpx.ReadTimeout):
            _receive.receive_answer(response, AnswerReader(RESPONSE_KEY))


@pytest.mark.parametrize("case", ["tls", "small", "encoded"])
def test_other_answers_are_read_through_httpx_alone(case: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """TLS, small or encoded bodies: the socket is never read directly (all bytes come from
    the parser, and the socket here would give nothing)."""
    if case == "small":
        monkeypatch.setattr(_receive, "DIRECT_MIN_BYTES", len(BODY) + 1)
    with respond(BODY, b"", tls=case == "tls", hang=True) as response:
        if case == "encoded":
            response.headers["content-encoding"] = "br"
            assert _receive._plain_socket(response) is None
            return
        reader = AnswerReader(RESPONSE_KEY)
        _receive.receive_answer(response, reader)
    np.testing.assert_array_equal(reader.fields()["grads"]["w"], RESULT["grads"]["w"])
