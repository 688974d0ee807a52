"""A tenant's quotas, resolved against the server's defaults, and what each refusal says.

Three quotas bound what one tenant holds of a shared server: jobs queued or running at once
(``concurrent_jobs``), samples queued or running at once (``queued_samples``), and the rate of
jobs it submits (``requests_per_s``, a token bucket holding one second's worth, at least one).
A tenant's own quotas come from its keys file entry (:class:`service.tenants.Quotas`); the
ones it does not give are the server's (``PSGRAD_TENANT_MAX_JOBS``,
``PSGRAD_TENANT_MAX_QUEUED_SAMPLES``, ``PSGRAD_TENANT_REQUESTS_PER_S``; 0: no limit). The
brokers enforce them at submit, the embedded one with :class:`TenantUsage` and the Redis one
in its submit script, so that every api replica counts the same jobs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from psgrad._errors import RateLimited, TooLarge
from service.config import Settings
from service.tenants import Quotas

__all__ = ["Limits", "TenantUsage", "limits", "over_quota", "refusal", "too_large_for_quota"]

_HOW_TO_RAISE = {
    "concurrent_jobs": "PSGRAD_TENANT_MAX_JOBS",
    "queued_samples": "PSGRAD_TENANT_MAX_QUEUED_SAMPLES",
    "requests_per_s": "PSGRAD_TENANT_REQUESTS_PER_S",
}


@dataclass(frozen=True)
class Limits:
    """The quotas that apply to one tenant; None: no limit."""

    concurrent_jobs: int | None = None
    queued_samples: int | None = None
    requests_per_s: float | None = None
    weight: float = 1.0

    @property
    def burst(self) -> float:
        """The token bucket's size: one second's worth of requests, at least one."""
        return max(1.0, self.requests_per_s or 0.0)


def limits(quotas: Quotas | None, settings: Settings) -> Limits:
    """The tenant's own quotas where it has them, else the server's (0 there: no limit)."""
    q = quotas or Quotas()

    def pick(own: float | None, default: float) -> float | None:
        value = own if own is not None else default
        return value if value > 0 else None

    jobs = pick(q.concurrent_jobs, settings.tenant_max_jobs)
    samples = pick(q.queued_samples, settings.tenant_max_queued_samples)
    return Limits(concurrent_jobs=None if jobs is None else int(jobs),
                  queued_samples=None if samples is None else int(samples),
                  requests_per_s=pick(q.requests_per_s, settings.tenant_requests_per_s),
                  weight=q.weight if q.weight > 0 else 1.0)


def refusal(tenant: str, lim: Limits, quota: str, found: float, samples: int) -> RateLimited:
    """The 429 past ``quota``; ``found``: the jobs or samples the tenant holds, or for
    ``requests_per_s`` the seconds until its next token."""
    if quota == "concurrent_jobs":
        return over_quota(tenant, quota, lim.concurrent_jobs or 0,
                          f"{found:g} jobs queued or running", retry_after=1.0)
    if quota == "queued_samples":
        return over_quota(tenant, quota, lim.queued_samples or 0,
                          f"{found:g} samples queued or running, this request adds {samples}",
                          retry_after=1.0)
    return over_quota(tenant, quota, lim.requests_per_s or 0, "requests arrive faster",
                      retry_after=found)


def over_quota(tenant: str, quota: str, value: float, used: str, *,
               retry_after: float) -> RateLimited:
    """The 429 for a request past ``quota`` (its ``value``); ``used`` says what the tenant
    holds now."""
    if quota == "requests_per_s":
        todo = f"retry after {retry_after:.2f} s, or space the requests out"
    else:
        todo = "wait for some of them to finish (or cancel some) and retry"
    return RateLimited(
        f"tenant '{tenant}' is over its quota {quota} = {value:g} ({used}): {todo}; the "
        f"operator sets it per tenant (the keys file's quotas) or for all "
        f"({_HOW_TO_RAISE[quota]})",
        retry_after=retry_after, quota=quota, limit=value, tenant=tenant)


def too_large_for_quota(tenant: str, samples: int, value: int, *, dp_step: bool = False
                        ) -> TooLarge:
    """The 413 for one request with more samples than the tenant may ever have queued; a DP
    run's step is never split (its Poisson batch is the mechanism's), so it can only shrink
    by sampling at a lower rate."""
    smaller = ("make the run's batches smaller (a lower sample_rate: a step's batch is never "
               "split)" if dp_step else
               "send smaller batches (psgrad.Client splits a large batch for you)")
    return TooLarge(
        f"the request has {samples} samples and tenant '{tenant}' may have at most {value} "
        f"queued (its quota queued_samples): {smaller}, or ask the operator to raise the quota "
        f"({_HOW_TO_RAISE['queued_samples']} or the keys file's quotas)",
        quota="queued_samples", limit=value, size=samples, tenant=tenant)


class TenantUsage:
    """What each tenant holds of an in-process queue, and its token bucket (embedded mode).

    Not thread-safe: the embedded broker calls it under its lock.
    """

    def __init__(self) -> None:
        self._jobs: dict[str, int] = {}
        self._samples: dict[str, int] = {}
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at)

    def admit(self, tenant: str, samples: int, lim: Limits, *, dp_step: bool = False) -> None:
        """Count one more job of ``samples`` for ``tenant`` (``dp_step``: a DP run's), or
        raise the refusal."""
        if lim.queued_samples is not None and samples > lim.queued_samples:
            raise too_large_for_quota(tenant, samples, lim.queued_samples, dp_step=dp_step)
        jobs, held = self._jobs.get(tenant, 0), self._samples.get(tenant, 0)
        if lim.concurrent_jobs is not None and jobs >= lim.concurrent_jobs:
            raise refusal(tenant, lim, "concurrent_jobs", jobs, samples)
        if lim.queued_samples is not None and held + samples > lim.queued_samples:
            raise refusal(tenant, lim, "queued_samples", held, samples)
        if lim.requests_per_s is not None:
            now = time.monotonic()
            tokens, at = self._buckets.get(tenant, (lim.burst, now))
            tokens = min(lim.burst, tokens + (now - at) * lim.requests_per_s)
            if tokens < 1.0:
                raise refusal(tenant, lim, "requests_per_s",
                              (1.0 - tokens) / lim.requests_per_s, samples)
            self._buckets[tenant] = (tokens - 1.0, now)
        self._jobs[tenant] = jobs + 1
        self._samples[tenant] = held + samples

    def release(self, tenant: str, samples: int) -> None:
        """One job of ``tenant`` ended (or left the queue)."""
        jobs = self._jobs.get(tenant, 0) - 1
        held = self._samples.get(tenant, 0) - samples
        if jobs <= 0:
            self._jobs.pop(tenant, None)
            self._samples.pop(tenant, None)
        else:
            self._jobs[tenant], self._samples[tenant] = jobs, max(0, held)

