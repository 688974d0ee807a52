"""Random example batches, and a batch's outputs computed one sample at a time.

Registration runs a model on a batch and on each of its samples alone before it serves whole
batches (zoo and ``sequential`` models in :mod:`service.registry`, exported programs whose
batch was made generic in :mod:`service.export.batch`): a model whose output for one sample
depends on the others, or that only runs right on a batch of one, must not be batched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def example(shape: Sequence[int], dtype: torch.dtype, high: int | None, n: int,
            gen: torch.Generator) -> torch.Tensor:
    """``n`` random samples: integers and booleans below ``high`` (2 if None), else normal."""
    if dtype.is_floating_point:
        return torch.randn((n, *shape), generator=gen, dtype=dtype)
    return torch.randint(0, high or 2, (n, *shape), generator=gen).to(dtype)


def one_at_a_time(module: Callable[..., torch.Tensor],
                  inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The outputs of each sample run alone (a batch of one), stacked as the batch's would be."""
    return torch.cat([module(*(x[i : i + 1] for x in inputs)) for i in range(len(inputs[0]))])
