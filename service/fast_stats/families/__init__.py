"""The layer families, one module each; importing them registers them (one line per family)."""

from service.fast_stats.families import add, batch_norm, conv, embedding, layer_norm, linear

__all__ = ["add", "batch_norm", "conv", "embedding", "layer_norm", "linear"]
