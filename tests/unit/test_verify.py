"""``verify``: the worker's per-sample loop and expectations against the tests' own reference, a
right answer passing, a wrong one caught, and the samples drawn reproducibly.

The reference (:mod:`tests.support.reference`) is independent of the service: its own losses,
its own loop over a copy of the module. The service's verification loop and what it expects of
each output must agree with it; the engine's answers must pass; a fault injected into the
``vmap`` strategy or into the engine's answer (:mod:`tests.support.faults`) must fail.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from psgrad._contract import answer_fields, output
from psgrad._errors import VerificationFailed
from service import engine
from service.config import Settings
from service.engine import Batch, Options
from service.outputs import OUTPUTS
from service.registry import LoadedModel, load_model
from service.strategies.projection import Projection
from service.validate import ParsedRequest
from service.verify import Plan, check, choose, plan
from service.verify.expected import AGGREGATE, PER_SAMPLE, Expected
from service.verify.reference import per_sample_loop, take
from tests.support import faults, reference
from tests.support.batches import SMALL_TRANSFORMER, make_batch

CPU = torch.device("cpu")
CASES = [
    ("simple-cnn", {}, "nll"),
    ("mlp", {"sizes": [6, 5, 3]}, "cross_entropy"),
    ("mlp", {"sizes": [6, 5, 3], "activation": "tanh"}, "mse"),
    ("linear-value", {"dim": 3, "bias": True}, "td0"),
    ("value-mlp", {"sizes": [4, 5]}, "td0"),
    ("value-mlp", {"sizes": [4, 5]}, "mse"),
    ("tiny-transformer", SMALL_TRANSFORMER, "cross_entropy"),
]
IDS = [f"{a}-{loss}" for a, _, loss in CASES]
STATS = ("losses", "norms", "layer_norms", "mean", "variance", "clipped_mean", "dot",
         "cosine_mean", "self_influence", "gns", "layer_gns")
_MODELS: dict[tuple[str, str, torch.dtype], LoadedModel] = {}


def model_for(arch: str, config: dict[str, Any], dtype: torch.dtype = torch.float32
              ) -> LoadedModel:
    key = (arch, repr(sorted(config.items())), dtype)
    if key not in _MODELS:
        _MODELS[key] = load_model(arch, arch, config, device=CPU, dtype=dtype)
    return _MODELS[key]


def outputs_of(loss: str) -> tuple[str, ...]:
    return ("grads", *STATS, *(("td_errors", "updates") if loss == "td0" else ()))


def request(arch: str, config: dict[str, Any], loss: str, n: int = 6, *,
            outputs: tuple[str, ...] | None = None, seed: int = 0,
            dtype: torch.dtype = torch.float32) -> ParsedRequest:
    """A request with per-call weights and a parameter subset (the first and last)."""
    model = model_for(arch, config, dtype)
    names = list(model.params)
    params = tuple(dict.fromkeys([names[0], names[-1]]))
    batch = make_batch(model, n, seed, loss=loss, weights=True)
    batch = _cast(batch, dtype)
    batch.reference = {k: v for k, v in batch.reference.items() if k in params}
    opts = Options(loss=loss, outputs=outputs or outputs_of(loss), params=params,
                   clip_norm=0.5, noise_multiplier=1.0, seed=3,
                   gamma=0.9 if loss == "td0" else 1.0)
    return ParsedRequest(model, opts, batch)


def _cast(batch: Batch, dtype: torch.dtype) -> Batch:
    def cast(t: Any) -> Any:
        if isinstance(t, dict):
            return {k: cast(v) for k, v in t.items()}
        return t.to(dtype) if t is not None and t.is_floating_point() else t

    return replace(batch, **{name: cast(getattr(batch, name)) for name in (
        "inputs", "targets", "next_inputs", "rewards", "dones", "weights", "reference")})


def answer_of(parsed: ParsedRequest, *, fast_stats: bool = True) -> dict[str, Any]:
    return engine.compute(parsed.model, parsed.batch, parsed.opts, fast_stats=fast_stats)[0]


def verified(parsed: ParsedRequest, answer: dict[str, Any], k: int = 3, seed: int = 11,
             **settings: Any) -> dict[str, Any]:
    return check(parsed, answer, Plan(k, seed, "request"), settings=Settings(**settings))


# ----------------------------------------------------------------------------- the reference


@pytest.mark.parametrize(("arch", "config", "loss"), CASES, ids=IDS)
def test_the_loop_is_the_reference_loop(arch: str, config: dict[str, Any], loss: str) -> None:
    parsed = request(arch, config, loss)
    sub = take(parsed.batch, [0, 2, 5])
    got = per_sample_loop(parsed.model, sub, parsed.opts)
    want = reference.loop_of(parsed.model, sub, parsed.opts)
    reference.assert_close(got.grads, want.grads, "grads")
    reference.assert_close(got.losses, want.losses, "losses")
    if loss == "td0":
        assert want.td_errors is not None
        reference.assert_close(got.aux, want.td_errors, "td_errors")


@pytest.mark.parametrize(("arch", "config", "loss"), CASES, ids=IDS)
def test_what_verify_expects_is_what_the_reference_computes(arch: str, config: dict[str, Any],
                                                            loss: str) -> None:
    """Per-sample outputs: the reference's rows; statistics: the reference's over the samples."""
    parsed = request(arch, config, loss)
    sub = take(parsed.batch, [1, 3, 4])
    e = Expected(per_sample_loop(parsed.model, sub, parsed.opts), sub, parsed.opts)
    want = reference.reference(parsed.model, sub, parsed.opts, [sub.size])[0]
    for name in parsed.opts.outputs:
        if name == "self_influence":
            want[name] = want["norms"].pow(2)
        table = PER_SAMPLE if name in PER_SAMPLE else AGGREGATE
        got = table[name](e)
        if output(name).also:  # a noise scale: its fields
            for field in answer_fields([name]):
                reference.assert_close(got[field], want[field], field, atol=1e-6, rtol=1e-5)
            continue
        reference.assert_close(got, want[name], name,
                               atol=1e-6, rtol=1e-5)  # both float64, from the same gradients


def test_every_output_says_how_it_is_verified() -> None:
    assert set(PER_SAMPLE) | set(AGGREGATE) == set(OUTPUTS.names())
    assert not set(PER_SAMPLE) & set(AGGREGATE)


def test_attribution_outputs_are_the_projected_reference() -> None:
    model = model_for("mlp", {"sizes": [6, 5, 3]})
    batch = make_batch(model, 5, 4)
    proj = Projection(16, 2)
    refs = {k: torch.randn(3, *v.shape) for k, v in model.params.items()}
    loop = reference.loop_of(model, batch, Options("cross_entropy", ("grads",),
                                                   tuple(model.params)))
    sketches = sum(proj.project(k, g) for k, g in loop.grads.items())
    wants = reference.attribution(loop, refs)
    for outputs, extra, want in [
        (("projection", "self_influence"), {}, {"projection": sketches,
                                                "self_influence": sketches.pow(2).sum(1)}),
        (("dots",), {"references": refs}, {"dots": wants["dots"]}),
        (("dots",), {"sketches": sketches[:2]}, {"dots": sketches @ sketches[:2].t()}),
    ]:
        b = replace(batch, **extra)
        opts = Options("cross_entropy", outputs, tuple(model.params),
                       projection=proj if "references" not in extra else None,
                       reference_count=3 if outputs == ("dots",) else 0,
                       reference_sketches="sketches" in extra)
        e = Expected(per_sample_loop(model, b, opts), b, opts)
        for name in outputs:
            reference.assert_close(PER_SAMPLE[name](e), want[name], name, atol=1e-5, rtol=1e-5)
        parsed = ParsedRequest(model, opts, b)
        for fast in (True, False):
            report = verified(parsed, answer_of(parsed, fast_stats=fast), k=5)
            assert set(report["checked"]) == set(outputs)


# ----------------------------------------------------------------------------- right answers


@pytest.mark.parametrize("fast", [True, False], ids=["fast_stats", "vmap"])
@pytest.mark.parametrize(("arch", "config", "loss"), CASES, ids=IDS)
def test_engine_answers_pass(arch: str, config: dict[str, Any], loss: str, fast: bool) -> None:
    parsed = request(arch, config, loss)
    report = verified(parsed, answer_of(parsed, fast_stats=fast), fast_stats=fast)
    assert report["samples"] == choose(6, 3, 11) and len(report["samples"]) == 3
    assert report["seed"] == 11 and report["source"] == "request"
    assert report["tolerance"] == {"atol": 3e-3, "rtol": 1e-5}
    assert list(report["checked"]) == list(parsed.opts.outputs)
    assert 0 <= report["max_abs_diff"] <= 3e-3
    assert report["max_abs_diff"] == max(report["checked"].values())
    assert report["ms"] > 0


def test_float64_models_are_held_to_the_float64_tolerance() -> None:
    parsed = request("value-mlp", {"sizes": [4, 5]}, "td0", dtype=torch.float64)
    report = verified(parsed, answer_of(parsed))
    assert report["tolerance"] == {"atol": 1e-9, "rtol": 1e-7}
    assert report["max_abs_diff"] <= 1e-9


def test_merged_jobs_are_verified_on_their_own_samples() -> None:
    """One engine call over two jobs: each job's answer against its own batch."""
    first = request("value-mlp", {"sizes": [4, 5]}, "mse", n=4, seed=1)
    second = replace(first, batch=replace(make_batch(first.model, 3, 2, loss="mse"),
                                          weights=first.batch.weights,
                                          reference=first.batch.reference))
    merged = Batch(inputs=torch.cat([first.batch.inputs, second.batch.inputs]),
                   targets=torch.cat([first.batch.targets, second.batch.targets]),
                   weights=first.batch.weights, reference=first.batch.reference)
    answers = engine.compute(first.model, merged, first.opts, [4, 3])
    for parsed, answer in zip((first, second), answers, strict=True):
        report = verified(parsed, answer, k=8)  # more than the job has: all of them
        assert report["samples"] == list(range(parsed.batch.size))
    with pytest.raises(VerificationFailed):  # the other job's answer is not this one's
        verified(second, answers[0], k=3)


