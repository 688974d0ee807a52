"""Fair scheduling across tenants, in process: the embedded broker's queue.

Each tenant has its own FIFO queue; the next job comes from the tenant with the lowest *pass*,
the samples served to it so far divided by its weight (``Quotas.weight``): start-time fair
queueing, in samples. A tenant with one job waiting is served right after the job now running,
whatever another tenant's backlog: a tenant whose queue was empty starts at the virtual time
(the pass at which the last job was taken), below that of a backlogged tenant, whose pass has
moved on by its running job. Backlogged tenants share the workers in proportion to their
weights. A tenant that leaves and comes back keeps the pass it had, so leaving gains nothing.

The Redis broker implements the same rule in Lua (:mod:`service.broker.redis.lua`), so that
every worker process picks from shared state; both are checked by the same tests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from service.jobs import Job

__all__ = ["FairQueue"]


class FairQueue:
    """Jobs per tenant, taken in weighted fair order; not thread-safe (the broker's lock is)."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[Job]] = {}  # only tenants with jobs queued
        self._passes: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._vtime = 0.0

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._queues)

    def __iter__(self) -> Iterator[Job]:
        for queue in self._queues.values():
            yield from queue

    def tenants(self) -> set[str]:
        """The tenants with jobs queued."""
        return set(self._queues)

    def push(self, job: Job, weight: float = 1.0) -> None:
        """Queue ``job`` at the end of its tenant's queue; ``weight``: the tenant's share."""
        tenant = job.tenant
        self._weights[tenant] = weight
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
            self._passes[tenant] = max(self._passes.get(tenant, 0.0), self._vtime)
        queue.append(job)

    def pop(self, room: int | None = None) -> Job | None:
        """The next job in fair order; None when nothing is queued or when that job has more
        than ``room`` samples (the batch is full: the job keeps its turn for the next one)."""
        if not self._queues:
            return None
        tenant = min(self._queues, key=lambda t: (self._passes[t], t))
        queue = self._queues[tenant]
        if room is not None and queue[0].size > room:
            return None
        job = queue.popleft()
        self._vtime = self._passes[tenant]
        self._passes[tenant] += job.size / self._weights[tenant]
        if not queue:
            del self._queues[tenant]
        return job

    def remove(self, job_id: str) -> Job | None:
        """Take a queued job out (canceled); None when it is not queued."""
        for tenant, queue in self._queues.items():
            for job in queue:
                if job.id == job_id:
                    queue.remove(job)
                    if not queue:
                        del self._queues[tenant]
                    return job
        return None

    def clear(self) -> None:
        self._queues.clear()
