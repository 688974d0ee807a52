"""The layer families, one module each; importing them registers them (one line per family)."""

from service.fast_stats.families import add, conv, embedding, layer_norm, linear

__all__ = ["add", "conv", "embedding", "layer_norm", "linear"]
