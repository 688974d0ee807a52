"""Random request batches for the engine tests: inputs of the model's spec, targets of its loss,
and optionally a reference and per-call weights (fixed seeds)."""

from __future__ import annotations

import torch

from service.engine import Batch
from service.registry import LoadedModel

# The zoo's transformer at a size the per-sample loop runs in milliseconds.
SMALL_TRANSFORMER = {"vocab": 11, "seq_len": 5, "d_model": 8, "nhead": 2, "dim_ff": 16,
                     "layers": 2, "classes": 3}


def make_batch(
    model: LoadedModel,
    n: int,
    seed: int = 0,
    *,
    loss: str | None = None,
    reference: bool = True,
    weights: bool = False,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    spec = model.input
    if spec.dtype == "int64":
        x = torch.randint(0, spec.high or 2, (n, *spec.shape), generator=gen)
    else:
        x = torch.randn((n, *spec.shape), generator=gen)
    loss = loss or model.default_loss
    batch = Batch(inputs=x)
    if loss == "td0":
        batch.next_inputs = torch.randn(x.shape, generator=gen)
        batch.rewards = torch.randn(n, generator=gen)
        batch.dones = (torch.rand(n, generator=gen) < 0.3).float()
    elif loss == "mse":
        batch.targets = torch.randn((n, *model.output_shape), generator=gen)
    else:
        batch.targets = torch.randint(0, model.output_shape[-1], (n,), generator=gen)
    if reference:
        batch.reference = {k: torch.randn(v.shape, generator=gen) for k, v in model.params.items()}
    if weights:
        batch.weights = {
            k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in model.params.items()
        }
    return batch
