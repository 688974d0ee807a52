"""The Redis broker's keyspace: every key of the job queue, of its jobs and of its workers,
with the TTLs and sizes that go with them; nothing else spells one (the scripts that use them
are :mod:`service.broker.redis.lua`'s). The keys of what psgrad keeps outside the queue are
:mod:`service.redis_keys`'s.

Each key starts with the configured prefix (``PSGRAD_REDIS_PREFIX``), so several deployments or
test runs share one Redis without seeing each other.
"""

from __future__ import annotations

from typing import NamedTuple

STREAM_GROUP = "workers"  # the consumer group every worker reads the job stream through
HEARTBEAT_TTL_FACTOR = 3  # a worker is alive while its heartbeat is younger than 3 beats
NOTIFY_TTL_S = 60  # the "job done" token outlives the job's end by this much at least


def job_stream(prefix: str) -> str:
    """The ticket stream: one entry ``{t: tenant}`` per job queued or running; acked ones go.

    A worker reads a ticket (``XREADGROUP`` in :data:`STREAM_GROUP`) for each job it takes, in
    the same script that picks whose job that is (:data:`service.broker.redis.lua.PICK_LUA`), so the
    group's ``lag`` is the number of jobs queued and not yet taken (what an autoscaler such as
    KEDA's ``redis-streams`` scaler reads, ``lagCount``) and its pending entries the jobs
    running. An entry ``{id, n}`` is a job queued by an api from before tenants: taken as is.
    """
    return f"{prefix}:jobs"


def job_tickets(prefix: str) -> str:
    """Hash: ticket entry id -> ``"<n> <job id>"``, the job a worker took with that ticket (a
    worker taking over a dead one's tickets with ``XAUTOCLAIM`` learns their jobs here)."""
    return f"{prefix}:jobs:tickets"


# The keys of one tenant end with its name: the scripts that choose a tenant themselves are
# handed the key with an empty name (e.g. ``tenant_queue(prefix, "")``) and append the name.


def tenant_queue(prefix: str, tenant: str) -> str:
    """List of a tenant's queued jobs, oldest first, each ``"<n> <job id>"``."""
    return f"{prefix}:queue:{tenant}"


def tenant_jobs(prefix: str, tenant: str) -> str:
    """Sorted set of a tenant's jobs queued or running (``"<n> <job id>"``), scored by when their
    state expires: its quotas of jobs and samples count these (an expired one drops out)."""
    return f"{prefix}:tenant-jobs:{tenant}"


def tenant_rate(prefix: str, tenant: str) -> str:
    """Hash of a tenant's request token bucket: ``tokens`` and ``at`` (Redis's clock, s)."""
    return f"{prefix}:tenant-rate:{tenant}"


def fair_active(prefix: str) -> str:
    """Sorted set of the tenants with jobs queued, scored by their pass (the samples served to
    them over their weight): the lowest is served next."""
    return f"{prefix}:fair:active"


def fair_passes(prefix: str) -> str:
    """Hash: tenant -> its pass when its queue last emptied (a tenant that leaves and comes back
    gains nothing: it resumes at the larger of this and the virtual time)."""
    return f"{prefix}:fair:passes"


def fair_weights(prefix: str) -> str:
    """Hash: tenant -> its weight (``Quotas.weight``), as its latest request said."""
    return f"{prefix}:fair:weights"


def fair_vtime(prefix: str) -> str:
    """String: the virtual time, the pass at which the job taken last was started."""
    return f"{prefix}:fair:vtime"


class QueueKeys(NamedTuple):
    """The queue's keys shared by every job, named once per process (:func:`queue_keys`); each
    is spelled by the function of its name above (``*_base``: a tenant's key with an empty name,
    for the scripts that append it)."""

    stream: str
    tickets: str
    fair_active: str
    fair_passes: str
    fair_weights: str
    fair_vtime: str
    tenant_queue_base: str
    tenant_jobs_base: str


def queue_keys(prefix: str) -> QueueKeys:
    return QueueKeys(job_stream(prefix), job_tickets(prefix), fair_active(prefix),
                     fair_passes(prefix), fair_weights(prefix), fair_vtime(prefix),
                     tenant_queue(prefix, ""), tenant_jobs(prefix, ""))


def job_state(prefix: str, job_id: str) -> str:
    """Hash: status, enqueued_at, deadline, attempts, started_at, finished_at, error, last_error,
    answer (the attempt whose answer is whole)."""
    return f"{prefix}:job:{job_id}"


