"""Exported programs on whole batches: the traced batch of one made generic, then checked.

``torch.export`` traces at a batch of one. Some graphs take the batch size from their input
everywhere (the CNNs); others keep that 1 as a literal (GPT-2's attention ``view([1, T, H,
D])``, Hugging Face's mask builders' ``arange(1)``). Fast statistics run the model once on the
whole batch, so at registration (in the child process) each program is tried at a batch of
:data:`BATCH` on ``meta``, and these rewrites are made where that run needs them:

- ``required``: a view, reshape or expand whose leading size is a literal 1 while its input
  carries the batch gets the batch there;
- ``batch``: a 1 the exporting code took from the batch size, though nothing it reads carries
  the batch: ``arange(1)``, the leading 1 of an expand or of a factory (``zeros([1, ...])``);
- ``lift``: an embedding whose indices every sample shares (positions, ``[1, T]``) reads them
  expanded to the batch, so its output, and the gradient there, is per sample (what fast
  statistics capture).

Every rewrite is written into the program document: one node ``sym_size.int(first input, 0)``
gives the batch, a rewritten literal names it, a lifted embedding reads ``expand(indices,
[batch, -1, ...])``. The stored program is that document, so every worker rebuilds it through
the same strict builder and allow-list (both ops are on it); at a batch of one each rewrite is
the identity. The widest set of rewrites that passes is kept: all three kinds, else without
``batch``, else ``required`` alone. It passes when the program gives a batch of
:data:`BATCH` at a batch of :data:`BATCH` on ``meta`` and, on the CPU with the real weights and
random inputs (integer ones below their token bounds), the batch's outputs equal its samples'
run one at a time. Otherwise the program is kept as it came and runs one sample at a time
(the vmap route), as it always could.
"""

from __future__ import annotations

import copy
import math
import resource
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx

from models.examples import example, one_at_a_time
from service.export.graph import Program, parse_program
from service.export.interpreter import ExportedModule, named_args
from service.export.module import (
    Exported,
    ExportLimits,
    build_module,
    dry_run,
    largest_sizes,
    materialise,
)

BATCH = 3
BATCH_NAME = "psgrad_batch"
TIERS = (("required", "batch", "lift"), ("required", "lift"), ("required",))
_ATEN = "torch.ops.aten."
_LEADING = {f"{_ATEN}view.default": "size", f"{_ATEN}reshape.default": "shape",
            f"{_ATEN}expand.default": "size"}
_FACTORIES = {f"{_ATEN}{op}": "size" for op in (
    "zeros.default", "ones.default", "full.default", "new_zeros.default", "new_ones.default",
    "new_full.default")}
_ARANGES = {f"{_ATEN}arange.{k}" for k in ("default", "start", "start_step")}
_EMBEDDING = f"{_ATEN}embedding.default"
_EXPAND = f"{_ATEN}expand.default"


@dataclass(frozen=True)
class Site:
    """A node the batch run may rewrite: its place in the document and the argument."""

    index: int
    kind: str  # "leading" (view, reshape, expand), "factory", "arange" or "lift" (embedding)
    arg: str


@dataclass(frozen=True)
class Choice:
    site: Site
    label: str  # "required", "batch" or "lift"
    rank: int = 0  # a lifted embedding's number of index dimensions


def make_batched(exported: Exported, limits: ExportLimits) -> tuple[Program, str]:
    """The program to store, and why it does not serve whole batches ("" when it does: its
    rewrites checked).

    Serving whole batches is an optimisation: whatever goes wrong here (a graph that fails at a
    batch, numbers that differ, the CPU budget spent) leaves the program as it came, on the
    vmap route, and says why; it never refuses a registration (the program's own run on the
    CPU, :func:`service.export.guard.check_example`, comes first and refuses what fails).
    """
    deadline = _deadline(limits.batch_check_s)
    tried: set[tuple[Choice, ...]] = set()
    reason = "no rewrite of its batch of one ran at a batch"
    for tier in TIERS:
        if time.process_time() > deadline:
            return exported.program, "checking a batch took longer than its CPU budget"
        try:
            choices = _choose(exported, tier)
            if choices is None or choices in tried:
                continue
            tried.add(choices)
            program = rewrite(exported.program, choices) if choices else exported.program
        except Exception as exc:  # a client's graph: any failure leaves it on one sample
            reason = f"rewriting its batch failed: {exc}"[:300]
            continue
        reason = _checked(replace(exported, program=program), deadline)
        if not reason:
            return program, ""
    return exported.program, reason


