"""Who a request belongs to: tenants, their role and their quotas.

Every key belongs to one tenant; jobs, DP runs and gradient stores belong to the tenant whose key
made them. With no keys configured (loopback dev mode) every request belongs to
:data:`DEFAULT_TENANT`. This module holds only the records; reading keys is the api's job and
enforcing quotas the broker's.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from psgrad._errors import InvalidInput

__all__ = ["DEFAULT_TENANT", "TENANT_NAME", "Quotas", "Tenant", "key_reused", "keyed_id",
           "owned_key", "owned_name"]

DEFAULT_TENANT = "default"  # the one tenant of a server without keys, and of data made before
# a tenant's name: it is part of Redis keys and file names, so never ':', '/' or '~'
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def owned_key(tenant: str, name: str) -> str:
    """Where ``tenant``'s store (or reference set) ``name`` is kept: the name itself for the
    default tenant, ``<tenant>~<name>`` for any other (``~`` is in no id), so each tenant names
    its stores in a namespace of its own (an id checked by the caller)."""
    return name if tenant == DEFAULT_TENANT else f"{tenant}~{name}"


def owned_name(key: str) -> str:
    """The name a tenant gave what is kept under ``key`` (an ensemble's, for the key of one
    of its checkpoints: ``<key>/checkpoint-<i>``)."""
    return key.partition("/")[0].rpartition("~")[2]


def key_owner(key: str) -> str:
    """The tenant that keeps what is under ``key`` (:func:`owned_key`'s ``tenant``)."""
    return key.rpartition("~")[0] or DEFAULT_TENANT


def keyed_id(tenant: str, key: str, hex_digits: int) -> str:
    """The id of what ``tenant`` made under the ``Idempotency-Key`` ``key`` (a job, a DP run):
    every try of that request names the same one, and no other tenant's."""
    return hashlib.sha256(f"{tenant}\0{key}".encode()).hexdigest()[:hex_digits]


def key_reused(what: str, made: str) -> InvalidInput:
    """The 422 of an ``Idempotency-Key`` sent again with another request: its first try made
    the ``what`` (a job, a run) of id ``made``."""
    return InvalidInput(f"this Idempotency-Key was sent before with another request ({what} "
                        f"'{made}'): send a new key with each new request", **{what: made})


@dataclass(frozen=True)
class Quotas:
    """A tenant's limits; None: no limit of its own (the server's defaults apply)."""

    queued_samples: int | None = None  # samples queued or running at once
    concurrent_jobs: int | None = None  # jobs queued or running at once
    requests_per_s: float | None = None  # sustained request rate (a token bucket)
    weight: float = 1.0  # its share of the workers relative to other tenants


@dataclass(frozen=True)
class Tenant:
    """The caller of a request, as its key says."""

    name: str
    admin: bool = False
    quotas: Quotas = field(default_factory=Quotas)
