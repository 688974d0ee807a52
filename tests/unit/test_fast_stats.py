"""The fast-statistics path equals the ``vmap`` path and the per-sample loop, output by output."""

from __future__ import annotations

import copy
import gc
import math
import subprocess
import sys
import weakref
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import ZOO, TensorSpec
from psgrad._contract import answer_fields
from psgrad._errors import PsgradError
from service import engine
from service.config import Settings, get_settings
from service.engine import Batch, Options
from service.fast_stats import (
    TUNING,
    Family,
    FastStats,
    _family,
    _plan,
    _stream,
    register_family,
)
from service.fast_stats._budget import Budget
from service.fast_stats._dense import Dense, dense_sum
from service.fast_stats._outer import OuterSource
from service.fast_stats._plan import PLANS
from service.fast_stats._replay import ModuleReplay, OpReplay
from service.fast_stats._source import LastGram, Materialised
from service.fast_stats.families import batch_norm, conv
from service.fast_stats.families.conv import ConvSource
from service.plugins import Registry
from service.registry import LoadedModel, load_model
from service.strategies import base
from service.strategies.base import NORM_BLOCK, squared_norms
from service.strategies.per_sample import per_sample_fn
from service.strategies.projection import Projection
from tests.support.accelerator import sized_as_on_an_accelerator
from tests.support.batches import make_batch
from tests.support.reference import (
    SUMMARY,
    assert_close,
    assert_output,
    attribution,
    loop_of,
    per_sample_loop,
    reference,
)

CPU = torch.device("cpu")
ONE_PASS = tuple(n for n in SUMMARY if n != "clipped_mean")  # taken in the backward pass


def zoo(arch: str, config: dict[str, Any] | None = None) -> LoadedModel:
    return load_model(arch, arch, config, device=CPU)


def custom(
    module: nn.Module,
    shape: tuple[int, ...],
    dtype: str = "float32",
    high: int = 0,
    loss: str = "cross_entropy",
    key: str = "",
) -> LoadedModel:
    """A LoadedModel around any module (tied weights and custom forwards are not in the zoo)."""
    module.eval().requires_grad_(False)
    spec = TensorSpec(shape, dtype, high or None)
    x = torch.randint(0, high, (2, *shape)) if high else torch.randn(2, *shape).to(
        getattr(torch, dtype))
    return LoadedModel(
        id=key,
        version="0",
        architecture="custom",
        config={},
        module=module,
        params={k: v.detach() for k, v in module.named_parameters()},
        buffers={k: v.detach() for k, v in module.named_buffers()},
        input=spec,
        output_shape=tuple(module(x).shape[1:]),
        default_loss=loss,
        losses=(loss,),
        activation_numel=10_000,
        structure=f"test-{key}",
    )


def check(
    model: LoadedModel,
    batch: Batch,
    *,
    loss: str | None = None,
    params: tuple[str, ...] | None = None,
    segments: list[int] | None = None,
    outputs: tuple[str, ...] = SUMMARY,
    clip: float = 0.5,
    gamma: float = 1.0,
) -> dict[str, Any]:
    """Fast path == vmap path == per-sample loop for every output; answers the fast meta."""
    loss = loss or model.default_loss
    if loss == "td0":
        outputs = (*outputs, "td_errors")
    opts = Options(
        loss=loss,
        outputs=outputs,
        params=params or tuple(model.params),
        clip_norm=clip,
        gamma=gamma,
    )
    segments = segments or [batch.size]
    fast = engine.compute(model, batch, opts, segments)
    slow = engine.compute(model, batch, opts, segments, fast_stats=False)
    want = reference(model, batch, opts, segments)
    for s, (f, v, r) in enumerate(zip(fast, slow, want, strict=True)):
        assert f["meta"]["route"] == "fast_stats"
        assert list(f) == [*answer_fields(outputs), "meta"]
        for name in answer_fields(outputs):
            # an answer is data, not part of the forward graph (numpy() refuses those)
            assert not any(t.requires_grad for t in _tensors(f[name])), name
        for name in outputs:
            assert_output(name, f, v, f"segment {s} (fast vs vmap)", samples=segments[s])
            assert_output(name, f, r, f"segment {s} (fast vs loop)", samples=segments[s])
    meta: dict[str, Any] = fast[0]["meta"]
    assert list(meta["method"]) == list(opts.params)
    return meta


def _tensors(value: Any) -> list[torch.Tensor]:
    return list(value.values()) if isinstance(value, dict) else [value]


SMALL = {
    "mlp": {"sizes": [6, 8, 3]},
    "simple-cnn": None,
    "tiny-transformer": {
        "vocab": 30,
        "seq_len": 6,
        "d_model": 8,
        "nhead": 2,
        "dim_ff": 12,
        "layers": 2,
        "classes": 3,
    },
    "linear-value": {"dim": 3, "bias": False},
    "value-mlp": {"sizes": [4, 8]},
}


def test_every_zoo_model_is_covered() -> None:
    assert {name for name, family in ZOO.items() if family.standalone} == set(SMALL)


@pytest.mark.parametrize("outputs", [SUMMARY, ONE_PASS], ids=["two-passes", "one-pass"])
@pytest.mark.parametrize("arch", list(SMALL))
def test_every_summary_output_on_every_zoo_model(arch: str, outputs: tuple[str, ...]) -> None:
    """Every output, with a clipped mean (a second pass over what the backward pass left) and
    without (each layer's statistics taken as the backward pass reaches it)."""
    model = zoo(arch, SMALL[arch])
    n = 3 if arch == "simple-cnn" else 5
    meta = check(model, make_batch(model, n), segments=[2, n - 2], outputs=outputs)
    if arch in ("mlp", "value-mlp"):
        assert set(meta["method"].values()) == {"linear"}
        assert {meta["form"][k] for k in meta["form"] if k.endswith("weight")} == {"outer"}
    if arch == "simple-cnn":
        assert meta["method"]["conv2.weight"] == "conv"
        assert meta["method"]["fc1.weight"] == "linear"
    if arch == "tiny-transformer":
        assert meta["method"]["embed.weight"] == "embedding"
        assert meta["method"]["pos"] == "direct"
        assert meta["method"]["encoder.0.self_attn.in_proj_weight"] == "linear"
        assert meta["method"]["encoder.1.norm2.weight"] == "direct"