def _deadline(budget_s: float) -> float:
    """When the check gives up (CPU time): after ``budget_s``, and never past half of what the
    process's CPU limit leaves, so checking a batch never makes a registration fail."""
    now = time.process_time()
    soft, _ = resource.getrlimit(resource.RLIMIT_CPU)
    if soft == resource.RLIM_INFINITY:
        return now + budget_s
    return min(now + budget_s, now + (soft - now) / 2)


def _sites(program: Program) -> Iterator[Site]:
    for i, node in enumerate(program.doc["graph_module"]["graph"]["nodes"]):
        target, named = node["target"], {a["name"]: a.get("arg") for a in node["inputs"]}
        if target in _LEADING and _leading_one(named.get(_LEADING[target])):
            yield Site(i, "leading", _LEADING[target])
        elif target in _FACTORIES and _leading_one(named.get(_FACTORIES[target])):
            yield Site(i, "factory", _FACTORIES[target])
        elif target in _ARANGES and _is_int(named.get("end"), 1) and \
                _is_int(named.get("start", {"as_int": 0}), 0) and \
                _is_int(named.get("step", {"as_int": 1}), 1):
            yield Site(i, "arange", "end")
        elif target == _EMBEDDING:
            yield Site(i, "lift", "indices")


def _is_int(arg: Any, value: int) -> bool:
    """``{"as_int": value}`` (or as a symbolic int that is a literal)."""
    if isinstance(arg, dict) and "as_sym_int" in arg:
        arg = arg["as_sym_int"]
    return isinstance(arg, dict) and type(arg.get("as_int")) is int and arg["as_int"] == value


def _leading_one(arg: Any) -> bool:
    """A size list whose first entry is the literal 1."""
    if not isinstance(arg, dict):
        return False
    if "as_ints" in arg:
        items = arg["as_ints"]
        return isinstance(items, list) and bool(items) and type(items[0]) is int and \
            items[0] == 1
    items = arg.get("as_sym_ints")
    return isinstance(items, list) and bool(items) and _is_int(items[0], 1)


def _module(exported: Exported, device: torch.device,
            values: dict[str, fx.Node] | None = None) -> ExportedModule:
    specs = {k: (list(t.shape), t.dtype) for k, t in exported.tensors.items()}
    return build_module(exported.program, specs, exported.params, exported.aliases, device,
                        values=values)


def _meta_inputs(program: Program, batch: int, *, largest: bool = False) -> list[torch.Tensor]:
    return [torch.empty([batch, *(largest_sizes(u) if largest else u.hints)[1:]], dtype=u.dtype,
                        device="meta") for u in program.inputs]


def _choose(exported: Exported, allowed: Sequence[str]) -> tuple[Choice, ...] | None:
    """The rewrites a run at a batch of :data:`BATCH` on ``meta`` needs (None: it fails)."""
    values: dict[str, fx.Node] = {}
    module = _module(exported, torch.device("meta"), values)
    graph = next(iter(values.values())).graph
    nodes = exported.program.doc["graph_module"]["graph"]["nodes"]
    sites = {}
    for site in _sites(exported.program):
        out = (nodes[site.index]["outputs"] or [{}])[0].get("as_tensor", {}).get("name")
        if out in values:
            sites[values[out]] = site
    ones: dict[fx.Node, tuple[int, ...]] = {}
    try:
        _Shapes(module, graph, ones).run(*_meta_inputs(exported.program, 1))
        trial = _Trial(module, graph, sites, ones, allowed)
        out = trial.run(*_meta_inputs(exported.program, BATCH))
    except Exception:  # any failure of a client's graph at a batch: it stays on one sample
        return None
    if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != BATCH:
        return None
    return tuple(trial.chosen)


