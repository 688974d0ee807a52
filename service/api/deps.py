"""Shared pieces of the routes as typed dependencies: state, settings, broker, registry, keys.

Every dependency is ``async``: FastAPI runs a plain ``def`` dependency in a thread pool, and three
thread hops cost a one-sample request more than all of its own work on the event loop.

``TenantDep`` is the caller's :class:`~service.tenants.Tenant`, read from its key (see
:mod:`service.keyring`); every data route needs it, and ``AdminDep`` (an admin key) guards model
registration and deletion. With no keys configured every request is the default tenant with
every right (the server then refuses to bind beyond loopback unless told to, see
:mod:`service.cli`). Keys are compared as SHA-256 digests, in constant time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, Query, Request
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from psgrad._errors import BadRequest, Forbidden, InvalidInput, Unauthorized
from service.api.metrics import Metrics
from service.api.status_data import note_tenant
from service.config import Settings
from service.dp.runs import RunStore
from service.jobs import Broker
from service.keyring import Keyring
from service.registry import ModelRegistry
from service.storage import Storage
from service.tenants import TENANT_NAME, Tenant
from service.worker.loop import WorkerPool


@dataclass
class AppState:
    """What the routes share; ``workers`` is the embedded mode's pool (None with Redis).
    ``storage`` holds every store (:mod:`service.storage`); the registry reads its models."""

    settings: Settings
    broker: Broker
    registry: ModelRegistry
    metrics: Metrics
    keyring: Keyring
    storage: Storage
    workers: WorkerPool | None = None

    async def ready(self, *, need_worker: bool = True) -> bool:
        """The broker answers and (``need_worker``) a worker serves the queue (the pool's, or
        Redis heartbeats)."""
        if need_worker and self.workers is not None and not self.workers.alive():
            return False
        return await self.broker.ready(need_worker=need_worker)


async def get_app_state(request: Request) -> AppState:
    state: AppState = request.app.state.psgrad
    return state


StateDep = Annotated[AppState, Depends(get_app_state)]


async def get_settings_dep(state: StateDep) -> Settings:
    return state.settings


async def get_broker(state: StateDep) -> Broker:
    return state.broker


async def get_registry(state: StateDep) -> ModelRegistry:
    return state.registry


async def get_runs(state: StateDep) -> RunStore:
    return state.storage.runs


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
BrokerDep = Annotated[Broker, Depends(get_broker)]
RegistryDep = Annotated[ModelRegistry, Depends(get_registry)]
RunsDep = Annotated[RunStore, Depends(get_runs)]

_bearer = HTTPBearer(
    auto_error=False,
    description="an API key (PSGRAD_API_KEYS, PSGRAD_KEYS_FILE) or an admin key "
    "(PSGRAD_ADMIN_KEYS, or role admin in the keys file), as 'Authorization: Bearer <key>'",
)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _given(credentials: HTTPAuthorizationCredentials | None) -> str:
    if credentials is None:
        raise Unauthorized("this server needs an API key: send 'Authorization: Bearer <key>'")
    return credentials.credentials


async def get_tenant(request: Request, state: StateDep, credentials: Credentials) -> Tenant:
    """The tenant whose key the request carries (401 without a valid one); with no keys
    configured, the default tenant with every right (loopback dev mode, as before tenants)."""
    keyring = state.keyring
    tenant = (keyring.dev_tenant() if not keyring.configured
              else keyring.lookup(_given(credentials)))
    if tenant is None:
        raise Unauthorized("the API key is not valid")
    note_tenant(request.scope, tenant.name)  # the status page's per-tenant counters
    return tenant


TenantDep = Annotated[Tenant, Depends(get_tenant)]


async def require_admin(tenant: TenantDep, state: StateDep) -> Tenant:
    """Only an admin key passes (registering and deleting models, other tenants' resources)."""
    if not tenant.admin:
        raise Forbidden(
            "this needs an admin key (PSGRAD_ADMIN_KEYS); an API key is not enough"
            + ("" if state.keyring.has_admin else ": no admin key is configured on this server")
        )
    return tenant


AdminDep = Annotated[Tenant, Depends(require_admin)]
ApiKey = Depends(get_tenant)  # for a router or route that needs a key but not its tenant
AdminKey = Depends(require_admin)

TenantParam = Annotated[
    str | None,
    Query(
        alias="tenant",
        pattern=f"^{TENANT_NAME.pattern}$",
        description="admin keys only: act on this tenant's resources (lists: only this "
        "tenant's; without it an admin lists every tenant's)",
    ),
]

# What a client names one request by (POST /jobs, POST /per-sample-grads, POST /dp-runs): every
# try of it under the key makes one thing (service.tenants.keyed_id)
def _one_key(request: Request, key: Annotated[str | None, Header(
        alias="Idempotency-Key", min_length=1, max_length=128, pattern=r"^[\x20-\x7e]+$",
        description="your name for this request (a UUID, say: printable ASCII, up to 128 "
        "characters): sent again with the same body, it answers what its first try made, "
        "made once; with another body, 422")] = None) -> str | None:
    """The request's ``Idempotency-Key``: one header, or none (two name two requests: which
    one this try is cannot be told, 400)."""
    sent = len(request.headers.getlist("idempotency-key"))
    if sent > 1:
        raise BadRequest(f"the request has {sent} Idempotency-Key headers: send one, your name "
                         "for this request")
    return key


IdempotencyKey = Annotated[str | None, Depends(_one_key)]


@dataclass(frozen=True)
class Scope:
    """Whose resources a request may see: the caller's own; an admin's, every tenant's (or the
    one its ``tenant`` parameter names)."""

    caller: Tenant
    asked: str | None = None  # the ``tenant`` parameter (admins only)

    @property
    def owner(self) -> str:
        """The tenant whose namespace a named resource (a reference set) is read from or
        written to, and whose a new resource becomes."""
        return self.asked or self.caller.name

    def sees(self, owner: str) -> bool:
        """A resource of ``owner``, addressed by its id, is visible (else: 404)."""
        return owner == self.owner or (self.caller.admin and self.asked is None)


async def get_scope(tenant: TenantDep, asked: TenantParam = None) -> Scope:
    if asked is not None and asked != tenant.name and not tenant.admin:
        raise Forbidden("the 'tenant' parameter needs an admin key: leave it out to act on "
                        "your own resources")
    return Scope(tenant, asked)


ScopeDep = Annotated[Scope, Depends(get_scope)]


# by APIRoute.unique_id (its name, path and method): one route's declared query names
_QUERY_NAMES: dict[str, frozenset[str]] = {}


async def refuse_unknown_query(request: Request) -> None:
    """Every route takes only the query parameters it declares: an unknown one (a typo such as
    ``?tennant=``) is a 422 naming it and the route's own, never silently ignored."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute) or not request.query_params:
        return
    known = _QUERY_NAMES.get(route.unique_id)
    if known is None:
        known = _QUERY_NAMES[route.unique_id] = frozenset(_query_names(route.dependant))
    if unknown := sorted(set(request.query_params) - known):
        takes = ", ".join(sorted(known)) or "none"
        raise InvalidInput(f"unknown query parameter {', '.join(map(repr, unknown))} for "
                           f"{request.method} {route.path}: leave it out (this route takes: "
                           f"{takes})", unknown=unknown, accepted=sorted(known))


def _query_names(dependant: Dependant) -> set[str]:
    """The query parameters a route declares, its dependencies' included."""
    names = {param.alias for param in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


RefuseUnknownQuery = Depends(refuse_unknown_query)  # every route's (service.api.app)
