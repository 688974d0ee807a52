"""The ``margin`` loss (TRAK's output function, ``log(p / (1 - p))`` of the correct class):
per-sample gradients, losses and sketches against the per-sample loop, on both paths."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from psgrad._errors import InvalidInput
from service import engine
from service.engine import Options
from service.losses import LOSSES
from service.registry import load_model
from service.strategies.projection import Projection
from tests.support.batches import SMALL_TRANSFORMER, make_batch
from tests.support.reference import assert_close, per_sample_loop

CPU = torch.device("cpu")
CASES = [("simple-cnn", {}), ("mlp", {"sizes": [6, 5, 3]}), ("tiny-transformer", SMALL_TRANSFORMER)]


@pytest.mark.parametrize("fast", [True, False], ids=["fast_stats", "vmap"])
@pytest.mark.parametrize(("arch", "config"), CASES, ids=[c[0] for c in CASES])
def test_margin_gradients_are_the_per_sample_loop(arch: str, config: dict[str, Any],
                                                  fast: bool) -> None:
    model = load_model(arch, arch, config, device=CPU)
    batch = make_batch(model, 5, 1, loss="margin", reference=False)
    proj = Projection(64, 2)
    opts = Options("margin", ("grads", "losses", "norms", "projection"), tuple(model.params),
                   projection=proj)
    [got] = engine.compute(model, batch, opts, fast_stats=fast)
    loop = per_sample_loop(model.module, {"inputs": batch.inputs, "targets": batch.targets},
                           "margin")
    assert_close(got["grads"], loop.grads)
    assert_close(got["losses"], loop.losses)
    assert_close(got["norms"], loop.norms)
    assert_close(got["projection"],
                 sum(proj.project(k, g.double()) for k, g in loop.grads.items()))
    if fast:  # the batched form keeps it on the fast path
        assert got["meta"]["route"] == "fast_stats"


def test_margin_is_the_log_odds_and_stable_at_confident_scores() -> None:
    """``logit_y - logsumexp(others)``: finite where ``p`` rounds to 1 in float32, equal to
    ``log p - log(1 - p)`` where that is computable, and batched == one sample at a time."""
    loss = LOSSES["margin"]
    scores = torch.tensor([[2.0, -1.0, 0.5], [200.0, -300.0, 0.0], [0.0, 0.0, 0.0]])
    targets = torch.tensor([0, 0, 2])
    assert loss.batched is not None
    batched = loss.batched(scores, {"targets": targets})
    assert batched is not None
    value = batched[0]
    p = torch.softmax(scores[0].double(), 0)[0]
    assert torch.isclose(value[0].double(), torch.log(p / (1 - p)), atol=1e-6)
    assert torch.isclose(value[1], torch.tensor(200.0))  # p is 1.0 in float32: no inf
    assert torch.isclose(value[2], torch.log(torch.tensor(0.5)))  # p = 1/3
    for i in range(3):
        one, _ = loss.fn(lambda x, i=i: scores[i], {"inputs": scores[i],  # type: ignore[misc]
                                                    "targets": targets[i]}, 1.0)
        assert torch.isclose(one, value[i])


def test_margin_needs_two_classes() -> None:
    model = load_model("mlp", "mlp", {"sizes": [4, 1]}, device=CPU)
    batch = make_batch(model, 2, 0, loss="margin", reference=False)
    batch.targets = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(InvalidInput, match="at least two"):
        engine.compute(model, batch, Options("margin", ("grads",), tuple(model.params)))
