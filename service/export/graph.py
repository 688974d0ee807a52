"""The program document: its signature read strictly, its graph rebuilt node by node in fx.

Every node's target must be a key of the allow-list (:mod:`service.export.allowed`); every argument
is matched to the op's own schema by name and its serialized kind checked against the declared
type: tensors only by the name of an earlier value, integers and floats as literals, strings
only from a fixed set, dtypes from a table, devices (named, None or left out) replaced by the
serving device. Guards, range constraints and symbolic size expressions are never read.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from psgrad._errors import InvalidArchive, RefusedProgram, TooLarge
from service.config import raise_setting
from service.export import allowed
from service.export.document import prune
from service.export.payloads import DTYPES, literal_int, obj, tensor_meta

SCHEMA_MAJOR, SCHEMA_MINOR = 8, 20  # torch 2.13's serializer; newer minors are refused
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
MAX_INPUTS = 4
MAX_LIST = 64
MAX_DYNAMIC = 1 << 16  # the largest size a dynamic dimension is served at
SYMBOL_RE = re.compile(r"s[0-9]{1,9}")
MEMORY_FORMATS = {1: torch.contiguous_format, 2: torch.channels_last,
                  3: torch.channels_last_3d, 4: torch.preserve_format}
SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


@dataclass(frozen=True)
class UserInput:
    name: str
    dtype: torch.dtype
    shape: tuple[int | None, ...]  # one sample (the exported batch of one removed); None: dynamic
    hints: tuple[int, ...]  # the exported example's sizes, batch of one included
    # (sample dim, low, high, symbol): sizes a request may choose, from literal range bounds
    dynamic: tuple[tuple[int, int, int, str], ...] = ()


@dataclass(frozen=True)
class Program:
    """What psgrad keeps of a program: the graph nodes and the signature, nothing else."""

    doc: dict[str, Any]  # the pruned document (:func:`prune`), stored with every version
    inputs: tuple[UserInput, ...]
    params: tuple[tuple[str, str], ...]  # (graph value, parameter name)
    buffers: tuple[tuple[str, str], ...]  # (graph value, buffer or constant name)
    constants: tuple[str, ...]  # the names among buffers that come from tensor constants
    output: str


def parse_program(doc: dict[str, Any], max_nodes: int) -> Program:
    """Check the version and the signature; the graph itself is checked by :func:`build_graph`."""
    version = obj(doc.get("schema_version"), "schema_version")
    if (version.get("major"), type(version.get("minor"))) != (SCHEMA_MAJOR, int) or \
            not 0 <= version["minor"] <= SCHEMA_MINOR:
        raise RefusedProgram(
            f"schema version {str(version)[:60]} is not one psgrad reads (major {SCHEMA_MAJOR}, "
            f"minor up to {SCHEMA_MINOR}): export with torch 2.13",
            schema_version=str(version)[:60])
    gm = obj(doc.get("graph_module"), "graph_module")
    graph = obj(gm.get("graph"), "graph")
    nodes = graph.get("nodes")
    if not isinstance(nodes, list):
        raise InvalidArchive("graph.nodes must be a list")
    if len(nodes) > max_nodes:
        raise TooLarge(f"the graph has {len(nodes)} nodes; the limit is {max_nodes}: "
                       f"{raise_setting('max_graph_nodes', max_nodes)}", limit=max_nodes)
    sig = obj(gm.get("signature"), "signature")
    inputs: list[UserInput] = []
    params: list[tuple[str, str]] = []
    buffers: list[tuple[str, str]] = []
    constants: list[str] = []
    specs = sig.get("input_specs")
    graph_inputs = graph.get("inputs")
    if not isinstance(specs, list) or not isinstance(graph_inputs, list) or \
            len(specs) != len(graph_inputs):
        raise InvalidArchive("signature.input_specs must match graph.inputs one to one")
    values = obj(graph.get("tensor_values"), "graph.tensor_values")
    for spec, arg in zip(specs, graph_inputs, strict=True):
        kind, body = _one(spec, "an input spec")
        name = _tensor_name(arg, "graph.inputs")
        if kind == "user_input":
            if _tensor_name(obj(body, kind).get("arg"), kind) != name:
                raise InvalidArchive(f"user input '{name}' does not match graph.inputs")
            inputs.append(_user_input(name, values.get(name), doc.get("range_constraints")))
        elif kind in ("parameter", "buffer", "tensor_constant"):
            key = {"parameter": "parameter_name", "buffer": "buffer_name",
                   "tensor_constant": "tensor_constant_name"}[kind]
            body = obj(body, kind)
            if _tensor_name(body.get("arg"), kind, bare=True) != name:
                raise InvalidArchive(f"{kind} '{name}' does not match graph.inputs")
            target = body.get(key)
            if not isinstance(target, str) or len(target) > 300:
                raise InvalidArchive(f"{kind} '{name}' has no valid {key}")
            (params if kind == "parameter" else buffers).append((name, target))
            if kind == "tensor_constant" or body.get("persistent") is False:
                constants.append(target)  # stored with the constants, not the weights
        else:
            raise RefusedProgram(f"input spec '{kind}' is refused: psgrad takes tensor inputs, "
                                 "parameters, buffers and tensor constants only", spec=kind)
    if not params:
        raise RefusedProgram("the program has no parameters to differentiate")
    if not 1 <= len(inputs) <= MAX_INPUTS:
        raise RefusedProgram(f"the program takes {len(inputs)} tensor inputs; psgrad serves 1 "
                             f"to {MAX_INPUTS}", inputs=len(inputs))
    outs = sig.get("output_specs")
    if not isinstance(outs, list) or len(outs) != 1 or _one(outs[0], "output spec")[0] != \
            "user_output":
        raise RefusedProgram("the program must return exactly one tensor and mutate nothing "
                             "(export model.eval(); BatchNorm in training mode updates buffers)")
    output = _tensor_name(obj(_one(outs[0], "output spec")[1], "user_output").get("arg"),
                          "output")
    graph_out = graph.get("outputs")
    if not isinstance(graph_out, list) or len(graph_out) != 1 or \
            _tensor_name(graph_out[0], "graph.outputs") != output:
        raise RefusedProgram("the program must return exactly one tensor")
    return Program(prune(doc), tuple(inputs), tuple(params), tuple(buffers), tuple(constants),
                   output)


def _one(value: Any, where: str) -> tuple[str, Any]:
    """A serialized union: an object with exactly one key."""
    if not isinstance(value, dict) or len(value) != 1:
        raise InvalidArchive(f"{where} must be an object with one key")
    return next(iter(value.items()))


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise InvalidArchive(f"{where}: value names are identifiers ({str(value)[:60]!r})")
    return value


def _tensor_name(arg: Any, where: str, *, bare: bool = False) -> str:
    """``{"as_tensor": {"name": n}}`` (or ``{"name": n}`` when ``bare``) -> n."""
    if not bare:
        kind, arg = _one(arg, where)
        if kind != "as_tensor":
            raise RefusedProgram(f"{where}: '{kind}' where a tensor is expected")
    return _name(obj(arg, where).get("name"), where)


def _user_input(name: str, meta: Any, constraints: Any) -> UserInput:
    m = tensor_meta(meta, f"input '{name}'", allow_symbolic=True)
    if not m.sizes or m.sizes[0] != 1:
        raise RefusedProgram(f"input '{name}' must have a batch dimension of exactly 1: export "
                             "with x[:1] (psgrad calls the program on one sample at a time)",
                             input=name)
    if not (m.dtype.is_floating_point or m.dtype in (torch.int64, torch.int32, torch.bool)):
        raise RefusedProgram(f"input '{name}' has dtype {m.dtype}", input=name)
    dynamic = tuple(d for i, size in enumerate(m.sizes[1:])
                    if size is None and (d := _range(meta["sizes"][i + 1], i, constraints)))
    return UserInput(name, m.dtype, m.sizes[1:], m.hints, dynamic)


def _range(size: Any, dim: int, constraints: Any) -> tuple[int, int, int, str] | None:
    """A symbolic size's literal bounds, or None: then it is served at its example size.

    The expression is never parsed: it must be, character for character, one symbol that
    ``range_constraints`` names (as torch writes it), whose bounds are literal integers.
    """
    expr = size.get("as_expr", {}).get("expr_str") if isinstance(size, dict) else None
    if not isinstance(expr, str) or not isinstance(constraints, dict):
        return None
    for symbol, bounds in constraints.items():
        if not isinstance(symbol, str) or not SYMBOL_RE.fullmatch(symbol) or expr not in (
                symbol, f"Symbol('{symbol}', positive=True, integer=True)"):
            continue
        low, high = (bounds.get(k) if isinstance(bounds, dict) else None
                     for k in ("min_val", "max_val"))
        if isinstance(low, int) and isinstance(high, int) and not isinstance(low, bool) and \
                not isinstance(high, bool) and 1 <= low <= min(high, MAX_DYNAMIC):
            return dim, low, min(high, MAX_DYNAMIC), symbol
    return None


def device_of(tensor: torch.Tensor) -> torch.device:
    """The device the module's weights live on: what every device argument becomes."""
    return tensor.device