class _Shapes(fx.Interpreter):
    """The batch-of-one run: every tensor's shape, by its node."""

    def __init__(self, module: torch.nn.Module, graph: fx.Graph,
                 shapes: dict[fx.Node, tuple[int, ...]]) -> None:
        super().__init__(module, graph=graph)
        self.shapes = shapes

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.shapes[n] = tuple(out.shape)
        return out


class _Trial(fx.Interpreter):
    """The run at a batch of :data:`BATCH`, deciding each site as it comes and running it so."""

    def __init__(self, module: torch.nn.Module, graph: fx.Graph, sites: dict[fx.Node, Site],
                 ones: dict[fx.Node, tuple[int, ...]], allowed: Sequence[str]) -> None:
        super().__init__(module, graph=graph)
        self.sites, self.ones, self.allowed = sites, ones, allowed
        self.chosen: list[Choice] = []

    def run_node(self, n: fx.Node) -> Any:
        site = self.sites.get(n)
        if site is None:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        named = named_args(n.target, args, kwargs)
        label, rank = self._decide(n, site, named)
        if label in self.allowed:
            if site.kind == "lift":
                ids = named["indices"]
                named["indices"] = ids.expand(BATCH, *ids.shape[1:])
            elif site.kind == "arange":
                named["end"] = BATCH
            else:
                named[site.arg] = [BATCH, *named[site.arg][1:]]
            self.chosen.append(Choice(site, label, rank))
        return n.target(**named)  # type: ignore[operator]

    def _decide(self, n: fx.Node, site: Site, named: dict[str, Any]) -> tuple[str, int]:
        if site.kind in ("factory", "arange"):
            return "batch", 0
        nodes = named_args(n.target, n.args, n.kwargs)
        if site.kind == "lift":
            ids, before = named["indices"], self.ones.get(nodes["indices"], ())
            shared = ids.dim() >= 1 and ids.shape[0] == 1 and before[:1] == (1,)
            return ("lift", ids.dim()) if shared else ("", 0)
        x, before = named["self"], self.ones.get(nodes["self"], ())
        if n.target is torch.ops.aten.expand.default:
            size = named["size"]
            carries = x.dim() == len(size) and x.shape[0] == BATCH and before[:1] == (1,)
            return ("required" if carries else "batch"), 0
        carries = x.numel() == BATCH * math.prod(before) != 0
        return ("required" if carries else ""), 0


def rewrite(program: Program, choices: Sequence[Choice]) -> Program:
    """``program`` with ``choices`` written into its document (parsed again, as a client's)."""
    doc = copy.deepcopy(program.doc)
    nodes = doc["graph_module"]["graph"]["nodes"]
    taken = _names(doc)
    batch = _fresh(BATCH_NAME, taken)
    before: dict[int, list[dict[str, Any]]] = {}
    for choice in choices:
        site = choice.site
        arg = next(a for a in nodes[site.index]["inputs"] if a["name"] == site.arg)
        if site.kind == "lift":
            ids = arg["arg"]["as_tensor"]["name"]
            name = _fresh(f"{BATCH_NAME}_ids", taken)
            size = [{"as_name": batch}, *[{"as_int": -1}] * (choice.rank - 1)]
            before.setdefault(site.index, []).append(
                _call(_EXPAND, [("self", {"as_tensor": {"name": ids}}),
                                ("size", {"as_sym_ints": size})], {"as_tensor": {"name": name}}))
            arg["arg"] = {"as_tensor": {"name": name}}
        elif site.kind == "arange":
            arg["arg"] = {"as_sym_int": {"as_name": batch}}
        else:
            value = arg["arg"]
            items = ([{"as_int": v} for v in value["as_ints"]] if "as_ints" in value
                     else list(value["as_sym_ints"]))
            arg["arg"] = {"as_sym_ints": [{"as_name": batch}, *items[1:]]}
    out = [_call(f"{_ATEN}sym_size.int",
                 [("self", {"as_tensor": {"name": program.inputs[0].name}}),
                  ("dim", {"as_int": 0})], {"as_sym_int": {"as_name": batch}})]
    for i, node in enumerate(nodes):
        out.extend(before.get(i, ()))
        out.append(node)
    doc["graph_module"]["graph"]["nodes"] = out
    # the stored document has no range constraints to read dynamic sizes from again
    return replace(parse_program(doc, max_nodes=len(out)), inputs=program.inputs)


