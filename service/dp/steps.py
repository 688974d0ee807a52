"""Where DP runs meet a request: creating a run, binding a request to it, counting its step.

- :func:`make_run` (``POST /dp-runs``): the sampling rate and expected batch size, the planned
  steps, the noise multiplier (given, or solved for ``target_epsilon``) and the budget in steps.
- :func:`bind` (request validation): a ``clipped_mean`` request with ``dp_run`` takes the run's
  clip norm, noise multiplier, clip form and expected batch size, and server-side noise.
- :func:`on_result` (the worker, when a job's answer is about to be stored): counts the job as
  one step, once, atomically with the budget check, and adds ``dp`` to the answer.
- :func:`precheck` (the api): refuses at once a request whose run has no step left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any

from psgrad._errors import BadRequest, InvalidInput
from service.dp.runs import CLIP_FORMS, DPRun, RunStore, exhausted, new_run_id, unknown
from service.strategies.base import Options

# the fields a dp_run request may not send: the run sets them, and the server draws the noise
RUN_SETS = ("clip_norm", "noise_multiplier", "seed")


def make_run(spec: Mapping[str, Any], cpu_s: int = 5) -> DPRun:
    """A new run from the body of ``POST /dp-runs`` (already type-checked by its schema).

    What is refused cheaply is refused before any accounting (:func:`check_spec`); the
    accounting itself runs under ``cpu_s`` seconds of CPU (``PSGRAD_DP_ACCOUNTING_CPU_S``).

    Raises:
        InvalidInput: a field out of range, a limit passed, or a run that can take no step.
    """
    from service.dp import accounting  # scipy and dp-accounting load on first use, not at start

    q, batch, steps = check_spec(spec)
    accountant, delta = spec.get("accountant") or "rdp", spec["delta"]
    target, budget = spec.get("target_epsilon"), spec.get("max_epsilon")
    budget = target if budget is None else budget
    assert budget is not None  # check_spec saw to it
    try:
        sigma, max_steps, first = accounting.planned(
            cpu_s, accountant, spec.get("noise_multiplier"), target, q, steps, delta, budget)
    except (ArithmeticError, ValueError) as exc:  # extreme values the accountant cannot take
        raise InvalidInput(f"the accountant cannot evaluate this run ({exc}): use a noise "
                           "multiplier, sampling rate and delta in the usual ranges") from None
    if max_steps < 1:
        raise InvalidInput(
            f"this run could never take a step: one step spends epsilon {first:.4g} ({accountant}, "
            f"delta {delta:g}), more than max_epsilon {budget:g}; raise max_epsilon to at least "
            f"{first:.4g}, or raise the noise multiplier or lower the sampling rate",
            first_step_epsilon=first, max_epsilon=budget)
    return DPRun(
        id=new_run_id(), model=spec["model"], clip_norm=spec["clip_norm"],
        noise_multiplier=float(sigma), sample_rate=float(q), expected_batch_size=float(batch),
        delta=delta, max_epsilon=budget, max_steps=max_steps, accountant=accountant,
        clip_form=spec.get("clip_form") or "exact", dataset_size=spec.get("dataset_size"),
        planned_steps=steps, target_epsilon=target, created=time.time())


def check_spec(spec: Mapping[str, Any]) -> tuple[float, float, int | None]:
    """The checks that need no accounting: finite numbers, two of the three sampling fields,
    one of noise and target, a budget, the planned steps within the cap, and a noise the
    accountant evaluates cheaply. Answers (sample rate, expected batch size, planned steps).

    The schema refuses Infinity and NaN already; this holds for every caller."""
    from service.dp import accounting

    bad = sorted(k for k, v in spec.items()
                 if isinstance(v, float) and not math.isfinite(v))
    if bad:
        raise InvalidInput(f"{', '.join(bad)} must be finite numbers (not Infinity or NaN)",
                           fields=bad)
    q, batch, size = spec.get("sample_rate"), spec.get("expected_batch_size"), spec.get(
        "dataset_size")
    if size is not None and batch is not None:
        q_from = batch / size
        if q is not None and not math.isclose(q, q_from, rel_tol=1e-9):
            raise InvalidInput(f"sample_rate {q} is not expected_batch_size / dataset_size "
                               f"({q_from}): give two of the three")
        q = q_from
    elif q is not None and (size is not None or batch is not None):
        batch = batch if batch is not None else q * size
    else:
        raise InvalidInput("give two of sample_rate, expected_batch_size and dataset_size: "
                           "the rate is what the accounting needs, the expected batch size "
                           "divides the noisy sum")
    if not 0 < q <= 1:
        raise InvalidInput(f"the sampling rate must be in (0, 1]; got {q}")
    steps, epochs = spec.get("steps"), spec.get("epochs")
    if steps is None and epochs is not None:
        steps = int(epochs / q)  # as Opacus counts an epoch: 1 / sample_rate steps
        if steps > accounting.MAX_STEPS:
            raise InvalidInput(
                f"{epochs:g} epochs at sample_rate {q:g} are {steps} steps, more than the "
                f"{accounting.MAX_STEPS} a run may plan: plan fewer epochs or a larger "
                "sampling rate", max_steps=accounting.MAX_STEPS)
    target, sigma = spec.get("target_epsilon"), spec.get("noise_multiplier")
    if (target is None) == (sigma is None):
        raise InvalidInput("give exactly one of noise_multiplier and target_epsilon")
    if sigma is None and not steps:
        raise InvalidInput("target_epsilon needs the planned 'steps' or 'epochs' to solve "
                           "for the noise multiplier")
    if spec.get("max_epsilon") is None and target is None:
        raise InvalidInput("give 'max_epsilon' (the budget) or 'target_epsilon'")
    if sigma is not None:
        accounting.check_noise(spec.get("accountant") or "rdp", sigma)
    return q, batch, steps


def describe(run: DPRun, steps: int, cpu_s: int = 5) -> dict[str, Any]:
    """``GET /dp-runs/{id}``: the run, its steps and epsilon under each accountant.

    The run's own accountant is computed here (no dearer than when the run was made: the
    budget search evaluated its last step); the other only within ``cpu_s`` seconds of CPU,
    and left out of ``epsilon`` past that (prv of an rdp run at a small noise multiplier)."""
    from service.dp import accounting

    args = (run.noise_multiplier, run.sample_rate, steps, run.delta)
    eps = {name: (accounting.epsilon(name, *args) if name == run.accountant
                  else accounting.epsilon_within(cpu_s, name, *args))
           for name in accounting.ACCOUNTANTS}
    spent = eps[run.accountant]
    assert spent is not None
    return {**dataclasses.asdict(run), "steps": steps,
            "epsilon": {k: v for k, v in eps.items() if v is not None}, "epsilon_spent": spent,
            "steps_left": max(0, run.max_steps - steps),
            "budget_left": max(0.0, run.max_epsilon - spent)}


def bind(fields: Mapping[str, Any], opts: Options, model_id: str,
         runs: RunStore | None) -> Options:
    """The options of a ``dp_run`` request: the run's mechanism, noise drawn on the server."""
    run_id = fields["dp_run"]
    if not isinstance(run_id, str) or not run_id:
        raise BadRequest("'dp_run' must be a run id from POST /dp-runs")
    sent = [k for k in RUN_SETS if fields.get(k) is not None]
    if sent:
        raise InvalidInput(f"a 'dp_run' request takes clip_norm and noise_multiplier from its "
                           f"run and draws its noise on the server: leave out {', '.join(sent)}",
                           fields=sent)
    if opts.outputs != ("clipped_mean",):
        raise InvalidInput("a 'dp_run' request releases only the noisy mean: ask for outputs "
                           "['clipped_mean'] (any other output would leak unnoised data)")
    found = runs.get(run_id) if runs is not None else None
    if found is None:
        raise unknown(run_id)
    run = found[0]
    if model_id != run.model.partition("@")[0]:
        raise InvalidInput(f"DP run '{run.id}' is for model '{run.model}', not '{model_id}'")
    return dataclasses.replace(
        opts, clip_norm=run.clip_norm, noise_multiplier=run.noise_multiplier, seed=None,
        divisor=run.expected_batch_size, norm_offset=CLIP_FORMS[run.clip_form],
        secure_noise=True)


