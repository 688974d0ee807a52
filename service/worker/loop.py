"""The worker loop, the same for every broker: take jobs, batch them, run the engine, answer.

Each round takes up to ``PSGRAD_BATCH_MAX_SAMPLES`` samples of queued jobs (0 ms of
``PSGRAD_BATCH_MAX_DELAY_MS``: one job per round, no cross-request batching). A job that finds
the worker idle runs at once; jobs that queued while it was busy are batched, waiting for more
only until the oldest has waited ``PSGRAD_BATCH_MAX_DELAY_MS`` (:func:`service.jobs.batch_until`).
Jobs whose deadline passed or that were canceled are dropped; the rest are validated one by one
(a bad job fails alone with its own error), grouped by
:meth:`service.validate.ParsedRequest.group_key`, and each group runs as ONE engine call on the
concatenated batch with one segment per job, so per-job statistics stay per job. If a merged call
fails, its jobs are retried one by one so that one job's problem never fails another's. A job
asked to be verified (``verify``, or drawn by ``PSGRAD_VERIFY_FRACTION``) is checked on its own
samples (:mod:`service.verify`) before its answer is stored; a wrong answer fails it alone.

The loop knows the queue only as a :class:`service.jobs.JobSource`. In embedded mode the app's
lifespan runs ``PSGRAD_WORKERS`` loops in threads (:class:`WorkerPool`); with Redis each
``psgrad worker`` process runs one (:mod:`service.worker_process`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Final, TypeVar

import torch

from psgrad._contract import output
from psgrad._errors import (
    InternalError,
    PsgradError,
    VerificationFailed,
)
from service import engine, verify, warmup
from service.answer_fields import HALF, result_fields
from service.compile_cache import CompiledFunctions
from service.config import Settings, raise_setting
from service.dp.runs import released_before, withheld
from service.dp.steps import on_result as count_dp_step
from service.fast_stats import SharedPlans, warm_kernels
from service.jobs import Job, JobSource, answer_too_large, missed_deadline
from service.registry import ModelRegistry, set_tf32
from service.storage import Storage
from service.strategies import per_sample
from service.validate import ParsedRequest, check_request
from service.worker.events import (
    BatchEnded,
    BatchStarted,
    Events,
    JobEnded,
    JobVerified,
    Subscriber,
)
from service.worker.recorder import WorkerStatus

log = logging.getLogger("psgrad.worker")

__all__ = ["Worker", "WorkerPool"]

MAX_NESTED = 2  # a job run between two chunks may itself let others in, this deep at most

T = TypeVar("T")


class _Failed(enum.Enum):
    FAILED = "failed"


_FAILED: Final = _Failed.FAILED  # what Worker._attempt answers once the job has failed


class Worker:
    """One loop over a :class:`JobSource`; run several in threads or processes for parallelism."""

    def __init__(
        self,
        source: JobSource,
        registry: ModelRegistry,
        settings: Settings,
        events: Events | None = None,
        compiled: CompiledFunctions | None = None,
        *,
        name: str = "worker",
        storage: Storage,
    ) -> None:
        self.name = name
        self.compiled = compiled  # PSGRAD_COMPILE=1: torch.compile, padded sizes
        self.source = source
        self.registry = registry
        self.settings = settings
        self.storage = storage  # the process's stores: DP runs, gradient stores
        self.events = events or Events()  # what the loop reports: metrics, the status page
        self.result_limit = _result_limit(settings, source)
        self.warmed = threading.Event()  # set once :meth:`run`'s warm-ups ended: ready for jobs
        self._warm = True  # whether :meth:`run` warms the registered models up
        self._nested = 0  # jobs run between two chunks of another's (:meth:`_interleave`)

    def plan_warmup(self, warm: bool = True) -> None:
        """What :meth:`run` warms besides the process's own start-up (``warm``: the registered
        warm-ups). Called before the loop's thread starts: not ready until :meth:`run` is
        through them."""
        self.warmed.clear()
        self._warm = warm

    def _warmups(self, stop: threading.Event) -> list[tuple[str, warmup.Shape]]:
        """The registered warm-ups, read from the model store: tried again each second while
        it cannot be read (a worker started before its Redis), until ``stop`` or
        ``PSGRAD_WARMUP_TIMEOUT_S``; then none, said in the log."""
        if not self._warm:
            return []
        end, said = time.monotonic() + self.settings.warmup_timeout_s, False
        while True:
            try:
                return warmup.wanted(self.registry.store)
            except Exception as exc:
                if not said:
                    log.warning("listing the models to warm up failed (%s); trying again each "
                                "second for up to PSGRAD_WARMUP_TIMEOUT_S", exc)
                    said = True
                if stop.wait(1.0) or time.monotonic() > end:
                    log.error("could not list the models to warm up; serving without them")
                    return []

    def run(self, stop: threading.Event, *, block_s: float = 0.5) -> None:
        """Take and process batches until ``stop`` is set. First the warm-ups, and only then
        :attr:`warmed` (which readiness reads): torch.func's set-up and, on the CPU, its
        compiled loops, which every process pays once (0.3 s read back from the host's cache,
        3-5 s compiled), then what :meth:`plan_warmup` planned (:meth:`warm`). Ready means that
        a job sent now starts now."""
        delay_s = max(0.0, self.settings.batch_max_delay_ms) / 1000.0
        max_samples = max(1, self.settings.batch_max_samples)
        max_jobs = max_samples if delay_s > 0 else 1
        if self.settings.torch_threads > 0:  # process-wide: on a host whose cores the api shares
            torch.set_num_threads(self.settings.torch_threads)
        set_tf32(self.settings.allow_tf32)
        per_sample.warm_up()  # torch.func's one-time import, before the first job rather than in it
        if self.registry.device.type == "cpu":  # an accelerator's tensors never take them
            warm_kernels()  # the CPU's compiled loops (numba), likewise
        self.warm(stop, self._warmups(stop))
        self.warmed.set()
        while not stop.is_set():
            try:
                jobs = self.source.take(max_jobs, max_samples, delay_s, block_s)
            except Exception:
                log.exception("taking jobs failed; retrying in 1 s")
                stop.wait(1.0)
                continue
            if jobs:
                self.process(jobs)

    def warm(self, stop: threading.Event, todo: list[tuple[str, warmup.Shape]]) -> None:
        """Compute the shapes registered models asked to be warmed at (:mod:`service.warmup`),
        so that their plans and weights are here before the first request; past
        ``PSGRAD_WARMUP_TIMEOUT_S`` (checked between shapes) the rest is left to requests."""
        end = time.monotonic() + self.settings.warmup_timeout_s
        for i, (ref, shape) in enumerate(todo):
            if stop.is_set() or time.monotonic() > end:
                log.warning("warm-up stopped after PSGRAD_WARMUP_TIMEOUT_S (%g s): %d of %d "
                            "shapes left to the first requests", self.settings.warmup_timeout_s,
                            len(todo) - i, len(todo))
                return
            started = time.perf_counter()
            try:
                parsed = self._request(warmup.example_fields(
                    self.registry.get(ref), shape, self.settings.max_elements))
                _compute([parsed], self.settings, self.compiled, plans=self.storage.plans)
            except PsgradError as exc:  # deleted since, or a shape it cannot take: as a request
                log.warning("warming up %s at %s skipped: %s", ref, shape, exc.message)
                continue
            except Exception:
                log.exception("warming up %s at %s failed", ref, shape)
                continue
            log.info("warmed up %s at %s in %.1f s (%d of %d)", ref, shape,
                     time.perf_counter() - started, i + 1, len(todo))

    def process(self, jobs: Sequence[Job]) -> None:
        """Validate, group and compute one batch of jobs; every job ends succeeded or failed."""
        live: list[Job] = []
        for job in jobs:
            # the monotonic deadline its source set: this host's wall clock may have stepped
            if (overdue := job.overdue_s()) > 0:
                waited = job.deadline - job.enqueued_at + overdue
                self._fail(job, missed_deadline(job.id, waited, retaken=job.attempts > 1),
                           retry=False)
            else:
                live.append(job)
        if not live:
            return
        running = self.source.started(live)  # marks them running; canceled ones are left out
        kept = {id(job) for job in running}
        for job in live:
            if id(job) not in kept:
                self._skip_canceled(job)
        groups: dict[tuple[Any, ...], list[tuple[Job, ParsedRequest]]] = {}
        for job in running:
            parsed = self._parse(job)
            if parsed is not None:  # a lone job needs no key (it hashes the weights sent)
                key = parsed.group_key() if len(running) > 1 else ()
                groups.setdefault(key, []).append((job, parsed))
        for items in groups.values():
            self._run_group(items)

    def _request(self, fields: dict[str, Any]) -> ParsedRequest:
        """A request's fields checked against its model, under this worker's limits."""
        return check_request(
            fields, self.registry.get(fields["model"]),
            max_batch_size=self.settings.max_batch_size,
            max_activations=self.settings.max_model_activations,
            dp_runs=self.storage.runs,
            reference_sets=self.storage.sets,
        )

    def _parse(self, job: Job) -> ParsedRequest | None:
        try:
            parsed = self._request(job.fields)
            _check_result_size(parsed, *self.result_limit)
            return parsed
        except PsgradError as exc:
            self._fail(job, exc, retry=False)
        except Exception:
            log.exception("validating job %s failed unexpectedly", job.id)
            self._fail(job, _internal(job), retry=False)
        return None

    def _run_group(self, items: list[tuple[Job, ParsedRequest]]) -> None:
        model = items[0][1].model.ref
        samples = sum(p.batch.size for _, p in items)
        self.events.emit(BatchStarted(model=model, jobs=len(items), samples=samples,
                                      tenants=tuple(j.tenant for j, _ in items)))
        norms: list[torch.Tensor] = []  # the norms the engine computed anyway (for the page)
        failure: Exception | None = None
        try:
            results, compute_s = self._computed(items, norms)
        except Exception as exc:
            failure, results, compute_s = exc, [], 0.0
        self.events.emit(BatchEnded(
            model=model, jobs=len(items), samples=samples,
            compute_s=None if failure is not None else compute_s, norms=tuple(norms),
            owners=tuple((j.tenant, p.batch.size) for j, p in items)))
        if failure is not None:
            self._group_failed(items, failure)
            return
        started = time.time() - compute_s
        done: list[tuple[Job, dict[str, Any]]] = []
        for (job, parsed), out in zip(items, results, strict=True):
            # before anything leaves: a wrong answer is never stored, nor a DP step counted
            checked = self._attempt(job, "verifying", partial(self._verified, job, parsed, out))
            if checked is _FAILED:
                continue
            result = result_fields(parsed, out)
            result["timing"] = {
                "queue_ms": round(max(0.0, started - job.enqueued_at) * 1000, 3),
                "compute_ms": round(compute_s * 1000, 3),
            }
            meta = result.pop("meta")  # last, after timing, as documented
            result["meta"] = {**meta, "batch_jobs": len(items), "batch_samples": samples}
            if checked is not None:
                result["meta"]["verify"] = checked
            # a DP run's step: counted once per job id, or refused (nothing released)
            counted = self._attempt(job, "counting the DP step",
                                    partial(count_dp_step, job.id, job.fields, result,
                                            self.storage.runs,
                                            self.settings.dp_accounting_cpu_s), retry=True)
            if counted is _FAILED:
                continue
            done.append((job, counted))
        done = self._ledger_on_disk(done)
        for job, _ in done:
            self._ended(job, "succeeded", started)
        try:  # all of the group's answers at once (Redis: one round trip for small ones)
            self.source.succeed_all(done)
        except Exception:
            log.exception("storing the results of jobs %s failed", ", ".join(j.id for j, _ in done))

    def _ledger_on_disk(self, done: list[tuple[Job, dict[str, Any]]]
                        ) -> list[tuple[Job, dict[str, Any]]]:
        """``done`` once the DP steps among them are on the ledger's disk (one wait for the
        batch, :meth:`RunStore.sync`), so that a crash of its host never loses a step whose
        noisy answer went out; where that fails, those jobs fail and release nothing (their
        steps stay counted: an over-count is safe, an under-count is not). Then each step's
        answer is marked as going out (:meth:`_first_release`)."""
        steps = {j.id for j, _ in done if isinstance(j.fields.get("dp_run"), str)}
        if not steps:
            return done
        try:
            self.storage.runs.sync()
        except Exception as exc:  # not confirmed in time, or the ledger's Redis unreachable
            log.warning("the DP steps of jobs %s are not confirmed on disk: %s",
                        ", ".join(sorted(steps)), exc)
            for job, _ in done:
                if job.id in steps:  # a 409: the same key can only replay it
                    self._fail(job, withheld(job.fields["dp_run"], job.id), retry=False)
            return [(j, r) for j, r in done if j.id not in steps]
        return [(j, r) for j, r in done if j.id not in steps or self._first_release(j)]

    def _first_release(self, job: Job) -> bool:
        """Whether DP step ``job``'s answer may go out: marked as going out now, before any of
        it is stored (:meth:`RunStore.released`); else the job fails and releases nothing (its
        answer went out before, or began to: one step never releases a second)."""
        run_id = job.fields["dp_run"]
        first = self._attempt(job, "marking the DP step's answer",
                              partial(self.storage.runs.released, run_id, job.id), retry=True)
        if first is _FAILED:
            return False
        if not first:
            self._fail(job, released_before(run_id, job.id), retry=False)
        return bool(first)

    def _computed(self, items: list[tuple[Job, ParsedRequest]], norms: list[torch.Tensor]
                  ) -> tuple[list[dict[str, Any]], float]:
        """The group's answers and the seconds the engine took for them. A lone job larger than
        ``PSGRAD_FAIR_CHUNK_SAMPLES`` whose outputs are per sample runs a chunk at a time, and
        between two chunks the jobs of other tenants waiting meanwhile run first (fair share
        inside a running job: they wait one chunk, not the whole job)."""
        job, parsed = items[0]
        planning = self._planning([j for j, _ in items], parsed.model.ref)
        chunk = self.settings.fair_chunk_samples
        size = parsed.batch.size
        if (len(items) > 1 or chunk <= 0 or size <= chunk or self._nested >= MAX_NESTED
                or not all(output(o).combine == "concat" for o in parsed.opts.outputs)):
            return _compute([p for _, p in items], self.settings, self.compiled,
                            on_norms=norms.append, plans=self.storage.plans, planning=planning)
        parts: list[dict[str, Any]] = []
        spent = 0.0
        for start in range(0, size, chunk):
            if start:
                self._interleave(job.tenant)
            part = replace(parsed, batch=parsed.batch.rows(start, min(size, start + chunk)))
            (answer,), seconds = _compute([part], self.settings, self.compiled,
                                          on_norms=norms.append, plans=self.storage.plans,
                                          planning=planning)
            parts.append(answer)
            spent += seconds
        return [_joined(parts)], spent

    def _interleave(self, tenant: str) -> None:
        """Run the jobs of tenants other than ``tenant`` queued now (in fair order, as many as
        a round takes), if there are any; the running job's next chunk waits for them."""
        if not self.source.waiting_tenants() - {tenant}:
            return
        max_samples = max(1, self.settings.batch_max_samples)
        jobs = self.source.take(max_samples, max_samples, 0.0, 0.0)
        if jobs:
            self._nested += 1
            try:
                self.process(jobs)
            finally:
                self._nested -= 1

    def _planning(self, jobs: list[Job], model: str) -> Callable[[bool], None]:
        """What the engine tells when it plans ``model`` for these jobs: the source records
        it, so that their deadlines do not count it (docs/operations.md, cold starts)."""
        since = 0.0

        def tell(begins: bool) -> None:
            nonlocal since
            try:
                if begins:  # the api adds the time since (its clock, capped by the grace)
                    since = time.monotonic()
                    self.source.planning(jobs, time.time())
                    return
                spent = time.monotonic() - since  # a duration: never the wall clock's step
                self.source.planning(jobs, None, spent)
                log.info("planned model %s in %.1f s, not counted against the deadline of %s",
                         model, spent, ", ".join(j.id for j in jobs))
            except Exception:  # the wait then counts the planning, as any work
                log.exception("recording the planning of jobs %s failed",
                              ", ".join(j.id for j in jobs))

        return tell

    def _group_failed(self, items: list[tuple[Job, ParsedRequest]], exc: Exception) -> None:
        """A group's engine call failed: a merged one's jobs run one by one (whatever went wrong,
        each job gets its own answer), a lone job fails with the error."""
        if len(items) > 1:
            log.warning("a merged batch of %d jobs failed (%s); running them one by one",
                        len(items), type(exc).__name__)
            for item in items:
                self._run_group([item])
            return
        job = items[0][0]
        if isinstance(exc, PsgradError):
            self._fail(job, exc, retry=False)
        else:
            log.error("computing job %s failed unexpectedly", job.id, exc_info=exc)
            self._fail(job, _internal(job), retry=True)

    def _attempt(self, job: Job, what: str, step: Callable[[], T], *, retry: bool = False
                 ) -> T | _Failed:
        """``step()``, or ``_FAILED`` once the job has failed with its error; an unexpected
        error is logged and fails it as internal (``retry``: the queue may deliver it again)."""
        try:
            return step()
        except PsgradError as exc:
            self._fail(job, exc, retry=False)
        except Exception:
            log.exception("%s of job %s failed unexpectedly", what, job.id)
            self._fail(job, _internal(job), retry=retry)
        return _FAILED

    def _verified(self, job: Job, parsed: ParsedRequest, out: dict[str, Any]
                  ) -> dict[str, Any] | None:
        """``meta.verify`` when the job is verified (asked, or drawn by
        ``PSGRAD_VERIFY_FRACTION``); raises :class:`VerificationFailed` for a wrong answer."""
        how = verify.plan(job.id, parsed, self.settings)
        if how is None:
            return None
        start = time.perf_counter()
        failed: VerificationFailed | None = None
        try:
            report = verify.check(parsed, out, how, settings=self.settings, compiled=self.compiled)
        except VerificationFailed as exc:
            log.error("job %s failed verification: %s", job.id, exc.message)
            failed, report = exc, exc.details.get("verify", {})
        self.events.emit(JobVerified(samples=len(report.get("samples", ())),
                                     seconds=time.perf_counter() - start,
                                     failed=failed is not None))
        if failed is not None:
            raise failed
        return report

    def _fail(self, job: Job, exc: PsgradError, *, retry: bool) -> None:
        self._ended(job, "failed")
        try:
            self.source.fail(job, exc.to_dict(), retry=retry)
        except Exception:
            log.exception("storing the error of job %s failed", job.id)

    def _skip_canceled(self, job: Job) -> None:
        self._ended(job, "canceled")
        try:
            self.source.acknowledge_canceled(job)
        except Exception:
            log.exception("acknowledging canceled job %s failed", job.id)

    def _ended(self, job: Job, status: str, started: float | None = None) -> None:
        """``job`` left the worker; it waited until ``started`` (its engine call), else until
        now."""
        waited = (time.time() if started is None else started) - job.enqueued_at
        self.events.emit(JobEnded(status=status, queue_s=max(0.0, waited)))