def test_one_sample_statistics_take_two() -> None:
    """variance and cosine_mean are checked on at least two samples (of one: 0 and 1), as
    the noise scale, which one sample does not define."""
    for two in ("variance", "gns", "layer_gns"):
        parsed = request("mlp", {"sizes": [6, 5, 3]}, "cross_entropy", outputs=(two, "norms"))
        assert len(verified(parsed, answer_of(parsed), k=1)["samples"]) == 2, two
    parsed = replace(parsed, opts=replace(parsed.opts, outputs=("mean", "norms")))
    assert len(verified(parsed, answer_of(parsed), k=1)["samples"]) == 1


def test_verified_gradients_stay_within_the_memory_budget() -> None:
    """simple-cnn: 1.2 M parameters, 24 MB a verified sample: 50 MB holds two of them."""
    parsed = request("simple-cnn", {}, "nll", n=8, outputs=("norms",))
    parsed = replace(parsed, opts=replace(parsed.opts, params=tuple(parsed.model.params)))
    answer = answer_of(parsed)
    assert len(verified(parsed, answer, k=8, memory_budget_mb=50)["samples"]) == 2
    assert len(verified(parsed, answer, k=8, memory_budget_mb=1)["samples"]) == 1
    assert len(verified(parsed, answer, k=8)["samples"]) == 8


