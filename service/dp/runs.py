"""DP runs: what a run is, and where it lives with its step count.

Three stores behind one interface, chosen like the model store (:func:`make_run_store`): memory
(embedded; gone with the process), files under ``PSGRAD_MODEL_DIR`` (embedded; survive a
restart), Redis (distributed; shared by the api and every worker). Each counts a step in one
atomic operation that also checks the budget and remembers the job id, so a job delivered twice
(a retry, a redelivery after a worker died) counts once, and no step is counted past the budget.
Each also marks a step's answer as going out before any of it does (:meth:`RunStore.released`),
so that one step never releases two noisy answers: a job delivered again after its answer began
to go out, or a job made again under a counted id (a key sent again once its job was deleted or
expired), is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import re
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError, ResponseError

from psgrad._contract import RUN_ID_PATTERN
from psgrad._errors import (
    Conflict,
    InsufficientStorage,
    Overloaded,
    PrivacyBudgetExhausted,
    UnknownDPRun,
)
from service import redis_keys
from service.config import Settings
from service.connections import connection_kwargs
from service.disk import unwritable
from service.tenants import DEFAULT_TENANT, keyed_id

RUN_ID_RE = re.compile(RUN_ID_PATTERN)  # the request contract's (psgrad._contract)
CLIP_FORMS = {"exact": 0.0, "opacus": 1e-6}  # the norm offset of each clip-factor form

# count() answers: the step was counted now, was counted before (same job), or was refused
COUNTED, REPEATED, EXHAUSTED, MISSING = 1, 0, -1, -2
LEDGER_FSYNC_TIMEOUT_MS = 2000  # WAITAOF for a counted step: everysec fsyncs every second
log = logging.getLogger(__name__)

# KEYS: run hash, released job ids. ARGV: job id. -> 1 marked now, 0 marked before, -2 no run
RELEASE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -2 end
return redis.call('SADD', KEYS[2], ARGV[1])
"""

# KEYS: run hash, counted job ids. ARGV: job id, max steps. -> {code, steps}
COUNT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-2, 0} end
local steps = tonumber(redis.call('HGET', KEYS[1], 'steps'))
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return {0, steps} end
if steps >= tonumber(ARGV[2]) then return {-1, steps} end
redis.call('SADD', KEYS[2], ARGV[1])
return {1, redis.call('HINCRBY', KEYS[1], 'steps', 1)}
"""


def new_run_id() -> str:
    return f"dp-{secrets.token_hex(12)}"


def keyed_run_id(tenant: str, key: str) -> str:
    """The id of ``tenant``'s run made under the ``Idempotency-Key`` ``key``
    (:func:`service.tenants.keyed_id`), shaped as :func:`new_run_id`'s."""
    return f"dp-{keyed_id(tenant, key, 24)}"


@dataclass(frozen=True)
class DPRun:
    """One DP-SGD run: its mechanism, its accounting and its budget (immutable once made)."""

    id: str
    model: str
    clip_norm: float
    noise_multiplier: float
    sample_rate: float
    expected_batch_size: float
    delta: float
    max_epsilon: float
    max_steps: int  # the most steps within max_epsilon under ``accountant``
    accountant: str
    clip_form: str = "exact"
    dataset_size: int | None = None
    planned_steps: int | None = None
    target_epsilon: float | None = None
    created: float = 0.0
    tenant: str = DEFAULT_TENANT  # who made it: only they take its steps (runs made before
    # tenants existed have no such field and belong to the default tenant)

    @property
    def norm_offset(self) -> float:
        return CLIP_FORMS[self.clip_form]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> DPRun:
        return cls(**json.loads(text))


def exhausted(run: DPRun, steps: int) -> PrivacyBudgetExhausted:
    return PrivacyBudgetExhausted(
        f"DP run '{run.id}' has spent its budget: {steps} steps taken, one more would pass "
        f"max_epsilon {run.max_epsilon:g} (delta {run.delta:g}, {run.accountant}); start a "
        "new run with a larger budget or more noise", run=run.id, steps=steps,
        max_steps=run.max_steps, max_epsilon=run.max_epsilon)


