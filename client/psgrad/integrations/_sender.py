"""A monitor's requests, sent from a child process at the lowest CPU priority.

The monitor's thread and the training share a process, so each request's Python work (the
client, httpx, the answer) took the training's own cores and its interpreter lock: about 4 ms
of CPU a request on the zoo's tiny transformer, 9-39% of a CPU-bound step when every step is
sampled (``benchmarks/callback.py``). :class:`Child` moves that work to a child process
(:func:`main`) that lowers its own priority first (``nice`` 19), so it runs on what the
training leaves idle: the monitor's thread only writes the copied batch to a
pipe and reads the few numbers the monitor logs.

Parent and child speak frames on the child's stdin and stdout: an 8-byte little-endian length,
then a safetensors file of the client's wire format (arrays as tensors, the rest JSON; nothing
is pickled or run): first the client's settings, then one call per frame, each answered by
one frame (the outputs the monitor reads, or the error's kind and message).
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import httpx
import numpy as np

from psgrad._arrays import to_numpy
from psgrad._client import Client
from psgrad._errors import BadRequest
from psgrad._wire import fields_from_safetensors, safetensors_parts

__all__ = ["Child", "Unanswered"]

NICE = 19  # the child's CPU priority: the lowest, so it never takes a busy core from training
ANSWERED = ("norms", "losses", "gns", "gns_trace", "gns_grad_sq", "layer_gns_trace",
            "layer_gns_grad_sq")  # the outputs a monitor's records read
SETTINGS, CALL, ANSWER = "settings", "call", "answer"  # each frame's metadata key
LENGTH = struct.Struct("<Q")
MAX_FRAME = 1 << 34  # a length beyond this is a broken pipe's garbage, not a batch


class Unanswered(Exception):
    """The child's call failed: ``kind`` is its error's class (``APIConnectionError``, ...)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Child:
    """The parent's end: :meth:`per_sample_grads` as the client's, answered by a child process
    with the client's settings (started with this, and again at the call after it exits). Only
    a client that reaches its server over HTTP can be copied into another process. The child
    has a session of its own, so a Ctrl-C meant for the training does not interrupt it: it
    ends when its stdin does (:meth:`close`, or this process gone)."""

    def __init__(self, client: Client) -> None:
        transport = getattr(client._http, "_transport", None)
        if not isinstance(transport, httpx.HTTPTransport):
            raise ValueError("a client with its own transport cannot be copied into a child "
                             "process: pass process=False to send from a thread instead")
        timeout = client.timeout
        self._settings = {
            "base_url": client.base_url, "api_key": client.api_key or "",
            "headers": {k: v for k, v in client._headers.items() if k != "Authorization"},
            "timeout": {"connect": timeout.connect, "read": timeout.read,
                        "write": timeout.write, "pool": timeout.pool},
            "max_retries": client.max_retries, "max_batch_size": client.max_batch_size,
            "binary": client.binary,
        }
        self._closed = False
        self._proc: subprocess.Popen[bytes] | None = self._start()  # its imports: now

    def per_sample_grads(self, model: str, inputs: Any, targets: Any = None,
                         **options: Any) -> dict[str, Any]:
        if self._closed:
            raise Unanswered("MonitorClosed", "the monitor closed before this batch was sent")
        if self._proc is None or self._proc.poll() is not None:  # it exited: start anew
            self._end()
            self._proc = self._start()
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None
        fields = {"model": model, "inputs": inputs, "targets": targets, **options}
        fields = {k: _arrays(v, k) for k, v in fields.items()}
        try:
            _write(proc.stdin, fields, CALL)
            answer = _read(proc.stdout, ANSWER)
        except (OSError, ValueError, BadRequest) as exc:  # the child died or broke the pipe
            self._end()
            raise Unanswered("SenderExited", f"the sending process stopped: {exc}") from None
        if answer is None:
            self._end()
            raise Unanswered("SenderExited", "the sending process stopped")
        if "error" in answer:
            raise Unanswered(str(answer["error"]), str(answer.get("message", "")))
        return answer

    def close(self) -> None:
        """Stop the child for good: a call after this is refused, never starts another."""
        self._closed = True
        self._end()

    def _end(self, timeout: float = 5.0) -> None:
        """Stop the child: its stdin closed (it exits when it reads the end), else killed."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        finally:
            if proc.stdout is not None:
                proc.stdout.close()

    def _start(self) -> subprocess.Popen[bytes]:
        here = str(Path(__file__).resolve().parents[2])  # the folder psgrad is imported from
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (here, os.environ.get("PYTHONPATH")) if p)}
        start = (f"import os\nif hasattr(os, 'nice'): os.nice({NICE})\n"  # not on Windows
                 f"from {__name__} import main\nmain()")
        proc = subprocess.Popen([sys.executable, "-c", start], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, start_new_session=True)
        assert proc.stdin is not None
        _write(proc.stdin, self._settings, SETTINGS)
        return proc


def _arrays(value: Any, name: str) -> Any:
    """``value`` as the wire takes it: arrays and tensors as numpy, mappings of them likewise,
    anything else (numbers, strings, lists of names) as it is."""
    if isinstance(value, Mapping):
        return {k: _arrays(v, f"{name}.{k}") for k, v in value.items()}
    if isinstance(value, np.ndarray) or hasattr(value, "detach"):  # detach: a torch tensor
        return to_numpy(value, name)
    return value


def _write(pipe: IO[bytes], fields: Mapping[str, Any], key: str) -> None:
    parts = safetensors_parts(fields, key)
    pipe.write(LENGTH.pack(sum(len(p) for p in parts)))
    for part in parts:
        pipe.write(part)
    pipe.flush()


def _read(pipe: IO[bytes], key: str) -> dict[str, Any] | None:
    """The next frame's fields, or None at the end of the stream."""
    head = pipe.read(LENGTH.size)
    if len(head) < LENGTH.size:
        return None
    (size,) = LENGTH.unpack(head)
    if size > MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes: the stream is broken")
    body = pipe.read(size)
    if len(body) < size:
        return None
    return fields_from_safetensors(body, key, max_header=size)


def main() -> None:
    """The child: read the settings, then answer each call until the parent closes stdin."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames may reach the parent's pipe
    settings = _read(stdin, SETTINGS)
    if settings is None:
        return
    with Client(settings["base_url"], api_key=settings["api_key"],
                timeout=httpx.Timeout(**settings["timeout"]),
                max_retries=settings["max_retries"], max_batch_size=settings["max_batch_size"],
                binary=settings["binary"], headers=settings["headers"]) as client:
        while (call := _read(stdin, CALL)) is not None:
            answer: dict[str, Any]
            try:
                result = client.per_sample_grads(call.pop("model"), call.pop("inputs"),
                                                 call.pop("targets", None), **call)
                answer = {k: result[k] for k in ANSWERED if k in result}
            except Exception as exc:  # answered to the parent, which counts and logs it
                answer = {"error": type(exc).__name__, "message": str(exc)}
            _write(stdout, answer, ANSWER)


if __name__ == "__main__":
    main()