def job_payload(prefix: str, job_id: str) -> str:
    """The request as safetensors bytes (``psgrad._wire.fields_to_safetensors``, key request),
    in the answers' Redis where one is configured (written once, read once: kept out of the
    queue's append-only file)."""
    return f"{prefix}:job:{job_id}:payload"


def job_answer(prefix: str, job_id: str) -> str:
    """Stream of the answer's ends: its safetensors header (key response) in an entry
    ``{a: attempt, k: head, d: bytes}``, then ``{a, k: end}`` once the job succeeded; the bytes
    in between are in :func:`job_pieces`.

    Each delivery (attempt) rewrites it from scratch; only the attempt the state hash names in
    ``answer`` is whole. An answer of at most :data:`ANSWER_INLINE_BYTES` is one ``head`` entry
    holding the whole file, written with the job's end in one round trip.
    """
    return f"{prefix}:job:{job_id}:answer"


def job_pieces(prefix: str, job_id: str, attempt: int | str) -> str:
    """Stream of one attempt's answer bytes after its header, in entries ``{d: bytes}`` of at
    most :data:`ANSWER_PIECE_BYTES`, in the answers' Redis (``PSGRAD_ANSWER_REDIS_URL``; by
    default the one Redis). One stream per attempt: a stale delivery still writing never mixes
    its bytes into its successor's. It expires with the job and is deleted with it."""
    return f"{prefix}:job:{job_id}:pieces:{attempt}"


# Bytes per answer stream entry (less where proto-max-bulk-len is lower). Small enough that
# Redis stores a piece in an allocation it reuses (8 MiB pieces cost Redis twice the CPU per
# byte), large enough that the work per piece is small beside its bytes; just under 1 MiB, as
# an entry of exactly 1 MiB plus its stream bytes would take jemalloc's next size (1.25 MiB).
ANSWER_PIECE_BYTES = (1 << 20) - (4 << 10)
ANSWER_INLINE_BYTES = 64 << 10  # answers up to this size go whole with the job's end


def job_notify(prefix: str, job_id: str) -> str:
    """List the api blocks on (BLPOP) until a worker or a cancel pushes the job's end."""
    return f"{prefix}:job:{job_id}:notify"


class JobKeys(NamedTuple):
    """One job's keys, named together once per job (:func:`job_keys`); each is spelled by the
    function of its name above."""

    prefix: str
    id: str
    state: str
    payload: str
    answer: str
    notify: str

    def pieces(self, attempt: int | str) -> str:
        """The pieces stream of one attempt's answer (:func:`job_pieces`)."""
        return job_pieces(self.prefix, self.id, attempt)


def job_keys(prefix: str, job_id: str) -> JobKeys:
    return JobKeys(prefix, job_id, job_state(prefix, job_id), job_payload(prefix, job_id),
                   job_answer(prefix, job_id), job_notify(prefix, job_id))


def job_bulk_keys(prefix: str, job_id: str, max_attempts: int) -> list[str]:
    """A job's keys in the answers' Redis: its payload and every pieces stream its deliveries
    may have written (one per attempt)."""
    return [job_payload(prefix, job_id),
            *(job_pieces(prefix, job_id, attempt) for attempt in range(1, max_attempts + 1))]


def job_ttl_s(deadline_in_s: float, result_ttl_s: int) -> int:
    """A job's keys live until its deadline plus the result TTL, so nothing outlives its use."""
    return max(1, int(max(0.0, deadline_in_s) + result_ttl_s + 1))


def worker_heartbeat(prefix: str, name: str) -> str:
    """String with a TTL of ``HEARTBEAT_TTL_FACTOR`` beats: present while the worker lives."""
    return f"{prefix}:worker:{name}"


WORKER_STATUS_TTL_S = 300  # a dead worker's last status stays on the status page this long


def worker_status(prefix: str, name: str) -> str:
    """JSON of the worker's :meth:`service.worker.recorder.WorkerStatus.snapshot`, written with each
    heartbeat; it outlives the heartbeat (``WORKER_STATUS_TTL_S``) so a dead worker shows dead."""
    return f"{prefix}:worker:{name}:status"


def worker_names(prefix: str) -> str:
    """Set of worker names that ever beat (pruned by readers of names whose heartbeat and
    status both expired)."""
    return f"{prefix}:workers"


def heartbeat_ttl_s(heartbeat_s: float) -> int:
    return max(1, round(heartbeat_s * HEARTBEAT_TTL_FACTOR + 0.5))