@pytest.mark.parametrize("outputs", [SUMMARY, ONE_PASS], ids=["two-passes", "one-pass"])
def test_an_output_written_in_place_by_the_next_op(outputs: tuple[str, ...]) -> None:
    """A layer's output gradient is the one at the layer's own output, also where the next op
    writes that output in place (an in-place ReLU): its place in the graph is taken as the
    layer runs."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 5),
                           nn.Tanh(), nn.Linear(5, 3))
    model = custom(module, (4,))
    meta = check(model, make_batch(model, 5), segments=[2, 3], outputs=outputs)
    assert set(meta["method"].values()) == {"linear"}


@pytest.mark.parametrize(
    ("arch", "loss"),
    [("mlp", "mse"), ("linear-value", "mse"), ("linear-value", "td0"), ("value-mlp", "td0")],
)
def test_other_losses(arch: str, loss: str) -> None:
    model = zoo(arch, SMALL[arch])
    check(model, make_batch(model, 4, loss=loss), loss=loss, gamma=0.9)


def test_a_zero_dimensional_bias_against_the_loop() -> None:
    model = zoo("linear-value", {"dim": 3, "bias": True})
    batch = make_batch(model, 4, loss="td0")
    opts = Options(
        loss="td0",
        outputs=(*SUMMARY, "td_errors"),
        params=tuple(model.params),
        clip_norm=0.5,
        gamma=0.9,
    )
    [fast] = engine.compute(model, batch, opts)
    [want] = reference(model, batch, opts, [4])
    assert fast["meta"]["method"] == {"theta": "direct", "bias": "direct"}
    for name in opts.outputs:
        assert_close(fast[name], want[name], name)


def test_td0_hand_check() -> None:
    """docs/requests.md's TD(0): theta=[0.2,-0.2,0.1], s=[2,1,-2], r=2, s'=[1,2,0]: -7.2..."""
    model = zoo("linear-value", {"dim": 3, "bias": False})
    batch = Batch(
        inputs=torch.tensor([[2.0, 1.0, -2.0]]),
        next_inputs=torch.tensor([[1.0, 2.0, 0.0]]),
        rewards=torch.tensor([2.0]),
        dones=torch.tensor([0.0]),
        weights={"theta": torch.tensor([0.2, -0.2, 0.1])},
    )
    opts = Options(loss="td0", outputs=("norms", "mean", "td_errors"), params=("theta",))
    [out] = engine.compute(model, batch, opts)
    torch.testing.assert_close(out["td_errors"], torch.tensor([1.8]))
    torch.testing.assert_close(out["mean"]["theta"], torch.tensor([-7.2, -3.6, 7.2]))
    torch.testing.assert_close(out["norms"], torch.tensor([-7.2, -3.6, 7.2]).norm().reshape(1))


@pytest.mark.parametrize(
    ("arch", "params"),
    [
        ("mlp", ("fc2.weight",)),
        ("mlp", ("fc1.bias", "fc2.weight")),
        ("tiny-transformer", ("embed.weight", "head.bias")),
        ("tiny-transformer", ("encoder.1.self_attn.out_proj.weight", "encoder.0.norm1.bias")),
        ("simple-cnn", ("conv1.weight",)),
    ],
)
def test_params_subsets(arch: str, params: tuple[str, ...]) -> None:
    model = zoo(arch, SMALL[arch])
    meta = check(model, make_batch(model, 3), params=params)
    assert list(meta["method"]) == list(params)


@pytest.mark.parametrize("arch", ["mlp", "tiny-transformer"])
def test_per_call_weights(arch: str) -> None:
    model = zoo(arch, SMALL[arch])
    check(model, make_batch(model, 4, weights=True), segments=[1, 3])


def test_clipped_mean_noise_is_the_vmap_paths() -> None:
    model = zoo("mlp", SMALL["mlp"])
    batch = make_batch(model, 5)
    opts = Options(
        loss="cross_entropy",
        outputs=("clipped_mean",),
        params=tuple(model.params),
        clip_norm=0.3,
        noise_multiplier=1.1,
        seed=7,
    )
    fast = engine.compute(model, batch, opts, [2, 3])
    slow = engine.compute(model, batch, opts, [2, 3], fast_stats=False)
    for f, s in zip(fast, slow, strict=True):
        assert f["meta"]["seed"] == s["meta"]["seed"] == 7
        assert_close(f["clipped_mean"], s["clipped_mean"])


def _sequential(
    layers: list[dict[str, Any]], shape: list[int], dtype: str = "float32"
) -> LoadedModel:
    config = {"layers": layers, "input": {"shape": shape, "dtype": dtype}}
    gen = torch.Generator().manual_seed(3)
    base = load_model("seq", "sequential", config, device=CPU)
    state = {k: v + 0.2 * torch.randn(v.shape, generator=gen) for k, v in base.params.items()}
    return load_model("seq", "sequential", config, {**state, **base.buffers}, device=CPU)


def _l(kind: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"type": kind, "args": list(args), "kwargs": kwargs}


SHAPES = [
    ([_l("Linear", 5, 4), _l("Flatten"), _l("Linear", 8, 2)], [2, 5], "gram"),  # 8 < 20
    (
        [_l("Linear", 2, 3), _l("Flatten"), _l("Linear", 18, 2)],
        [6, 2],
        "materialise",
    ),  # 72 >= 6
    # a 4-D input: T = 4 positions, 32 >= 9
    ([_l("Linear", 3, 3), _l("Flatten"), _l("Linear", 12, 2)], [2, 2, 3], "materialise"),
    ([_l("Conv1d", 4, 6, 3), _l("Flatten"), _l("Linear", 18, 2)], [4, 5], "gram"),  # 18 < 72
    (
        [
            _l("Conv1d", 2, 3, 3, stride=2, dilation=2, padding=2),
            _l("Flatten"),
            _l("Linear", 15, 2),
        ],
        [2, 9],
        "materialise",
    ),
    (
        [_l("Conv2d", 2, 4, 3, padding=1, groups=2), _l("Flatten"), _l("Linear", 64, 2)],
        [2, 4, 4],
        "materialise",
    ),
    (
        [
            _l("Conv2d", 2, 2, [2, 3], padding="same", padding_mode="reflect"),
            _l("Flatten"),
            _l("Linear", 24, 2),
        ],
        [2, 3, 4],
        "materialise",
    ),
    (
        [_l("Conv2d", 1, 2, 2, padding="same"), _l("Flatten"), _l("Linear", 18, 2)],
        [1, 3, 3],
        "materialise",
    ),
    (
        [
            _l("Conv3d", 2, 2, 2, stride=[1, 2, 1], padding=1, dilation=[1, 1, 2]),
            _l("Flatten"),
            _l("Linear", 64, 2),
        ],
        [2, 3, 3, 4],
        "materialise",
    ),
]


@pytest.mark.parametrize(("layers", "shape", "form"), SHAPES)
def test_sequences_and_convolutions_on_both_sides_of_the_choice(
    layers: list[dict[str, Any]], shape: list[int], form: str
) -> None:
    model = _sequential(layers, shape)
    meta = check(model, make_batch(model, 4), segments=[3, 1])
    assert meta["form"]["0.weight"] == form
    assert meta["method"]["0.weight"] == layers[0]["type"].rstrip("123d").lower()


def test_embedding_with_padding_and_repeated_tokens() -> None:
    layers = [
        _l("Embedding", 7, 3, padding_idx=0),
        _l("Linear", 3, 4),
        _l("Mean", dim=1),
        _l("Linear", 4, 2),
    ]
    model = _sequential(layers, [6], "int64")
    batch = make_batch(model, 5)
    batch.inputs = torch.randint(0, 3, (5, 6), generator=torch.Generator().manual_seed(1))
    assert (batch.inputs == 0).any()
    meta = check(model, batch)
    assert meta["method"]["0.weight"] == "embedding"
    assert meta["form"]["1.weight"] == "materialise"  # T = 6: 72 >= 12


class TiedPair(nn.Module):
    """One weight in two Linear layers: its per-sample gradient is the sum of both parts, which
    is the sequence form over the two calls (two positions)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


class TiedHead(nn.Module):
    """An embedding table reused as the output layer (``F.linear`` in the model's forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(9, 4)
        self.mix = nn.Linear(4, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(tokens))).mean(1)
        return F.linear(h, self.emb.weight)


class TiedOverPositions(TiedHead):
    """GPT-2's layout: the embedding table reused as the output layer at every position."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.mix(self.emb(tokens))), self.emb.weight).mean(1)


class Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.t()


