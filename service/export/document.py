"""The stored program document: only the keys psgrad reads, rebuilt from scratch.

A client's ``model.json`` may carry anything beside what psgrad reads: stack traces, a module
tree, guards, or junk (a string of 40 MB, lists nested a thousand deep) in the signature, in a
node's arguments or in a tensor's metadata. :func:`prune` copies out exactly the keys the
loader reads, each in the shape it reads it, so what is stored with a version (and parsed again
by every worker) is as small and as shallow as the program itself: nothing unread survives, and
nothing nests deeper than a few levels. Values that are read stay as sent, to be checked by the
graph builder; a value in a shape the loader does not read becomes ``None``, which the builder
refuses where it reads it, as it would have refused the original.
"""

from __future__ import annotations

from typing import Any

from service.export import allowed

MAX_KIND = 64  # longest union tag kept as sent (every tag psgrad reads is far shorter)
MAX_ITEMS = 1025  # a list argument longer than the builder accepts stays too long to pass
_SCALARS = ("as_int", "as_float", "as_bool", "as_string", "as_scalar_type", "as_layout",
            "as_memory_format")
_SPEC_KEYS = {"user_input": (), "parameter": ("parameter_name",), "buffer": ("buffer_name",
              "persistent"), "tensor_constant": ("tensor_constant_name",)}


def prune(doc: dict[str, Any]) -> dict[str, Any]:
    """The parts psgrad reads of a program document, in the shapes it reads them."""
    gm = _dict(doc.get("graph_module"))
    graph = _dict(gm.get("graph"))
    inputs = _list(graph.get("inputs"))
    outputs = _list(graph.get("outputs"))
    values = _dict(graph.get("tensor_values"))
    keep = {_name_of(a) for a in inputs + outputs}
    version = _dict(doc.get("schema_version"))
    return {
        "schema_version": {k: _scalar(version.get(k)) for k in ("major", "minor")},
        "graph_module": {
            "graph": {
                "inputs": [_arg(a) for a in inputs],
                "outputs": [_arg(a) for a in outputs],
                "nodes": [_node(n) for n in _list(graph.get("nodes"))],
                "tensor_values": {k: _tensor_meta(v) for k, v in values.items() if k in keep},
            },
            "signature": _signature(_dict(gm.get("signature"))),
        },
    }


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _scalar(value: Any) -> Any:
    """A JSON number, string or bool as sent; anything else None."""
    return value if isinstance(value, int | float | str | bool) else None


def _name_of(arg: Any) -> Any:
    body = _dict(_dict(arg).get("as_tensor"))
    return _scalar(body.get("name"))


def _named(value: Any) -> dict[str, Any] | None:
    return {"name": _scalar(value.get("name"))} if isinstance(value, dict) else None


def _sym(value: Any) -> dict[str, Any] | None:
    """A size: ``{"as_int": n}`` or ``{"as_name": s}``."""
    if not isinstance(value, dict) or len(value) != 1:
        return None
    kind, body = next(iter(value.items()))
    return {kind: _scalar(body)} if kind in ("as_int", "as_name") else None


def _arg(value: Any) -> dict[str, Any] | None:
    """One serialized argument: a one-key union, its body in the shape the builder reads."""
    if not isinstance(value, dict) or len(value) != 1:
        return None
    kind, body = next(iter(value.items()))
    if not isinstance(kind, str) or len(kind) > MAX_KIND:
        return None
    if kind in _SCALARS:
        return {kind: _scalar(body)}
    if kind == "as_tensor":
        return {kind: _named(body)}
    if kind == "as_optional_tensor":  # one level: a tensor or none
        return {kind: _optional(body)}
    if kind == "as_tensors" and isinstance(body, list):
        return {kind: [_named(t) for t in body[:MAX_ITEMS]]}
    if kind == "as_optional_tensors" and isinstance(body, list):
        return {kind: [_optional(t) for t in body[:MAX_ITEMS]]}
    if kind in ("as_ints", "as_bools") and isinstance(body, list):
        return {kind: [_scalar(v) for v in body[:MAX_ITEMS]]}
    if kind == "as_sym_ints" and isinstance(body, list):
        return {kind: [_sym(v) for v in body[:MAX_ITEMS]]}
    if kind == "as_sym_int":
        return {kind: _sym(body)}
    return {kind: None}  # as_none, as_device (the serving device), or refused where read


