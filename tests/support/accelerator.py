"""Fast statistics as a GPU runs them, on any device: what they do there, checked or counted
here (no GPU is needed to run the same operations, only to time them)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from unittest import mock

import torch

from service.fast_stats import TUNING, strategy
from service.fast_stats._budget import Budget
from service.fast_stats.families import conv
from service.strategies import base


@contextmanager
def sized_as_on_an_accelerator() -> Iterator[None]:
    """Pieces of per-sample gradients sized as on a GPU (a quarter of the memory budget, each
    layer's in one piece where it fits), norms taken as reductions that add in a tree (one norm
    of a long row, a mean's over its parameters fused), and every convolution's per-sample
    weight gradients with the batch folded into groups; the CPU's fused loops off (a GPU runs
    torch's operations)."""
    def budget(nbytes: int, _device: torch.device) -> Budget:
        return Budget(nbytes, torch.device("cuda"))

    folded = partial(conv.weight_grad, folded=True)
    with mock.patch.object(strategy, "Budget", budget), \
            mock.patch.object(base, "tree_reduces", lambda _device: True), \
            mock.patch.object(conv, "weight_grad", folded), \
            mock.patch.object(TUNING, "fused", False):
        yield
