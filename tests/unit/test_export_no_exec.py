"""No generated code, pickle or sympy on an exported program's path: reading, building, running.

``torch.fx.GraphModule`` writes Python source for its graph and ``exec``s it; psgrad's
:class:`~service.export.interpreter.ExportedModule` walks the graph node by node instead. These
tests run the whole path (the loader, the worker's rebuild from a stored version, the engine's
vmap route) with ``exec``, ``eval``, ``compile``, pickle, ``torch.load`` and ``sympy.sympify``
replaced by functions that fail, and with an audit hook that fails on any ``exec``, ``compile``,
unpickling or ``dlopen`` event (it also sees code that imported those functions under names of
its own, and C code). The results must still equal the per-sample loop on the original module.

Warm-up: torch (and psgrad) may import modules lazily on a first use, and an import executes
the module's code. So before anything is trapped, the same path runs once on another model
("cnn"): imports are then done, and what the trapped run does is the path itself. (Run alone,
the tests also pass without it: exporting the test's own models first imports all the path
needs. It is kept so that no order of tests can make them fail for an import.)
"""

from __future__ import annotations

import builtins
import pickle
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import numpy as np
import pytest
import sympy
import torch
from torch import fx
from torch.func import functional_call, grad, vmap
from torch.overrides import TorchFunctionMode

from service import engine
from service.config import Settings
from service.export import ExportLimits, materialise, read_program
from service.registration import register_exported
from service.registry import ModelRegistry
from service.validate import parse_request
from tests.support.export import CASES, TOL, exported, exported_hf, token_batch
from tests.support.reference import Loop, per_sample_loop

CPU = torch.device("cpu")
AUDITED = ("exec", "compile", "pickle.find_class", "ctypes.dlopen")
_events: list[tuple[str, str]] | None = None  # recording while a list


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _events is not None and event in AUDITED:
        _events.append((event, repr(args)[:200]))


sys.addaudithook(_audit)  # hooks cannot be removed: it records only inside ``trapped()``


def _refuse(name: str) -> Any:
    def raiser(*_a: Any, **_k: Any) -> Any:
        raise AssertionError(f"{name} was called on the exported program's path")
    return raiser


@contextmanager
def trapped() -> Iterator[list[tuple[str, str]]]:
    """Inside: exec, eval, compile, pickle, torch.load and sympify raise; the audit events seen
    are recorded in the list it yields (empty when the path executed nothing)."""
    global _events
    events: list[tuple[str, str]] = []
    with pytest.MonkeyPatch.context() as mp:
        for owner, name in ((builtins, "exec"), (builtins, "eval"), (builtins, "compile"),
                            (pickle, "loads"), (pickle, "load"), (torch, "load"),
                            (sympy, "sympify")):
            mp.setattr(owner, name, _refuse(f"{owner.__name__}.{name}"))
        _events = events
        try:
            yield events
        finally:
            _events = None


def _register(data: bytes, loss: str) -> ModelRegistry:
    """A registry holding ``data`` as model 'm', registered as the api does (in a child)."""
    registry = ModelRegistry(CPU)
    register_exported(registry, "m", data, Settings(redis_url=None, model_dir=None, device="cpu"),
                      default_loss=loss, losses=[])
    return registry


def _numpy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _numpy(v) for k, v in value.items()}
    return value.numpy()


def _serve(registry: ModelRegistry, batch: dict[str, Any]) -> dict[str, Any]:
    """The engine's vmap route on the version rebuilt from the store, as a worker builds it."""
    fresh = ModelRegistry(CPU, store=registry.store)  # nothing cached: ExportedFamily.build
    parsed = parse_request({"model": "m", "outputs": ["grads", "norms"], **_numpy(batch)}, fresh)
    answer: dict[str, Any] = engine.compute(parsed.model, parsed.batch, parsed.opts,
                                            fast_stats=False)[0]
    return answer


def _check(answer: dict[str, Any], want: Loop) -> None:
    for k, g in want.grads.items():
        np.testing.assert_allclose(np.asarray(answer["grads"][k]), g.numpy(), **TOL, err_msg=k)
    np.testing.assert_allclose(answer["norms"], want.norms.numpy(), **TOL)


