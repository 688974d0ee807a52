"""``create_app()``: the FastAPI app, its routers, error handling, metrics and lifespan."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from psgrad import __version__
from service.api import errors
from service.api.deps import AppState, RefuseUnknownQuery
from service.api.docs import install_docs, install_openapi
from service.api.metrics import Metrics, MetricsMiddleware
from service.api.routes import dp, grads, jobs, models, oip, ops, reference_sets, status, stores
from service.broker import make_broker
from service.broker.embedded import EmbeddedBroker
from service.config import Settings, get_settings
from service.export.child import SPARES
from service.jobs import Broker
from service.keyring import Keyring, install_sighup
from service.registry import ModelRegistry, make_registry
from service.storage import Storage, open_storage
from service.worker.loop import WorkerPool

log = logging.getLogger("psgrad.api")

DESCRIPTION = """Per-sample gradients as a service. POST a batch to `/per-sample-grads` (JSON or
safetensors) and get each sample's gradient, or statistics of them (norms, mean, variance,
DP-SGD clipped mean, dot products, TD(0) updates). Errors are
`{"error": {"code", "message", "details"}}`."""


def create_app(
    settings: Settings | None = None,
    broker: Broker | None = None,
    *,
    registry: ModelRegistry | None = None,
    storage: Storage | None = None,
) -> FastAPI:
    """The api; without ``broker`` it makes one from the settings (embedded without Redis).

    Every store is built here, once (:func:`service.storage.open_storage`; a ``registry``
    given keeps its model store), and handed to the routes and the workers. With the embedded
    broker the app also runs the workers: a :class:`WorkerPool` over the broker, sharing the
    app's registry (models registered through the api are served at once) and storage (the
    same memory stores); their events feed the app's metrics and each loop's status. With
    Redis the workers are ``psgrad worker`` processes.
    """
    settings = settings or get_settings()
    metrics = Metrics()
    storage = storage or open_storage(settings, models=registry.store if registry else None)
    registry = registry or make_registry(settings, storage.models)
    broker = broker or make_broker(settings)
    workers = None
    if isinstance(broker, EmbeddedBroker):
        workers = WorkerPool.over(broker, registry, settings, [metrics.on_event],
                                  storage=storage)
    keyring = Keyring(settings.api_keys, settings.admin_keys, settings.keys_file)
    state = AppState(settings=settings, broker=broker, registry=registry, metrics=metrics,
                     workers=workers, keyring=keyring, storage=storage)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        install_sighup()  # SIGHUP: re-read PSGRAD_KEYS_FILE
        if settings.export_spare and settings.may_register:
            SPARES.keep(settings.export_memory_mb, settings.export_cpu_s)  # registration's
        await broker.start()
        if workers is not None:
            workers.start()
        try:
            yield
        finally:
            if workers is not None:
                workers.stop()
            await broker.close()  # wakes the workers waiting for a job
            if workers is not None:
                await workers.join()
            SPARES.close()

    app = FastAPI(
        title="psgrad",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        dependencies=[RefuseUnknownQuery],
    )
    app.state.psgrad = state
    errors.install(app)
    app.add_middleware(errors.CatchAllMiddleware)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    for router in (grads.router, jobs.router, models.router, ops.router, dp.router,
                   reference_sets.router, stores.router, status.router, oip.router):
        app.include_router(router)
    install_docs(app)
    install_openapi(app)
    return app
