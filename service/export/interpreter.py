"""The module of an exported program: its tensors, and a forward that walks the graph node by node.

``torch.fx.GraphModule`` turns its graph into Python source and ``exec``s it (when it is built
and on every ``recompile``), then runs that generated code on every forward. psgrad promises that
nothing on a client archive's path is executed, evaluated or unpickled, so the checked graph is
never turned into code: :class:`NodeWalk` reads the ``fx.Graph`` once into a tuple of
:class:`Step` records (plain data: the allow-listed callable, its arguments with earlier values
as slots) and :meth:`NodeWalk.run` calls them in order. Constructing an ``fx.Graph`` and its nodes
generates no code; only ``GraphModule`` and ``Graph.python_code`` do, and neither is used here.

The walk does what the generated code did: a placeholder is the next input, a ``get_attr`` reads
the module's attribute at call time (so ``functional_call`` sees its swapped tensors), a call is
``target(*args, **kwargs)`` (so a ``TorchFunctionMode`` sees each aten call), and a value is
dropped after its last use (so intermediates are freed as early as before).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn


class _Slot:
    """An earlier node's value in a step's arguments: its index in the walk's value list."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


@dataclass(frozen=True, slots=True)
class Step:
    """One node of the graph.

    ``op`` is fx's: ``placeholder`` (``target``: the input's position), ``get_attr``
    (``target``: the attribute path), ``call_function`` (``target``: the callable the graph
    builder put there, from the allow-list) or ``output``. ``free``: the values whose last use is
    this step, dropped once it has run.
    """

    op: str
    name: str
    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    free: tuple[int, ...]


Hook = Callable[[Step, Any], None]


def _slots(value: Any, index: dict[fx.Node, int]) -> Any:
    """``value`` (a node's argument) with every node replaced by the slot of its value, and fx's
    immutable lists and dicts made plain ones (what the ops receive, as from fx's code)."""
    if isinstance(value, fx.Node):
        return _Slot(index[value])
    if isinstance(value, list):
        return [_slots(v, index) for v in value]
    if isinstance(value, tuple):
        return tuple(_slots(v, index) for v in value)
    if isinstance(value, dict):
        return {k: _slots(v, index) for k, v in value.items()}
    return value


_NESTED = (list, tuple, dict)


def _fill(value: Any, values: list[Any]) -> Any:
    """``value`` with every slot replaced by its value; lists are new ones on every call, as in
    fx's code, so no op can change the graph's literals."""
    if type(value) is _Slot:
        return values[value.index]
    if type(value) is list or type(value) is tuple:
        return type(value)(_fill(v, values) for v in value)
    if type(value) is dict:
        return {k: _fill(v, values) for k, v in value.items()}
    return value


def _args(args: tuple[Any, ...], values: list[Any]) -> list[Any]:
    """:func:`_fill` of a call's positional arguments, unrolled one level: most are slots or
    numbers, and this is the walk's inner loop."""
    return [values[a.index] if type(a) is _Slot else _fill(a, values) if type(a) in _NESTED
            else a for a in args]


@dataclass(frozen=True)
class NodeWalk:
    """A graph read into steps, run by :meth:`run` without generating any code."""

    steps: tuple[Step, ...]
    arity: int  # placeholders: the inputs a call takes

    @classmethod
    def of(cls, graph: fx.Graph) -> NodeWalk:
        nodes = list(graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        last: dict[int, int] = {}  # value -> the step that uses it last
        for i, node in enumerate(nodes):
            for used in node.all_input_nodes:
                last[index[used]] = i
        free: dict[int, list[int]] = {}
        for value, step in last.items():
            free.setdefault(step, []).append(value)
        steps, arity = [], 0
        for i, node in enumerate(nodes):
            dropped = free.get(i, []) + ([i] if not node.users and node.op != "output" else [])
            if node.op == "placeholder":
                target: Any = arity
                arity += 1
            elif node.op == "get_attr":
                target = tuple(str(node.target).split("."))
            elif node.op in ("call_function", "output"):
                target = node.target
            else:
                raise ValueError(f"node '{node.name}': '{node.op}' nodes are not run here")
            steps.append(Step(node.op, node.name, target, _slots(node.args, index),
                              _slots(node.kwargs, index), tuple(dropped)))
        if not steps or steps[-1].op != "output":
            raise ValueError("the graph must end with its output")
        return cls(tuple(steps), arity)

    def run(self, module: nn.Module, inputs: Sequence[Any], hook: Hook | None = None) -> Any:
        """The graph's output for ``inputs``; ``hook(step, value)`` sees every value computed."""
        if len(inputs) != self.arity:
            raise TypeError(f"the program takes {self.arity} inputs, got {len(inputs)}")
        values: list[Any] = [None] * len(self.steps)
        for i, step in enumerate(self.steps):
            if step.op == "call_function":
                out = step.target(*_args(step.args, values),
                                  **(_fill(step.kwargs, values) if step.kwargs else {}))
            elif step.op == "get_attr":
                out = module
                for part in step.target:
                    out = getattr(out, part)
            elif step.op == "placeholder":
                out = inputs[step.target]
            else:
                return _fill(step.args[0], values)
            if hook is not None:
                hook(step, out)
            values[i] = out
            for j in step.free:
                values[j] = None
        raise AssertionError("unreachable: NodeWalk.of checks that the graph ends in its output")


def named_args(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """An aten op's arguments by their schema names."""
    schema = target._schema.arguments
    return {a.name: args[i] if i < len(args) else kwargs[a.name] for i, a in enumerate(schema)
            if i < len(args) or a.name in kwargs}


class ExportedModule(nn.Module):
    """An exported program's tensors (parameters and buffers under their dotted names, so
    ``state_dict``, ``named_parameters`` and ``functional_call`` see them as usual) and its graph,
    run node by node."""

    def __init__(self, graph: fx.Graph) -> None:
        super().__init__()
        self.graph = graph
        self.walk = NodeWalk.of(graph)

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.walk.run(self, inputs)


# attribute names a tensor of the program may not take: the module's own
RESERVED = frozenset(dir(ExportedModule)) | {"graph", "walk"}
