"""Splitting a batch into requests the server accepts, and combining the answers exactly.

The plan is written once, without I/O, as a generator: it yields the fields of each request and
receives the decoded answer (or, through ``throw``, the error), so the sync and the async client
drive the same code (``BaseClient._chunked``, one of the client's steps).

The request's per-sample fields (``inputs``, each named input, ``targets``, ``mask``, ...) are
sliced, and each output is combined as the request contract declares it
(:data:`psgrad._contract.OUTPUTS`, its ``combine``). Over chunks of sizes n_1 .. n_k
(B = sum n_c):

- per-sample outputs (``concat``: ``grads``, ``losses``, ``norms``, ``layer_norms``, ``dot``,
  ``td_errors``, ``updates``, ``projection``, ``dots``, ...) are concatenated in order.
- ``mean`` is the n-weighted mean of the chunk means, and ``variance`` is merged with Chan's
  parallel formula (M2 = M2_a + M2_b + delta^2 n_a n_b / n, with M2_c = variance_c * n_c), in
  float64; a chunk's ``mean`` is requested alongside ``variance`` for that. Every other output
  that combines as a ``mean`` (``kfac_inputs`` and its fields) is n-weighted the same way.
- ``clipped_mean``: each chunk is asked for its noiseless clipped mean (``noise_multiplier=0``),
  the clipped sums (mean_c * n_c) are added, then the noise N(0, (noise_multiplier * clip_norm)^2)
  is drawn once per element by the client with ``numpy.random.default_rng(seed)`` and the total
  divided by B. The client does this even for a batch that fits in one request, so a seeded
  result does not depend on how the batch was split (the server's own noise, drawn with torch's
  generator, is never used by the SDK). The seed used is in ``result.meta["seed"]``.
- ``gns`` and ``layer_gns`` (the gradient noise scale): each chunk is asked for ``norms``
  (``layer_norms``) and ``mean`` instead; over the whole batch, in float64,
  ``gns_trace = (sum_i |g_i|^2 - B |mean|^2) / (B - 1)``, ``gns_grad_sq = |mean|^2 -
  gns_trace / B`` and ``gns`` their ratio (0 where ``gns_grad_sq`` is), as the server defines
  them (per parameter for ``layer_gns``).
- ``cosine_mean`` needs the mean gradient of the whole batch, which no chunk knows. Two passes:
  the first collects every chunk's ``mean`` (and ``norms``) with the other outputs; the second
  asks each chunk for ``dot`` with ``reference`` = the combined mean; then
  cosine_i = dot_i / (norm_i * |mean|), 0 where a norm is 0, as the server defines it. A batch
  that fits in one request is computed by the server in one pass.

A request with ``dp_run`` is one DP-SGD step: it is sent whole, as one request, with the
server's noise.

With ``verify`` each request is verified on its own samples; ``meta["verify"]`` of a split batch
merges their reports (:func:`merge_verify`).

A 413 answer for a chunk of more than one sample shrinks the chunk (to the ``limit`` the server
names when it is a batch-size limit, else half) and the plan starts again; the limit learned is
returned so the client remembers it.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from psgrad._arrays import Fields, cast_floats
from psgrad._contract import OUTPUTS, SAMPLE_FIELDS, answer_fields
from psgrad._errors import TooLarge

Plan = Generator[Fields, Fields, "PlanResult"]
Steps = Generator[Fields, Fields, Fields]

# What is sliced per sample, and how each output combines: the request contract's.
COMBINE = {o.name: o.combine for o in OUTPUTS}
FIELD_OF = {field: o.name for o in OUTPUTS for field in o.also}  # a field to its output
CONCAT = tuple(name for name, how in COMBINE.items() if how == "concat")
NOT_OUTPUTS = ("model", "batch_size", "loss", "timing", "meta")


@dataclass
class PlanResult:
    fields: Fields  # model, batch_size, loss, each output, timing, meta
    limit: int | None  # the batch-size limit learned from a 413, if any


def concat(parts: list[Any]) -> Any:
    """Concatenate per-sample outputs: arrays, or dicts of arrays keyed by parameter."""
    if isinstance(parts[0], Mapping):
        return {k: concat([p[k] for p in parts]) for k in parts[0]}
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def merge_moments(
    counts: list[int],
    means: list[Mapping[str, np.ndarray]],
    variances: list[Mapping[str, np.ndarray]] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Combine per-chunk means (and population variances) exactly, with Chan's formula."""
    mean_out: dict[str, np.ndarray] = {}
    var_out: dict[str, np.ndarray] = {}
    for k in means[0]:
        dtype = means[0][k].dtype
        n_a = counts[0]
        mean = means[0][k].astype(np.float64)
        m2 = variances[0][k].astype(np.float64) * n_a if variances else None
        for n_b, mean_c, i in zip(counts[1:], means[1:], range(1, len(counts)), strict=True):
            mean_b = mean_c[k].astype(np.float64)
            n = n_a + n_b
            delta = mean_b - mean
            mean = mean + delta * (n_b / n)
            if variances is not None and m2 is not None:
                m2_b = variances[i][k].astype(np.float64) * n_b
                m2 = m2 + m2_b + delta**2 * (n_a * n_b / n)
            n_a = n
        mean_out[k] = mean.astype(dtype)
        if m2 is not None:
            var_out[k] = (m2 / n_a).astype(dtype)
    return mean_out, var_out


