"""Shared pieces of the routes as typed dependencies: state, settings, broker, registry, keys.

Every dependency is ``async``: FastAPI runs a plain ``def`` dependency in a thread pool, and three
thread hops cost a one-sample request more than all of its own work on the event loop.

``ApiKey`` guards every data route and ``AdminKey`` model registration and deletion. With no keys
configured both let everyone in (the server then refuses to bind beyond loopback unless told
to, see :mod:`service.cli`). Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from psgrad._errors import Forbidden, Unauthorized
from service.api.metrics import Metrics
from service.config import Settings
from service.jobs import Broker
from service.registry import ModelRegistry
from service.worker import WorkerPool


@dataclass
class AppState:
    """What the routes share; ``workers`` is the embedded mode's pool (None with Redis)."""

    settings: Settings
    broker: Broker
    registry: ModelRegistry
    metrics: Metrics
    workers: WorkerPool | None = None

    async def ready(self) -> bool:
        """The broker answers and a worker serves the queue (the pool's, or Redis heartbeats)."""
        if self.workers is not None and not self.workers.alive():
            return False
        return await self.broker.ready()


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


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
BrokerDep = Annotated[Broker, Depends(get_broker)]
RegistryDep = Annotated[ModelRegistry, Depends(get_registry)]

_bearer = HTTPBearer(
    auto_error=False,
    description="an API key (PSGRAD_API_KEYS) or an admin "
    "key (PSGRAD_ADMIN_KEYS), as 'Authorization: Bearer <key>'",
)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def key_matches(given: str, keys: frozenset[str]) -> bool:
    """Constant time in the key's content: every configured key is compared."""
    found = False
    raw = given.encode()
    for key in keys:
        found |= hmac.compare_digest(raw, key.encode())
    return found


def _given(credentials: HTTPAuthorizationCredentials | None) -> str:
    if credentials is None:
        raise Unauthorized("this server needs an API key: send 'Authorization: Bearer <key>'")
    return credentials.credentials


async def require_key(settings: SettingsDep, credentials: Credentials) -> None:
    """Any configured key (API or admin) passes; no keys configured: everyone passes."""
    keys = settings.api_key_set | settings.admin_key_set
    if keys and not key_matches(_given(credentials), keys):
        raise Unauthorized("the API key is not valid")


async def require_admin(settings: SettingsDep, credentials: Credentials) -> None:
    """Only an admin key passes (for registering and deleting models)."""
    admin, api = settings.admin_key_set, settings.api_key_set
    if not admin and not api:
        return
    given = _given(credentials)
    if admin and key_matches(given, admin):
        return
    if key_matches(given, api):
        raise Forbidden(
            "this needs an admin key (PSGRAD_ADMIN_KEYS); an API key is not enough"
            + ("" if admin else ": no admin key is configured on this server")
        )
    raise Unauthorized("the API key is not valid")


ApiKey = Depends(require_key)
AdminKey = Depends(require_admin)
