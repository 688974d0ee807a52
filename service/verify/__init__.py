"""Verification of an answer: recompute some samples with the per-sample loop and compare.

A request's ``verify: k`` (or ``PSGRAD_VERIFY_FRACTION`` of the jobs that did not ask, with
``PSGRAD_VERIFY_SAMPLES`` samples) makes the worker, once the engine has answered, pick ``k`` of
the job's samples at random (seeded by ``verify_seed``, else by the job id: the same job picks the
same samples), recompute them one at a time with plain autograd (:mod:`service.verify.reference`)
and compare every output it can (:mod:`service.verify.expected` says what, per output) within the
tolerance the tests hold the engine to. A difference beyond it fails the job with
:class:`psgrad.VerificationFailed` (500 ``verification_failed``): the answer is withheld, never
served as right. The report is the answer's ``meta.verify``.

Cost: ``k`` backward passes of batch one (the loop), plus, for the statistics, one more engine
call on the job's batch (:func:`_statistics`). The batch's own call is untouched.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from psgrad._contract import answer_fields
from psgrad._contract import output as output_spec
from psgrad._errors import VerificationFailed
from service import engine
from service.config import Settings
from service.validate import ParsedRequest
from service.verify.expected import AGGREGATE, AT_LEAST_TWO, PER_SAMPLE, Expected, Whole
from service.verify.reference import per_sample_loop, take

if TYPE_CHECKING:
    from service.compile_cache import CompiledFunctions

__all__ = ["TOLERANCE", "Plan", "affordable", "check", "choose", "plan"]

# The tests' tolerance (the PyTorch tutorial's in float32): |got - want| <= atol + rtol |want|.
# Half-precision models (an exported program may have one) get about their precision; the test
# suite has none to hold them to.
TOLERANCE = {torch.float64: (1e-9, 1e-7), torch.float16: (1e-2, 1e-2),
             torch.bfloat16: (5e-2, 5e-2)}  # (atol, rtol)
FLOAT32 = (3e-3, 1e-5)  # float32, and any other dtype


@dataclass(frozen=True)
class Plan:
    """Which job is verified, and how: ``k`` samples drawn with ``seed``."""

    k: int
    seed: int
    source: str  # "request" (verify: k) or "fraction" (PSGRAD_VERIFY_FRACTION)


def _hash63(job_id: str, what: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{job_id}:{what}".encode()).digest()[:8], "big") >> 1


def plan(job_id: str, parsed: ParsedRequest, settings: Settings) -> Plan | None:
    """The job's verification, or None. The operator's draw is a function of the job id, so a job
    delivered again (Redis) is verified again, on the same samples."""
    k, source = parsed.verify, "request"
    if k <= 0:
        if _hash63(job_id, "draw") / 2**63 >= settings.verify_fraction:
            return None
        k, source = settings.verify_samples, "fraction"
    if k <= 0:
        return None
    seed = parsed.verify_seed if parsed.verify_seed is not None else _hash63(job_id, "seed")
    return Plan(k, seed, source)


def choose(n: int, k: int, seed: int) -> list[int]:
    """``min(k, n)`` distinct sample indices of ``n``, in order, drawn from ``seed``."""
    return sorted(random.Random(seed).sample(range(n), min(k, n)))


def check(parsed: ParsedRequest, answer: dict[str, Any], how: Plan, *, settings: Settings,
          compiled: CompiledFunctions | None = None) -> dict[str, Any]:
    """``meta.verify`` of ``answer`` (the engine's outputs of this job, before any cast to the
    answer dtype); raises :class:`VerificationFailed` when an output is off."""
    started = time.perf_counter()
    model, opts, batch = parsed.model, parsed.opts, parsed.batch
    k = how.k
    if AT_LEAST_TWO & set(opts.outputs):
        k = max(k, 2)
    rows = choose(batch.size, min(k, affordable(parsed, settings)), how.seed)
    sub = take(batch, rows)
    expected = Expected(per_sample_loop(model, sub, opts), sub, opts, model)
    # under autocast the engine's forward and backward round through bfloat16; the loop's don't
    atol, rtol = TOLERANCE.get(opts.autocast_dtype or model.dtype, FLOAT32)
    cmp = _Comparison(rows, atol, rtol)
    index = torch.tensor(rows, dtype=torch.long)
    for name in opts.outputs:
        if name in PER_SAMPLE:
            cmp.add(name, _rows_of(answer[name], index), PER_SAMPLE[name](expected))
    aggregates = tuple(name for name in opts.outputs if name in AGGREGATE)
    if aggregates:
        _statistics(parsed, answer, rows, expected, cmp, settings, compiled)
    report = {
        "samples": rows,
        "seed": how.seed,
        "source": how.source,
        "max_abs_diff": cmp.worst,
        "tolerance": {"atol": atol, "rtol": rtol},
        "checked": {name: cmp.diffs[name] for name in opts.outputs},  # in the request's order
        "ms": round((time.perf_counter() - started) * 1000, 3),
    }
    if cmp.failure is not None:
        raise cmp.failure(report)
    return report


def _statistics(parsed: ParsedRequest, answer: dict[str, Any], rows: list[int],
                expected: Expected, cmp: _Comparison, settings: Settings,
                compiled: CompiledFunctions | None) -> None:
    """Statistics, twice, from ONE engine call on the job's batch reordered so that the verified
    samples are a segment of their own and the others a second one (noise off):

    - the verified samples' segment against the loop's statistic of them (how the engine computes
      it, for this model, weights and options, at full sensitivity);
    - the answer against the loop's samples combined with the engine's statistic of the others
      (the answer itself: its assembly, division, noise, the merge of its batch).
    """
    opts, batch = parsed.opts, parsed.batch
    aggregates = tuple(name for name in opts.outputs if name in AGGREGATE)
    chosen = set(rows)
    rest = [i for i in range(batch.size) if i not in chosen]
    combined: tuple[str, ...] = ()  # what Whole reads of the others
    if {"variance", "cosine_mean"} & set(aggregates):
        combined = ("mean",)
    if {"gns", "layer_gns"} & set(aggregates):
        combined = ("mean", "layer_norms")
    quiet = replace(opts, outputs=tuple(dict.fromkeys((*aggregates, *combined))),
                    noise_multiplier=0.0)
    parts = engine.compute(parsed.model, take(batch, rows + rest), quiet,
                           [len(rows), len(rest)] if rest else [len(rows)],
                           budget_bytes=settings.memory_budget_mb << 20, compiled=compiled,
                           fast_stats=settings.fast_stats)
    whole = Whole(expected, parts[1] if rest else None, len(rest),
                  answer.get("meta", {}).get("seed", opts.seed))
    index = torch.tensor(rows, dtype=torch.long)
    for name in aggregates:
        if name == "kfac_inputs":  # each of its fields, in the segment and in the answer
            for field in answer_fields([name]):
                cmp.add(name, parts[0][field], AGGREGATE[name](expected)[field],
                        per_sample=False, of="recomputed by the engine over the verified samples")
                cmp.add(name, answer[field], whole.kfac_inputs[field], per_sample=False,
                        of="in the answer")
            continue
        if output_spec(name).also:  # a noise scale: its two estimates
            _estimates(cmp, name, parts[0], AGGREGATE[name](expected),
                       of="recomputed by the engine over the verified samples")
            _estimates(cmp, name, answer, getattr(whole, name), of="in the answer")
            continue
        cos = name == "cosine_mean"
        cmp.add(name, parts[0][name], AGGREGATE[name](expected), per_sample=cos,
                of="recomputed by the engine over the verified samples")
        want = getattr(whole, name)
        if want is not None:  # None: a DP run's noise, which nothing can draw again
            cmp.add(name, _rows_of(answer[name], index) if cos else answer[name], want,
                    per_sample=cos, of="in the answer")


def _estimates(cmp: _Comparison, name: str, got: dict[str, Any], want: dict[str, Any], *,
               of: str) -> None:
    """A noise scale's ``trace`` and ``grad_sq`` against the loop's. Each is a difference of
    terms the size of ``trace + grad_sq`` (the mean squared norm, up to (n - 1) / n), so its
    relative tolerance is of that; the ratio is theirs (where ``grad_sq`` is near 0 any rounding
    moves it far, so it is not compared itself)."""
    trace, grad_sq = output_spec(name).also
    scale = _map2(lambda t, g: t.abs() + g.abs(), want[trace], want[grad_sq])
    for field in (trace, grad_sq):
        cmp.add(name, got[field], want[field], per_sample=False, of=of, scale=scale)


def _map2(fn: Any, a: Any, b: Any) -> Any:
    return {k: fn(v, b[k]) for k, v in a.items()} if isinstance(a, dict) else fn(a, b)


def affordable(parsed: ParsedRequest, settings: Settings) -> int:
    """The most samples whose gradients fit in ``PSGRAD_MEMORY_BUDGET_MB`` (at least one, as a
    ``vmap`` chunk): the loop keeps each verified sample's gradient, and the comparison a float64
    copy and its temporaries (a large model's summary asked with ``verify: 64`` would otherwise
    hold 64 whole gradients)."""
    model = parsed.model
    numel = sum(model.params[k].numel() for k in parsed.opts.params)
    per_sample = numel * (torch.finfo(model.dtype).bits // 8 + 16) or 1
    return max(1, (settings.memory_budget_mb << 20) // per_sample)


def _rows_of(value: Any, index: torch.Tensor) -> Any:
    if isinstance(value, dict):
        return {k: _rows_of(v, index) for k, v in value.items()}
    return value.index_select(0, index.to(value.device))


class _Comparison:
    """Each output's largest difference, and the first one beyond the tolerance."""

    def __init__(self, rows: list[int], atol: float, rtol: float) -> None:
        self.rows, self.atol, self.rtol = rows, atol, rtol
        self.diffs: dict[str, float | None] = {}
        self.failure: _Failure | None = None

    @property
    def worst(self) -> float | None:
        """The largest difference (None when one was not finite: a NaN against a number)."""
        values = list(self.diffs.values())
        return None if None in values else max((v for v in values if v is not None), default=0.0)

    def add(self, name: str, got: Any, want: Any, *, per_sample: bool = True,
            of: str = "in the answer", scale: Any = None) -> None:
        """``got`` against ``want``, in ``got``'s dtype and on its device (as the tests compare);
        ``per_sample``: row i is verified sample i; ``scale`` (shaped as ``want``): the size the
        relative tolerance is of, where it is not ``|want|``."""
        scales = scale if isinstance(scale, dict) else {}
        pairs = ([(f"{name}/{k}", got[k], want[k], scales.get(k)) for k in want]
                 if isinstance(want, dict) else [(name, got, want, scale)])
        worst = self.diffs.get(name, 0.0)
        for where, g, w, size in pairs:
            g = g.detach()
            w = w.to(g.device, g.dtype)
            diff = (g - w).abs_()
            size = w.abs() if size is None else size.to(g.device, g.dtype)
            over = ~(diff <= self.atol + self.rtol * size)  # NaN: over
            if bool(over.any()):  # infinities and NaN where both are agree
                same = (g == w) | (g.isnan() & w.isnan())
                over &= ~same
                diff.masked_fill_(same, 0.0)
            top = float(diff.max()) if diff.numel() else 0.0
            if worst is not None:
                worst = None if not math.isfinite(top) else max(worst, top)
            if self.failure is None and bool(over.any()):
                at = None
                if per_sample and over.dim():
                    at = self.rows[int(over.reshape(over.shape[0], -1).any(1).nonzero()[0, 0])]
                self.failure = _Failure(where, at, of, top, self.atol, self.rtol)
        self.diffs[name] = worst


@dataclass(frozen=True)
class _Failure:
    where: str
    sample: int | None
    of: str
    diff: float
    atol: float
    rtol: float

    def __call__(self, report: dict[str, Any]) -> VerificationFailed:
        what = f"{self.where} {self.of}"
        if self.sample is not None:
            what = f"sample {self.sample}'s {what}"
        return VerificationFailed(
            f"verification failed: {what} differs from the per-sample loop by {self.diff:.4g} "
            f"(tolerance {self.atol:g} + {self.rtol:g} x |value|; verified samples "
            f"{report['samples']}). The answer is withheld: it is wrong (a server bug or a "
            "faulty device); retry, and report it with the request or job id",
            output=self.where, sample=self.sample, check=self.of,
            diff=self.diff if math.isfinite(self.diff) else None, verify=report,
        )
