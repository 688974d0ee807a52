"""From a client's archive to a checked :class:`~service.export.interpreter.ExportedModule`.

:func:`read_program` is the whole registration-time path: the archive (zip limits, entry
names), the program (version, signature), the tensors (raw bytes, tied weights) and a dry run
on the ``meta`` device that allocates nothing, bounds the activations of one sample and checks
that a batch of one gives a batch of one. :func:`build_module` is what every worker runs on a
stored version: the same graph builder, so a stored program is held to the same allow-list.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import torch
from torch import fx, nn

from psgrad._errors import InvalidArchive, PsgradError, RefusedProgram, TooLarge
from service.config import raise_setting
from service.export.archive import CONSTANTS_CONFIG, WEIGHTS_CONFIG, ArchiveLimits, read_archive
from service.export.graph import Program, UserInput, build_graph, parse_program
from service.export.interpreter import RESERVED, ExportedModule, NodeWalk, Step
from service.export.payloads import read_payloads

_SEGMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}|[0-9]{1,6}")


@dataclass(frozen=True)
class ExportLimits:
    archive: ArchiveLimits = field(default_factory=ArchiveLimits)
    max_nodes: int = 20_000
    max_weight_bytes: int = 500 * 1024 * 1024
    max_parameters: int = 50_000_000
    max_activations: int = 32 * 1024 * 1024  # elements of every intermediate of one sample
    batch_check_s: float = 20.0  # CPU seconds the batch check (:mod:`.batch`) may take


@dataclass
class Exported:
    """A program and its tensors by canonical name; ``aliases`` maps every name to one."""

    program: Program
    tensors: dict[str, torch.Tensor]
    params: tuple[str, ...]  # canonical parameter names, in signature order
    aliases: dict[str, str]
    output_shape: tuple[int, ...] = ()
    activations: int = 0
    highs: dict[str, int] = field(default_factory=dict)  # integer inputs: ids below this

    def shapes(self) -> dict[str, tuple[list[int], str]]:
        return {k: (list(t.shape), str(t.dtype).removeprefix("torch."))
                for k, t in self.tensors.items()}


def read_program(data: bytes | IO[bytes], limits: ExportLimits) -> Exported:
    """Parse, check, build on ``meta`` and dry-run a client's ``.pt2`` bytes."""
    try:
        return _read_program(data, limits)
    except RecursionError:  # arguments nested past Python's stack: a 4xx like any refusal
        raise RefusedProgram("the program nests too deeply") from None


def _read_program(data: bytes | IO[bytes], limits: ExportLimits) -> Exported:
    archive = read_archive(data, limits.archive)
    program = parse_program(archive.program, limits.max_nodes)
    buffers = [b for _, b in program.buffers if b not in program.constants]
    weights = read_payloads(archive.weights_config, archive.weights,
                            [p for _, p in program.params] + buffers, WEIGHTS_CONFIG,
                            limits.max_weight_bytes)
    consts = read_payloads(archive.constants_config, archive.constants,
                           list(program.constants), CONSTANTS_CONFIG, limits.max_weight_bytes)
    tensors = {**weights.tensors, **consts.tensors}
    aliases = {**weights.aliases, **consts.aliases}
    params = tuple(dict.fromkeys(aliases[p] for _, p in program.params))
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    n_params = sum(tensors[p].numel() for p in params)
    check_size(n_params, size, limits)
    exported = Exported(program, tensors, params, aliases)
    specs = {k: (list(t.shape), t.dtype) for k, t in tensors.items()}
    meta = build_module(program, specs, params, aliases, torch.device("meta"))
    exported.output_shape, exported.activations = dry_run(meta, program,
                                                          limits.max_activations)
    # the sizes a request sends are measured when it comes (:mod:`service.export.guard`):
    # a range's top may be far above what any request of the program asks for
    exported.highs = token_bounds(program, {v: tensors[aliases[n]].shape[0]
                                            for v, n in program.params})
    return exported


def check_size(n_params: int, n_bytes: int, limits: ExportLimits) -> None:
    """A program's parameters and tensor bytes against their limits, each named."""
    if n_params > limits.max_parameters:
        raise TooLarge(f"the program has {n_params} parameters; the limit is "
                       f"{limits.max_parameters}: "
                       f"{raise_setting('max_parameters', limits.max_parameters)}",
                       limit=limits.max_parameters, setting="PSGRAD_MAX_PARAMETERS")
    if n_bytes > limits.max_weight_bytes:
        raise TooLarge(f"the program's tensors take {n_bytes} bytes; the limit is "
                       f"{limits.max_weight_bytes}: "
                       f"{raise_setting('max_weight_bytes', limits.max_weight_bytes)}",
                       limit=limits.max_weight_bytes, setting="PSGRAD_MAX_WEIGHT_BYTES")


_SHAPE_ONLY = frozenset(f"torch.ops.aten.{op}" for op in (
    "view.default", "reshape.default", "unsqueeze.default", "flatten.using_ints",
    "contiguous.default", "clone.default", "alias.default"))