class Opaque(nn.Module):
    """Parameters read through ``w.t()``: module replays (the owner, then the whole model)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Transposed()
        self.scale = nn.Parameter(torch.randn(2, 3))
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inner(x))
        return self.head(h) + h @ self.scale.t()


@pytest.mark.parametrize(
    ("factory", "shape", "high", "methods"),
    [
        (TiedPair, (4,), 0, {"a.weight": "linear", "a.bias": "linear", "head.weight": "linear"}),
        (TiedHead, (5,), 9, {"emb.weight": "tied", "mix.weight": "linear"}),
        (Opaque, (4,), 0, {"inner.w": "direct", "scale": "vmap", "head.weight": "linear"}),
    ],
)
def test_tied_and_opaque_parameters(
    factory: type[nn.Module], shape: tuple[int, ...], high: int, methods: dict[str, str]
) -> None:
    torch.manual_seed(0)
    model = custom(factory(), shape, "int64" if high else "float32", high, key=factory.__name__)
    meta = check(model, make_batch(model, 4), segments=[1, 3])
    for name, method in methods.items():
        assert meta["method"][name] == method, name
    if factory is TiedPair:
        # 2 positions: the Gram form's 2 (4 + 4) is not below materialising's 4 x 4
        assert meta["form"]["a.weight"] == "materialise"
    if factory is TiedHead:  # the embedding and the output layer's part, in closed form
        assert meta["form"]["emb.weight"] == "tied:embedding+outer"


@pytest.mark.parametrize("pairs", [False, True], ids=["dot-with-mean", "pairs"])
def test_a_tied_layer_over_positions_takes_its_cosines_by_pairs_or_the_dot(
    pairs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each sample's dot with the tied parameter's mean from the pairwise products (the output
    layer's, the embedding's at equal tokens and their cross terms) or from each part's dot with
    the mean: the loop's cosines, in segments, tokens repeated."""
    monkeypatch.setattr(OuterSource, "pairs_cheaper", lambda self, n: pairs and self.t > 1)
    torch.manual_seed(0)
    model = custom(TiedOverPositions(), (5,), "int64", 9, key="TiedOverPositions")
    batch = make_batch(model, 4)
    assert len(batch.inputs.unique()) < batch.inputs.numel()
    meta = check(model, batch, segments=[1, 3], outputs=("cosine_mean", "mean", "norms"))
    assert meta["form"]["emb.weight"] == "tied:embedding+materialise"  # 5 (4 + 9) >= 4 x 9


@pytest.mark.parametrize("positions", [False, True, "eager"],
                         ids=["one-position", "pieces", "pieces-eager"])
def test_variance_keeps_its_digits_when_the_mean_is_large(
    positions: bool | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inputs far from 0 next to their spread: float64 sums for one position; over positions,
    each piece's deviations from its own samples' mean (the CPU's fused loop, or torch's
    eager operations as on an accelerator), sets of samples merged."""
    monkeypatch.setattr(TUNING, "fused", positions != "eager")
    if positions:
        monkeypatch.setattr(TUNING, "piece_bytes", 64)
        monkeypatch.setattr(TUNING, "min_rows", 1)
        monkeypatch.setenv("PSGRAD_FAST_STATS_FORM", "materialise")
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(5, 4), nn.Flatten(), nn.Linear(8, 2))
        model = custom(module, (2, 5), key="large-mean-positions")
    else:
        model = zoo("mlp", SMALL["mlp"])
    batch = make_batch(model, 6, reference=False)
    batch.inputs = 40.0 + 0.01 * batch.inputs
    batch.targets = torch.zeros(6, dtype=torch.long)
    opts = Options(loss="cross_entropy", outputs=("variance",), params=tuple(model.params))
    get_settings.cache_clear()
    try:
        [fast] = engine.compute(model, batch, opts)
    finally:
        get_settings.cache_clear()
    if positions:
        assert fast["meta"]["form"]["0.weight"] == "materialise", fast["meta"]["form"]
    [want] = reference(model, batch, opts, [6])
    for k, v in want["variance"].items():
        scale = float(v.abs().max()) + 1e-12
        assert_close(fast["variance"][k], v, k, atol=1e-3 * scale, rtol=1e-3)


def test_per_sample_outputs_take_the_fast_path_and_the_switch_the_vmap_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = zoo("mlp", SMALL["mlp"])
    batch = make_batch(model, 3)
    opts = Options(loss="cross_entropy", outputs=("grads", "norms"), params=tuple(model.params))
    [out] = engine.compute(model, batch, opts)
    assert out["meta"]["route"] == "fast_stats"
    assert set(out["meta"]["method"].values()) == {"linear"}
    monkeypatch.setenv("PSGRAD_FAST_STATS", "0")
    assert Settings().fast_stats is False
    [slow] = engine.compute(model, batch, opts, fast_stats=Settings().fast_stats)
    assert slow["meta"]["route"] != "fast_stats"
    assert set(slow["meta"]["method"].values()) == {"vmap"}
    for name in opts.outputs:
        assert_close(out[name], slow[name], name)
    opts = Options(loss="cross_entropy", outputs=("norms",), params=tuple(model.params))
    [out] = engine.compute(model, batch, opts, fast_stats=Settings().fast_stats)
    assert set(out["meta"]["method"].values()) == {"vmap"}


class Branchy(nn.Module):
    """Reads its weights more often for larger batches: the probe's plan does not hold."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if x.shape[0] > 3:
            h = self.lin(torch.tanh(h))
        return self.head(h)


def test_a_call_that_reads_parameters_unlike_the_probe_takes_the_vmap_path() -> None:
    model = custom(Branchy(), (4,), key="branchy")
    batch = make_batch(model, 5)
    opts = Options(loss="cross_entropy", outputs=("norms", "mean"), params=tuple(model.params))
    [out] = engine.compute(model, batch, opts)
    assert out["meta"]["route"] != "fast_stats"
    [want] = reference(model, batch, opts, [5])
    assert_close(out["norms"], want["norms"])
    small = make_batch(model, 3)
    [out] = engine.compute(model, small, opts)
    assert out["meta"]["route"] == "fast_stats"


@dataclass(frozen=True)
class _ScaledInput:
    x: torch.Tensor

    @property
    def key(self) -> None:
        return None


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(x * self.scale))


def test_a_layer_family_is_one_registered_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family defined here (one class, one decorator) computes ``x * w``'s weight."""
    registry = Registry("layer family", PsgradError, sort=False)
    for func, family in _family.FAMILIES.items():
        registry.add(func, family)
    monkeypatch.setattr(_family, "FAMILIES", registry)

    @register_family(torch.Tensor.mul)
    class Scale(Family[_ScaledInput]):
        method = "scale"

        def capture(self, cap: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    found: dict[int, str]) -> Any:
            x, w = args
            if kwargs or id(w) not in found or not cap.is_batched(x) or w.dim() != 1:
                return None
            out = func(*args)
            return out, [self.use(func, {found[id(w)]: "weight"}, _ScaledInput(x), out)]

        def source(self, name: str, role: str, uses: Any, ctx: Any) -> Any:
            parts = [u.grad * self.payload(u).x for u in uses]
            return dense_sum(name, parts, ctx, self.method)

    torch.manual_seed(0)
    model = custom(_Scaled(), (4,), key="toy-family")
    try:
        meta = check(model, make_batch(model, 4), segments=[1, 3])
    finally:
        PLANS.drop(lambda key: key[0] != model.structure)
    assert meta["method"] == {"scale": "scale", "head.weight": "linear", "head.bias": "linear"}