def test_dp_run_options_are_verified_as_the_run_divides_and_clips() -> None:
    """A DP run's step: the run's divisor and Opacus's norm offset; its CSPRNG noise is off in
    the check (no seed can draw it again)."""
    parsed = request("mlp", {"sizes": [6, 5, 3]}, "cross_entropy", outputs=("clipped_mean",))
    parsed = replace(parsed, opts=replace(parsed.opts, divisor=9.5, norm_offset=1e-6,
                                          secure_noise=True, noise_multiplier=0.0, seed=None,
                                          clip_norm=2.0))
    report = verified(parsed, answer_of(parsed), k=4)
    assert report["max_abs_diff"] <= 3e-3
    wrong = replace(parsed, opts=replace(parsed.opts, divisor=None))  # the engine's own divisor
    with pytest.raises(VerificationFailed):
        verified(parsed, answer_of(wrong), k=4)


# ----------------------------------------------------------------------------- wrong answers


@pytest.mark.parametrize("outputs", [("grads",), ("norms",), ("losses", "mean"), ("variance",),
                                     ("clipped_mean",), ("cosine_mean",), ("dot",), ("gns",),
                                     ("layer_gns",)])
def test_a_wrong_gradient_in_the_strategy_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                    outputs: tuple[str, ...]) -> None:
    parsed = request("value-mlp", {"sizes": [4, 5]}, "mse", outputs=outputs)
    parsed.batch.inputs[4, 0] = faults.MARKER
    faults.wrong_gradient(monkeypatch, delta=0.5)  # a statistic of 6 samples dilutes it
    answer = answer_of(parsed, fast_stats=False)
    with pytest.raises(VerificationFailed) as caught:
        verified(parsed, answer, k=6, fast_stats=False)
    err = caught.value
    assert err.code == "verification_failed" and err.status == 500
    assert err.details["output"].split("/")[0] in outputs
    assert err.details["verify"]["samples"] == list(range(6))
    assert err.details["diff"] > 3e-3
    if outputs[0] in ("grads", "norms", "dot"):  # per sample: the sample is named
        assert err.details["sample"] == 4
        assert "sample 4's" in err.message
    assert "withheld" in err.message