def token_bounds(program: Program, rows: dict[str, int]) -> dict[str, int]:
    """Integer inputs that index an embedding (maybe through reshapes): ids must stay below
    its row count (``rows``: graph value -> first size of the parameter), so a request with an
    id out of range is refused before it reaches the graph."""
    origin = {u.name: u.name for u in program.inputs if not u.dtype.is_floating_point}
    highs: dict[str, int] = {}
    for node in program.doc["graph_module"]["graph"]["nodes"]:
        args = {str(a.get("name")): str((a.get("arg") or {}).get("as_tensor", {}).get("name"))
                for a in node["inputs"] if isinstance(a, dict) and isinstance(a.get("arg"), dict)}
        outs = [str((o.get("as_tensor") or {}).get("name")) for o in node["outputs"]
                if isinstance(o, dict)]
        source = origin.get(args.get("self") or args.get("input") or "")
        if node["target"] in _SHAPE_ONLY and source and outs:
            origin[outs[0]] = source
        user = origin.get(args.get("indices", ""))
        weight = args.get("weight", "")
        if node["target"] == "torch.ops.aten.embedding.default" and user and weight in rows:
            highs[user] = min(highs.get(user, 1 << 62), rows[weight])
    return highs


def materialise(exported: Exported, device: torch.device) -> ExportedModule:
    """The module of ``exported`` on ``device`` with its own tensors loaded: on their own
    device, the tensors themselves (the registration's checks only read them: copying GPT-2
    small's 500 MB took 1.5 s of each check)."""
    specs = {k: (list(t.shape), t.dtype) for k, t in exported.tensors.items()}
    module = build_module(exported.program, specs, exported.params, exported.aliases, device)
    with torch.no_grad():
        for name, value in module.state_dict(keep_vars=True).items():
            tensor = exported.tensors[name]
            if tensor.device == value.device:
                value.set_(tensor)
            else:
                value.copy_(tensor)
    return module


def build_module(program: Program, specs: dict[str, tuple[list[int], torch.dtype]],
                 params: tuple[str, ...], aliases: dict[str, str],
                 device: torch.device | None = None,
                 values: dict[str, fx.Node] | None = None) -> ExportedModule:
    """The module of ``program`` with empty tensors of ``specs`` (load the weights after);
    ``values`` as :func:`~service.export.graph.build_graph` fills it."""
    attrs: dict[str, str] = {}
    for value_name, name in (*program.params, *program.buffers):
        canonical = aliases.get(name)
        if canonical not in specs:
            raise InvalidArchive(f"'{name}' has no tensor in the archive", parameter=name)
        attrs[value_name] = canonical
    root = ExportedModule(build_graph(program, attrs, values))
    for name in dict.fromkeys([*attrs.values(), *specs]):  # in the signature's order
        shape, dtype = specs[name]
        owner, leaf = _owner(root, name)
        value = torch.empty(shape, dtype=dtype, device=device)
        if name in params:
            owner.register_parameter(leaf, nn.Parameter(value, requires_grad=False))
        else:
            owner.register_buffer(leaf, value)
    return root


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The submodule that holds ``name`` ('a.b.weight' -> root.a.b, 'weight'), made on demand."""
    parts = name.split(".")
    if len(parts) > 16 or not all(_SEGMENT.fullmatch(p) and p not in RESERVED for p in parts):
        raise RefusedProgram(f"tensor name {name[:100]!r} is refused: names are dotted "
                             "identifiers that are not attributes of a torch module",
                             parameter=name[:100])
    owner = root
    for part in parts[:-1]:
        child = owner._modules.get(part)
        if child is None:
            if part in owner._parameters or part in owner._buffers:
                raise RefusedProgram(f"'{name[:100]}' nests under a tensor", parameter=name[:100])
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    leaf = parts[-1]
    if leaf in owner._modules or leaf in owner._parameters or leaf in owner._buffers:
        raise RefusedProgram(f"tensor name '{name[:100]}' is used twice", parameter=name[:100])
    return owner, leaf


def largest_sizes(user: UserInput) -> list[int]:
    sizes = list(user.hints)
    for dim, _, high, _ in user.dynamic:
        sizes[dim + 1] = high
    return sizes


def dry_run(module: ExportedModule, program: Program, max_activations: int, *,
            largest: bool = False, sizes: Sequence[Sequence[int]] | None = None,
            walk: NodeWalk | None = None) -> tuple[tuple[int, ...], int]:
    """Run ``module`` (built on ``meta``) on the exported example sizes, counting activations.

    With ``largest``, every dynamic dimension takes the top of its range instead; with
    ``sizes``, each input takes those (a batch of one included: what a request sent). ``walk``
    replaces the module's own (the same steps, some of them recording what they see).
    """
    counted = [0]

    def count(step: Step, out: Any) -> None:
        for t in out if isinstance(out, list | tuple) else (out,):
            if isinstance(t, torch.Tensor) and step.op == "call_function":
                counted[0] += t.numel()
        if counted[0] > max_activations:
            hint = raise_setting("max_model_activations", max_activations)
            raise TooLarge(f"one sample's activations exceed {max_activations} elements (at "
                           f"'{step.name}'): {hint}, or send smaller inputs",
                           limit=max_activations, setting="PSGRAD_MAX_MODEL_ACTIVATIONS")

    where = "on its own example sizes" if sizes is None else "at the sizes sent"
    if sizes is None:
        sizes = [largest_sizes(u) if largest else u.hints for u in program.inputs]
    inputs = [torch.empty(list(n), dtype=u.dtype, device="meta")
              for n, u in zip(sizes, program.inputs, strict=True)]
    try:
        out = (walk or module.walk).run(module, inputs, count)
    except PsgradError:
        raise
    except Exception as exc:  # any failure of a client's graph is the client's
        raise RefusedProgram(f"the program fails {where}: {exc}"[:400]) from None
    if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != 1:
        raise RefusedProgram("the program must return one tensor with a batch dimension of 1 "
                             "for an input batch of 1")
    return tuple(out.shape[1:]), counted[0]