def released_before(run_id: str, job_id: str) -> Conflict:
    """A counted step whose answer went out before, or may have: it is not released again."""
    return Conflict(
        f"DP run '{run_id}': this step (job {job_id}) was counted and its noisy answer released "
        "before, or it may have been (an answer cut off, or an Idempotency-Key sent again after "
        "its job was deleted or expired); one step never releases a second answer: send the "
        "step again under a new Idempotency-Key (psgrad's run.step does), as a new step",
        run=run_id, job=job_id)


def withheld(run_id: str, job_id: str) -> Conflict:
    """A counted step whose answer the ledger's disk did not confirm: kept back (the step
    stays counted), and the same key can only replay this."""
    return Conflict(
        f"DP run '{run_id}': this step (job {job_id}) was counted, but the ledger did not "
        "confirm it on disk, so its noisy answer was not released: send the step again under a "
        "new Idempotency-Key (psgrad's run.step does), as a new step; this one stays counted",
        run=run_id, job=job_id)


def unknown(run_id: str) -> UnknownDPRun:
    return UnknownDPRun(f"unknown DP run '{run_id[:80]}': create one with POST /dp-runs",
                        run=run_id[:80])


class RunStore:
    """The interface of every store; all methods are safe to call from threads."""

    def create(self, run: DPRun) -> DPRun:
        """Keep ``run`` under its id, unless a run holds that id already (one made under the
        same ``Idempotency-Key``: :func:`keyed_run_id`), and answer the run kept."""
        raise NotImplementedError

    def get(self, run_id: str) -> tuple[DPRun, int] | None:
        """The run and its steps counted so far, or None."""
        raise NotImplementedError

    def ids(self) -> list[str]:
        raise NotImplementedError

    def delete(self, run_id: str) -> bool:
        raise NotImplementedError

    def _count(self, run: DPRun, job_id: str) -> tuple[int, int]:
        """(code, steps): one of COUNTED, REPEATED, EXHAUSTED, MISSING, atomically."""
        raise NotImplementedError

    def count(self, run_id: str, job_id: str) -> tuple[DPRun, int]:
        """Count job ``job_id`` as one step of the run, once; answer the run and its steps.

        Raises:
            UnknownDPRun: no such run (deleted meanwhile).
            PrivacyBudgetExhausted: the run already took ``max_steps`` steps.
        """
        found = self.get(run_id)
        if found is None:
            raise unknown(run_id)
        code, steps = self._count(found[0], job_id)
        if code == MISSING:
            raise unknown(run_id)
        if code == EXHAUSTED:
            raise exhausted(found[0], steps)
        return found[0], steps

    def released(self, run_id: str, job_id: str) -> bool:
        """Mark counted job ``job_id``'s answer as going out: True the first time, False once
        marked before (by this process or another, or counted before this process read the
        run from its files: its answer may have gone out). Called before any of the answer
        is stored.

        Raises:
            UnknownDPRun: no such run (deleted meanwhile).
        """
        raise NotImplementedError

    def sync(self) -> None:
        """Return once every step counted so far is on disk, or raise: called by the worker
        before it releases the answers of the steps it counted (one wait for a whole batch).
        Files fsync each step as they count it; memory keeps nothing past the process."""

    def close(self) -> None:
        return None


