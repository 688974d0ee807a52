"""How much memory the transient per-sample tensors of one call may take."""

from __future__ import annotations

import torch

from service.fast_stats._tuning import TUNING


class Budget:
    """Memory for transient per-sample tensors and for caching them between the two passes.

    On a CPU a chunk or piece is sized to stay in cache while what is read from it runs. On an
    accelerator every operation is a kernel launch paid on the host (a plain step of BERT-base
    at B=4 took 35 ms on an H200, one aten operation in 23 us), so pieces there are as large as
    a quarter of the budget allows: one per layer where it fits, not one per cache-sized slice.
    """

    def __init__(self, budget_bytes: int, device: torch.device | None = None) -> None:
        self.budget = max(1 << 20, budget_bytes)
        self.cache_left = self.budget // 4
        self.cached = device is None or device.type == "cpu"  # sized for a CPU's cache

    def piece(self, cache_bytes: int) -> int:
        """Bytes of one piece of transient tensors: ``cache_bytes`` on a CPU, a quarter of the
        budget on an accelerator."""
        return min(self.budget // 4, cache_bytes if self.cached else self.budget)

    def chunk(self, bytes_per_sample: int, batch: int, work: int | None = None) -> int:
        """Samples per chunk so that one chunk's transient tensors take about ``work`` bytes
        (``TUNING.chunk_bytes`` unless given) on a CPU (:meth:`piece`): big enough for
        efficient kernels, small next to the activations a backward holds."""
        work = TUNING.chunk_bytes if work is None else work
        return max(1, min(batch, self.piece(work) // max(1, bytes_per_sample)))

    def reserve(self, nbytes: int) -> bool:
        """Take ``nbytes`` of the cache's share, if that much is left."""
        if nbytes <= self.cache_left:
            self.cache_left -= nbytes
            return True
        return False