def build_graph(program: Program, attrs: dict[str, str],
                values: dict[str, fx.Node] | None = None) -> fx.Graph:
    """The fx graph of ``program``; ``attrs`` maps graph values to module attributes.

    Device arguments read the device of the first parameter at run time, so one graph serves
    on whatever device its module is moved to (``meta`` for the dry run included). ``values``,
    when given, is filled with the fx node of every named value of the program (what the batch
    check (:mod:`.batch`) needs to relate the graph back to the document).
    """
    graph = fx.Graph()
    env: dict[str, tuple[str, Any]] = {}  # name -> ("tensor" | "sym", fx node)
    for name, target in attrs.items():
        env[name] = ("tensor", graph.get_attr(target))
    device = graph.call_function(device_of, (env[program.params[0][0]][1],))
    for user in program.inputs:
        env[user.name] = ("tensor", graph.placeholder(user.name))
    nodes = program.doc["graph_module"]["graph"]["nodes"]
    for i, node in enumerate(nodes):
        _node(graph, obj(node, f"node {i}"), env, device)
    kind, out = env.get(program.output, ("", None))
    if kind != "tensor":
        raise InvalidArchive(f"the output '{program.output}' is not a tensor of the graph")
    graph.output(out)
    if values is not None:
        values.update({k: v for k, (_, v) in env.items() if isinstance(v, fx.Node)})
    return graph