def clipped_sum(
    counts: list[int], clipped_means: list[Mapping[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """The sum over all samples of the clipped gradients, from noiseless clipped means."""
    return {
        k: sum(
            (cm[k].astype(np.float64) * n for n, cm in zip(counts, clipped_means, strict=True)),
            start=np.zeros(clipped_means[0][k].shape),
        )
        for k in clipped_means[0]
    }


def add_noise(
    sums: Mapping[str, np.ndarray],
    size: int,
    *,
    sigma: float,
    seed: int,
    dtype: Mapping[str, np.dtype[Any]],
) -> dict[str, np.ndarray]:
    """(sum + N(0, sigma^2) per element) / B, the noise drawn once, parameters sorted by name."""
    rng = np.random.default_rng(seed)
    out = {}
    for k in sorted(sums):  # a fixed order, whatever order the answer listed them in
        noise = rng.normal(0.0, sigma, size=sums[k].shape) if sigma > 0 else 0.0
        out[k] = ((sums[k] + noise) / size).astype(dtype[k])
    return {k: out[k] for k in sums}


def cosine(dot: np.ndarray, norms: np.ndarray, mean: Mapping[str, np.ndarray]) -> np.ndarray:
    """cos_i = dot_i / (|g_i| |mean|), 0 where either norm is 0 (the server's convention)."""
    mean_norm = math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in mean.values()))
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = dot.astype(np.float64) / (norms.astype(np.float64) * mean_norm)
    return np.nan_to_num(cos, nan=0.0, posinf=0.0, neginf=0.0).astype(dot.dtype)


def merge_verify(answers: list[tuple[int, Fields]]) -> dict[str, Any] | None:
    """One ``meta.verify`` for a batch split into requests (each verified on its own samples):
    the samples as indices into the whole batch, each output's largest difference (None: one
    was not finite), the requests' seeds in order, their time summed."""
    reports = [(start, (a.get("meta") or {}).get("verify")) for start, a in answers]
    found = [(start, r) for start, r in reports if isinstance(r, dict)]
    if not found:
        return None

    def worst(values: list[Any]) -> float | None:
        return None if None in values else max(values, default=0.0)

    checked: dict[str, list[Any]] = {}
    for _, r in found:
        for name, diff in (r.get("checked") or {}).items():
            checked.setdefault(name, []).append(diff)
    return {
        "samples": sorted({start + int(i) for start, r in found for i in r.get("samples", ())}),
        "seeds": [r.get("seed") for _, r in found],
        "source": found[0][1].get("source"),
        "max_abs_diff": worst([r.get("max_abs_diff") for _, r in found]),
        "tolerance": found[0][1].get("tolerance"),
        "checked": {name: worst(diffs) for name, diffs in checked.items()},
        "ms": round(sum(float(r.get("ms") or 0.0) for _, r in found), 3),
    }


def _slice(fields: Fields, start: int, stop: int) -> Fields:
    """The per-sample fields (named inputs each) cut to samples [start, stop)."""
    return {k: _rows(v, start, stop) if k in SAMPLE_FIELDS else v for k, v in fields.items()}


def _rows(value: Any, start: int, stop: int) -> Any:
    if isinstance(value, Mapping):
        return {k: _rows(v, start, stop) for k, v in value.items()}
    return value[start:stop] if isinstance(value, np.ndarray) else value


def batch_size(fields: Fields) -> int:
    """B: the first dimension of ``inputs`` (of its first named input when it has several)."""
    inputs = fields.get("inputs")
    if isinstance(inputs, Mapping):
        inputs = next(iter(inputs.values()), None)
    return int(inputs.shape[0]) if isinstance(inputs, np.ndarray) and inputs.ndim else 0


def _batch_limit(exc: TooLarge, sent: int) -> int | None:
    """The chunk size to try after a 413 for ``sent`` samples, or None if shrinking cannot help."""
    if sent <= 1:
        return None
    limit, size = exc.details.get("limit"), exc.details.get("size")
    if isinstance(limit, int) and size == sent and "field" not in exc.details and 0 < limit < sent:
        return limit  # the batch-size limit itself
    return sent // 2  # a body, element or result-size limit: fewer samples help


def grads_plan(
    fields: Fields, *, limit: int | None, progress: Callable[[int, int], None] | None = None
) -> Plan:
    """Run one gradients request as one or more requests; see the module docstring."""
    size = batch_size(fields)
    wanted = list(dict.fromkeys(fields.get("outputs") or ["grads"]))
    if fields.get("dp_run") is not None:  # a DP-SGD step: one request, the server's noise
        answer = yield fields
        if progress:
            progress(size, size)
        return PlanResult(answer, None)
    noise = None
    if "clipped_mean" in wanted:
        sigma = float(fields.get("noise_multiplier") or 0.0) * float(fields.get("clip_norm") or 0)
        seed = fields.get("seed")
        noise = (sigma, secrets.randbits(63) if seed is None else int(seed))
        fields = {k: v for k, v in fields.items() if k != "seed"} | {"noise_multiplier": 0.0}
    learned = None
    while True:
        chunk = size if limit is None else max(1, min(limit, size))
        try:
            result = yield from _run(fields, wanted, size, chunk, progress)
            break
        except TooLarge as exc:
            new = _batch_limit(exc, chunk)
            if new is None:
                raise
            limit = learned = new
    if noise is not None:
        sigma, seed = noise
        cm = result["clipped_mean"]
        sums = {k: v.astype(np.float64) * size for k, v in cm.items()}
        result["clipped_mean"] = add_noise(
            sums, size, sigma=sigma, seed=seed, dtype={k: v.dtype for k, v in cm.items()}
        )
        result["meta"]["seed"] = seed
    narrow = fields.get("answer_dtype")
    if chunk < size and narrow in ("float16", "bfloat16"):  # merged from float32 chunks: the
        # outputs rounded once (bfloat16's values held in float32, as its answers are read)
        result.update(cast_floats({k: v for k, v in result.items() if k not in NOT_OUTPUTS},
                                  narrow))
    return PlanResult(result, learned)


def _run(
    fields: Fields,
    wanted: list[str],
    size: int,
    chunk: int,
    progress: Callable[[int, int], None] | None,
) -> Steps:
    if chunk >= size:  # one request: the server computes every output itself
        answer = yield {**fields, "outputs": wanted}
        if progress:
            progress(size, size)
        return _ordered(_combine([answer], [size], wanted, [answer]), wanted)
    # the chunks in float32, merged in float64 and rounded once at the end (grads_plan): a
    # merge of narrow chunks rounds each (gns's sum|g|^2 - B|mean|^2 cancels: 75% off)
    fields = {k: v for k, v in fields.items() if k != "answer_dtype"}
    two_pass = "cosine_mean" in wanted
    noisy = [o for o in wanted if COMBINE[o] == "gns"]
    first = [o for o in wanted if o != "cosine_mean" and o not in noisy]
    if "variance" in wanted or two_pass or noisy:
        first.append("mean")
    if two_pass or "gns" in wanted:
        first.append("norms")
    if "layer_gns" in wanted:
        first.append("layer_norms")
    first = list(dict.fromkeys(first))
    total = size * (2 if two_pass else 1)
    bounds = [(a, min(size, a + chunk)) for a in range(0, size, chunk)]
    counts = [b - a for a, b in bounds]
    parts: list[Fields] = []
    for a, b in bounds:
        part = yield {**_slice(fields, a, b), "outputs": first}
        parts.append(part)
        # Pin the version the first chunk used, so new weights registered meanwhile never mix.
        fields = {**fields, "model": part.get("model", fields["model"])}
        if progress:
            progress(b, total)
    answers = list(parts)
    starts = [a for a, _ in bounds]
    result = _combine(parts, counts, first, answers)
    for name in noisy:
        result.update(noise_scale(name, result, size))
    if two_pass:
        mean = result["mean"]
        second = {**fields, "outputs": ["dot"], "reference": mean}
        dots = []
        for a, b in bounds:
            answer = yield _slice(second, a, b)
            answers.append(answer)
            dots.append(answer["dot"])
            if progress:
                progress(size + b, total)
        result["cosine_mean"] = cosine(concat(dots), result["norms"], mean)
        result["timing"], result["meta"]["requests"] = _timing(answers), len(answers)
        starts += starts
    verified = merge_verify(list(zip(starts, answers, strict=True)))
    if verified is not None:
        result["meta"]["verify"] = verified
    return _ordered(result, wanted)


def _ordered(result: Fields, wanted: list[str]) -> Fields:
    """The outputs in the order they were asked for, and nothing that was not."""
    return {k: result[k] for k in (*NOT_OUTPUTS, *answer_fields(wanted)) if k in result}


def noise_scale(name: str, combined: Fields, size: int) -> Fields:
    """``gns`` (or ``layer_gns``) and its two estimates from a batch's combined ``norms`` (or
    ``layer_norms``) and ``mean``, in float64, answered in the mean's dtype."""
    mean = combined["mean"]
    dtype = next(iter(mean.values())).dtype
    mean_sq = {k: float(np.sum(v.astype(np.float64) ** 2)) for k, v in mean.items()}
    if name == "gns":
        sq = {"": float(np.sum(combined["norms"].astype(np.float64) ** 2))}
        mean_sq = {"": sum(mean_sq.values())}
    else:
        sq = {k: float(np.sum(v.astype(np.float64) ** 2))
              for k, v in combined["layer_norms"].items()}
    fields: list[dict[str, Any]] = [{}, {}, {}]
    for k, s in sq.items():
        trace = (s - size * mean_sq[k]) / (size - 1)
        grad_sq = mean_sq[k] - trace / size
        ratio = trace / grad_sq if grad_sq != 0 and math.isfinite(trace / grad_sq) else 0.0
        for into, value in zip(fields, (ratio, trace, grad_sq), strict=True):
            into[k] = np.asarray(value, dtype=dtype)
    values = [f[""] if name == "gns" else f for f in fields]
    return dict(zip(answer_fields([name]), values, strict=True))


def _combine(
    parts: list[Fields], counts: list[int], outputs: list[str], answers: list[Fields]
) -> Fields:
    first = parts[0]
    out: Fields = {k: first[k] for k in ("model", "loss") if k in first}
    out["batch_size"] = sum(counts)
    if len(parts) == 1:
        out.update({k: first[k] for k in answer_fields(outputs) if k in first})
    else:
        for name in outputs:
            if COMBINE.get(name) == "concat":
                out[name] = concat([p[name] for p in parts])
        if "mean" in outputs:
            variances = [p["variance"] for p in parts] if "variance" in outputs else None
            out["mean"], var = merge_moments(counts, [p["mean"] for p in parts], variances)
            if variances is not None:
                out["variance"] = var
        for name in answer_fields([o for o in outputs if o != "mean"]):
            if COMBINE.get(name, COMBINE.get(FIELD_OF.get(name, ""))) == "mean":
                out[name] = merge_moments(counts, [p[name] for p in parts])[0]
        if "clipped_mean" in outputs:
            cms = [p["clipped_mean"] for p in parts]
            sums = clipped_sum(counts, cms)
            out["clipped_mean"] = {
                k: (v / out["batch_size"]).astype(cms[0][k].dtype) for k, v in sums.items()
            }
    out["timing"] = _timing(answers)
    out["meta"] = {**(first.get("meta") or {}), "requests": len(answers)}
    return out


def _timing(answers: list[Fields]) -> dict[str, float]:
    """Server-side times summed over the requests (the time the batch cost the server)."""
    timing: dict[str, float] = {}
    for p in answers:
        for k, v in (p.get("timing") or {}).items():
            if isinstance(v, (int, float)):
                timing[k] = timing.get(k, 0.0) + float(v)
    return timing
