"""Sketches (``proj``) on the fast path: each source's part, in its family's structured form.

Kept apart from the statistics' two passes: a sketch needs neither norms nor means, only one
more look at what each source holds (a Linear's or a convolution's inputs and output gradients,
an embedding's token rows, or materialised gradients for the rest). Only the sum over the
selected parameters is ever answered, so every source adds its part into one ``[B, k]`` buffer
(no buffer per parameter to allocate and add up) and the small dense ones go in together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.fast_stats._source import Source
from service.strategies.base import Call


def sketch(call: Call, found: Sequence[Source]) -> torch.Tensor | None:
    """Each sample's sketch over the selected parameters, ``[B, k]``, when the call needs it."""
    projection = call.opts.projection
    if not call.need.proj:
        return None
    assert projection is not None, "validation asks for a projection with 'proj'"
    out = torch.zeros((call.size, projection.k), dtype=call.model.dtype,
                      device=call.model.device)
    with torch.no_grad():  # the captured inputs are part of the forward graph
        for source in found:
            source.project(projection, out)
    return out