def _node(graph: fx.Graph, node: dict[str, Any], env: dict[str, tuple[str, Any]],
          device: fx.Node) -> None:
    target = node.get("target")
    inputs, outputs = node.get("inputs"), node.get("outputs")
    if not isinstance(target, str) or not isinstance(inputs, list) or \
            not isinstance(outputs, list):
        raise InvalidArchive("every node needs a target, inputs and outputs")
    shown = target[:80]
    named = {}
    for a in inputs:
        a = obj(a, f"an input of {shown}")
        named[_name(a.get("name"), f"an argument of {shown}")] = a
    if len(named) != len(inputs):
        raise InvalidArchive(f"{shown}: an argument is given twice")
    if target in allowed.DROPPED:
        if outputs:
            raise InvalidArchive(f"{shown} has outputs")
        return
    if target in allowed.SYM_OPS:
        if set(named) != {"a", "b"}:
            raise RefusedProgram(f"{shown} takes 'a' and 'b'", op=shown)
        pair = tuple(_sym(named[k].get("arg"), env, shown) for k in ("a", "b"))
        _bind(outputs, ["int"], graph.call_function(allowed.SYM_OPS[target], pair), env, shown)
        return
    if target in allowed.IDENTITY:
        keep = allowed.IDENTITY[target]
        if keep not in named:
            raise InvalidArchive(f"{shown} lacks '{keep}'")
        value = _decode(named[keep].get("arg"), "Tensor", shown, keep, env, device)
        _bind(outputs, ["Tensor"], value, env, shown)
        return
    op = allowed.OPS.get(target)
    if op is None:
        raise RefusedProgram(f"op '{shown}' is not on psgrad's allow-list of pure aten ops",
                             op=shown)
    schema = op._schema
    known = {a.name: a for a in schema.arguments}
    unknown = sorted(set(named) - set(known))
    if unknown:
        raise RefusedProgram(f"{shown} has no argument {', '.join(unknown)[:80]}", op=shown)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    positional = True
    for a in schema.arguments:
        given = named.get(a.name)
        # a device left out or None is the serving device too: run as written, a factory op
        # would allocate on the CPU whatever device the rest runs on (``meta`` in the size pass)
        placed = str(a.real_type) in ("Device", "Optional[Device]")
        if given is None:
            if not a.has_default_value():
                raise InvalidArchive(f"{shown} lacks argument '{a.name}'")
            positional = False
            if placed:
                kwargs[a.name] = device
            continue
        value = _decode(given.get("arg"), str(a.real_type), shown, a.name, env, device)
        if placed and value is None:
            value = device
        pin = (target.removeprefix("torch.ops.aten."), a.name)
        if pin in allowed.PINNED and value != allowed.PINNED[pin]:
            raise RefusedProgram(f"{shown}: {a.name}={value!r} is refused ({a.name} must be "
                                 f"{allowed.PINNED[pin]!r}; export model.eval())", op=shown,
                                 argument=a.name)
        if positional and not a.kwarg_only and given.get("kind") == 1:
            args.append(value)
        else:
            positional = False
            kwargs[a.name] = value
    call = graph.call_function(op, tuple(args), kwargs)
    _bind(outputs, [str(r.real_type) for r in schema.returns], call, env, shown)


