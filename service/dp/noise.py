"""Gaussian noise that the holder of the model cannot predict or replay.

The bits come from the operating system's CSPRNG (``os.urandom``: ``getrandom(2)`` on Linux, a
ChaCha20 stream reseeded from the kernel's entropy pool), 64 bits per uniform, turned into
standard normals by the Box-Muller transform in float64 and then scaled and cast to the
gradient's dtype. No seed exists, so none can be chosen, echoed or leaked; a generator such as
torch's Mersenne Twister seeded from a secret would be predictable from enough of its output.

What this does not address: Box-Muller over floating point is not an exact Gaussian, and its
rounding can in principle leak through the low bits (Mironov 2012 on the Laplace mechanism;
attacks on floating-point Gaussian samplers, Jin et al. 2022). Users who need that guarantee
need a discrete Gaussian with secure rounding, which psgrad does not implement.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch


def secure_normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
    """N(0, std^2) per element, float64 on the CPU, from the OS CSPRNG."""
    n = math.prod(shape)
    pairs = (n + 1) // 2
    raw = np.frombuffer(os.urandom(16 * pairs), dtype=np.uint64).reshape(2, pairs)
    u1 = ((raw[0] >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53  # (0, 1]: log is finite
    u2 = (raw[1] >> np.uint64(11)).astype(np.float64) * 2.0**-53  # [0, 1)
    radius = np.sqrt(-2.0 * np.log(u1))
    angle = 2.0 * np.pi * u2
    z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:n]
    return torch.from_numpy(z * std).reshape(shape)