@pytest.mark.parametrize("name", ["mean", "variance", "clipped_mean", "cosine_mean",
                                  "gns_trace", "layer_gns_grad_sq"])
def test_a_wrong_statistic_in_the_answer_alone_is_caught(name: str) -> None:
    """The engine is right, the answer is not (as a merge or an assembly gone wrong would make
    it): the check of the answer against the loop's samples and the engine's others catches it,
    noise included (clipped_mean is noised here, the seed drawn again)."""
    asked = name.removesuffix("_trace").removesuffix("_grad_sq")  # a noise scale's estimate
    parsed = request("value-mlp", {"sizes": [4, 5]}, "mse", outputs=(asked,))
    answer = answer_of(parsed)
    verified(parsed, answer, k=2)  # right as it is
    if name == "gns_trace":
        answer[name] = answer[name] + 0.01
    elif name == "cosine_mean":
        answer[name] = answer[name].clone()
        answer[name][choose(6, 2, 11)[1]] += 0.01
    else:
        answer[name] = {k: v + 0.01 for k, v in answer[name].items()}
    with pytest.raises(VerificationFailed) as caught:
        verified(parsed, answer, k=2)
    assert caught.value.details["check"] == "in the answer"
    assert "in the answer differs from the per-sample loop" in caught.value.message


def test_a_dp_runs_noise_is_left_out_of_the_answers_check() -> None:
    """CSPRNG noise cannot be drawn again: clipped_mean is then checked on the segment only."""
    parsed = request("mlp", {"sizes": [6, 5, 3]}, "cross_entropy", outputs=("clipped_mean",))
    parsed = replace(parsed, opts=replace(parsed.opts, secure_noise=True, seed=None, divisor=6.0))
    assert verified(parsed, answer_of(parsed), k=2)["max_abs_diff"] <= 3e-3


def test_a_wrong_sample_not_drawn_goes_unseen(monkeypatch: pytest.MonkeyPatch) -> None:
    """verify samples: only the drawn samples are checked (the report names them)."""
    parsed = request("value-mlp", {"sizes": [4, 5]}, "mse", outputs=("grads",))
    rows = choose(6, 2, 11)
    wrong = next(i for i in range(6) if i not in rows)
    parsed.batch.inputs[wrong, 0] = faults.MARKER
    faults.wrong_gradient(monkeypatch)
    answer = answer_of(parsed, fast_stats=False)
    assert verified(parsed, answer, k=2, fast_stats=False)["samples"] == rows
    parsed.batch.inputs[rows[1], 0] = faults.MARKER
    with pytest.raises(VerificationFailed):
        verified(parsed, answer_of(parsed, fast_stats=False), k=2, fast_stats=False)


