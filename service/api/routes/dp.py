"""``/dp-runs``: DP-SGD runs with privacy accounting and a budget (see :mod:`service.dp`).

A run fixes the mechanism (clip norm, noise multiplier, sampling rate, expected batch size) and
the budget; a ``clipped_mean`` request with ``dp_run`` is one step of it. Creating and reading
need an API key; deleting a run (and with it the record of the budget spent) an admin key.

A run belongs to the tenant that made it: another tenant gets 404 for it everywhere (read, and
a step naming it); only its own tenant takes its steps. Admin keys read, list and delete every
tenant's runs (``?tenant=`` narrows the list to one tenant).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from psgrad._contract import whole
from service.api.deps import (
    AdminDep,
    ApiKey,
    IdempotencyKey,
    RegistryDep,
    RunsDep,
    Scope,
    ScopeDep,
    SettingsDep,
    TenantDep,
    TenantParam,
)
from service.api.schemas import errors
from service.dp.runs import RUN_ID_RE, keyed_run_id, unknown
from service.dp.steps import describe, make_run
from service.tenants import key_reused

router = APIRouter(prefix="/dp-runs", tags=["DP-SGD runs"], dependencies=[ApiKey])

SAMPLING = ("The accounting assumes Poisson sampling: each record joins each batch independently "
            "with probability sample_rate (psgrad.dp.poisson_batches). Shuffled fixed-size "
            "batches are not covered by this analysis (it then understates epsilon).")


Whole = Annotated[int, BeforeValidator(whole)]


class DPRunCreate(BaseModel):
    # JSON bodies may carry Infinity and NaN literals: every float must be finite; strict as
    # the gradients request is (no "1" for 1, no true for 1), a whole float an integer
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    model: str = Field(min_length=1, description="the model the run trains: an id, or "
                       "'id@version'",
                       examples=["mlp"])
    clip_norm: float = Field(gt=0, description="C: each sample's whole gradient is scaled by "
                             "min(1, C / |g|) (clip_form 'opacus': C / (|g| + 1e-6))")
    noise_multiplier: float | None = Field(
        None, ge=0.01, le=1e4, description="sigma: the noise std on the clipped sum is sigma * C; "
        "give this or target_epsilon")
    target_epsilon: float | None = Field(
        None, ge=1e-3, le=1e3, description="solve sigma so that the planned steps spend this "
        "epsilon (needs steps or epochs); also the default max_epsilon")
    sample_rate: float | None = Field(None, ge=1e-9, le=1, description="q, the Poisson sampling "
                                      "rate; give two of sample_rate, expected_batch_size, "
                                      f"dataset_size. {SAMPLING}")
    expected_batch_size: float | None = Field(
        None, gt=0, le=1e9, description="q * N: the noisy sum is divided by this, not by the "
        "batch's actual size (Opacus's convention)")
    dataset_size: Whole | None = Field(None, gt=0, le=10**12, description="N, records in the "
                                     "training set")
    delta: float = Field(ge=1e-30, lt=1, description="the delta of (epsilon, delta)-DP, e.g. 1e-5 "
                         "(below 1 / dataset_size)")
    max_epsilon: float | None = Field(
        None, gt=0, le=1e3, description="the budget: a step that would pass it answers 409 "
        "privacy_budget_exhausted (default: target_epsilon)")
    steps: Whole | None = Field(None, gt=0, le=10**6, description="planned steps")
    epochs: float | None = Field(None, gt=0, le=1e4, description="planned epochs: "
                                 "int(epochs / sample_rate) steps")
    accountant: Literal["rdp", "prv"] = Field(
        "rdp", description="rdp: Renyi DP at integer orders 2..256 (equals Opacus's "
        "RDPAccountant at those orders); prv: the numerically composed privacy-loss "
        "distribution (tight; Opacus's PRVAccountant computes the same curve). Both by Google's "
        "dp-accounting")
    clip_form: Literal["exact", "opacus"] = Field(
        "exact", description="exact: min(1, C / |g|); opacus: min(1, C / (|g| + 1e-6))")


class DPRunView(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str = Field(description="the run id to send as 'dp_run'")
    tenant: str = Field(description="the tenant that made it (only its keys take its steps)")
    model: str
    clip_norm: float
    noise_multiplier: float = Field(description="sigma (given or solved)")
    sample_rate: float
    expected_batch_size: float
    delta: float
    accountant: str
    clip_form: str
    max_epsilon: float
    max_steps: int = Field(description="the most steps within max_epsilon under the accountant")
    steps: int = Field(description="steps counted so far (one per dp_run request that "
                       "succeeded; a retried job counts once)")
    epsilon: dict[str, float] = Field(description="epsilon spent so far under each accountant "
                                      "(the other one left out past its CPU-time limit)")
    epsilon_spent: float = Field(description="epsilon under the run's accountant")
    steps_left: int
    budget_left: float = Field(description="max_epsilon - epsilon_spent")


class DPRunList(BaseModel):
    runs: list[dict[str, Any]] = Field(description="id, tenant, model, steps, max_steps, "
                                       "accountant")


def _checked(run_id: str) -> str:
    if not RUN_ID_RE.fullmatch(run_id):
        raise unknown(run_id)
    return run_id


@router.post("", status_code=201, response_model=DPRunView,
             responses=errors(400, 401, 404, 415, 422), summary="Start a DP-SGD run")
async def create_run(body: DPRunCreate, settings: SettingsDep, registry: RegistryDep,
                     store: RunsDep, tenant: TenantDep,
                     key: IdempotencyKey = None) -> dict[str, Any]:
    """Fix the run's mechanism and budget; solving for target_epsilon takes a second or two.
    The run is the caller's tenant's. With an ``Idempotency-Key``, the request sent again (its
    answer lost) answers the run its first try made, with the steps it has taken; the key
    sent with another body is a 422.

    422 for a number that is not finite, a run that could never take a step (its first step
    alone passes max_epsilon), prv below its smallest noise multiplier, more planned steps than
    the cap, or accounting past PSGRAD_DP_ACCOUNTING_CPU_S seconds of CPU."""
    spec = body.model_dump()
    await run_in_threadpool(registry.describe, body.model)  # 404 for an unknown model
    made = await run_in_threadpool(make_run, spec, settings.dp_accounting_cpu_s)
    run = replace(made, tenant=tenant.name,
                  id=made.id if key is None else keyed_run_id(tenant.name, key))
    kept = await run_in_threadpool(store.create, run)
    if replace(kept, created=run.created) != run:
        raise key_reused("run", kept.id)
    found = await run_in_threadpool(store.get, kept.id)
    steps = 0 if found is None else found[1]
    return await run_in_threadpool(describe, kept, steps, settings.dp_accounting_cpu_s)


@router.get("", response_model=DPRunList, responses=errors(400, 401, 403),
            summary="The caller's DP runs (an admin's: every tenant's)")
async def list_runs(store: RunsDep, scope: ScopeDep) -> dict[str, Any]:
    def brief() -> list[dict[str, Any]]:
        out = []
        for run_id in store.ids():
            found = store.get(run_id)
            if found is not None and scope.sees(found[0].tenant):
                run, steps = found
                out.append({"id": run.id, "tenant": run.tenant, "model": run.model,
                            "steps": steps,
                            "max_steps": run.max_steps, "accountant": run.accountant})
        return out

    return {"runs": await run_in_threadpool(brief)}


@router.get("/{run_id}", response_model=DPRunView, responses=errors(400, 401, 403, 404),
            summary="A run's steps, epsilon and budget left")
async def get_run(run_id: str, settings: SettingsDep, store: RunsDep,
                  scope: ScopeDep) -> dict[str, Any]:
    """Epsilon under both accountants (prv takes up to a second on a CPU)."""
    found = await run_in_threadpool(store.get, _checked(run_id))
    if found is None or not scope.sees(found[0].tenant):
        raise unknown(run_id)
    return await run_in_threadpool(describe, *found, settings.dp_accounting_cpu_s)


@router.delete("/{run_id}", responses=errors(400, 401, 403, 404),
               summary="Delete a run (admin)")
async def delete_run(run_id: str, store: RunsDep, admin: AdminDep,
                     tenant: TenantParam = None) -> dict[str, Any]:
    """The run and its record of the budget spent go; its id then answers 404. With
    ``tenant``: only a run of that tenant."""
    def delete() -> bool:
        found = store.get(_checked(run_id))
        if found is None or not Scope(admin, tenant).sees(found[0].tenant):
            return False
        return store.delete(run_id)

    if not await run_in_threadpool(delete):
        raise unknown(run_id)
    return {"id": run_id, "deleted": True}


__all__ = ["router"]
