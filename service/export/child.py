"""Registration in a child process: ``python -m service.export.child`` (see :func:`run_child`).

A hostile archive may try to exhaust memory or time while it is parsed, built and dry-run;
it does so in this process, under ``RLIMIT_AS`` and ``RLIMIT_CPU``, and the api only reads
the answer: one JSON line (the checked program, or the error body) and, on success, the
safetensors file of its tensors, written to a temporary file the api opened for it. The
archive is read from a file too, one in memory where Linux has them (``memfd_create``): 500 MB
through pipes took GPT-2's registration seconds, and written to a file on disk, 1 s. The api
writes a request's body into it as the body arrives (``checking_child`` in
:mod:`service.export.register`), so the archive is never also joined in the api's memory.
:func:`run_child` is the api's side.

A child takes one archive and exits. It imports torch and the checks before it reads its
input, so the api keeps one started ahead (:data:`SPARES`): a registration finds the imports
done (3.8 s of GPT-2's, on a 2-core host) and starts the next spare.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from typing import IO, Any

from psgrad._errors import (
    InvalidArchive,
    PsgradError,
    RefusedProgram,
    TooLarge,
    error_from_body,
)
from service.config import raise_setting

CHILD_ENV_KEEP = ("PATH", "PYTHONPATH", "HOME", "LANG", "LC_ALL", "TMPDIR")


@dataclass
class Child:
    """A started child and its two files: the archive it reads (in memory), the tensors it
    writes (a temporary file: in memory as well, GPT-2's registration measured slower), both
    opened before it started and handed to it; no pipe carries either."""

    proc: subprocess.Popen[bytes]
    archive: IO[bytes]
    tensors: IO[bytes]

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()

    def end(self) -> None:
        if self.archive.closed:  # ended already
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()
        self.archive.close()
        self.tensors.close()


class Spares:
    """At most one child started ahead, with its limits (a child of other limits is ended)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spare: tuple[tuple[int, int], Child] | None = None

    def take(self, memory_mb: int, cpu_s: int, *, refill: bool = True) -> Child:
        """A started child with these limits (the spare, else a new one); the next spare
        starts now, unless not to ``refill`` (the caller calls :meth:`keep` itself)."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare[0] == (memory_mb, cpu_s) and spare[1].proc.poll() is None:
            child = spare[1]
        else:
            if spare is not None:
                spare[1].end()
            child = _start(memory_mb, cpu_s)
        if refill:
            self.keep(memory_mb, cpu_s)
        return child

    def keep(self, memory_mb: int, cpu_s: int) -> None:
        """Start a spare with these limits, if none is waiting."""
        with self._lock:
            if self._spare is None:
                self._spare = ((memory_mb, cpu_s), _start(memory_mb, cpu_s))

    def close(self) -> None:
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare[1].end()


SPARES = Spares()


def _start(memory_mb: int, cpu_s: int) -> Child:
    archive, tensors = _in_memory("psgrad-archive"), tempfile.TemporaryFile()  # noqa: SIM115
    env = {k: v for k, v in os.environ.items() if k in CHILD_ENV_KEEP}
    env.update(PSGRAD_CHILD_MEMORY_MB=str(memory_mb), PSGRAD_CHILD_CPU_S=str(cpu_s),
               PSGRAD_CHILD_FILES=f"{archive.fileno()},{tensors.fileno()}", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(  # -P: nothing imported from the working directory
        [sys.executable, "-P", "-m", "service.export.child"], env=env,
        pass_fds=(archive.fileno(), tensors.fileno()),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    return Child(proc, archive, tensors)


def _in_memory(name: str) -> IO[bytes]:
    """A file held in memory, never written back to a disk (a temporary file where the OS
    cannot make one)."""
    if hasattr(os, "memfd_create"):
        return open(os.memfd_create(name), "w+b")
    return tempfile.TemporaryFile()


def run_child(archive: bytes | Child, limits: dict[str, Any], *, memory_mb: int, cpu_s: int,
              timeout_s: float) -> tuple[dict[str, Any], bytes]:
    """Check an archive in a fresh interpreter: its bytes, or a child taken from
    :data:`SPARES` with these limits, holding it in its archive file (ended here either way);
    the answer document and the tensors' bytes."""
    if isinstance(archive, Child):
        with archive:
            archive.archive.flush()
            _check_zip(os.pread(archive.archive.fileno(), 4, 0))
            return _answer(archive, limits, memory_mb, cpu_s, timeout_s)
    _check_zip(archive)  # no process needed to say so
    with SPARES.take(memory_mb, cpu_s) as child:
        child.archive.write(archive)
        child.archive.flush()
        return _answer(child, limits, memory_mb, cpu_s, timeout_s)


def _check_zip(head: bytes) -> None:
    if not head.startswith(b"PK\x03\x04"):
        raise InvalidArchive("the body is not a zip archive: send the file torch.export.save "
                             "wrote")


def _answer(child: Child, limits: dict[str, Any], memory_mb: int, cpu_s: int,
            timeout_s: float) -> tuple[dict[str, Any], bytes]:
    try:  # the limits, on one line, say go
        head, _ = child.proc.communicate(json.dumps(limits).encode() + b"\n", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise TooLarge(f"checking the program took more than {timeout_s:g} s of wall-clock time "
                       "and was stopped: send a smaller program, or "
                       f"{raise_setting('export_timeout_s', timeout_s)}",
                       limit=timeout_s) from None
    try:
        answer = json.loads(head)
    except (ValueError, RecursionError):
        answer = None
    if not isinstance(answer, dict):
        if child.proc.returncode == -signal.SIGXCPU:
            raise TooLarge(f"checking the program used more than {cpu_s} s of CPU time and was "
                           "stopped: send a smaller program, or "
                           f"{raise_setting('export_cpu_s', cpu_s)}", limit=cpu_s)
        raise TooLarge(f"checking the program stopped (exit {child.proc.returncode}): it needs "
                       f"more than {memory_mb} MiB or {cpu_s} s of CPU time: "
                       f"{raise_setting('export_memory_mb', memory_mb)} or "
                       f"{raise_setting('export_cpu_s', cpu_s)}", limit=memory_mb)
    if "error" in answer:
        raise error_from_body(answer, int(answer.get("status", 422)))
    child.tensors.seek(0)
    return answer, child.tensors.read()


def _limit_self() -> None:
    memory = int(os.environ.get("PSGRAD_CHILD_MEMORY_MB", "4096")) << 20
    cpu = int(os.environ.get("PSGRAD_CHILD_CPU_S", "60"))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    # SIGXCPU at the soft limit (the api names it), SIGKILL a moment later if it is ignored
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 2))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def main() -> int:
    _limit_self()
    import torch._dynamo  # noqa: F401  (the checks' meta kernels import it on first use: 1.8 s)

    from psgrad._wire import safetensors_parts
    from service.export.archive import ArchiveLimits
    from service.export.batch import make_batched
    from service.export.guard import check_example
    from service.export.module import ExportLimits, read_program

    out = sys.stdout.buffer
    archive_fd, tensors_fd = map(int, os.environ["PSGRAD_CHILD_FILES"].split(","))
    try:  # everything is imported: from here on a spare child waits for its input
        raw = json.loads(sys.stdin.buffer.readline())
        limits = ExportLimits(archive=ArchiveLimits(**raw.pop("archive")), **raw)
        # what it writes is bounded as the weights are: no answer can fill the api's disk
        size = limits.max_weight_bytes + (64 << 20)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        with open(archive_fd, "rb", closefd=False) as archive:
            exported = read_program(archive, limits)
        check_example(exported, limits)
        program, unbatched = make_batched(exported, limits)
        tensors = {k: v.contiguous() for k, v in exported.tensors.items()}
    except PsgradError as exc:
        return _refuse(exc)
    except MemoryError:
        memory = os.environ.get("PSGRAD_CHILD_MEMORY_MB", "4096")
        return _refuse(TooLarge(f"checking the program ran out of memory: "
                                f"{raise_setting('export_memory_mb', memory)}"))
    except RecursionError:
        return _refuse(RefusedProgram("the program nests too deeply"))
    answer = {
        "program": program.doc,
        "batched": not unbatched,
        "batch_check": unbatched,  # why it runs one sample at a time ("" when it does not)
        "inputs": [{"name": u.name, "shape": list(u.shape), "hints": list(u.hints),
                    "dtype": str(u.dtype).removeprefix("torch."),
                    "dynamic": [list(d) for d in u.dynamic],
                    "high": exported.highs.get(u.name)} for u in program.inputs],
        "parameters": list(exported.params),
        "aliases": exported.aliases,
        "output_shape": list(exported.output_shape),
        "activations": exported.activations,
    }
    with open(tensors_fd, "wb", closefd=False) as f:  # in place: no copy of the whole file
        for part in safetensors_parts(_arrays(tensors), "tensors"):
            f.write(part)
    out.write(json.dumps(answer).encode() + b"\n")
    return 0


def _arrays(tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` as numpy views (bfloat16 as its bits, :data:`psgrad._wire.BFLOAT16`), which
    :func:`psgrad._wire.safetensors_parts` writes without copying."""
    import torch

    from psgrad._wire import BFLOAT16

    return {k: t.view(torch.int16).numpy().view(BFLOAT16) if t.dtype == torch.bfloat16
            else t.numpy() for k, t in tensors.items()}


def _refuse(exc: PsgradError) -> int:
    sys.stdout.buffer.write(json.dumps({**exc.to_dict(), "status": exc.status}).encode() + b"\n")
    return 0


def limits_dict(limits: Any) -> dict[str, Any]:
    """An :class:`ExportLimits` as the JSON the child reads."""
    return asdict(limits)


if __name__ == "__main__":
    raise SystemExit(main())