class MemoryRunStore(RunStore):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, DPRun] = {}
        self._jobs: dict[str, list[str]] = {}  # counted job ids in order: len() is the steps
        self._seen: dict[str, set[str]] = {}
        self._released: dict[str, set[str]] = {}

    def create(self, run: DPRun) -> DPRun:
        with self._lock:
            held = self._runs.get(run.id)
            if held is not None:
                return held
            self._runs[run.id] = run
            self._jobs[run.id], self._seen[run.id], self._released[run.id] = [], set(), set()
            return run

    def get(self, run_id: str) -> tuple[DPRun, int] | None:
        with self._lock:
            self._load(run_id)
            run = self._runs.get(run_id)
            return (run, len(self._jobs[run_id])) if run is not None else None

    def ids(self) -> list[str]:
        with self._lock:
            return sorted(self._runs)

    def delete(self, run_id: str) -> bool:
        with self._lock:
            self._jobs.pop(run_id, None)
            self._seen.pop(run_id, None)
            self._released.pop(run_id, None)
            return self._runs.pop(run_id, None) is not None

    def released(self, run_id: str, job_id: str) -> bool:
        with self._lock:
            self._load(run_id)
            marked = self._released.get(run_id)
            if marked is None:
                raise unknown(run_id)
            if job_id in marked:
                return False
            marked.add(job_id)
            return True

    def _count(self, run: DPRun, job_id: str) -> tuple[int, int]:
        with self._lock:
            self._load(run.id)
            if run.id not in self._jobs:
                return MISSING, 0
            return self._tally(run, job_id)

    def _tally(self, run: DPRun, job_id: str, record: Callable[[], None] | None = None
               ) -> tuple[int, int]:
        """(code, steps) of job ``job_id`` counted against the run as held in memory;
        ``record``: puts the step on disk before it counts. Hold the lock."""
        jobs, seen = self._jobs[run.id], self._seen[run.id]
        if job_id in seen:
            return REPEATED, len(jobs)
        if len(jobs) >= run.max_steps:
            return EXHAUSTED, len(jobs)
        if record is not None:
            record()
        jobs.append(job_id)
        seen.add(job_id)
        return COUNTED, len(jobs)

    def _load(self, run_id: str) -> None:
        """Files: read a run into memory on first use (call with the lock held)."""


