"""An exported program checked at the sizes and values a request sends, before it runs.

Registration bounds a program at its example sizes; a request may send any size within a
dynamic range, and a program's size arithmetic may peak anywhere in it (``zeros([(T - 2) *
(65538 - T)])`` is empty at both ends of 2..65536 and 4 GiB at T = 32769). So
:class:`RequestCheck` runs the program on ``meta`` at the sizes each request sends (nothing is
allocated; the result is cached per sizes) and refuses it past ``PSGRAD_MAX_MODEL_ACTIVATIONS``.

The same run records what every indexing op may read (:data:`INDEXING`: the rows of an
embedding, the size of the dimension ``index_select``, ``gather`` and ``index.Tensor`` index).
The values of their indices come from the request's integer inputs, through arithmetic
(``ids + 5``), or from the program's own buffers and constants: the part of the graph that
computes them (never its parameters) runs on the CPU on the request's inputs, and an index out
of range is refused with a 422 before the model runs, on any device. On a GPU an index out of
range is a device-side assert that kills the worker's CUDA context; on the CPU, an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import torch
from torch import fx
from torch.func import vmap

from models.examples import example
from psgrad._errors import InvalidInput, PsgradError, RefusedProgram
from service.export.graph import Program, device_of
from service.export.interpreter import ExportedModule, NodeWalk, named_args
from service.export.module import Exported, ExportLimits, build_module, dry_run, materialise
from service.lru import LockedLRU

aten = torch.ops.aten
Bound = tuple[int, int] | None  # an index's allowed [low, high), or None: not checked (a mask)


def _embedding(named: dict[str, Any]) -> list[Bound]:
    return [(0, named["weight"].shape[0])]


def _along(named: dict[str, Any]) -> list[Bound]:
    """``index_select`` and ``gather``: non-negative indices below the size of ``dim``."""
    x = named["self"]
    return [(0, x.shape[named["dim"] % x.dim()] if x.dim() else 1)]


def _index(named: dict[str, Any]) -> list[Bound]:
    """``x[i, j, ...]``: each integer index below its dimension's size (negative from its end);
    a boolean mask takes as many dimensions as it has, and is checked by torch itself."""
    x, cursor = named["self"], 0
    bounds: list[Bound] = []
    for t in named["indices"]:
        if t is None:
            cursor += 1
            bounds.append(None)
        elif t.dtype in (torch.bool, torch.uint8):
            cursor += t.dim()
            bounds.append(None)
        else:
            size = x.shape[cursor] if cursor < x.dim() else 0
            bounds.append((-size, size))
            cursor += 1
    return bounds


# op -> (the arguments holding indices, their bounds from the op's arguments on ``meta``)
INDEXING: dict[Any, tuple[str, Callable[[dict[str, Any]], list[Bound]]]] = {
    aten.embedding.default: ("indices", _embedding),
    aten.index_select.default: ("index", _along),
    aten.gather.default: ("index", _along),
    aten.index.Tensor: ("indices", _index),
}


@dataclass(frozen=True)
class Sized:
    """What the program does at one set of sizes: its activations and its indices' bounds."""

    activations: int
    bounds: tuple[Bound, ...]  # one per index tensor, in :attr:`RequestCheck.indices` order