def _call(target: str, inputs: list[tuple[str, Any]], output: dict[str, Any]) -> dict[str, Any]:
    return {"target": target, "inputs": [{"name": k, "arg": v, "kind": 1} for k, v in inputs],
            "outputs": [output]}


def _names(value: Any) -> set[str]:
    """Every value name in a document (graph inputs, node outputs)."""
    found: set[str] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            for k, item in v.items():
                if k in ("name", "as_name") and isinstance(item, str):
                    found.add(item)
                else:
                    stack.append(item)
        elif isinstance(v, list):
            stack.extend(v)
    return found


def _fresh(name: str, taken: set[str]) -> str:
    out, k = name, 0
    while out in taken:
        k += 1
        out = f"{name}_{k}"
    taken.add(out)
    return out


def _checked(exported: Exported, deadline: float) -> str:
    """Batch one as before, a batch of :data:`BATCH` on ``meta`` (at the largest dynamic sizes
    too), then the batch's numbers against its samples' one at a time on the CPU: "" when all
    hold, else what did not."""
    program = exported.program
    try:
        meta = _module(exported, torch.device("meta"))
        shape, _ = dry_run(meta, program, 1 << 62)
        if shape != exported.output_shape:
            return f"at a batch of one its output became {list(shape)}"
        for largest in (False, True) if any(u.dynamic for u in program.inputs) else (False,):
            out = meta(*_meta_inputs(program, BATCH, largest=largest))
            if not isinstance(out, torch.Tensor) or out.shape[:1] != (BATCH,):
                return f"a batch of {BATCH} did not give {BATCH} outputs"
        if time.process_time() > deadline:
            return "checking a batch took longer than its CPU budget"
        return _same_numbers(exported, deadline)
    except Exception as exc:  # a client's graph that fails at a batch stays on one sample
        return f"it fails at a batch of {BATCH}: {exc}"[:300]


SHORT = 8  # the size each dynamic dimension takes when a batch's numbers are compared


def _same_numbers(exported: Exported, deadline: float) -> str:
    """A batch's outputs against its samples' one at a time, on the CPU with the program's own
    tensors: where every dynamic dimension takes :data:`SHORT` (or the bottom of its range),
    else at the exported sizes. What is compared, the batch's rewrites, does not change with a
    length; GPT-2 small's comparison took 2.3 s at its exported 64 positions."""
    program = exported.program
    module = materialise(exported, torch.device("cpu"))
    hints = [list(u.hints) for u in program.inputs]
    short = [list(u.hints) for u in program.inputs]
    for sizes, u in zip(short, program.inputs, strict=True):
        for dim, low, _, _ in u.dynamic:
            sizes[dim + 1] = max(low, min(sizes[dim + 1], SHORT))
    if short != hints:
        try:
            return _compared(exported, module, short, deadline)
        except Exception:  # sizes its graph does not take: compare at its own
            pass
    return _compared(exported, module, hints, deadline)


def _compared(exported: Exported, module: ExportedModule, sizes: list[list[int]],
              deadline: float) -> str:
    gen = torch.Generator().manual_seed(1)
    xs = [example(s[1:], u.dtype, exported.highs.get(u.name), BATCH, gen)
          for s, u in zip(sizes, exported.program.inputs, strict=True)]
    with torch.no_grad():
        start = time.process_time()
        first = module(*(x[:1] for x in xs))
        if start + (time.process_time() - start) * (2 * BATCH + 1) > deadline:
            return "checking a batch would take longer than its CPU budget"
        batched = module(*xs)
        singles = torch.cat([first, one_at_a_time(module, [x[1:] for x in xs])])
    if batched.shape != singles.shape or not batched.dtype.is_floating_point:
        return "its output at a batch is not its samples' outputs stacked"
    tol = max(1e-4, 10 * torch.finfo(batched.dtype).eps)
    scale = max(1.0, float(singles.abs().nan_to_num().max()))
    if torch.allclose(batched, singles, rtol=tol, atol=tol * scale, equal_nan=True):
        return ""
    return "a batch's outputs differ from its samples' run one at a time"