def _bind(outputs: list[Any], returns: list[str], call: Any, env: dict[str, tuple[str, Any]],
          shown: str) -> None:
    """Name the op's results: one tensor, several (getitem), a list, or a size."""
    if len(outputs) != len(returns):
        raise InvalidArchive(f"{shown} returns {len(returns)} values, the node names "
                             f"{len(outputs)}")
    for i, (out, kind) in enumerate(zip(outputs, returns, strict=True)):
        tag, body = _one(out, f"an output of {shown}")
        item = call if len(returns) == 1 else call.graph.call_function(operator.getitem,
                                                                       (call, i))
        if kind == "Tensor" and tag == "as_tensor":
            _define(env, _name(obj(body, shown).get("name"), shown), ("tensor", item))
        elif kind == "List[Tensor]" and tag == "as_tensors" and isinstance(body, list):
            for j, t in enumerate(body[:1024]):
                part = call.graph.call_function(operator.getitem, (item, j))
                _define(env, _name(obj(t, shown).get("name"), shown), ("tensor", part))
        elif kind in ("int", "SymInt") and tag == "as_sym_int":
            _define(env, _name(obj(body, shown).get("as_name"), shown), ("sym", item))
        else:
            raise RefusedProgram(f"{shown}: output '{tag}' where the op returns {kind}",
                                 op=shown)


def _define(env: dict[str, tuple[str, Any]], name: str, value: tuple[str, Any]) -> None:
    if name in env:
        raise InvalidArchive(f"value '{name}' is defined twice")
    env[name] = value


def _sym(arg: Any, env: dict[str, tuple[str, Any]], shown: str) -> Any:
    kind, body = _one(arg, f"an argument of {shown}")
    if kind == "as_int":
        return literal_int(body, shown)
    if kind == "as_sym_int":
        sub, value = _one(body, shown)
        if sub == "as_int":
            return literal_int(value, shown)
        if sub == "as_name" and env.get(value, ("",))[0] == "sym":
            return env[value][1]
    raise RefusedProgram(f"{shown}: '{kind}' where an integer size is expected", op=shown)


def _decode(arg: Any, typ: str, shown: str, name: str, env: dict[str, tuple[str, Any]],
            device: fx.Node) -> Any:
    """One argument, checked against its declared type (``typ`` from the op's schema)."""
    kind, body = _one(arg, f"{shown}.{name}")
    optional = typ.startswith("Optional[")
    base = typ[9:-1] if optional else typ
    where = f"{shown} argument '{name}'"
    if kind == "as_none" and optional:
        return None
    if base == "Tensor" and kind in ("as_tensor", "as_optional_tensor"):
        if kind == "as_optional_tensor":
            return _decode(body, typ, shown, name, env, device)
        tname = _name(obj(body, where).get("name"), where)
        if env.get(tname, ("",))[0] != "tensor":
            raise InvalidArchive(f"{where}: '{tname}' is not an earlier tensor")
        return env[tname][1]
    if base in ("List[Tensor]", "List[Optional[Tensor]]") and isinstance(body, list) and \
            kind in ("as_tensors", "as_optional_tensors") and len(body) <= 1024:
        inner = "Optional[Tensor]" if kind == "as_optional_tensors" else "Tensor"
        return [_decode(t if inner == "Optional[Tensor]" else {"as_tensor": t}, inner, shown,
                        name, env, device) for t in body]
    if base in ("int", "SymInt", "number") and kind in ("as_int", "as_sym_int"):
        return _sym(arg, env, shown)
    if base in ("List[int]", "List[SymInt]") and kind in ("as_ints", "as_sym_ints") and \
            isinstance(body, list) and len(body) <= MAX_LIST:
        return [literal_int(v, where) if kind == "as_ints" else
                _sym({"as_sym_int": v}, env, shown) for v in body]
    if base in ("float", "number", "Tensor") and kind == "as_float":
        return _float(body, where)
    if base in ("float", "Tensor") and kind == "as_int":
        return literal_int(body, where)
    if base == "number" and kind == "as_bool" and isinstance(body, bool):
        return body
    if base == "bool" and kind == "as_bool" and isinstance(body, bool):
        return body
    if base == "List[bool]" and kind == "as_bools" and isinstance(body, list) and \
            len(body) <= MAX_LIST and all(isinstance(b, bool) for b in body):
        return list(body)
    if base == "str" and kind == "as_string" and isinstance(body, str):
        if not allowed.known_string(shown, name, body):
            raise RefusedProgram(f"{where}: the string {body[:60]!r} is not one psgrad accepts",
                                 op=shown, argument=name)
        return body
    if base == "ScalarType" and kind == "as_scalar_type" and body in DTYPES:
        return DTYPES[body]
    if base == "Layout" and kind == "as_layout" and body == 7:
        return torch.strided
    if base == "MemoryFormat" and kind == "as_memory_format" and body in MEMORY_FORMATS:
        return MEMORY_FORMATS[body]
    if base == "Device" and kind == "as_device":
        return device  # whatever device the archive names: the serving device
    raise RefusedProgram(f"{where}: '{kind}' is refused where the op takes {typ}", op=shown,
                         argument=name)


def _float(value: Any, where: str) -> float:
    if isinstance(value, str) and value in SPECIAL_FLOATS:
        return SPECIAL_FLOATS[value]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RefusedProgram(f"{where} must be a number")
    return float(value)
