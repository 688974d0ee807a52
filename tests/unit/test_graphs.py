"""CUDA graphs of engine calls (service/graphs.py), as far as the CPU can check them.

The CPU has no graphs: with the setting on, nothing is captured there. The rest is checked with
the device test and the capture stood in for (``Replaying``: it runs the captured call again on
the graph's own input buffers and writes into its own output buffers, as a replay does): a class
is captured on its second call and replayed after, on new samples of its shape, answers equal
to the per-sample loop; what cannot be captured runs eager; the class is the exact shapes.
Whether graphs pay is measured only where a GPU is lent (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from service import engine, graphs
from service.engine import Batch, Options
from service.registry import load_model
from service.strategies.base import Call, Result
from tests.support.reference import assert_close, reference

OUTPUTS = ("norms", "clipped_mean", "variance")


def tensors(result: Result) -> list[torch.Tensor]:
    out = [result.losses, result.aux]
    for stats in result.params.values():
        for value in vars(stats).values():
            out += list(value) if isinstance(value, tuple) else [value] if value is not None \
                else []
    return out


class Replaying:
    """A stand-in graph: ``replay`` runs the captured call on the same buffers."""

    def __init__(self, eager: graphs.Eager, static: Call, result: Result) -> None:
        self.eager, self.static, self.result = eager, static, result
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for mine, again in zip(tensors(self.result), tensors(self.eager(self.static)),
                               strict=True):
            mine.copy_(again)


@pytest.fixture
def model() -> Any:
    return load_model("simple-cnn", "simple-cnn", None, device=torch.device("cpu"))


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The device test says CUDA; captures are stood in for and listed here."""
    made: list[Any] = []

    def capture(call: Call, eager: graphs.Eager) -> graphs.Captured:
        inputs = {k: v.clone() for k, v in call.samples.items()}
        static = replace(call, samples=inputs)
        result = eager(static)
        captured = graphs.Captured(Replaying(eager, static, result), inputs, result)
        made.append(captured)
        return captured

    monkeypatch.setattr(graphs, "_on_cuda", lambda call: True)
    monkeypatch.setattr(graphs, "_capture", capture)
    graphs.GRAPHS.clear()
    yield made
    graphs.GRAPHS.clear()


def batch(n: int, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    return Batch(inputs=torch.randn(n, 1, 28, 28, generator=gen),
                 targets=torch.randint(0, 10, (n,), generator=gen))


def answer(model: Any, b: Batch, opts: Options, **kw: Any) -> dict[str, Any]:
    got: dict[str, Any] = engine.compute(model, b, opts, [2, b.size - 2], **kw)[1]
    want = reference(model, b, opts, [2, b.size - 2])[1]
    for name in OUTPUTS:
        assert_close(got[name], want[name], name)
    return got


def opts_of(model: Any, outputs: tuple[str, ...] = OUTPUTS) -> Options:
    return Options(loss="nll", outputs=outputs, params=tuple(model.params), clip_norm=0.5)


def test_the_cpu_captures_nothing(model: Any) -> None:
    graphs.GRAPHS.clear()
    for seed in range(3):
        answer(model, batch(5, seed), opts_of(model), cuda_graphs=True)
    assert len(graphs.GRAPHS) == 0


def test_a_class_is_captured_on_its_second_call_and_replayed_after(
        model: Any, cuda: list[Any]) -> None:
    opts = opts_of(model)
    answer(model, batch(5, 0), opts, cuda_graphs=True)
    assert cuda == []  # the first call runs eager: the plan and the allocator warm
    answer(model, batch(5, 1), opts, cuda_graphs=True)
    assert len(cuda) == 1 and cuda[0].graph.replays == 1
    for seed in (2, 3):  # new samples of the same shapes: copied in, replayed, cloned out
        got = answer(model, batch(5, seed), opts, cuda_graphs=True)
    assert len(cuda) == 1 and cuda[0].graph.replays == 3
    buffers = {t.data_ptr() for t in tensors(cuda[0].result)}
    assert all(torch.as_tensor(v).data_ptr() not in buffers for v in got.values()
               if isinstance(v, torch.Tensor))


def test_a_call_that_cannot_be_captured_runs_eager(
        model: Any, cuda: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[Call] = []

    def refuse(call: Call, eager: graphs.Eager) -> graphs.Captured:
        tried.append(call)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", refuse)
    for seed in range(4):
        answer(model, batch(5, seed), opts_of(model), cuda_graphs=True)
    assert len(tried) == 1  # remembered: the class runs eager without trying again


def test_a_class_is_its_exact_shapes_and_samples_alone(model: Any, cuda: list[Any]) -> None:
    opts = opts_of(model)
    for n in (5, 6, 5, 6):
        answer(model, batch(n, n), opts, cuda_graphs=True)
    assert [c.inputs["inputs"].shape[0] for c in cuda] == [5, 6]
    call = engine.prepare(model, batch(5, 0), opts, [5])
    assert graphs.servable(call, True) and not graphs.servable(call, False)
    weighted = replace(call, params={**call.params, "fc1.bias": call.params["fc1.bias"] + 1})
    grads = engine.prepare(model, batch(5, 0), opts_of(model, ("grads",)), [5])
    assert not graphs.servable(weighted, True) and not graphs.servable(grads, True)
