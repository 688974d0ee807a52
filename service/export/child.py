"""Registration in a child process: ``python -m service.export.child LIMITS_JSON < archive``.

A hostile archive may try to exhaust memory or time while it is parsed, built and dry-run;
it does so in this process, under ``RLIMIT_AS`` and ``RLIMIT_CPU``, and the api only reads
the answer: one JSON line (the checked program, or the error body), then on success the
safetensors bytes of its tensors. :func:`run_child` is the api's side.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from dataclasses import asdict
from typing import Any

from psgrad._errors import (
    InvalidArchive,
    PsgradError,
    RefusedProgram,
    TooLarge,
    error_from_body,
)
from service.config import raise_setting

CHILD_ENV_KEEP = ("PATH", "PYTHONPATH", "HOME", "LANG", "LC_ALL", "TMPDIR")


def run_child(data: bytes, limits: dict[str, Any], *, memory_mb: int, cpu_s: int,
              timeout_s: float) -> tuple[dict[str, Any], bytes]:
    """Check ``data`` in a fresh interpreter; the answer document and the tensors' bytes."""
    if not data.startswith(b"PK\x03\x04"):  # not a zip: no process needed to say so
        raise InvalidArchive("the body is not a zip archive: send the file torch.export.save "
                             "wrote")
    env = {k: v for k, v in os.environ.items() if k in CHILD_ENV_KEEP}
    env.update(PSGRAD_CHILD_MEMORY_MB=str(memory_mb), PSGRAD_CHILD_CPU_S=str(cpu_s),
               OMP_NUM_THREADS="1")
    try:
        done = subprocess.run(  # -P: nothing imported from the working directory
            [sys.executable, "-P", "-m", "service.export.child", json.dumps(limits)], input=data,
            capture_output=True, timeout=timeout_s, env=env, check=False,
        )
    except subprocess.TimeoutExpired:
        raise TooLarge(f"checking the program took more than {timeout_s:g} s of wall-clock time "
                       "and was stopped: send a smaller program, or "
                       f"{raise_setting('export_timeout_s', timeout_s)}",
                       limit=timeout_s) from None
    head, _, tail = done.stdout.partition(b"\n")
    try:
        answer = json.loads(head)
    except (ValueError, RecursionError):
        answer = None
    if not isinstance(answer, dict):
        if done.returncode == -signal.SIGXCPU:
            raise TooLarge(f"checking the program used more than {cpu_s} s of CPU time and was "
                           "stopped: send a smaller program, or "
                           f"{raise_setting('export_cpu_s', cpu_s)}", limit=cpu_s)
        raise TooLarge(f"checking the program stopped (exit {done.returncode}): it needs more "
                       f"than {memory_mb} MiB or {cpu_s} s of CPU time: "
                       f"{raise_setting('export_memory_mb', memory_mb)} or "
                       f"{raise_setting('export_cpu_s', cpu_s)}", limit=memory_mb)
    if "error" in answer:
        raise error_from_body(answer, int(answer.get("status", 422)))
    return answer, tail


def _limit_self() -> None:
    memory = int(os.environ.get("PSGRAD_CHILD_MEMORY_MB", "4096")) << 20
    cpu = int(os.environ.get("PSGRAD_CHILD_CPU_S", "60"))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    # SIGXCPU at the soft limit (the api names it), SIGKILL a moment later if it is ignored
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 2))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def main() -> int:
    _limit_self()
    from safetensors.torch import save

    from service.export.archive import ArchiveLimits
    from service.export.batch import make_batched
    from service.export.guard import check_example
    from service.export.module import ExportLimits, read_program

    out = sys.stdout.buffer
    try:
        raw = json.loads(sys.argv[1])
        limits = ExportLimits(archive=ArchiveLimits(**raw.pop("archive")), **raw)
        exported = read_program(sys.stdin.buffer.read(), limits)
        check_example(exported, limits)
        program, unbatched = make_batched(exported, limits)
        tensors = save({k: v.contiguous() for k, v in exported.tensors.items()})
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
    out.write(json.dumps(answer).encode() + b"\n" + tensors)
    return 0


def _refuse(exc: PsgradError) -> int:
    sys.stdout.buffer.write(json.dumps({**exc.to_dict(), "status": exc.status}).encode() + b"\n")
    return 0


def limits_dict(limits: Any) -> dict[str, Any]:
    """An :class:`ExportLimits` as the JSON the child reads."""
    return asdict(limits)


if __name__ == "__main__":
    raise SystemExit(main())