def on_result(job_id: str, fields: Mapping[str, Any], result: dict[str, Any],
              runs: RunStore, cpu_s: int = 5) -> dict[str, Any]:
    """Count a ``dp_run`` job's step (once per job id) and add ``dp`` to its answer.

    The step's epsilon is the run's accountant's, computed within ``cpu_s`` seconds of CPU
    (``PSGRAD_DP_ACCOUNTING_CPU_S``); past that (``prv``, whose cost grows as the noise
    shrinks), it is ``rdp``'s, an upper bound of the same guarantee, and ``dp.accountant``
    says which one answered (``dp.fallback`` why).

    Raises:
        PrivacyBudgetExhausted: the run has no step left; the answer must not be released.
    """
    run_id = fields.get("dp_run")
    if not isinstance(run_id, str):
        return result
    from service.dp import accounting

    run, steps = runs.count(run_id, job_id)
    args = (run.noise_multiplier, run.sample_rate, steps, run.delta)
    eps = accounting.epsilon_within(cpu_s, run.accountant, *args)
    used, fallback = run.accountant, None
    if eps is None:  # the step is counted and its answer released: never without an epsilon
        used, eps = "rdp", accounting.epsilon("rdp", *args)
        fallback = (f"{run.accountant} needed more than {cpu_s} s of CPU "
                    f"({accounting.LIMIT_NAME}): rdp's bound, which is never smaller")
    out = {k: v for k, v in result.items() if k != "meta"}
    out["dp"] = {"run": run.id, "steps": steps, "epsilon": eps, "delta": run.delta,
                 "accountant": used, "max_epsilon": run.max_epsilon,
                 **({"fallback": fallback} if fallback else {})}
    if "meta" in result:
        out["meta"] = result["meta"]  # last, as documented
    return out


async def precheck(fields: Mapping[str, Any], runs: RunStore, tenant: str) -> None:
    """Refuse before queueing: an unknown run or another tenant's (404: a step spends only
    the caller's own runs, admins' included), or one whose budget is spent (409)."""
    run_id = fields.get("dp_run")
    if not isinstance(run_id, str):
        return
    found = await asyncio.to_thread(runs.get, run_id)
    if found is None or found[0].tenant != tenant:
        raise unknown(run_id)
    if found[1] >= found[0].max_steps:
        raise exhausted(*found)
