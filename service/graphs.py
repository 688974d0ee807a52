"""CUDA graphs of an engine call: captured once per class of calls, replayed after.

A small batch on a GPU is launch-bound: the H200 run took 1.9-8.5x a plain step at B=4, most of
it the CPU launching kernels. With ``PSGRAD_CUDA_GRAPHS`` on and the model on CUDA, the engine's
call (the strategy that serves it, fast statistics first) is captured as a CUDA graph the second
time its *class* is seen (the first call runs eager and warms the plan and the allocator) and
replayed from then on.

The class is the model version, the options, the segments and every sample field's dtype and
exact shape (batch size and length): a graph's buffers have one shape. The capture's inputs are
the samples alone, copied into the graph's own buffers before each replay; the parameters are
the model's own tensors, which keep their addresses while the model is loaded. So a call with
per-call weights, references or sketches, or one that returns full per-sample gradients, runs
eager. What cannot be captured (a call that reads a value back to the host, as planning does)
raises during capture: its class is remembered as eager, and the call answers eagerly, the same.
Outputs are cloned out of the graph's buffers, so an answer never changes under a later replay.
On the CPU there is nothing to capture: the setting changes nothing there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from service.lru import LockedLRU
from service.strategies.base import Call, ParamStats, Result, Tensors

log = logging.getLogger(__name__)

__all__ = ["GRAPHS", "Captured", "graph_key", "run", "servable"]

Eager = Callable[[Call], Result]
CAPTURE_AFTER = 1  # eager calls of a class before it is captured (the plan, the allocator)


@dataclass
class Captured:
    """One class's graph: its input buffers and the result its replay writes."""

    graph: Any  # torch.cuda.CUDAGraph (anything with replay())
    inputs: Tensors
    result: Result


@dataclass
class _Seen:
    calls: int = 0
    captured: Captured | None = None
    eager: bool = False  # capture failed: this class runs eager


GRAPHS: LockedLRU[tuple[Any, ...], _Seen] = LockedLRU(64)


def servable(call: Call, enabled: bool) -> bool:
    """Whether ``call`` may run from a graph: enabled, on CUDA, its inputs the samples alone."""
    model = call.model
    return (enabled and _on_cuda(call) and not call.need.grads
            and not call.reference and not call.references and call.sketches is None
            and all(call.params[k] is v for k, v in model.params.items()))


def _on_cuda(call: Call) -> bool:
    return call.model.device.type == "cuda"


def graph_key(call: Call) -> tuple[Any, ...]:
    return (call.model.ref, str(call.model.device), call.opts, call.bounds,
            tuple((k, v.dtype, tuple(v.shape)) for k, v in call.samples.items()))


def run(call: Call, eager: Eager, enabled: bool,
        capture: Callable[[Call, Eager], Captured] | None = None) -> Result:
    """``eager(call)``, or its class's graph replayed on the call's samples."""
    if not servable(call, enabled):
        return eager(call)
    seen = GRAPHS.get_or_make(graph_key(call), _Seen)
    if seen.captured is not None:
        return _replay(seen.captured, call)
    seen.calls += 1
    if seen.eager or seen.calls <= CAPTURE_AFTER:
        return eager(call)
    try:
        seen.captured = (capture or _capture)(call, eager)
    except Exception as exc:  # a host sync or an op graphs refuse: eager from now on
        seen.eager = True
        log.info("model %s runs eager at %s: its call cannot be captured as a CUDA graph (%s)",
                 call.model.ref, graph_key(call)[-1], str(exc).splitlines()[0][:200])
        return eager(call)
    return _replay(seen.captured, call)


def _capture(call: Call, eager: Eager) -> Captured:
    inputs = {k: v.clone() for k, v in call.samples.items()}
    static = replace(call, samples=inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up capture needs, on a side stream
        eager(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = eager(static)
    return Captured(graph, inputs, result)


def _replay(captured: Captured, call: Call) -> Result:
    for k, v in call.samples.items():
        captured.inputs[k].copy_(v)
    captured.graph.replay()
    return _cloned(captured.result)


def _cloned(result: Result) -> Result:
    def out(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, tuple):
            return tuple(out(v) for v in value)
        return value

    params = {k: ParamStats(**{f.name: out(getattr(s, f.name)) for f in fields(ParamStats)})
              for k, s in result.params.items()}
    return Result(losses=out(result.losses), aux=out(result.aux), params=params,
                  meta=dict(result.meta), sketch=out(result.sketch))
