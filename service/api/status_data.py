"""The status page's data (``GET /status.json``): the api's own request view plus every worker's.

:class:`RequestStats` is filled by :class:`service.api.metrics.MetricsMiddleware` for every
request: counters and a bounded deque of latencies per route, requests and error answers by the
model a body named (:func:`note_model`, called where bodies are decoded) and the error code of
the answer. It lives on the event loop alone, so it takes no lock.

:func:`status_view` adds the workers: in embedded mode the pool's threads
(:meth:`service.worker.loop.WorkerPool.snapshots`), with Redis what each ``psgrad worker`` published
with its heartbeat (:meth:`service.broker.redis.api.RedisBroker.worker_snapshots`). Queue waits and
norm histograms are merged over the workers (the raw recent waits, so the percentiles are exact;
the histograms share their buckets, :data:`service.worker.recorder.NORM_EDGES`). Latency and request
counts are this api process's: several api replicas each show their own.

Each tenant sees its own view: the requests its keys made (routes, models, errors), the norm
histograms of its own jobs, and a worker's batch in hand only while one of its jobs is in it;
the workers' counters and the queue are the service's and shown to all. An admin sees every
tenant's (requests without a valid key too), or one tenant's view with ``?tenant=``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import orjson
from pydantic import BaseModel, Field, ValidationError
from starlette.types import Scope

from psgrad._errors import PsgradError
from service.model_store import REF_RE
from service.worker.recorder import NORM_EDGES, WINDOW_S, Recent, percentiles

if TYPE_CHECKING:
    from service.api.deps import AppState

__all__ = ["RequestStats", "StatusView", "note_model", "status_view"]

MAX_LABELS = 64  # distinct models counted apart; the rest are counted as OTHER
OTHER = "(other)"
INVALID = "(invalid)"  # a model field that is not an id or id@version
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
_SCOPE_KEY = "psgrad.model"
_TENANT_KEY = "psgrad.tenant"


def note_model(scope: Scope, model: Any) -> None:
    """Tell the request's counters which model its body named (strings only; others ignored)."""
    if isinstance(model, str):
        scope[_SCOPE_KEY] = model if REF_RE.fullmatch(model) else INVALID


def note_tenant(scope: Scope, tenant: str) -> None:
    """Tell the request's counters whose request it is (set once its key is read)."""
    scope[_TENANT_KEY] = tenant


def error_code(body: bytes, status: int) -> str:
    """The ``error.code`` of an error answer's JSON body; ``http_<status>`` for an answer that
    is not an error body (``/readyz``'s 503)."""
    try:
        code = orjson.loads(body)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        code = None
    return code[:64] if isinstance(code, str) else f"http_{status}"