def _vmap_grads(name: str, data: bytes, x: torch.Tensor, y: torch.Tensor
                ) -> dict[str, torch.Tensor]:
    """read_program, materialise, then functional_call + vmap(grad), in this process."""
    case = CASES[name]
    loaded = read_program(data, ExportLimits())
    module = materialise(loaded, CPU)
    params = {k: loaded.tensors[k] for k in loaded.params}
    buffers = {k: v for k, v in loaded.tensors.items() if k not in params}

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return case.loss(functional_call(module, (p, buffers), (xi.unsqueeze(0),)), xi, yi)

    return vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)  # type: ignore[no-any-return]


@cache
def _warm_up() -> None:
    case = CASES["cnn"]
    x, y = case.example(2), case.target(2)
    _vmap_grads("cnn", exported("cnn")[1], x, y)
    _serve(_register(exported("cnn")[1], "cross_entropy"), {"inputs": x, "targets": y})


@pytest.mark.parametrize(("name", "loss"), [("resnet", "cross_entropy"), ("gpt", "next_token")])
def test_loading_building_and_running_execute_no_code(name: str, loss: str) -> None:
    _warm_up()
    case, (module, data) = CASES[name], exported(name)
    x, y = case.example(3), case.target(3)
    targets = y if loss == "cross_entropy" else x  # next_token: the ids themselves
    registry = _register(data, loss)  # the child is an interpreter of its own: not trapped here
    with trapped() as events:
        got = _vmap_grads(name, data, x, y)
        answer = _serve(registry, {"inputs": x, "targets": targets})
    assert events == []
    want = per_sample_loop(module, {"inputs": x, "targets": targets}, loss)
    assert set(got) == set(want.grads)
    for k, g in want.grads.items():
        torch.testing.assert_close(got[k], g, **TOL, msg=k)
    _check(answer, want)


def test_a_hugging_face_gpt2_runs_without_generated_code() -> None:
    pytest.importorskip("transformers")
    _warm_up()
    module, data = exported_hf("gpt2")
    ids, mask = token_batch(3, 6)  # exported at 8: the dynamic length
    registry = _register(data, "next_token")
    batch = {"inputs": {"input_ids": ids, "attention_mask": mask}, "targets": ids, "mask": mask}
    with trapped() as events:
        read_program(data, ExportLimits())
        answer = _serve(registry, batch)
    assert events == []
    _check(answer, per_sample_loop(module, batch, "next_token"))


def test_the_traps_catch_a_graph_module() -> None:
    """The traps are not vacuous: fx's own module, built from the same graph, is caught by each."""
    module = materialise(read_program(exported("cnn")[1], ExportLimits()), CPU)
    with trapped() as events, pytest.raises(AssertionError, match=r"builtins\.compile"):
        fx.GraphModule(module, module.graph)
    global _events
    _events = events  # the audit hook alone, the functions left as they are
    try:
        fx.GraphModule(module, module.graph)
    finally:
        _events = None
    assert {"compile", "exec"} <= {e for e, _ in events}


class _Calls(TorchFunctionMode):
    """Every torch function called, with the names of the tracked tensors among its arguments."""

    def __init__(self, tracked: dict[int, str]) -> None:
        super().__init__()
        self.tracked = tracked
        self.calls: list[tuple[Any, tuple[str, ...]]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        flat = [*args, *(kwargs or {}).values()]
        flat = [t for v in flat for t in (v if isinstance(v, list | tuple) else (v,))]
        self.calls.append((func, tuple(self.tracked[id(t)] for t in flat
                                       if isinstance(t, torch.Tensor) and id(t) in self.tracked)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["resnet", "gpt"])
def test_the_walk_makes_the_calls_fx_generated_code_makes(name: str) -> None:
    """What a TorchFunctionMode sees under ``functional_call`` (fast statistics' capture) is what
    it saw with fx's module: the same functions in the same order, reading the tensors passed
    in (not the module's own) in the same places, and the same output."""
    loaded = read_program(exported(name)[1], ExportLimits())
    module = materialise(loaded, CPU)
    reference = fx.GraphModule(module, module.graph)  # the test may exec: it is not the path
    params = {k: loaded.tensors[k].clone() for k in loaded.params}
    buffers = {k: v for k, v in loaded.tensors.items() if k not in params}
    tracked = {id(v): k for k, v in params.items()}
    x = CASES[name].example(2)[:1]
    seen = []
    for m in (module, reference):
        with torch.no_grad(), _Calls(tracked) as mode:
            out = functional_call(m, (params, buffers), (x,))
        seen.append((mode.calls, out))
    (walked, out), (generated, want) = seen
    assert walked == generated
    assert {n for _, names in walked for n in names} == set(params)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
