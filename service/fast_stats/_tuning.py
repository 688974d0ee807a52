"""The thresholds that choose between ways to one answer, in one place to read and to set.

Each chooses how a statistic is computed (in cache-sized pieces or whole, by the CPU's numba
loops or eager torch, by unfolding a convolution's fields or by its weight-gradient kernel),
never what it is: the answer is the same to rounding on every setting. The defaults are what
was measured fastest (the figures are beside the code each one steers). A test sets one on
:data:`TUNING` to walk a path the defaults would not take at a test's small sizes, and checks
the answer against the per-sample loop.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Tuning:
    """The fast path's thresholds; sizes in bytes are what a CPU's cache holds (an accelerator
    takes a quarter of the call's budget instead: :meth:`Budget.piece`)."""

    fused: bool = True  # the CPU's numba loops where they apply (False: eager torch everywhere)
    block_bytes: int = 16 << 10  # one block of the loops' columns, every sample's: an L1 cache
    chunk_bytes: int = 32 << 20  # a chunk's transient tensors (:meth:`Budget.chunk`)
    piece_bytes: int = 8 << 20  # variance's, dots' and cosine's per-sample gradients per piece
    min_rows: int = 128  # output rows of a piece at least (:meth:`OuterSource.piece_shape`)
    whole_piece_bytes: int = 64 << 20  # cosine's pieces with every sample of a segment in each
    check_bytes: int = 64 << 20  # one sample's written gradients of one group the plan checks
    fold_min_field: float = 64  # a convolution's in_channels / groups * kernel elements, and
    fold_min_positions: float = 100  # its output positions per sample, to fold (conv.folded)
    # how much faster per operation the weight-gradient convolution materialises per-sample
    # gradients than the Gram form's batched matmuls of unfolded fields run (ResNet-18's 14x14
    # layers at B=32 on an AVX-512 host: the convolution near 200 GFLOP/s, the Gram products
    # near 100, and unfolding copies every receptive field first)
    fold_gain: float = 2.0
    few_channels: int = 16  # input channels per group under which a CPU convolves per sample


TUNING = Tuning()