@pytest.mark.parametrize("name", ["grads", "layer_norms", "losses", "mean", "variance",
                                  "clipped_mean", "self_influence"])
def test_a_wrong_output_of_fast_statistics_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                     name: str) -> None:
    parsed = request("mlp", {"sizes": [6, 5, 3]}, "cross_entropy", outputs=(name,))
    faults.wrong_output(monkeypatch, name, row=2)
    answer = engine.compute(parsed.model, parsed.batch, parsed.opts)[0]
    assert answer["meta"]["route"] == "fast_stats"
    with pytest.raises(VerificationFailed) as caught:
        verified(parsed, answer, k=6)
    assert caught.value.details["output"].split("/")[0] == name


def test_a_wrong_td0_update_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = request("linear-value", {"dim": 3, "bias": True}, "td0",
                     outputs=("updates", "td_errors"))
    faults.wrong_output(monkeypatch, "td_errors", row=1)
    with pytest.raises(VerificationFailed) as caught:
        verified(parsed, engine.compute(parsed.model, parsed.batch, parsed.opts)[0], k=6)
    assert caught.value.details == {**caught.value.details, "output": "td_errors", "sample": 1}


# ----------------------------------------------------------------------------- the draw


def test_samples_are_seeded_and_reproducible() -> None:
    assert choose(100, 5, 1) == choose(100, 5, 1) == sorted(set(choose(100, 5, 1)))
    assert choose(100, 5, 1) != choose(100, 5, 2)
    assert choose(3, 64, 0) == [0, 1, 2]
    parsed = request("mlp", {"sizes": [6, 5, 3]}, "cross_entropy")
    off = Settings()
    assert plan("job-a", parsed, off) is None  # not asked, no fraction
    asked = replace(parsed, verify=2)
    a, b = plan("job-a", asked, off), plan("job-b", asked, off)
    assert a is not None and b is not None
    assert a == plan("job-a", asked, off) and a.seed != b.seed  # from the job id
    assert (a.k, a.source) == (2, "request")
    seeded = plan("job-a", replace(asked, verify_seed=5), off)
    assert seeded == Plan(2, 5, "request")


def test_the_operator_fraction_draws_jobs_by_id() -> None:
    parsed = request("mlp", {"sizes": [6, 5, 3]}, "cross_entropy")
    every = Settings(verify_fraction=1.0, verify_samples=3)
    got = plan("job-a", parsed, every)
    assert got is not None and (got.k, got.source) == (3, "fraction")
    some = Settings(verify_fraction=0.25)
    drawn = [plan(f"job-{i}", parsed, some) is not None for i in range(2000)]
    assert 0.2 < sum(drawn) / len(drawn) < 0.3
    assert drawn == [plan(f"job-{i}", parsed, some) is not None for i in range(2000)]
    asked = plan("job-a", replace(parsed, verify=4), Settings(verify_fraction=1.0))
    assert asked is not None and (asked.k, asked.source) == (4, "request")


def test_settings_bound_the_fraction_and_samples() -> None:
    for bad in ({"verify_fraction": 1.5}, {"verify_fraction": -0.1}, {"verify_samples": 0},
                {"verify_samples": 65}):
        with pytest.raises(ValueError):
            Settings(**bad)


@pytest.mark.parametrize("field", ["kfac_inputs", "kfac_grads", "kfac_tokens"])
def test_kfac_factors_are_verified_one_sample_at_a_time(field: str) -> None:
    """The engine takes the batch's factors at once; verify recomputes the verified samples'
    one at a time with plain autograd and catches a wrong field in the answer."""
    parsed = request("tiny-transformer", SMALL_TRANSFORMER, "cross_entropy",
                     outputs=("kfac_inputs",))
    parsed = replace(parsed, opts=replace(parsed.opts, params=tuple(parsed.model.params)))
    answer = answer_of(parsed)
    report = verified(parsed, answer, k=2)  # right as it is
    assert report["checked"]["kfac_inputs"] is not None
    answer[field] = {k: v * 1.01 + 0.01 for k, v in answer[field].items()}
    with pytest.raises(VerificationFailed) as caught:
        verified(parsed, answer, k=2)
    assert caught.value.details["check"] == "in the answer"
