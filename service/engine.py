"""The per-sample gradient engine: prepare a call, let a strategy fill the records, assemble.

One call computes every requested output for a batch that may hold several jobs (``segments``):
per-sample outputs are split back per job, and statistics (``mean``, ``variance``,
``clipped_mean``, ``cosine_mean``) are computed per job, never over the merged batch.

The strategies (:mod:`service.strategies`) are tried in order: fast statistics
(:mod:`service.fast_stats`, when enabled: no per-sample gradient materialised where a layer
family has a closed form) and then ``vmap`` (:mod:`service.strategies.vmap`, every model and
output). A strategy that cannot serve a call declines and the next one runs. Both fill the same
per-parameter records, and :mod:`service.outputs` turns them into the answer, so every output
means the same whichever strategy computed it; ``meta["method"]`` says how each parameter was
computed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from psgrad._errors import InvalidInput
from service import curvature, graphs
from service.fast_stats import FastStats, SharedPlans
from service.outputs import assemble, need_of
from service.outputs import output_bytes as _output_bytes
from service.registry import LoadedModel
from service.strategies.base import Batch, Call, Options, Result, Strategy, bounds_of
from service.strategies.per_sample import per_sample_fn, warm_up
from service.strategies.vmap import Vmap, chunk_size

if TYPE_CHECKING:
    from service.compile_cache import CompiledFunctions

__all__ = ["Batch", "Options", "chunk_size", "compute", "lock_for", "output_bytes",
           "per_sample_fn", "prepare", "warm_up"]

PER_SAMPLE_GRADS = frozenset({"grads", "updates"})  # outputs that keep every per-sample gradient
_VMAP = Vmap()
_STRATEGIES: tuple[Strategy, ...] = (FastStats(), _VMAP)
# functional_call swaps a module's parameters in place for the duration of a call, so two
# threads running the same module (or the cached per-sample function built on a module of the
# same structure) would read each other's parameters and get zero gradients. One lock per
# structure, striped over a fixed set so that the locks never grow with the models served.
_LOCKS = tuple(threading.Lock() for _ in range(64))


def compute(model: LoadedModel, batch: Batch, opts: Options,
            segments: Sequence[int] | None = None, *, budget_bytes: int = 1 << 30,
            compiled: CompiledFunctions | None = None, fast_stats: bool = True,
            on_norms: Callable[[torch.Tensor], None] | None = None,
            plans: SharedPlans | None = None,
            planning: Callable[[bool], None] | None = None,
            cuda_graphs: bool = False) -> list[dict[str, Any]]:
    """Every requested output, for each segment of the batch (one segment per job).

    With ``compiled`` (``PSGRAD_COMPILE=1``) the per-sample function runs under torch.compile
    in padded pieces of preferred sizes (:mod:`service.compile_cache`); results are the same.
    With ``fast_stats`` (``PSGRAD_FAST_STATS``, default on) fast statistics are tried first.
    ``on_norms`` gets the whole batch's per-sample gradient norms ``[B]`` when the outputs needed
    squared norms anyway (the status page's histogram); it never makes the call compute them.
    ``plans``: where fast statistics' plans are shared beyond this process (Redis, or the data
    directory), so that a model planned once is not planned again; ``planning`` is told when
    the call plans (True) and when that ends (False). ``cuda_graphs``
    (``PSGRAD_CUDA_GRAPHS``): on CUDA, a class of calls seen before replays its graph
    (:mod:`service.graphs`).
    """
    segments = list(segments or [batch.size])
    if sum(segments) != batch.size:
        raise ValueError(f"segments {segments} do not add up to the batch size {batch.size}")
    call = prepare(model, batch, opts, segments, budget_bytes=budget_bytes, compiled=compiled,
                   plans=plans, planning=planning)
    # compiled functions (PSGRAD_COMPILE=1) are the vmap strategy's: per-sample gradients go
    # through them; summaries still take fast statistics when those apply
    vmap_only = not fast_stats or (compiled is not None and call.need.grads)
    strategies = (_VMAP,) if vmap_only else _STRATEGIES
    with lock_for(model):
        try:
            result = graphs.run(call, partial(_run, strategies), cuda_graphs)
        except RuntimeError as exc:  # an op refusing autocast's mixed dtypes is the request's
            if opts.autocast == "off" or isinstance(exc, torch.OutOfMemoryError):
                raise
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise InvalidInput(
                f"model '{model.id}' does not run under autocast {opts.autocast} on "
                f"{model.device.type} ({first}): leave 'autocast' out",
                autocast=opts.autocast) from exc
    return assemble(call, result, on_norms)


def lock_for(model: LoadedModel) -> threading.Lock:
    """The lock held while anything runs ``model``'s module through ``functional_call`` (the
    engine's strategies, and the verification loop of :mod:`service.verify`). Not reentrant."""
    return _LOCKS[hash(model.structure or model.ref) % len(_LOCKS)]


def prepare(model: LoadedModel, batch: Batch, opts: Options, segments: Sequence[int], *,
            budget_bytes: int = 1 << 30, compiled: CompiledFunctions | None = None,
            plans: SharedPlans | None = None,
            planning: Callable[[bool], None] | None = None) -> Call:
    """The call a strategy sees: per-call weights applied, every tensor on the model's device."""
    device = model.device
    weights = {k: v.to(device, model.dtype) for k, v in batch.weights.items()}
    return Call(
        model=model,
        opts=opts,
        params={**model.params, **weights},
        samples={k: v.to(device) for k, v in batch.samples().items()},
        reference={k: v.to(device, model.dtype) for k, v in batch.reference.items()},
        references={k: v.to(device, model.dtype) for k, v in batch.references.items()},
        sketches=None if batch.sketches is None else batch.sketches.to(device, model.dtype),
        bounds=bounds_of(segments),
        need=need_of(opts.outputs, opts),
        budget_bytes=budget_bytes,
        compiled=compiled,
        plans=plans,
        planning=planning,
    )


def _run(strategies: Sequence[Strategy], call: Call) -> Result:
    for strategy in strategies:
        result = strategy.run(call)
        if result is not None:
            return result
    raise RuntimeError("no strategy served the call (the last one never declines)")


def output_bytes(model: LoadedModel, opts: Options, batch_size: int) -> int:
    """Bytes of the answer, to refuse an oversized result before computing it."""
    n_selected = sum(model.params[k].numel() for k in opts.params)
    itemsize = torch.finfo(model.dtype).bits // 8
    factors = curvature.factor_numel(model, opts.params) if "kfac_inputs" in opts.outputs else 0
    return (_output_bytes(opts.outputs, len(opts.params), n_selected, batch_size, itemsize, opts)
            + factors * itemsize)