def test_the_strategy_fills_what_the_need_asks() -> None:
    model = zoo("mlp", SMALL["mlp"])
    batch = make_batch(model, 4)
    opts = base.Options(loss="cross_entropy", outputs=("norms",), params=tuple(model.params))
    call = base.Call(model=model, opts=opts, params=dict(model.params), samples=batch.samples(),
                     reference={}, bounds=base.bounds_of([4]), need=base.Need(sq=True))
    result = FastStats().run(call)
    assert result is not None
    grads, (losses, _) = per_sample_fn(model, "cross_entropy", 1.0)(
        dict(model.params), {}, model.buffers, batch.samples())
    torch.testing.assert_close(result.losses, losses)
    for k, stats in result.params.items():
        torch.testing.assert_close(stats.sq, grads[k].flatten(1).pow(2).sum(1))
        assert stats == base.ParamStats(sq=stats.sq)
    result = FastStats().run(replace(call, need=base.Need(grads=True, sq=True)))
    assert result is not None
    for k, stats in result.params.items():
        assert stats.grads is not None and stats.grads.is_contiguous()
        torch.testing.assert_close(stats.grads, grads[k])
        torch.testing.assert_close(stats.sq, grads[k].flatten(1).pow(2).sum(1))
        assert stats == base.ParamStats(grads=stats.grads, sq=stats.sq)


# ----------------------------------------------------------------------------- grads and updates

GRADS = ("grads",)


def _losses(arch: str) -> tuple[str, ...]:
    family = ZOO[arch]
    return tuple(family.loss_info(family.config(SMALL[arch]))[1])


def grads_outputs(loss: str) -> tuple[str, ...]:
    return ("grads", "updates") if loss == "td0" else GRADS


@pytest.mark.parametrize(
    ("arch", "loss"),
    [(arch, loss) for arch in SMALL for loss in _losses(arch)],
)
def test_grads_on_every_zoo_model_and_loss(arch: str, loss: str) -> None:
    """Every zoo model x loss: each per-sample gradient written by the fast path equals the
    per-sample loop and the vmap path, over several jobs and with per-call weights."""
    model = zoo(arch, SMALL[arch])
    n = 4 if arch == "simple-cnn" else 5
    batch = make_batch(model, n, loss=loss, weights=True)
    meta = check(model, batch, loss=loss, outputs=grads_outputs(loss), segments=[2, 1, n - 3],
                 gamma=0.9)
    if arch == "simple-cnn":
        assert meta["method"]["conv2.weight"] == "conv"
        assert meta["method"]["fc1.weight"] == "linear"
    if arch == "tiny-transformer":
        assert meta["method"]["embed.weight"] == "embedding"
        assert meta["method"]["encoder.0.self_attn.in_proj_weight"] == "linear"


@pytest.mark.parametrize(
    ("arch", "params"),
    [
        ("mlp", ("fc2.weight",)),
        ("tiny-transformer", ("embed.weight", "head.bias")),
        ("tiny-transformer", ("encoder.1.self_attn.out_proj.weight", "encoder.0.norm1.bias")),
        ("simple-cnn", ("conv1.weight", "fc2.bias")),
        ("value-mlp", ("0.weight",)),
    ],
)
def test_grads_of_params_subsets(arch: str, params: tuple[str, ...]) -> None:
    model = zoo(arch, SMALL[arch])
    params = tuple(k for k in params if k in model.params) or tuple(model.params)[:1]
    loss = model.default_loss
    meta = check(model, make_batch(model, 3), loss=loss, params=params,
                 outputs=grads_outputs(loss), segments=[1, 2])
    assert list(meta["method"]) == list(params)


@pytest.mark.parametrize("arch", ["mlp", "tiny-transformer", "simple-cnn"])
def test_grads_with_statistics(arch: str) -> None:
    """Statistics asked for with the gradients are read off the written answer."""
    model = zoo(arch, SMALL[arch])
    check(model, make_batch(model, 4), outputs=(*GRADS, *SUMMARY), segments=[3, 1])


@pytest.mark.parametrize(("layers", "shape", "form"), SHAPES)
def test_grads_of_sequences_and_convolutions(
    layers: list[dict[str, Any]], shape: list[int], form: str
) -> None:
    model = _sequential(layers, shape)
    meta = check(model, make_batch(model, 4), outputs=GRADS, segments=[3, 1])
    assert meta["method"]["0.weight"] == layers[0]["type"].rstrip("123d").lower()


@pytest.mark.parametrize("folded", [True, False], ids=["folded", "per-sample"])
@pytest.mark.parametrize(
    ("layers", "shape"), [(layers, shape) for layers, shape, _ in SHAPES
                          if layers[0]["type"].startswith("Conv")])