class _Route:
    __slots__ = ("errors", "latency", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.latency = Recent(1024)


class RequestStats:
    """Requests since the api started, their recent latencies, and error answers by code."""

    def __init__(self, *, per_tenant: bool = True) -> None:
        self.routes: dict[tuple[str, str], _Route] = {}
        self.models: dict[str, Counter[str]] = {}  # model -> {"requests": n, "errors": n, code: n}
        self.errors: Counter[tuple[str | None, str]] = Counter()
        # each tenant's own counters (tenants are the configured keys': a bounded set)
        self.tenants: dict[str, RequestStats] | None = {} if per_tenant else None

    def observe(self, scope: Scope, *, route: str, status: int, seconds: float,
                code: str | None) -> None:
        """One answered request (``code``: its error code when ``status`` >= 400), counted
        for every tenant's view and for its own tenant's."""
        self._observe(scope, route=route, status=status, seconds=seconds, code=code)
        tenant = scope.get(_TENANT_KEY)
        if self.tenants is not None and isinstance(tenant, str):
            own = self.tenants.get(tenant)
            if own is None:
                own = self.tenants[tenant] = RequestStats(per_tenant=False)
            own._observe(scope, route=route, status=status, seconds=seconds, code=code)

    def _observe(self, scope: Scope, *, route: str, status: int, seconds: float,
                 code: str | None) -> None:
        method = scope.get("method", "")  # routes are the app's templates: a bounded set
        key = (route, method if method in _METHODS else "OTHER")
        stats = self.routes.get(key)
        if stats is None:
            stats = self.routes[key] = _Route()
        stats.requests += 1
        stats.latency.add(seconds * 1000)
        model = scope.get(_SCOPE_KEY)
        if model is not None:
            model = _bounded(self.models, model)
            counts = self.models.setdefault(model, Counter())
            counts["requests"] += 1
        if status >= 400:
            stats.errors += 1
            code = code or f"http_{status}"
            self.errors[(model, code)] += 1
            if model is not None:
                counts["errors"] += 1
                counts[code] += 1

    def view(self, now: float, tenant: str | None = None) -> dict[str, Any]:
        """Every request's counters, or (``tenant``) that tenant's own."""
        if tenant is not None:
            own = (self.tenants or {}).get(tenant)
            return (own or RequestStats(per_tenant=False)).view(now)
        routes = [
            {"route": route, "method": method, "requests": s.requests, "errors": s.errors,
             "latency_ms": _ms(percentiles(s.latency.values(WINDOW_S, now)))}
            for (route, method), s in sorted(self.routes.items())
        ]
        models = [
            {"model": m, "requests": c["requests"], "errors": c["errors"],
             "codes": {k: v for k, v in sorted(c.items()) if k not in ("requests", "errors")}}
            for m, c in sorted(self.models.items())
        ]
        errors = [{"model": m, "code": code, "count": n}
                  for (m, code), n in sorted(self.errors.items(), key=lambda kv: -kv[1])]
        return {"routes": routes, "models": models, "errors": errors}


def _bounded(seen: Mapping[str, Any], label: str) -> str:
    """``label``, or OTHER once MAX_LABELS distinct ones are counted (clients pick models)."""
    return label if label in seen or len(seen) < MAX_LABELS else OTHER


def _ms(p: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in p.items()}


# --- the answer -------------------------------------------------------------------------------


class Percentiles(BaseModel):
    count: int = Field(description="values in the window")
    p50: float | None = Field(description="median; null without values")
    p99: float | None = Field(description="99th percentile (nearest rank); null without values")


class BatchInHand(BaseModel):
    jobs: int = Field(description="jobs merged into the engine call running now")
    samples: int
    model: str = Field(description="'id@version'")
    since: float = Field(description="epoch seconds when the call started")
    tenants: list[str] = Field(default_factory=list, description="whose jobs are in it (a "
                               "tenant's view: only its own name)")


class WorkerView(BaseModel):
    id: str = Field(description="thread name (embedded) or consumer name (Redis)")
    host: str | None
    device: str | None
    pid: int | None
    alive: bool = Field(description="thread running (embedded), heartbeat not expired (Redis)")
    started_at: float | None = Field(description="epoch seconds")
    seen_at: float | None = Field(description="epoch seconds of this snapshot (Redis: its "
                                  "last heartbeat)")
    jobs_done: int = Field(description="jobs succeeded since the worker started")
    jobs_failed: int
    jobs_canceled: int
    samples_done: int
    samples_per_s: float = Field(description="samples of the engine calls of the last 10 s")
    batch: BatchInHand | None = Field(description="what it computes now; null: idle")


class QueueView(BaseModel):
    depth: int | None = Field(description="jobs in the queue (Redis: the stream, which holds a "
                              "job until its end is stored); null when the broker did not answer")
    wait_ms: Percentiles = Field(description="time jobs waited before their engine call, over "
                                 "every worker's recent jobs")


class RouteView(BaseModel):
    route: str = Field(description="the route template ('unmatched' for unknown paths)")
    method: str
    requests: int = Field(description="since the api started")
    errors: int = Field(description="answers with status >= 400")
    latency_ms: Percentiles = Field(description="recent requests (window_s, at most 1024)")


class ModelRequests(BaseModel):
    model: str = Field(description="as the body named it; '(invalid)' or '(other)'")
    requests: int
    errors: int
    codes: dict[str, int] = Field(description="error answers by error code")


class ErrorCount(BaseModel):
    model: str | None = Field(description="null: the request named no model")
    code: str = Field(description="the error code of the answer")
    count: int


class NormHistogram(BaseModel):
    model: str = Field(description="'id@version'")
    count: int = Field(description="per-sample norms in the window")
    counts: list[int] = Field(description="per bucket: [0] below norm_edges[0], [i] in "
                              "[edges[i-1], edges[i]), last: at or above the last edge")


class StatusView(BaseModel):
    """``GET /status.json``: the workers, the queue, requests and recent gradient norms."""

    time: float = Field(description="epoch seconds")
    tenant: str | None = Field(description="whose requests, errors and norms this view shows; "
                               "null: every tenant's (an admin key's view)")
    mode: Literal["embedded", "redis"]
    window_s: int = Field(description="what 'recent' means: waits, latencies and norms")
    broker_error: str | None = Field(description="why the workers or the queue are missing")
    workers: list[WorkerView]
    queue: QueueView
    routes: list[RouteView]
    models: list[ModelRequests] = Field(description="requests whose body named a model")
    errors: list[ErrorCount] = Field(description="every error answer, by model and code")
    norm_edges: list[float] = Field(description="bucket edges of every norm histogram")
    norms: list[NormHistogram] = Field(description="per model, the per-sample gradient norms "
                                       "computed recently (only by requests whose outputs "
                                       "compute them: norms, layer_norms, clipped_mean, ...)")


async def status_view(state: AppState, tenant: str | None = None) -> dict[str, Any]:
    """The page's data now (a :class:`StatusView`): every tenant's, or ``tenant``'s own."""
    now = time.time()
    broker_error = None
    workers: list[dict[str, Any]] = []
    depth: int | None = None
    try:
        if state.workers is not None:
            workers = state.workers.snapshots()
        else:
            workers = await state.broker.worker_snapshots()
        depth = await state.broker.queue_depth()
    except PsgradError as exc:  # Redis down: the api's own view still shows
        broker_error = exc.message
    waits: list[float] = []
    norms: dict[str, list[int]] = {}
    for w in workers:
        waits += [v for v in w.get("queue_wait_ms", ()) if isinstance(v, (int, float))]
        found = w.get("norms") if tenant is None else _mapping(w.get("tenant_norms")).get(tenant)
        for model, counts in _mapping(found).items():
            if isinstance(counts, list) and len(counts) == len(NORM_EDGES) + 1:
                have = norms.setdefault(model, [0] * len(counts))
                norms[model] = [a + int(b) for a, b in zip(have, counts, strict=True)]
    return {
        "time": now,
        "tenant": tenant,
        "mode": "embedded" if state.workers is not None else "redis",
        "window_s": WINDOW_S,
        "broker_error": broker_error,
        "workers": [_worker(w, tenant) for w in workers],
        "queue": {"depth": depth, "wait_ms": _ms(percentiles(waits))},
        **state.metrics.recent.view(now, tenant),
        "norm_edges": list(NORM_EDGES),
        "norms": [{"model": m, "count": sum(c), "counts": c} for m, c in sorted(norms.items())],
    }


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _worker(doc: Mapping[str, Any], tenant: str | None = None) -> dict[str, Any]:
    """A snapshot as a :class:`WorkerView` row; what a worker did not publish (or published
    in another form: another version) is null or 0, never an error. For ``tenant``'s view the
    batch in hand shows only while one of its jobs is in it."""
    row = _row(doc)
    batch = row["batch"]
    if tenant is not None and batch is not None:
        tenants = batch.get("tenants")
        row["batch"] = ({**batch, "tenants": [tenant]} if isinstance(tenants, list)
                        and tenant in tenants else None)
    try:
        return WorkerView.model_validate(row).model_dump()
    except ValidationError:
        keep = ("id", "alive")
        return WorkerView.model_validate(_row({k: doc[k] for k in keep if k in doc})).model_dump()


def _row(doc: Mapping[str, Any]) -> dict[str, Any]:
    batch = doc.get("batch")
    return {
        "id": str(doc.get("id", "?")),
        "host": doc.get("host"),
        "device": doc.get("device"),
        "pid": doc.get("pid"),
        "alive": bool(doc.get("alive")),
        "started_at": doc.get("started_at"),
        "seen_at": doc.get("time"),
        "jobs_done": doc.get("jobs_done", 0),
        "jobs_failed": doc.get("jobs_failed", 0),
        "jobs_canceled": doc.get("jobs_canceled", 0),
        "samples_done": doc.get("samples_done", 0),
        "samples_per_s": doc.get("samples_per_s", 0.0),
        "batch": batch if isinstance(batch, dict) else None,
    }
