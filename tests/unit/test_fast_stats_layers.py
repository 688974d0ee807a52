"""Every allow-listed layer type through the fast path, against stock torch one sample at a time.

The reference gradients come from :mod:`tests.support.reference`'s per-sample loop over
:mod:`tests.support.layers`' stock ``torch.nn`` models (``nn.GRU`` itself, not psgrad's unrolled
copy) loaded with the same weights.
"""

from __future__ import annotations

import pytest
import torch

from models.sequential import LAYERS
from service import engine
from service.engine import Batch, Options
from service.registry import LoadedModel, load_model
from tests.support.layers import CASES, Case, perturbed, reference_model
from tests.support.reference import (
    SUMMARY,
    assert_close,
    assert_output,
    per_sample_loop,
    summarize,
)

OUTPUTS = tuple(k for k in SUMMARY if k != "losses")
ONE_PASS = tuple(k for k in OUTPUTS if k != "clipped_mean")
CLOSED = {
    "Linear": "linear",
    "Conv1d": "conv",
    "Conv2d": "conv",
    "Conv3d": "conv",
    "Embedding": "embedding",
    "BatchNorm1d": "batch_norm",
    "BatchNorm2d": "batch_norm",
    "BatchNorm3d": "batch_norm",
    "RNN": "linear",
    "GRU": "linear",
    "LSTM": "linear",
}


def test_every_allowed_type_has_a_case() -> None:
    assert {layer["type"] for case in CASES for layer in case.layers} == set(LAYERS)


def loaded(case: Case) -> tuple[LoadedModel, dict[str, torch.Tensor]]:
    """The case's model with perturbed weights, and those weights (for the stock model)."""
    spec = case.spec()
    config = {k: spec[k] for k in ("layers", "input", "default_loss")}
    cpu = torch.device("cpu")
    base = load_model(case.name, "sequential", config, device=cpu)
    state = perturbed({**base.params, **base.buffers})
    return load_model(case.name, "sequential", config, state, device=cpu), state


@pytest.mark.parametrize("outputs", [OUTPUTS, ONE_PASS], ids=["two-passes", "one-pass"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_allowed_layer_type(case: Case, outputs: tuple[str, ...]) -> None:
    """Every statistic, with a clipped mean (a second pass over what the backward pass left) and
    without (each layer's statistics taken as the backward pass reaches it)."""
    model, state = loaded(case)
    x, y = case.batch(4)
    gen = torch.Generator().manual_seed(5)
    reference = {k: torch.randn(v.shape, generator=gen) for k, v in model.params.items()}
    batch = Batch(inputs=x, targets=y, reference=reference)
    opts = Options(loss=case.loss, outputs=outputs, params=tuple(model.params), clip_norm=0.5)
    segments = [1, 3]
    fast = engine.compute(model, batch, opts, segments)
    slow = engine.compute(model, batch, opts, segments, fast_stats=False)
    stock = per_sample_loop(reference_model(case, state), {"inputs": x, "targets": y}, case.loss)
    loop = summarize(stock, segments, clip_norm=opts.clip_norm, reference=batch.reference)
    for f, s, r, n in zip(fast, slow, loop, segments, strict=True):
        assert f["meta"]["route"] == "fast_stats"
        for name in outputs:
            assert_output(name, f, s, "(fast vs vmap)", samples=n)
            assert_output(name, f, r, "(fast vs stock torch loop)", samples=n)
    methods = fast[0]["meta"]["method"]
    for i, layer in enumerate(case.layers):
        for name, method in methods.items():
            if name.startswith(f"{i}.") and layer["type"] in CLOSED:
                assert method == CLOSED[layer["type"]], name
            elif name.startswith(f"{i}."):  # norms, Bilinear, ConvTranspose: per-op replay
                assert method in ("direct", "linear"), name  # attention: linear projections


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_grads_of_every_allowed_layer_type(case: Case) -> None:
    """Each layer's per-sample gradients as the fast path writes them, against stock torch."""
    model, state = loaded(case)
    x, y = case.batch(4)
    opts = Options(loss=case.loss, outputs=("grads",), params=tuple(model.params))
    fast = engine.compute(model, Batch(inputs=x, targets=y), opts, [1, 3])
    stock = per_sample_loop(reference_model(case, state), {"inputs": x, "targets": y}, case.loss)
    for f, r in zip(fast, summarize(stock, [1, 3]), strict=True):
        assert f["meta"]["route"] == "fast_stats"
        assert_close(f["grads"], r["grads"], "grads (fast vs stock torch loop)")