def _optional(value: Any) -> dict[str, Any] | None:
    """An optional tensor: ``{"as_tensor": ...}`` or ``{"as_none": ...}``, never nested."""
    if isinstance(value, dict) and len(value) == 1 and ("as_tensor" in value or
                                                         "as_none" in value):
        return _arg(value)
    return None


def _node(node: Any) -> dict[str, Any] | None:
    if not isinstance(node, dict):
        return None
    target = node.get("target")
    target = target if isinstance(target, str) and len(target) <= 300 else None
    inputs = [{"name": _scalar(a.get("name")), "arg": _arg(a.get("arg")),
               "kind": _scalar(a.get("kind"))} if isinstance(a, dict) else None
              for a in _list(node.get("inputs"))[:MAX_ITEMS]]
    if target in allowed.DROPPED:  # never run: nothing of its arguments is read
        inputs = []
    elif target in allowed.IDENTITY:  # only the argument passed through is read
        inputs = [a for a in inputs if a is not None and a["name"] == allowed.IDENTITY[target]]
    return {"target": target, "inputs": inputs,
            "outputs": [_output(o) for o in _list(node.get("outputs"))[:MAX_ITEMS]]}


def _output(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict) or len(value) != 1:
        return None
    kind, body = next(iter(value.items()))
    if kind == "as_tensor":
        return {kind: _named(body)}
    if kind == "as_tensors" and isinstance(body, list):
        return {kind: [_named(t) for t in body[:MAX_ITEMS]]}
    if kind == "as_sym_int" and isinstance(body, dict):
        return {kind: {"as_name": _scalar(body.get("as_name"))}}
    return {str(kind)[:MAX_KIND]: None}


def _tensor_meta(value: Any) -> dict[str, Any]:
    """dtype, layout and sizes: what :func:`~service.export.payloads.tensor_meta` reads. A
    symbolic size keeps its hint only (its expression is never read)."""
    meta = _dict(value)
    sizes: list[Any] = []
    for size in _list(meta.get("sizes")):
        expr = _dict(_dict(size).get("as_expr"))
        if expr:
            sizes.append({"as_expr": {"hint": _sym(expr.get("hint"))}})
        else:
            sizes.append(_sym(size))
    return {"dtype": _scalar(meta.get("dtype")), "layout": _scalar(meta.get("layout")),
            "sizes": sizes}


def _signature(sig: dict[str, Any]) -> dict[str, Any]:
    """Input specs (user inputs, parameters, buffers, tensor constants) and output specs, with
    the names they bind; another kind keeps its tag only (the parser refuses it by name)."""
    specs: list[Any] = []
    for spec in _list(sig.get("input_specs")):
        if not isinstance(spec, dict) or len(spec) != 1:
            specs.append(None)
            continue
        kind, body = next(iter(spec.items()))
        body = _dict(body)
        if kind == "user_input":
            specs.append({kind: {"arg": _arg(body.get("arg"))}})
        elif kind in _SPEC_KEYS:
            specs.append({kind: {"arg": _named(body.get("arg")),
                                 **{k: _scalar(body.get(k)) for k in _SPEC_KEYS[kind]}}})
        else:
            specs.append({str(kind)[:MAX_KIND]: None})
    outs: list[Any] = []
    for spec in _list(sig.get("output_specs")):
        if isinstance(spec, dict) and len(spec) == 1 and "user_output" in spec:
            outs.append({"user_output": {"arg": _arg(_dict(spec["user_output"]).get("arg"))}})
        else:
            outs.append({str(next(iter(spec), ""))[:MAX_KIND]: None}
                        if isinstance(spec, dict) else None)
    return {"input_specs": specs, "output_specs": outs}
