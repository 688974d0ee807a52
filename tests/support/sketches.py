"""The figure sketches are held to: the worst pairwise inner-product error over per-sample
gradients, ``max |<Pa, Pb> - <a, b>| / (|a| |b|)``, against a dense Gaussian projection's.

The dense reference needs no ``[P, k]`` matrix: a Gaussian projection is rotation invariant, so
the sketches of B gradients have the distribution of the sketches of their coordinates in an
orthonormal basis of their span (rows of the Cholesky factor of their Gram matrix, ``[B, B]``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

import torch

from service import engine
from service.engine import Batch, Options
from service.registry import LoadedModel, load_model
from service.strategies.projection import Projection
from tests.support.batches import make_batch
from tests.support.reference import per_sample_loop


def in_fresh_processes(code: str, runs: int = 2) -> list[Any]:
    """What ``code`` prints (JSON) in ``runs`` fresh interpreters, each importing this checkout
    (the working directory, then any PYTHONPATH) the way this process does."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    return [json.loads(subprocess.run([sys.executable, "-c", code], check=True, env=env,
                                      capture_output=True, text=True).stdout)
            for _ in range(runs)]


def zoo_gradients(arch: str, n: int) -> tuple[LoadedModel, Batch, torch.Tensor]:
    """A zoo model in its default configuration, a batch of ``n`` and its per-sample gradients
    by the loop, flattened over every parameter, ``[n, P]`` float64."""
    model = load_model(arch, arch, {}, device=torch.device("cpu"))
    batch = make_batch(model, n, 0, reference=False)
    loop = per_sample_loop(model.module, {"inputs": batch.inputs, "targets": batch.targets},
                           model.default_loss)
    return model, batch, torch.cat([g.reshape(n, -1).double() for g in loop.grads.values()], 1)


def worst_pair(sketches: torch.Tensor, gram: torch.Tensor) -> float:
    """``max |<Pa, Pb> - <a, b>| / (|a| |b|)`` over every pair, each sample with itself too."""
    norms = gram.diagonal().sqrt()
    return float(((sketches @ sketches.t() - gram).abs() / torch.outer(norms, norms)).max())


def dense_worst(gram: torch.Tensor, k: int, seed: int) -> float:
    """The worst pair of a dense Gaussian ``[k, P] / sqrt(k)`` projection, from the Gram matrix."""
    eye = torch.eye(len(gram), dtype=gram.dtype)
    coords = torch.linalg.cholesky(gram + 1e-12 * gram.diagonal().mean() * eye)
    gen = torch.Generator().manual_seed(10_000 + seed)
    gauss = torch.randn(len(gram), k, generator=gen, dtype=gram.dtype) / math.sqrt(k)
    return worst_pair(coords @ gauss, coords @ coords.t())


def service_sketches(model: LoadedModel, batch: Batch, proj: Projection,
                     fast: bool = True) -> torch.Tensor:
    """The service's ``projection`` output of ``batch`` (fast path, or ``vmap``), float64."""
    opts = Options(model.default_loss, ("projection",), tuple(model.params), projection=proj)
    [got] = engine.compute(model, batch, opts, fast_stats=fast)
    return got["projection"].double()  # type: ignore[no-any-return]