class FileRunStore(MemoryRunStore):
    """Runs under ``<PSGRAD_MODEL_DIR>/.dp-runs/<id>/``: ``run.json`` and ``steps.log`` (one
    counted job id per line, appended and flushed to disk before the step counts). Servers
    sharing the folder share each run's budget: a step is counted under an exclusive lock on
    its ``steps.log`` (``flock``), after reading the lines the others appended."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__()
        self.root = Path(root) / ".dp-runs"
        self.root.mkdir(parents=True, exist_ok=True)
        self._read_to: dict[str, int] = {}  # the bytes of each run's steps.log read so far

    def _folder(self, run_id: str) -> Path:
        return self.root / (run_id if RUN_ID_RE.fullmatch(run_id) else "_")

    def create(self, run: DPRun) -> DPRun:
        from service.model_store import _write_atomic

        folder = self._folder(run.id)
        folder.mkdir(exist_ok=True)
        (folder / "steps.log").touch()
        with self._lock:  # a run of this id kept before (by this process or another) stays
            if not _write_atomic(folder / "run.json", run.to_json().encode(), exclusive=True):
                self._load(run.id)
                return self._runs[run.id]
            self._read_to[run.id] = 0
        return super().create(run)

    def ids(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if (p / "run.json").is_file())

    def delete(self, run_id: str) -> bool:
        folder = self._folder(run_id)
        with self._lock:
            found = (folder / "run.json").is_file()
            for name in ("run.json", "steps.log"):  # the spec first: gone at once
                (folder / name).unlink(missing_ok=True)
            if folder.is_dir() and RUN_ID_RE.fullmatch(run_id):
                folder.rmdir()
            self._read_to.pop(run_id, None)
        return super().delete(run_id) or found

    def get(self, run_id: str) -> tuple[DPRun, int] | None:
        with self._lock:
            self._load(run_id)
            if run_id in self._runs:
                self._read_steps(run_id)
        return super().get(run_id)

    def _read_steps(self, run_id: str) -> None:
        """:meth:`_catch_up` from the run's ``steps.log`` (gone: deleted meanwhile)."""
        with contextlib.suppress(FileNotFoundError), open(
                self._folder(run_id) / "steps.log", "rb") as f:
            self._catch_up(run_id, f)

    def _load(self, run_id: str) -> None:
        if run_id in self._runs:
            return
        folder = self._folder(run_id)
        try:
            run = DPRun.from_json((folder / "run.json").read_bytes())
            (folder / "steps.log").stat()
        except (FileNotFoundError, NotADirectoryError):
            return
        self._runs[run_id], self._jobs[run_id], self._seen[run_id] = run, [], set()
        self._released[run_id], self._read_to[run_id] = set(), 0
        self._read_steps(run_id)

    def _catch_up(self, run_id: str, f: Any) -> None:
        """Read the steps appended to the run's ``steps.log`` (``f``, open) since last read,
        by another process or before this one read the run: a step counted elsewhere may have
        released its answer. Call with the lock held."""
        f.seek(self._read_to[run_id])
        raw = f.read()
        whole = raw[:raw.rfind(b"\n") + 1]  # a line being written is read when it is whole
        self._read_to[run_id] += len(whole)
        for job_id in whole.decode().split():
            if job_id not in self._seen[run_id]:
                self._jobs[run_id].append(job_id)
                self._seen[run_id].add(job_id)
                self._released[run_id].add(job_id)

    def _tally(self, run: DPRun, job_id: str, record: Callable[[], None] | None = None
               ) -> tuple[int, int]:
        """Memory's count, under an exclusive lock on the run's ``steps.log`` that every
        process on the folder takes, after reading the lines the others appended; the step
        appended to it before it counts."""
        try:
            with open(self._folder(run.id) / "steps.log", "rb+") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # freed on close
                self._catch_up(run.id, f)
                return super()._tally(run, job_id, partial(self._append, f, run.id, job_id))
        except FileNotFoundError:  # deleted meanwhile
            return MISSING, 0
        except OSError as exc:  # opened for writing: a read-only folder refuses here
            raise _unrecorded(run.id, exc) from None

    def _append(self, f: Any, run_id: str, job_id: str) -> None:
        """The step at the end of ``f`` (its ``steps.log``, open and locked), on disk, and read
        up to there; a folder that takes no write (read-only, full) refuses the step (507),
        its line cut off again: nothing is released that the ledger does not hold."""
        end = f.seek(0, os.SEEK_END)
        try:
            f.write(job_id.encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
            self._read_to[run_id] = f.tell()
        except OSError as exc:
            with contextlib.suppress(OSError):
                f.truncate(end)
            raise _unrecorded(run_id, exc) from None


def _unrecorded(run_id: str, exc: OSError) -> InsufficientStorage:
    """A step its ``steps.log`` could not take (a folder read-only, full, not writable): not
    counted, nothing released (507)."""
    refused = unwritable(exc, "the DP runs' folder under PSGRAD_MODEL_DIR", "PSGRAD_MODEL_DIR")
    return InsufficientStorage(
        f"DP run '{run_id}': its step was not taken and nothing was released: "
        + (refused.message if refused else f"it could not be recorded ({exc.strerror})"),
        run=run_id, reason=refused.details["reason"] if refused else "not_written")


class RedisRunStore(RunStore):
    """Runs in Redis (key names in :mod:`service.redis_keys`); counting is one Lua script.

    A counted step must be on Redis's disk before its answer is released, or a crash of the
    Redis host (power, kernel) inside ``appendfsync everysec``'s window loses the step while
    the user holds its noisy answer: the ledger would under-count epsilon. :meth:`durability`
    says how this Redis gets there (docs/operations.md, "A crash of the Redis host")."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.r = client
        self.prefix = prefix
        self._count_script = client.register_script(COUNT_LUA)
        self._release_script = client.register_script(RELEASE_LUA)
        self._durability: str | None = None

    def durability(self) -> str:
        """How a counted step reaches the disk before its answer goes out, probed once:
        ``always`` (the AOF with ``appendfsync always``: Redis fsyncs before it replies),
        ``waitaof`` (Redis 7.2 or later: each step waits for ``WAITAOF``), or ``none`` (no
        AOF, ``everysec`` on an older Redis, or a Redis that hides its settings: a host crash
        may lose the last second's steps; logged once as an error)."""
        if self._durability is None:
            self._durability = self._probe()
            if self._durability == "none":
                log.error(
                    "DP runs: the Redis that keeps their step counts does not put a step on "
                    "disk before its answer is released (no append-only file, or appendfsync "
                    "%s on a Redis without WAITAOF): a crash of that host can lose the steps "
                    "of its last second, and the runs' epsilon would then be under-counted. "
                    "Set appendfsync always on it, or use Redis 7.2 or later "
                    "(docs/operations.md)", self._config().get("appendfsync", "unknown"))
        return self._durability

    def _config(self) -> dict[str, str]:
        try:
            found = self.r.config_get("append*")
        except RedisError:  # CONFIG disabled (a managed Redis): unknown
            return {}
        return dict(found)  # redis-py reads CONFIG GET's reply as text

    def _probe(self) -> str:
        config = self._config()
        if config.get("appendonly") == "yes" and config.get("appendfsync") == "always":
            return "always"
        if config.get("appendonly") == "no":
            return "none"
        try:
            self.r.execute_command("WAITAOF", 1, 0, 1)
        except ResponseError:  # unknown before Redis 7.2, refused without an AOF
            return "none"
        return "waitaof"

    def sync(self) -> None:
        """With ``waitaof``: one write of this connection, then ``WAITAOF`` on it, which
        returns once the AOF is synced past that write, so past every step counted before
        (from any connection: the file is one sequence)."""
        if self.durability() != "waitaof":
            return
        pipe = self.r.pipeline(transaction=False)
        pipe.incr(redis_keys.dp_ledger_sync(self.prefix))
        pipe.execute_command("WAITAOF", 1, 0, LEDGER_FSYNC_TIMEOUT_MS)
        _, (local, _) = pipe.execute()
        if int(local) < 1:
            raise Overloaded(
                f"the DP steps were counted, but Redis did not confirm them on disk within "
                f"{LEDGER_FSYNC_TIMEOUT_MS} ms, so their answers were not released; retry "
                "(these steps stay counted against the budget)", retry_after=1)

    def create(self, run: DPRun) -> DPRun:
        key = redis_keys.dp_run(self.prefix, run.id)
        pipe = self.r.pipeline(transaction=True)
        pipe.hsetnx(key, "spec", run.to_json())  # a run of this id kept before stays
        pipe.hsetnx(key, "steps", 0)
        pipe.sadd(redis_keys.dp_run_ids(self.prefix), run.id)
        pipe.hget(key, "spec")
        return DPRun.from_json(pipe.execute()[-1])

    def get(self, run_id: str) -> tuple[DPRun, int] | None:
        spec, steps = self.r.hmget(redis_keys.dp_run(self.prefix, run_id), ["spec", "steps"])
        return None if spec is None else (DPRun.from_json(spec), int(steps or 0))

    def ids(self) -> list[str]:
        found = self.r.smembers(redis_keys.dp_run_ids(self.prefix))
        return sorted(v.decode() for v in found)

    def delete(self, run_id: str) -> bool:
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(redis_keys.dp_run(self.prefix, run_id),
                    redis_keys.dp_run_jobs(self.prefix, run_id),
                    redis_keys.dp_run_released(self.prefix, run_id))
        pipe.srem(redis_keys.dp_run_ids(self.prefix), run_id)
        return bool(pipe.execute()[0])

    def _count(self, run: DPRun, job_id: str) -> tuple[int, int]:
        code, steps = self._count_script(
            keys=[redis_keys.dp_run(self.prefix, run.id),
                  redis_keys.dp_run_jobs(self.prefix, run.id)],
            args=[job_id, run.max_steps])
        return int(code), int(steps)

    def released(self, run_id: str, job_id: str) -> bool:
        marked = int(self._release_script(
            keys=[redis_keys.dp_run(self.prefix, run_id),
                  redis_keys.dp_run_released(self.prefix, run_id)], args=[job_id]))
        if marked == MISSING:
            raise unknown(run_id)
        return marked == 1

    def close(self) -> None:
        self.r.close()


def make_run_store(settings: Settings) -> RunStore:
    """Redis when a Redis URL is set, else files under ``model_dir`` when set, else memory
    (built once per process, :func:`service.storage.open_storage`)."""
    if settings.redis_url:
        import redis

        client = redis.Redis.from_url(settings.redis_url, **connection_kwargs(settings))
        return RedisRunStore(client, settings.redis_prefix)
    if settings.model_dir:
        return FileRunStore(settings.model_dir)
    return MemoryRunStore()

