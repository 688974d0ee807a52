"""Sketches (``proj``) on the fast path: each source's part, in its family's structured form.

Kept apart from the statistics' two passes: a sketch needs neither norms nor means, only one
more look at what each source holds (a Linear's or a convolution's inputs and output gradients,
an embedding's token rows, or materialised gradients for the rest).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from service.fast_stats._source import Source
from service.strategies.base import Call, ParamStats


def with_sketches(call: Call, found: Sequence[Source], params: dict[str, ParamStats]
                  ) -> dict[str, ParamStats]:
    """``params`` with each parameter's part of the sketches, when the call needs them."""
    projection = call.opts.projection
    if not call.need.proj:
        return params
    assert projection is not None, "validation asks for a projection with 'proj'"
    parts = {}
    with torch.no_grad():  # the captured inputs are part of the forward graph
        for source in found:
            parts.update(source.project(projection))
    return {k: replace(p, proj=parts[k]) for k, p in params.items()}