def test_convolutions_folded_into_groups(
    layers: list[dict[str, Any]], shape: list[int], folded: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The weight-gradient convolutions (strides, dilation, groups, "same" padding): every
    sample's with the batch folded into the groups (as on a GPU) or one convolution per sample
    (as on a CPU), and the batch's (clipped and plain sums), give the same gradients and
    statistics; these layers are too small to take the weight-gradient convolution on their
    own."""
    calls = []
    real = conv.weight_grad

    def spy(*args: Any, per_sample: bool) -> torch.Tensor:
        calls.append((args[0].shape[0], per_sample))
        return real(*args, per_sample=per_sample, folded=folded)

    monkeypatch.setattr(TUNING, "fold_min_field", 0)
    monkeypatch.setattr(TUNING, "fold_min_positions", 0)
    monkeypatch.setattr(conv, "weight_grad", spy)
    model = _sequential(layers, shape)
    check(model, make_batch(model, 4), outputs=GRADS, segments=[3, 1])
    assert (4, True) in calls  # the call's batch, not only the probe's
    for form in ("materialise", "gram"):  # every statistic; without variance the Gram
        # form's sums and clipped sums are the batch's convolutions
        monkeypatch.setenv("PSGRAD_FAST_STATS_FORM", form)
        get_settings.cache_clear()
        calls.clear()
        outputs = SUMMARY if form == "materialise" else tuple(
            k for k in SUMMARY if k != "variance")
        check(model, make_batch(model, 4), segments=[3, 1], outputs=outputs)
        assert (4, True) in calls if form == "materialise" else (3, False) in calls, calls
    get_settings.cache_clear()


@pytest.mark.parametrize("form", ["gram", "materialise"])
@pytest.mark.parametrize(("layers", "shape", "folded"), [
    (layers, shape, folded) for layers, shape, _ in SHAPES
    for folded in (False, True) if not folded or layers[0]["type"] != "Linear"])
def test_dots_with_references_in_either_form(
    layers: list[dict[str, Any]], shape: list[int], form: str, folded: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """M dot products per sample from the gradients built a slice of output rows at a time
    (sequences, convolutions with strides, dilation and groups), or a convolution's chunk by
    chunk by the batch-folded convolution, as the loop gives them."""
    calls = []
    real = conv.weight_grad

    def spy(*args: Any, per_sample: bool) -> torch.Tensor:
        calls.append((args[0].shape[0], per_sample))
        return real(*args, per_sample=per_sample)

    monkeypatch.setattr(conv, "weight_grad", spy)
    monkeypatch.setattr(TUNING, "fold_min_field", 0 if folded else math.inf)
    monkeypatch.setattr(TUNING, "fold_min_positions", 0 if folded else math.inf)
    monkeypatch.setenv("PSGRAD_FAST_STATS_FORM", form)
    monkeypatch.setattr(TUNING, "piece_bytes", 64)  # several slices per layer, and sets
    monkeypatch.setattr(TUNING, "min_rows", 1)  # of one or a few samples
    get_settings.cache_clear()
    model = _sequential(layers, shape)
    batch = make_batch(model, 4)
    gen = torch.Generator().manual_seed(3)
    batch.references = {k: torch.randn((3, *v.shape), generator=gen)
                        for k, v in model.params.items()}
    opts = Options(loss=model.default_loss, outputs=("dots",), params=tuple(model.params))
    [got] = engine.compute(model, batch, opts)
    get_settings.cache_clear()
    assert got["meta"]["route"] == "fast_stats"
    assert form in got["meta"]["form"].values(), got["meta"]["form"]
    want = attribution(loop_of(model, batch, opts), batch.references)["dots"]
    assert_close(got["dots"], want)
    assert ((4, True) in calls) == folded, calls  # the call's batch, not only the probe's


@pytest.mark.parametrize("way", ["pairs", "mean", "pieces", "pieces-eager"])
@pytest.mark.parametrize(("layers", "shape"), [(layers, shape) for layers, shape, _ in SHAPES])
def test_cosine_by_pairwise_products_the_mean_or_pieces(
    layers: list[dict[str, Any]], shape: list[int], way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each sample's dot with its segment's mean as the mean of its pairwise dot products, as
    the dot with the mean (a convolution's by one forward convolution with the mean as its
    weight), or with its squared norm from its gradient built a piece at a time (a linear
    layer's over positions, a convolution's unfolded in one block; by the CPU's fused loop, or
    torch's eager operations as on an accelerator), each taken here wherever it applies, not
    only where cheaper: the loop's cosines."""
    monkeypatch.setattr(TUNING, "fused", way != "pieces-eager")
    way = way.removesuffix("-eager")
    taken = []
    built = []

    def always(self: OuterSource, n: int) -> bool:
        taken.append(self.whole and self.t > 1)
        return taken[-1] and way == "pairs"

    with_cos = OuterSource._with_cos

    def spy(self: OuterSource, *args: Any) -> Any:
        built.append(self.names[0])
        return with_cos(self, *args)

    monkeypatch.setattr(OuterSource, "pairs_cheaper", always)
    monkeypatch.setattr(OuterSource, "_with_cos", spy)
    monkeypatch.setattr(TUNING, "whole_piece_bytes", math.inf if way == "pieces" else 0)
    monkeypatch.setattr(TUNING, "piece_bytes", 64)  # several pieces per layer
    monkeypatch.setattr(TUNING, "min_rows", 1)
    monkeypatch.setattr(ConvSource, "cache", False)  # not the cached gradients' dots
    monkeypatch.setattr(_stream, "held", lambda source, numel: source)  # nor the held ones
    model = _sequential(layers, shape)
    check(model, make_batch(model, 4), segments=[3, 1], outputs=("cosine_mean", "mean"))
    assert any(taken) or built  # some layer took the way asked for
    # the first layer (over positions, or a convolution) builds in pieces; the linear layer
    # over a flattened input has one position
    assert built == (["0.weight"] if way == "pieces" else []), built


def test_grads_of_an_embedding_with_padding_and_repeated_tokens() -> None:
    layers = [_l("Embedding", 7, 3, padding_idx=0), _l("Linear", 3, 4), _l("Mean", dim=1),
              _l("Linear", 4, 2)]
    model = _sequential(layers, [6], "int64")
    batch = make_batch(model, 5)
    batch.inputs = torch.randint(0, 3, (5, 6), generator=torch.Generator().manual_seed(1))
    meta = check(model, batch, outputs=GRADS)
    assert meta["method"]["0.weight"] == "embedding"


@pytest.mark.parametrize(
    ("factory", "shape", "high", "methods"),
    [
        (TiedPair, (4,), 0, {"a.weight": "linear", "head.weight": "linear"}),
        (TiedHead, (5,), 9, {"emb.weight": "tied", "mix.weight": "linear"}),
        (Opaque, (4,), 0, {"inner.w": "direct", "scale": "vmap", "head.weight": "linear"}),
    ],
)
@pytest.mark.parametrize("step", [None, 1], ids=["whole", "one-sample-chunks"])
def test_grads_of_tied_and_replayed_parameters(
    factory: type[nn.Module], shape: tuple[int, ...], high: int, methods: dict[str, str],
    step: int | None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replays and tied sums write their chunks into the one buffer of the answer."""
    if step is not None:
        for cls in (Materialised, OpReplay, ModuleReplay):
            monkeypatch.setattr(cls, "chunk_size", lambda self: step)
    torch.manual_seed(0)
    model = custom(factory(), shape, "int64" if high else "float32", high, key=factory.__name__)
    meta = check(model, make_batch(model, 4), outputs=GRADS, segments=[1, 3])
    for name, method in methods.items():
        assert meta["method"][name] == method, name


def test_convolutions_unfolded_a_sample_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ConvSource, "chunk_size", lambda self: 1)
    monkeypatch.setattr(ConvSource, "span", lambda self: 1)
    monkeypatch.setattr(ConvSource, "folded", lambda self: False)  # conv2 would fold
    monkeypatch.setattr(TUNING, "whole_piece_bytes", math.inf)  # cosine: blocks, not pieces
    model = zoo("simple-cnn", SMALL["simple-cnn"])
    check(model, make_batch(model, 3), outputs=(*GRADS, "cosine_mean", "variance", "mean"),
          segments=[2, 1])


@pytest.mark.parametrize("folded", [False, True], ids=["unfolded-pieces", "folded-chunks"])
@pytest.mark.parametrize("step", [1, 2])
def test_variance_merges_blocks_of_samples(
    step: int, folded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Variance over many positions builds each block of samples' gradients once (unfolded, a
    slice of rows at a time, or by the batch-folded convolution) and merges the blocks'
    moments: uneven blocks inside uneven segments give the loop's variance and mean."""
    monkeypatch.setattr(ConvSource, "chunk_size", lambda self: step)  # folded chunks
    monkeypatch.setattr(ConvSource, "span", lambda self: step)  # unfolded blocks
    monkeypatch.setattr(ConvSource, "folded", lambda self: folded)
    monkeypatch.setattr(TUNING, "piece_bytes", 64)  # several slices per layer, and sets
    monkeypatch.setattr(TUNING, "min_rows", 1)  # of one or a few samples
    monkeypatch.setenv("PSGRAD_FAST_STATS_FORM", "materialise")
    get_settings.cache_clear()
    model = zoo("simple-cnn", SMALL["simple-cnn"])
    batch = make_batch(model, 5)
    opts = Options(loss=model.default_loss, outputs=("variance", "mean"),
                   params=tuple(model.params))
    got = engine.compute(model, batch, opts, [3, 2])
    get_settings.cache_clear()
    assert "materialise" in got[0]["meta"]["form"].values(), got[0]["meta"]["form"]
    for g, want in zip(got, reference(model, batch, opts, [3, 2]), strict=True):
        for name in opts.outputs:  # variances of 1e-3: tighter than the tutorial's atol
            assert_close(g[name], want[name], name, atol=1e-7, rtol=1e-4)


@pytest.mark.parametrize("outputs", [("clipped_mean",), ("variance",), ("cosine_mean",),
                                     ("clipped_mean", "projection")])
def test_each_source_is_dropped_after_its_last_pass(
    outputs: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a layer's source holds of the forward and backward passes (its inputs and output
    gradients) is freed once its statistics are done, so the memory held falls as the answer
    grows; a call that also makes sketches keeps every source for them."""
    done: list[weakref.ref[OuterSource]] = []
    alive: list[int] = []

    def spy(method: Any) -> Any:
        def run(self: OuterSource, *args: Any, **kwargs: Any) -> Any:
            gc.collect()
            alive.append(sum(r() is not None for r in done))
            out = method(self, *args, **kwargs)
            done.append(weakref.ref(self))
            return out
        return run

    # the last pass: the second for clipped_mean and cosine_mean, the first for variance
    last = "pass1" if outputs == ("variance",) else "pass2"
    monkeypatch.setattr(OuterSource, last, spy(getattr(OuterSource, last)))
    model = zoo("mlp", {"sizes": [6, 8, 5, 3]})
    opts = Options(loss=model.default_loss, outputs=outputs, params=tuple(model.params),
                   clip_norm=0.5, projection=Projection(16) if "projection" in outputs else None)
    [got] = engine.compute(model, make_batch(model, 4), opts)
    assert got["meta"]["route"] == "fast_stats"
    assert len(alive) == 3, alive  # one per linear layer
    assert alive == ([0, 1, 2] if "projection" in outputs else [0, 0, 0])


@pytest.mark.parametrize(("outputs", "inside"), [
    (("norms",), [True, True, False]), (("variance", "mean"), [True, True, False]),
    (("cosine_mean",), [True, True, False]), (("dot", "dots"), [True, True, False]),
    (("norms", "clipped_mean"), []), (("norms", "grads"), []), (("norms", "projection"), []),
])
def test_one_pass_statistics_are_taken_as_the_backward_pass_reaches_each_layer(
    outputs: tuple[str, ...], inside: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call that takes one pass over each layer forms its sources and takes their statistics
    as the backward pass reaches the layer, so its input and output gradient need not be held
    to the end: inside the pass for every layer but the lowest (its gradient is the pass's
    last, asked for), top down. A call with a clipped mean, per-sample gradients or sketches
    reads the sources again after: they are formed after the pass. Both give the loop's
    answers."""
    seen: list[bool] = []
    settle = _stream.settle

    def spy(source: Any, need: Any) -> Any:
        seen.append(torch._C._current_autograd_node() is not None)
        return settle(source, need)

    monkeypatch.setattr(_stream, "settle", spy)
    model = zoo("mlp", {"sizes": [6, 8, 5, 3]})
    batch = make_batch(model, 4)
    gen = torch.Generator().manual_seed(3)
    batch.reference = {k: torch.randn(v.shape, generator=gen) for k, v in model.params.items()}
    batch.references = {k: torch.randn((2, *v.shape), generator=gen)
                        for k, v in model.params.items()}
    opts = Options(loss=model.default_loss, outputs=outputs, params=tuple(model.params),
                   clip_norm=0.5, projection=Projection(16) if "projection" in outputs else None)
    got = engine.compute(model, batch, opts, [3, 1])
    assert seen == inside
    slow = engine.compute(model, batch, opts, [3, 1], fast_stats=False)
    loop = reference(model, batch, opts, [3, 1])
    for g, v, r, n in zip(got, slow, loop, [3, 1], strict=True):
        assert g["meta"]["route"] == "fast_stats"
        for name in outputs:
            assert_output(name, g, v, "(fast vs vmap)", samples=n)
            if name in r:  # the loop's summaries (dots and sketches: the vmap path's alone)
                assert_output(name, g, r, "(fast vs loop)", samples=n)


@pytest.mark.parametrize("outputs", [("clipped_mean", "norms", "variance"),
                                     ("cosine_mean", "norms")])
def test_two_passes_hold_per_sample_gradients_where_they_are_the_smaller(
    outputs: tuple[str, ...], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """For a clipped mean or the cosines (two passes over a layer), a layer whose norms
    materialise its per-sample gradients and whose gradients are fewer numbers than its input
    and output gradient (a convolution over many positions with few channels: 54 against 236 a
    sample here) holds them, built in the backward pass, for both passes; a layer where they
    are the larger keeps its input and output gradient. Both give the loop's answers."""
    kept: dict[str, str] = {}
    real = _stream.held

    def spy(source: Any, numel: int) -> Any:
        out = real(source, numel)
        kept[source.names[0]] = type(out).__name__
        return out

    monkeypatch.setattr(_stream, "held", spy)
    layers = [_l("Conv2d", 2, 3, 3), _l("Flatten"), _l("Linear", 108, 4)]
    model = _sequential(layers, [2, 8, 8])
    meta = check(model, make_batch(model, 5), segments=[2, 3], outputs=outputs)
    assert meta["form"]["0.weight"] == "materialise"
    assert kept == {"0.weight": "Dense", "2.weight": "LinearSource"}, kept


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize(("layers", "early"), [
    ([_l("Conv2d", 2, 3, 2), _l("BatchNorm2d", 3), _l("Flatten"), _l("Linear", 12, 2)], True),
    ([_l("BatchNorm2d", 2), _l("Conv2d", 2, 3, 2), _l("Flatten"), _l("Linear", 12, 2)], False),
])
def test_batch_norm_gradients_reduced_as_the_backward_reaches_them(
    layers: list[dict[str, Any]], early: bool, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch norm's output gradient is reduced to each sample's sums by a hook as the backward
    pass reaches it (where a layer below it asks for a gradient), never held to the end of the
    pass; on the model's input it is reduced after (its gradient is the last the pass makes).
    Both give the loop's answers, with a clipped mean and without, by the CPU's fused loop or
    the eager operations."""
    monkeypatch.setattr(TUNING, "fused", fused)
    inside: list[bool] = []
    reduce = batch_norm.BatchNorm.reduce

    def spy(self: Any, use: Any, g: torch.Tensor) -> torch.Tensor:
        inside.append(torch._C._current_autograd_node() is not None)
        return reduce(self, use, g)

    monkeypatch.setattr(batch_norm.BatchNorm, "reduce", spy)
    model = _sequential(layers, [2, 3, 3])
    for outputs in (SUMMARY, ONE_PASS):
        inside.clear()
        meta = check(model, make_batch(model, 4), segments=[3, 1], outputs=outputs)
        assert "batch_norm" in meta["method"].values(), meta["method"]
        assert set(inside) == {early}, inside  # the fast path's (and the probe's, once)


def test_batch_norm_statistics_written_in_place_are_read_again() -> None:
    """A batch norm's scale and shift are kept from call to call while its running statistics
    stay as they were: written in place (their version counters move), the next call reads
    the new ones; a model loaded afresh (new buffers) gets its own."""
    layers = [_l("Conv2d", 2, 3, 2), _l("BatchNorm2d", 3), _l("Flatten"), _l("Linear", 12, 2)]
    model = _sequential(layers, [2, 3, 3])
    batch = make_batch(model, 4)
    opts = Options(loss=model.default_loss, outputs=("norms",), params=tuple(model.params))
    first = check(model, batch, outputs=("norms",))
    assert first["method"]["1.weight"] == "batch_norm", first["method"]
    norms = torch.as_tensor(engine.compute(model, batch, opts, [4])[0]["norms"])
    model.buffers["1.running_var"].mul_(9.0)
    model.buffers["1.running_mean"].add_(0.5)
    check(model, batch, outputs=("norms",))
    again = torch.as_tensor(engine.compute(model, batch, opts, [4])[0]["norms"])
    assert not torch.allclose(again, norms, rtol=1e-2), (again, norms)
    check(_sequential(layers, [2, 3, 3]), batch, outputs=("norms",))


class _SharedInput(nn.Module):
    """A query and a key of one input, as attention reads it, and a layer of the same shapes
    on another input."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.v(torch.tanh(self.q(x)) * self.k(x))).sum(1)


def test_layers_that_read_one_input_build_its_gram_matrix_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two linear layers of one input (a query and a key) take their norms over its positions
    from one Gram matrix of it, built for the first and read again by the second (in the
    backward pass and after it); a layer of the same shapes on another input builds its own.
    The loop's answers."""
    built: list[bool] = []
    call = LastGram.__call__

    def spy(self: LastGram, a: torch.Tensor) -> torch.Tensor:
        before = self._last
        out = call(self, a)
        built.append(self._last is not before)
        return out

    monkeypatch.setattr(LastGram, "__call__", spy)
    model = custom(_SharedInput(), (3, 8), key="shared-input")
    for outputs in (("norms", "layer_norms"), ("norms", "clipped_mean", "mean")):
        built.clear()
        meta = check(model, make_batch(model, 4), segments=[3, 1], outputs=outputs)
        forms = {meta["form"][k] for k in ("q.weight", "k.weight", "v.weight")}
        assert forms == {"gram"}, meta["form"]
        assert built.count(False) >= 1, built  # read again, not built again


def _zero_answer(self: OuterSource, rows: int | None = None) -> dict[str, torch.Tensor]:
    """A planted wrong answer: zeros for the source's first parameter."""
    n = self.batch if rows is None else rows
    return {self.names[0]: torch.zeros((n, *self.shapes[self.names[0]]))}


def _mixed(pass1: Any) -> Any:
    """A planted wrong first pass: right for the first sample, the first parameter's dots
    doubled for the others (what a capture mixing samples would do)."""

    def mixed(self: OuterSource, need: Any, keep: bool = True) -> dict[str, Any]:
        out = pass1(self, need, keep)
        name = self.names[0]
        got = out[name]
        if got.dot is not None and got.dot.shape[0] > 1:
            dot = got.dot.clone()
            dot[1:] *= 2
            out[name] = replace(got, dot=dot)
        return out

    return mixed


class _Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(x))


@pytest.mark.parametrize("check_bytes", [TUNING.check_bytes, 1])
def test_the_probe_checks_the_written_gradients(
    monkeypatch: pytest.MonkeyPatch, check_bytes: int
) -> None:
    """A family whose written answer is wrong (its statistics right) loses the parameter to the
    whole-model replay, and the answer stays right: the sources' answers written all at once or
    one source at a time (each compared with every probe sample's gradients)."""

    monkeypatch.setattr(OuterSource, "answer", _zero_answer)
    monkeypatch.setattr(TUNING, "check_bytes", check_bytes)
    torch.manual_seed(0)
    model = custom(_Broken(), (4,), key=f"broken-answer-{check_bytes}")
    try:
        meta = check(model, make_batch(model, 4), outputs=GRADS)
    finally:
        PLANS.drop(lambda key: key[0] != model.structure)
    assert meta["method"] == {"lin.weight": "vmap", "lin.bias": "linear"}


def test_the_probe_checks_every_sample_not_only_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A family whose statistics are right for a batch's first sample and wrong for the others
    (what a capture mixing samples would do) loses the parameter to the whole-model replay:
    the check's batch of one cannot see it, its weighted dots over the probe do."""
    monkeypatch.setattr(OuterSource, "pass1", _mixed(OuterSource.pass1))
    torch.manual_seed(0)
    model = custom(_Broken(), (4,), key="broken-mixed")
    try:
        meta = check(model, make_batch(model, 4), outputs=("norms",))
    finally:
        PLANS.drop(lambda key: key[0] != model.structure)
    assert meta["method"] == {"lin.weight": "vmap", "lin.bias": "linear"}


class _Cast(nn.Module):
    """A float32 layer feeding a bfloat16 one through a cast of its own, as a partly cast
    model is."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.a = nn.Linear(16, width)
        self.b = nn.Linear(width, 4).to(torch.bfloat16)
        self.narrow = torch.bfloat16  # the loop's float64 copy casts to float64

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)).to(self.narrow)).float()


def _deep(dtype: torch.dtype) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(16, 64), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    return nn.Sequential(*layers, nn.LayerNorm(64), nn.Linear(64, 4)).to(dtype)


NARROW = {"bfloat16": lambda: _deep(torch.bfloat16), "float16": lambda: _deep(torch.float16),
          "mixed": _Cast}


def _narrow(module: nn.Module, outputs: tuple[str, ...]) -> dict[str, Any]:
    """The fast path's answers for ``module`` (its inputs in its first parameter's dtype, 16
    features) on 8 samples, each checked against the per-sample loop in float64 on the same
    weights to bfloat16's precision."""
    dtype = next(module.parameters()).dtype
    model = custom(module, (16,), dtype=str(dtype).removeprefix("torch."),
                   key=f"narrow-{type(module).__name__}-{dtype}")
    batch = make_batch(model, 8, reference=False)
    batch.inputs = batch.inputs.to(dtype)
    opts = Options(loss="cross_entropy", outputs=outputs, params=tuple(model.params))
    try:
        got = engine.compute(model, batch, opts, [8])[0]
    finally:
        PLANS.drop(lambda key: key[0] != model.structure)
    wide = copy.deepcopy(module).double()
    if isinstance(wide, _Cast):
        wide.narrow = torch.float64
    loop = per_sample_loop(wide, {"inputs": batch.inputs.double(), "targets": batch.targets},
                           "cross_entropy")
    if "norms" in outputs:
        torch.testing.assert_close(got["norms"].double(), loop.norms, rtol=3e-2, atol=0)
    for k, g in got.get("grads", {}).items():
        want = loop.grads[k]
        torch.testing.assert_close(g.double(), want, rtol=3e-2,
                                   atol=3e-2 * float(want.abs().max()), msg=k)
    meta: dict[str, Any] = got["meta"]
    return meta


@pytest.mark.parametrize("kind", list(NARROW))
def test_a_narrow_models_plan_is_checked_in_float32_and_keeps_every_layer(kind: str) -> None:
    """A bfloat16 or float16 model's plan, or one whose graph casts to bfloat16 itself, is
    checked on the probe in float32, to float32's bounds: every layer stays captured op by op
    (checked in the model's own dtypes, most of a bfloat16 network's layers and every layer of
    the cast one went to the whole-model replay, their rounding past those bounds), and the
    answers are the float64 loop's to the dtype's precision."""
    torch.manual_seed(0)
    meta = _narrow(NARROW[kind](), ("norms", "grads"))
    assert set(meta["method"].values()) <= {"linear", "direct"}, meta["method"]


@pytest.mark.parametrize("kind", ["bfloat16", "mixed"])
def test_a_narrow_models_check_still_finds_samples_mixed(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Checked in float32, a plan whose statistics mix samples (as in
    :func:`test_the_probe_checks_every_sample_not_only_the_first`) still loses its weights to
    the whole-model replay, and the answers stay the loop's."""
    monkeypatch.setattr(OuterSource, "pass1", _mixed(OuterSource.pass1))
    torch.manual_seed(0)
    meta = _narrow(NARROW[kind](), ("norms",))
    assert {k for k, v in meta["method"].items() if v == "vmap"} == {
        k for k in meta["method"] if k.endswith("weight") and not k.startswith("10.")}


class _Pooled(nn.Module):
    """A convolution over any image size, pooled to one value per channel."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(self.conv(x), 1).flatten(1))


def test_the_check_cuts_an_image_to_32x32_and_still_finds_a_wrong_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe's check runs a 40x40 image at 32x32 (``_plan.SPATIAL``: the same ops, a
    fraction of the work), and a convolution whose written answer is wrong there still loses
    its weight to the whole-model replay; the answers are the loop's."""
    sizes: list[tuple[int, ...]] = []
    run = _plan.forward_backward

    def spy(setup: Any, plan: Any, **kwargs: Any) -> Any:
        sizes.append(tuple(setup.samples["inputs"].shape[2:]))
        return run(setup, plan, **kwargs)

    monkeypatch.setattr(_plan, "forward_backward", spy)
    monkeypatch.setattr(ConvSource, "answer", _zero_answer)
    torch.manual_seed(0)
    model = custom(_Pooled(), (2, 40, 40), key="pooled-40")
    try:
        meta = check(model, make_batch(model, 4), outputs=GRADS)
    finally:
        PLANS.drop(lambda key: key[0] != model.structure)
    assert meta["method"]["conv.weight"] == "vmap"
    assert (32, 32) in sizes and (40, 40) in sizes, sizes


class _LoudInputs(nn.Module):
    """A linear layer fed inputs 1000x its output gradients' scale: the weight's dots with a
    random direction are about 10^4 times the bias's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(1000 * x)


def test_the_probe_finds_a_small_parameter_wrong_on_every_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bias whose per-sample gradients are 1.5x the true ones in every form the sources give
    (written, squared norm and dot alike, so they agree with one another) loses the bias to the
    whole-model replay, and the answers are the loop's: the forward-mode check scales each
    parameter's share to the largest's, where the bias's error (about 5e-5 of the summed
    dots) would pass unscaled."""
    init = Dense.__init__

    def loud(self: Dense, name: str, grads: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        init(self, name, grads * 1.5 if name == "lin.bias" else grads, *args, **kwargs)

    monkeypatch.setattr(Dense, "__init__", loud)
    torch.manual_seed(0)
    model = custom(_LoudInputs(), (64,), key="loud-inputs")
    try:
        meta = check(model, make_batch(model, 4), outputs=("norms", "grads"))
    finally:
        PLANS.drop(lambda key: key[0] != model.structure)
    assert meta["method"] == {"lin.weight": "linear", "lin.bias": "vmap"}


LONG_BFLOAT16_DOTS = """
import torch
from service.strategies.base import dots_with
torch.set_num_threads(1)
gen = torch.Generator().manual_seed(0)
rows = torch.randn(4, 393216, generator=gen).bfloat16()
refs = torch.randn(2, 393216, generator=gen).bfloat16()
want = rows.double() @ refs.double().t()
scale = float(want.abs().max())
torch.testing.assert_close(dots_with(rows, refs).double(), want, rtol=1e-2, atol=1e-2 * scale)
"""


def test_long_bfloat16_dots_keep_the_thin_side_on_the_left() -> None:
    """``dots_with`` of 4 bfloat16 rows of 393,216 elements with 2 references answers (in a
    child process). torch 2.13's oneDNN on a Xeon with AMX kills the process with SIGFPE for
    the other orientation, ``rows @ refs^T`` (at 393,216 elements and at least 2 references;
    327,680 passed): a worker, not one request, would die."""
    done = subprocess.run([sys.executable, "-c", LONG_BFLOAT16_DOTS], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("width", [1, 7, NORM_BLOCK, 3 * NORM_BLOCK, (1 << 22) + 123])
def test_squared_norms_of_long_rows_keep_float32_precision(width: int) -> None:
    """Each row's squared norm within 1e-6 (relative) of float64's, rows shorter than a block,
    whole blocks and a 4 M-element row with a tail alike. On the CPU one float32 accumulator
    over the 4 M-element row (``vector_norm`` of the whole row) is off by 2.5e-5."""
    gen = torch.Generator().manual_seed(4)
    rows = torch.rand((3, width), generator=gen) + 0.5
    want = rows.double().pow(2).sum(1)
    got = squared_norms(rows.reshape(3, -1, 1) if width > 1 else rows)
    assert got.dtype == torch.float32 and got.shape == (3,)
    assert float(((got.double() - want).abs() / want).max()) < 1e-6
    assert torch.equal(squared_norms(rows[:0]), torch.zeros(0))


@pytest.mark.parametrize("fused", [False, True])
def test_a_mean_norm_over_parameters_fused_or_in_blocks(
    fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The squared norm of a gradient over its parameters (tensors of several shapes, one
    longer than a block) as one fused norm, as a GPU takes it, or in blocks per tensor, as a
    CPU does: float64's, to 1e-6."""
    monkeypatch.setattr(base, "tree_reduces", lambda _device: fused)
    gen = torch.Generator().manual_seed(5)
    tensors = [torch.rand(shape, generator=gen) + 0.5
               for shape in [(3, 4), (7,), (2, NORM_BLOCK + 5), ()]]
    want = sum(float(t.double().pow(2).sum()) for t in tensors)
    got = base.squared_norm_sum(tensors)
    assert got.shape == () and got.dtype == torch.float32
    assert abs(float(got) - want) / want < 1e-6


def test_sized_as_on_an_accelerator_every_statistic_is_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pieces of per-sample gradients sized as on a GPU (a quarter of the memory budget: each
    layer's in one piece, where a CPU's cache takes several) and biases of several sizes in one
    group: every summary output over two segments as the loop gives it, and fewer pieces
    (these layers' per-sample gradients are not held for two passes here, though smaller than
    their inputs and output gradients: :func:`_stream.held`)."""
    pieces: list[int] = []  # each piece's first sample
    real = OuterSource.pieces

    def spy(self: OuterSource, *args: Any, **kwargs: Any) -> Any:
        for piece in real(self, *args, **kwargs):
            pieces.append(piece[0])
            yield piece

    monkeypatch.setattr(OuterSource, "pieces", spy)
    monkeypatch.setattr(TUNING, "piece_bytes", 256)  # a CPU's cache: several pieces a layer
    monkeypatch.setattr(TUNING, "min_rows", 1)
    layers = [_l("Linear", 6, 8), _l("ReLU"), _l("Linear", 8, 5), _l("LayerNorm", 5),
              _l("Flatten"), _l("Linear", 20, 3)]
    model = _sequential(layers, [4, 6])
    batch = make_batch(model, 5)
    monkeypatch.setattr(_stream, "held", lambda source, numel: source)
    outputs = ("norms", "variance", "cosine_mean", "clipped_mean", "mean")
    check(model, batch, segments=[2, 3], outputs=outputs)
    on_cpu = len(pieces)
    pieces.clear()
    with sized_as_on_an_accelerator():
        check(model, batch, segments=[2, 3], outputs=outputs)
    assert 0 < len(pieces) < on_cpu, (len(pieces), on_cpu)


def test_an_accelerator_takes_pieces_from_the_budget_a_cpu_from_its_cache() -> None:
    cpu, gpu = Budget(1 << 30), Budget(1 << 30, torch.device("cuda"))
    assert cpu.piece(8 << 20) == 8 << 20 and gpu.piece(8 << 20) == 1 << 28
    assert cpu.chunk(1 << 20, 1000) == 32 and gpu.chunk(1 << 20, 1000) == 256
    assert Budget(16 << 20).piece(8 << 20) == 4 << 20  # never past a quarter of the budget
