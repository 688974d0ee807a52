"""The engine against the obviously correct reference, output by output, for every zoo model.

The reference (:mod:`tests.support.reference`) runs each sample alone (batch of one) through a
plain copy of the module with ``torch.autograd.grad`` and the loss written out with
``torch.nn.functional`` (TD(0): the target built by hand with the next value detached); every
statistic is then computed in float64 from the stacked per-sample gradients. The engine is
called the way the worker calls it: several jobs in one call (``segments``), memory budgets that
force several chunks, per-call weights, parameter subsets, and with and without the
fast-statistics path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from service import engine
from service.engine import Batch, Options
from service.outputs import OUTPUTS
from service.registry import LoadedModel, load_model
from tests.support.batches import SMALL_TRANSFORMER
from tests.support.reference import ATTRIBUTION, reference

CPU = torch.device("cpu")
TOL = {torch.float32: {"atol": 3e-3, "rtol": 1e-5}, torch.float64: {"atol": 1e-9, "rtol": 1e-7}}
# Two computations of the same numbers in a different batch layout (one call vs one per job).
SAME = {torch.float32: {"atol": 1e-5, "rtol": 1e-4}, torch.float64: {"atol": 1e-12, "rtol": 1e-10}}
# Every registered output: the reference below must know each of them. The noise scales, which
# one sample does not define and this test's jobs of one sample would meet, are held to the loop
# with their own tolerance, in segments, by test_fast_stats.py's check (fast and vmap alike).
COMMON = tuple(name for name, out in OUTPUTS.items()
               if not out.td0_only and name not in ATTRIBUTION and not out.also)
TD0_ONLY = tuple(name for name, out in OUTPUTS.items() if out.td0_only)
FEW = settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# (architecture, small config, loss): every zoo family with each loss it accepts.
CASES = [
    ("simple-cnn", {}, "nll"),  # the tutorial's CNN: it has only its real default size
    ("mlp", {"sizes": [6, 5, 3]}, "cross_entropy"),
    ("mlp", {"sizes": [6, 5, 3], "activation": "tanh"}, "mse"),
    ("linear-value", {"dim": 3, "bias": True}, "td0"),
    ("linear-value", {"dim": 3, "bias": True}, "mse"),
    ("value-mlp", {"sizes": [4, 5]}, "td0"),
    ("value-mlp", {"sizes": [4, 5]}, "mse"),
    ("tiny-transformer", SMALL_TRANSFORMER, "cross_entropy"),
    ("simple-cnn", {}, "margin"),  # TRAK's output function, on every classifier
    ("mlp", {"sizes": [6, 5, 3]}, "margin"),
    ("tiny-transformer", SMALL_TRANSFORMER, "margin"),
]
_MODELS: dict[tuple[str, str, torch.dtype], LoadedModel] = {}


def model_for(arch: str, config: dict[str, Any], dtype: torch.dtype = torch.float32) -> LoadedModel:
    key = (arch, repr(sorted(config.items())), dtype)
    if key not in _MODELS:
        _MODELS[key] = load_model(arch, arch, config, device=CPU, dtype=dtype)
    return _MODELS[key]


def test_every_zoo_family_and_loss_is_covered() -> None:
    from models import ZOO

    covered = {(arch, loss) for arch, _, loss in CASES}
    for name, family in ZOO.items():
        if not family.standalone:
            continue  # `sequential` is built only from a registered spec
        for loss in family.loss_info(family.config())[1]:
            assert (name, loss) in covered, f"{name} with {loss} is not tested"


# ----------------------------------------------------------------------------- the reference


def expected(
    model: LoadedModel, batch: Batch, opts: Options, segments: list[int]
) -> list[dict[str, Any]]:
    """Every output per job from the per-sample loop, in float64 numpy."""
    wants = reference(model, batch, opts, segments)
    for name in opts.outputs:
        assert name in wants[0], f"no reference for output {name!r}: add one to the reference"
    return [to_numpy(want) for want in wants]


def to_numpy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: to_numpy(v) for k, v in value.items()}
    return value.detach().double().numpy()


def assert_close(got: Any, want: Any, dtype: torch.dtype, what: str, tol: Any = TOL) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{what}: keys differ"
        for k in want:
            assert_close(got[k], want[k], dtype, f"{what}[{k}]", tol)
        return
    assert isinstance(got, torch.Tensor), f"{what}: not a tensor"
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}"
    actual = got.detach().double().numpy()
    assert actual.shape == np.shape(want), f"{what}: shape {actual.shape} != {np.shape(want)}"
    np.testing.assert_allclose(actual, want, err_msg=what, **tol[dtype])


# ----------------------------------------------------------------------------- batches


def make_batch(
    model: LoadedModel, loss: str, n: int, seed: int, *, weights: tuple[str, ...] = ()
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    dtype = model.dtype
    spec = model.input

    def states() -> torch.Tensor:
        if spec.dtype == "int64":
            return torch.randint(0, spec.high or 2, (n, *spec.shape), generator=gen)
        return torch.randn((n, *spec.shape), generator=gen, dtype=dtype)

    batch = Batch(inputs=states())
    if loss == "td0":
        batch.next_inputs = states()
        batch.rewards = torch.randn(n, generator=gen, dtype=dtype)
        batch.dones = (torch.rand(n, generator=gen) < 0.3).to(dtype)
    elif loss == "mse":
        batch.targets = torch.randn((n, *model.output_shape), generator=gen, dtype=dtype)
    else:
        batch.targets = torch.randint(0, model.output_shape[-1], (n,), generator=gen)
    batch.weights = {
        k: model.params[k] + 0.1 * torch.randn(model.params[k].shape, generator=gen, dtype=dtype)
        for k in weights
    }
    batch.reference = {
        k: torch.randn(v.shape, generator=gen, dtype=dtype) for k, v in model.params.items()
    }
    return batch


def concat(batches: list[Batch]) -> Batch:
    first = batches[0]
    out = Batch(
        inputs=torch.cat([b.inputs for b in batches]),
        weights=first.weights,
        reference=first.reference,
    )
    for name in ("targets", "next_inputs", "rewards", "dones"):
        if getattr(first, name) is not None:
            setattr(out, name, torch.cat([getattr(b, name) for b in batches]))
    return out


def budget_for(model: LoadedModel, opts: Options, chunk: int) -> int:
    """A memory budget for which the engine runs ``chunk`` samples per vmap call."""
    big = 1 << 40
    keep = bool(engine.PER_SAMPLE_GRADS & set(opts.outputs))
    per_sample = big // engine.chunk_size(model, opts.params, 1 << 62, big, keep=keep)
    return chunk * per_sample + per_sample // 2


def outputs_for(loss: str) -> tuple[str, ...]:
    return COMMON + TD0_ONLY if loss == "td0" else COMMON


# ----------------------------------------------------------------------------- properties


@st.composite
def requests(
    draw: st.DrawFn, arch: str, config: dict[str, Any], loss: str, dtype: torch.dtype
) -> dict[str, Any]:
    model = model_for(arch, config, dtype)
    names = list(model.params)
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
    every = draw(st.booleans())
    params = tuple(names) if every else tuple(n for n in names if n in chosen)
    weighted = draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names)))
    segments = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    available = outputs_for(loss)
    outputs = draw(
        st.one_of(st.just(available), st.lists(st.sampled_from(available), min_size=1, unique=True))
    )
    return {
        "params": params,
        "weights": tuple(n for n in names if n in weighted),
        "segments": segments,
        "outputs": tuple(outputs),
        "chunk": draw(st.sampled_from([None, 1, 2, 3])),
        "gamma": draw(st.sampled_from([1.0, 0.9, 0.0])),
        "clip": draw(st.sampled_from([0.05, 1.0, 100.0])),
        "fast": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def check(
    arch: str, config: dict[str, Any], loss: str, dtype: torch.dtype, req: dict[str, Any]
) -> None:
    """One engine call over several jobs == the reference per job == one engine call per job."""
    model = model_for(arch, config, dtype)
    opts = Options(
        loss=loss,
        outputs=req["outputs"],
        params=req["params"],
        clip_norm=req["clip"],
        gamma=req["gamma"] if loss == "td0" else 1.0,
    )
    jobs = [
        make_batch(model, loss, n, req["seed"] + j, weights=req["weights"])
        for j, n in enumerate(req["segments"])
    ]
    for job in jobs[1:]:  # jobs merged into one call share their weights and reference
        job.weights, job.reference = jobs[0].weights, jobs[0].reference
    merged = concat(jobs)
    budget = (1 << 30) if req["chunk"] is None else budget_for(model, opts, req["chunk"])
    answer = engine.compute(
        model, merged, opts, req["segments"], budget_bytes=budget, fast_stats=req["fast"]
    )
    assert len(answer) == len(jobs)
    if answer[0]["meta"].get("route") != "fast_stats":
        want_chunk = merged.size if req["chunk"] is None else min(req["chunk"], merged.size)
        assert answer[0]["meta"]["chunk_size"] == want_chunk
    wants = expected(model, merged, opts, req["segments"])
    for s, (job, got, want) in enumerate(zip(jobs, answer, wants, strict=True)):
        assert list(got) == [*opts.outputs, "meta"]
        for name in opts.outputs:
            assert_close(got[name], want[name], dtype, f"segment {s} {name}")
        alone = engine.compute(model, job, opts, budget_bytes=budget, fast_stats=req["fast"])[0]
        for name in opts.outputs:
            assert_close(got[name], to_numpy(alone[name]), dtype, f"segment {s} {name} alone", SAME)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(
    ("arch", "config", "loss"), CASES, ids=[f"{a}-{loss}" for a, _, loss in CASES]
)
def test_engine_equals_per_sample_loop(
    arch: str, config: dict[str, Any], loss: str, dtype: torch.dtype
) -> None:
    @FEW
    @given(req=requests(arch, config, loss, dtype))
    @example(
        req={
            "params": (),
            "weights": (),
            "segments": [1],
            "outputs": (),
            "chunk": None,
            "gamma": 1.0,
            "clip": 1.0,
            "fast": False,
            "seed": 0,
        }
    )
    def run(req: dict[str, Any]) -> None:
        model = model_for(arch, config, dtype)
        req = {
            **req,
            "params": req["params"] or tuple(model.params),
            "outputs": req["outputs"] or outputs_for(loss),
        }
        check(arch, config, loss, dtype, req)

    run()


@pytest.mark.parametrize(
    ("arch", "config", "loss"),
    [CASES[1], CASES[5], CASES[7]],
    ids=["mlp", "value-mlp-td0", "tiny-transformer"],
)
@pytest.mark.parametrize("chunk", [1, 2])
@pytest.mark.parametrize("keep", [True, False], ids=["with-grads", "summaries"])
def test_small_budgets_give_the_one_chunk_answer(
    arch: str, config: dict[str, Any], loss: str, chunk: int, keep: bool
) -> None:
    """Chunks that cut across jobs change no number: the kept gradients are copied into one
    answer, and cosine_mean takes them (with grads) or a second pass (summaries only)."""
    model = model_for(arch, config)
    outputs = tuple(o for o in outputs_for(loss) if keep or o not in engine.PER_SAMPLE_GRADS)
    opts = Options(loss=loss, outputs=outputs, params=tuple(model.params), clip_norm=0.5, gamma=0.9)
    batch = concat([make_batch(model, loss, n, 7 + j) for j, n in enumerate([3, 1, 3])])
    budget = budget_for(model, opts, chunk)
    whole = engine.compute(model, batch, opts, [3, 1, 3], fast_stats=False)
    parts = engine.compute(model, batch, opts, [3, 1, 3], budget_bytes=budget, fast_stats=False)
    assert whole[0]["meta"]["chunk_size"] == batch.size
    assert parts[0]["meta"]["chunk_size"] == chunk
    for s, (w, p) in enumerate(zip(whole, parts, strict=True)):
        for name in opts.outputs:
            assert_close(p[name], to_numpy(w[name]), model.dtype, f"segment {s} {name}", SAME)


def clipped(
    model: LoadedModel, batch: Batch, *, noise: float, seed: int | None, clip: float = 0.5
) -> tuple[dict[str, torch.Tensor], Any]:
    opts = Options(
        loss="cross_entropy",
        outputs=("clipped_mean",),
        params=tuple(model.params),
        clip_norm=clip,
        noise_multiplier=noise,
        seed=seed,
    )
    out = engine.compute(model, batch, opts, fast_stats=False)[0]
    return out["clipped_mean"], out["meta"].get("seed")


def test_clipped_mean_noise_is_seeded_and_of_the_right_scale() -> None:
    model = model_for("mlp", {"sizes": [60, 40, 10]})  # 2,850 parameters: a good std estimate
    batch = make_batch(model, "cross_entropy", 4, 3)
    size, clip, noise = batch.size, 0.5, 1.3
    plain, _ = clipped(model, batch, noise=0.0, seed=None, clip=clip)
    opts = Options("cross_entropy", ("clipped_mean",), tuple(model.params), clip_norm=clip)
    want = expected(model, batch, opts, [size])[0]["clipped_mean"]
    assert_close(plain, want, torch.float32, "noiseless clipped_mean")

    first, seed = clipped(model, batch, noise=noise, seed=1234, clip=clip)
    again, _ = clipped(model, batch, noise=noise, seed=1234, clip=clip)
    other, _ = clipped(model, batch, noise=noise, seed=1235, clip=clip)
    assert seed == 1234
    for k in first:
        assert torch.equal(first[k], again[k]), f"{k}: the same seed gave other noise"
        assert not torch.equal(first[k], other[k]), f"{k}: another seed gave the same noise"
    drawn = torch.cat([((first[k] - plain[k]) * size).flatten() for k in first]).double()
    assert drawn.numel() > 2000
    assert abs(float(drawn.std()) / (noise * clip) - 1) < 0.06
    assert abs(float(drawn.mean())) < 4 * noise * clip / drawn.numel() ** 0.5

    unseeded, chosen = clipped(model, batch, noise=noise, seed=None, clip=clip)
    assert isinstance(chosen, int)  # a drawn seed is reported so the call can be repeated
    replay, _ = clipped(model, batch, noise=noise, seed=chosen, clip=clip)
    for k in unseeded:
        assert torch.equal(unseeded[k], replay[k])


def test_clipped_mean_noise_per_job_is_the_noise_of_the_job_alone() -> None:
    model = model_for("mlp", {"sizes": [6, 5, 3]})
    jobs = [make_batch(model, "cross_entropy", n, 20 + n) for n in (2, 3)]
    jobs[1].reference = jobs[0].reference
    opts = Options(
        loss="cross_entropy",
        outputs=("clipped_mean",),
        params=tuple(model.params),
        clip_norm=0.3,
        noise_multiplier=2.0,
        seed=99,
    )
    merged = engine.compute(model, concat(jobs), opts, [2, 3], fast_stats=False)
    for job, got in zip(jobs, merged, strict=True):
        alone = engine.compute(model, job, opts, fast_stats=False)[0]
        assert_close(
            got["clipped_mean"],
            to_numpy(alone["clipped_mean"]),
            torch.float32,
            "clipped_mean",
            SAME,
        )
        assert got["meta"]["seed"] == 99


def test_threads_computing_the_same_model_get_their_own_gradients() -> None:
    """functional_call swaps the module's parameters in place: concurrent calls must not mix."""
    import threading

    model = model_for("value-mlp", {})  # big enough (8-64-64-1) for the calls to overlap
    opts = Options("mse", ("grads", "norms", "mean", "cosine_mean"), tuple(model.params))
    jobs = [make_batch(model, "mse", 1 + i % 4, 100 + i) for i in range(32)]
    alone = [engine.compute(model, job, opts, fast_stats=False)[0] for job in jobs]
    got: dict[int, dict[str, Any]] = {}

    def work(indices: range) -> None:
        for i in indices:
            got[i] = engine.compute(model, jobs[i], opts, fast_stats=False)[0]

    threads = [threading.Thread(target=work, args=(range(t, 32, 2),)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, want in enumerate(alone):
        for name in opts.outputs:
            assert_close(got[i][name], to_numpy(want[name]), torch.float32, f"job {i} {name}", SAME)


def test_zoo_weights_do_not_depend_on_threads_building_at_once() -> None:
    """Seeded builds share the global RNG: concurrent builds must not draw each other's numbers
    (a worker thread got other default weights, hence another version, for a zoo id)."""
    import threading

    from models import get_family
    from service.registry import build_module

    configs = [(a, get_family(a).config(c)) for a, c, _ in CASES if a != "simple-cnn"]
    want = [build_module(arch, config).state_dict() for arch, config in configs]
    for _ in range(10):
        got: list[tuple[int, dict[str, torch.Tensor]]] = []

        def work(order: list[int], got: list[tuple[int, dict[str, torch.Tensor]]] = got) -> None:
            for i in order:
                got.append((i, build_module(*configs[i]).state_dict()))

        indices = list(range(len(configs)))
        threads = [threading.Thread(target=work, args=(o,)) for o in (indices, indices[::-1])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, state in got:
            for k, v in state.items():
                assert torch.equal(v, want[i][k]), f"{configs[i][0]} {k}"


def test_joined_batches_are_their_samples_one_after_another() -> None:
    """A merged call's batch: every per-sample field (named inputs too) concatenated in order,
    what the jobs share (weights, references) taken once; a lone batch is itself."""
    rng = torch.Generator().manual_seed(0)
    weights = {"w": torch.ones(2)}

    def part(n: int) -> Batch:
        return Batch(inputs=torch.randn(n, 3, generator=rng), targets=torch.arange(n),
                     rewards=torch.randn(n, generator=rng), weights=weights,
                     named={"extra": torch.randn(n, 2, generator=rng)})

    a, b = part(2), part(3)
    joined = Batch.joined([a, b])
    assert joined.size == 5 and joined.weights is weights and joined.dones is None
    for name in ("inputs", "targets", "rewards"):
        assert torch.equal(getattr(joined, name), torch.cat([getattr(a, name), getattr(b, name)]))
    assert torch.equal(joined.named["extra"], torch.cat([a.named["extra"], b.named["extra"]]))
    assert Batch.joined([a]) is a


def test_the_loop_routes_cudnn_switch_keeps_torchs_other_cudnn_settings() -> None:
    """On CUDA the loop route runs stock recurrent layers with cuDNN off (its recurrent kernels
    cannot be differentiated by torch.func, nor in eval mode); the switch must leave the other
    cuDNN settings as the operator set them, during the call and after it."""
    from service.strategies.per_sample import _without_cudnn

    cudnn = torch.backends.cudnn
    was = cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32
    cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = True, True, True, False
    try:
        with _without_cudnn():
            assert not cudnn.enabled
            assert (cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32) == (True, True, False)
        assert (cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32) == (
            True, True, True, False)
    finally:
        cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = was