class RequestCheck:
    """Sizes and indices of a request, checked against one program before its model runs.

    Built over a served module (its buffers and constants are the index part's inputs; its
    parameters are never read) and a ``meta`` twin of it (built on first use, for the runs at
    each new set of sizes).
    """

    def __init__(self, module: ExportedModule, program: Program,
                 meta: Callable[[], ExportedModule]) -> None:
        self.program = program
        self._module = module
        self._meta_of = meta
        self._meta: ExportedModule | None = None
        self._sized: LockedLRU[tuple[Any, ...], Sized] = LockedLRU(64)
        sites = [n for n in module.graph.nodes
                 if n.op == "call_function" and n.target in INDEXING]
        self.sites = tuple(n.name for n in sites)
        # every tensor an indexing op reads as indices: (the op, as named to a client, and
        # the node computing the indices)
        self._candidates: list[tuple[str, fx.Node]] = []
        for n in sites:
            arg = named_args(n.target, n.args, n.kwargs)[INDEXING[n.target][0]]
            for t in arg if isinstance(arg, list | tuple) else [arg]:
                if isinstance(t, fx.Node):
                    self._candidates.append((f"{n.target} ('{n.name}')", t))
        self._walk: tuple[NodeWalk, Any, tuple[int, ...]] | None = None

    def __call__(self, inputs: Sequence[torch.Tensor], max_activations: int) -> int:
        """The activations of one sample at these inputs' sizes; raises ``TooLarge`` past
        ``max_activations`` and ``InvalidInput`` for an index out of range."""
        sizes = tuple((1, *x.shape[1:]) for x in inputs)
        sized = self._sized.get_or_make((sizes, max_activations),
                                        lambda: self._measure(sizes, max_activations))
        if self._candidates:
            self._check_indices(inputs, sized)
        return sized.activations

    def _measure(self, sizes: tuple[tuple[int, ...], ...], limit: int) -> Sized:
        if self._meta is None:
            self._meta = self._meta_of()
        meta = self._meta
        seen: dict[str, list[Bound]] = {}

        def recording(step: Any) -> Any:
            op, (key, bounds_of) = step.target, INDEXING[step.target]

            def run(*args: Any, **kwargs: Any) -> Any:
                named = named_args(op, args, kwargs)
                arg = named[key]
                entries = arg if isinstance(arg, list | tuple) else [arg]
                seen[step.name] = [b for t, b in zip(entries, bounds_of(named), strict=True)
                                   if t is not None]
                return op(*args, **kwargs)

            return replace(step, target=run)

        walk = NodeWalk(tuple(recording(s) if s.name in self.sites else s
                              for s in meta.walk.steps), meta.walk.arity)
        _, activations = dry_run(meta, self.program, limit, sizes=sizes, walk=walk)
        bounds = [b for name in self.sites for b in seen.get(name, ())]
        return Sized(activations, tuple(bounds))

    def _index_part(self, sized: Sized) -> tuple[NodeWalk, Any, tuple[int, ...]]:
        """The walk computing the integer indices (a mask's bound is None: torch checks a
        mask's shape itself), the tensors it reads, and which of the bounds are theirs."""
        if self._walk is None:
            chosen = tuple(i for i, b in enumerate(sized.bounds) if b is not None)
            walk, attrs = _index_walk(self._module.graph,
                                      [self._candidates[i][1] for i in chosen])
            params = {k for k, _ in self._module.named_parameters()}
            tensors = dict(self._module.named_parameters()) | dict(self._module.named_buffers())
            # parameters as meta tensors: an index computed from them is found (and refused),
            # never computed from weights a request may replace
            self._walk = walk, _tree({k: tensors[k].to("meta" if k in params else "cpu")
                                      for k in attrs}), chosen
        return self._walk

    def _check_indices(self, inputs: Sequence[torch.Tensor], sized: Sized) -> None:
        walk, attrs, chosen = self._index_part(sized)
        if not chosen:
            return

        def one(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(walk.run(attrs, [x.unsqueeze(0) for x in xs]))

        try:
            with torch.no_grad():
                values = vmap(one)(*(x.to("cpu") for x in inputs))
        except PsgradError:
            raise
        except Exception as exc:  # the client's graph, on the client's inputs
            raise InvalidInput(f"the program fails on these inputs where it computes its "
                               f"indices: {exc}"[:400]) from None
        for i, value in zip(chosen, values, strict=True):
            name, bound = self._candidates[i][0], sized.bounds[i]
            assert bound is not None
            if value.device.type == "meta":
                raise RefusedProgram(f"the indices of {name} are computed from the program's "
                                     "parameters: psgrad checks every index before a model "
                                     "runs, and cannot check these", op=name)
            if not value.numel():
                continue
            low, high = int(value.min()), int(value.max())
            if low < bound[0] or high >= bound[1]:
                raise InvalidInput(
                    f"{name} would read index {high if high >= bound[1] else low} of a "
                    f"dimension of size {bound[1]}: with these inputs the program indexes out "
                    "of range (send ids within what the model's tables hold)", op=name,
                    low=low, high=high, size=bound[1])


def _index_walk(graph: fx.Graph, wanted: Sequence[fx.Node]) -> tuple[NodeWalk, list[str]]:
    """The part of ``graph`` that computes ``wanted`` (every placeholder kept, so it takes the
    program's inputs), and the attributes it reads. The serving device is the CPU here."""
    needed: set[fx.Node] = set()
    stack = list(wanted)
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        if not (n.op == "call_function" and n.target is device_of):
            stack.extend(n.all_input_nodes)
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: list[str] = []
    for n in graph.nodes:
        if n.op == "placeholder":
            env[n] = sub.placeholder(n.name)
        elif n in needed:
            if n.op == "call_function" and n.target is device_of:
                env[n] = sub.call_function(_cpu, ())
                continue
            if n.op == "get_attr":
                attrs.append(str(n.target))
            env[n] = sub.node_copy(n, lambda m: env[m])
            if n.target is aten.sym_size.int:  # vmap has no rule for the op; shapes it has
                env[n].target = _size
    sub.output(tuple(env[n] for n in wanted))
    return NodeWalk.of(sub), attrs


def _size(x: torch.Tensor, dim: int) -> int:
    return int(x.shape[dim])


def _cpu() -> torch.device:
    return torch.device("cpu")


def _tree(tensors: dict[str, torch.Tensor]) -> Any:
    """Dotted names as nested attributes (what a walk's ``get_attr`` steps read)."""
    root = SimpleNamespace()
    for name, value in tensors.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                setattr(node, part, SimpleNamespace())
            node = getattr(node, part)
        setattr(node, leaf, value)
    return root


def check_example(exported: Exported, limits: ExportLimits) -> None:
    """At registration: the program's indices checked, then one forward on the CPU with its own
    tensors and an example input. A program that fails here (an embedding row its buffer holds
    out of range, say) would fail every request; it is refused now, with what failed."""
    module = materialise(exported, torch.device("cpu"))
    specs = {k: (list(t.shape), t.dtype) for k, t in exported.tensors.items()}
    program = exported.program
    check = RequestCheck(module, program, lambda: build_module(
        program, specs, exported.params, exported.aliases, torch.device("meta")))
    gen = torch.Generator().manual_seed(1)
    xs = [example(u.hints[1:], u.dtype, exported.highs.get(u.name), 1, gen)
          for u in program.inputs]
    try:
        check(xs, limits.max_activations)
    except InvalidInput as exc:
        raise RefusedProgram(f"on an example input: {exc.message}", **exc.details) from None
    try:
        with torch.no_grad():
            module(*xs)
    except Exception as exc:  # the client's graph, on its own weights
        raise RefusedProgram(f"the program fails on the CPU with its own tensors and an "
                             f"example input: {exc}"[:400]) from None
