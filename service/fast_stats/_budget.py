"""How much memory the transient per-sample tensors of one call may take."""

from __future__ import annotations


class Budget:
    """Memory for transient per-sample tensors and for caching them between the two passes."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = max(1 << 20, budget_bytes)
        self.cache_left = self.budget // 4

    def chunk(self, bytes_per_sample: int, batch: int, work: int = 32 << 20) -> int:
        """Samples per chunk so that one chunk's transient tensors take about ``work`` bytes:
        big enough for efficient kernels, small next to the activations a backward holds."""
        limit = min(self.budget // 4, work)
        return max(1, min(batch, limit // max(1, bytes_per_sample)))

    def reserve(self, nbytes: int) -> bool:
        """Take ``nbytes`` of the cache's share, if that much is left."""
        if nbytes <= self.cache_left:
            self.cache_left -= nbytes
            return True
        return False