class WorkerPool:
    """Worker loops in threads: the workers of the embedded mode.

    The app's lifespan starts it after the broker and ends it in three steps: :meth:`stop` (no
    loop starts another round), the broker's close (which wakes the loops waiting for a job),
    then :meth:`join` (a running engine call finishes first). No loops: a queue nobody serves,
    and :meth:`alive` says so.
    """

    def __init__(self, workers: Sequence[Worker], statuses: Sequence[WorkerStatus]) -> None:
        self.workers = list(workers)
        self.statuses = list(statuses)  # what each loop is doing, for GET /status
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @classmethod
    def over(
        cls,
        source: JobSource,
        registry: ModelRegistry,
        settings: Settings,
        subscribers: Sequence[Subscriber] = (),
        *,
        storage: Storage,
    ) -> WorkerPool:
        """``PSGRAD_WORKERS`` loops over one source and one storage (the app's), each reporting
        to ``subscribers`` (the app's metrics) and to its own :class:`WorkerStatus`; with
        ``PSGRAD_COMPILE=1`` they share the functions compiled in this process."""
        compiled = CompiledFunctions(settings, writer=False) if settings.compile else None
        workers, statuses = [], []
        for i in range(settings.workers):
            status = WorkerStatus(f"psgrad-worker-{i}", str(registry.device))
            events = Events(*subscribers, status.on_event)
            workers.append(Worker(source, registry, settings, events, compiled, name=status.name,
                                  storage=storage))
            statuses.append(status)
        return cls(workers, statuses)

    def start(self) -> None:
        self._stop.clear()
        for i, work in enumerate(self.workers):  # one warms up (they share one process)
            work.plan_warmup(warm=i == 0)
            thread = threading.Thread(target=work.run, args=(self._stop,), name=work.name,
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("%d embedded worker thread(s) started", len(self._threads))

    def alive(self) -> bool:
        """At least one loop runs, none was told to stop, and the warm-up ended (the app's
        readiness asks this)."""
        return (not self._stop.is_set() and any(t.is_alive() for t in self._threads)
                and all(w.warmed.is_set() for w in self.workers))

    def snapshots(self) -> list[dict[str, Any]]:
        """Each loop's :meth:`WorkerStatus.snapshot`, with ``alive``: its thread runs."""
        running = {t.name for t in self._threads if t.is_alive() and not self._stop.is_set()}
        return [{**s.snapshot(), "alive": s.name in running} for s in self.statuses]

    def stop(self) -> None:
        """Tell every loop to stop after the round in hand."""
        self._stop.set()

    async def join(self, timeout_s: float = 60.0) -> None:
        """Wait for the loops (off the event loop: their results still wake waiters on it)."""
        for thread in self._threads:
            await asyncio.to_thread(thread.join, timeout_s)
        self._threads.clear()


def _internal(job: Job) -> InternalError:
    return InternalError(
        f"the server failed unexpectedly on job {job.id}; the error is logged "
        "on the server under this job id",
        job_id=job.id,
    )


def _result_limit(settings: Settings, source: JobSource) -> tuple[int, str, str]:
    """PSGRAD_MAX_RESULT_BYTES, or less when the source stores less (Redis: one value); what
    the limit is, and how to raise it."""
    limit = settings.max_result_bytes
    what = "the limit (PSGRAD_MAX_RESULT_BYTES)"
    how = raise_setting("max_result_bytes", limit)
    store = source.max_value_bytes
    if store is not None and store * 63 // 64 < limit:  # room for the encoding's header
        limit, what = store * 63 // 64, "the most the job queue keeps in one value (Redis)"
        how = f"raise Redis's proto-max-bulk-len (now {store})"
    return limit, what, how


def _check_result_size(parsed: ParsedRequest, limit: int, what: str, how: str) -> None:
    size = engine.output_bytes(parsed.model, parsed.opts, parsed.batch.size)
    if parsed.answer_dtype in HALF:  # two bytes a number instead of the model's own
        size = size * 16 // torch.finfo(parsed.model.dtype).bits
    if size > limit:
        outputs = ", ".join(parsed.opts.outputs)
        raise answer_too_large(size, limit, f"{what} ({outputs} for {parsed.batch.size} samples)",
                               how)


def _joined(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer of its chunks' answers, every output per sample (concatenated in order);
    the first chunk's meta, with how many chunks there were."""
    first = parts[0]
    if len(parts) == 1:
        return first

    def cat(values: list[Any]) -> Any:
        if isinstance(values[0], dict):
            return {k: cat([v[k] for v in values]) for k in values[0]}
        return torch.cat(values)

    out = {k: cat([p[k] for p in parts]) for k in first if k != "meta"}
    out["meta"] = {**first["meta"], "chunks": len(parts)}
    return out


def _compute(
    group: Sequence[ParsedRequest], settings: Settings, compiled: CompiledFunctions | None = None,
    on_norms: Callable[[torch.Tensor], None] | None = None, plans: SharedPlans | None = None,
    planning: Callable[[bool], None] | None = None,
) -> tuple[list[dict[str, Any]], float]:
    first = group[0]
    batch = engine.Batch.joined([p.batch for p in group])
    start = time.perf_counter()
    results = engine.compute(
        first.model,
        batch,
        first.opts,
        [p.batch.size for p in group],
        budget_bytes=settings.memory_budget_mb << 20,
        compiled=compiled,
        fast_stats=settings.fast_stats,
        on_norms=on_norms,
        plans=plans,
        planning=planning,
        cuda_graphs=settings.cuda_graphs,
    )
    return results, time.perf_counter() - start
