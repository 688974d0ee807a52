"""Hostile and buggy exported programs: sizes that peak inside a range, indices out of range.

Each is a real ``torch.export`` archive (the indexing ones exported as they are; the size one
exported plainly, then given nodes torch's own export would refuse to trace) so the loader sees
exactly what a client would send.
"""

from __future__ import annotations

import io
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.support.export import program, with_program

PEAK_T = 32769  # (T - 2) * (65538 - T) is largest here: 1,073,741,823 elements (4 GiB)
GROWN_T, GROWN_LIMIT = 8192, 1 << 24  # zeros(T, T, 2): 128 Mi elements (512 MiB) past 16 Mi
INDEX_OPS = ("embedding", "index_select", "gather", "index")
ROWS = 10


def save(module: nn.Module, example: tuple[torch.Tensor, ...],
         dynamic: Any = None) -> bytes:
    ep = torch.export.export(module.eval(), example, dynamic_shapes=dynamic)
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    return buf.getvalue()


class Pooled(nn.Module):
    """``x [1, T, 4] -> [1, 2]``: a linear layer summed over a dynamic length."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum(1)


def _node(target: str, inputs: dict[str, Any], output: dict[str, Any]) -> dict[str, Any]:
    return {"target": target, "inputs": [{"name": k, "arg": v, "kind": 1}
                                         for k, v in inputs.items()], "outputs": [output]}


@cache
def peaked() -> bytes:
    """:class:`Pooled` (T in 2..65536) plus ``zeros([(T - 2) * (65538 - T)]).sum()``: nothing
    at both ends of the range, 4 GiB of zeros at T = 32769."""
    torch.manual_seed(0)
    length = torch.export.Dim("T", min=2, max=65536)
    data = save(Pooled(), (torch.randn(1, 5, 4),), ({1: length},))
    doc = program(data)
    graph = doc["graph_module"]["graph"]
    out = graph["outputs"][0]["as_tensor"]["name"]

    def sym(name: str) -> dict[str, Any]:
        return {"as_sym_int": {"as_name": name}}

    aten = "torch.ops.aten."
    graph["nodes"] += [
        _node(f"{aten}sym_size.int", {"self": {"as_tensor": {"name": "x"}}, "dim": {"as_int": 1}},
              sym("t")),
        _node("_operator.sub", {"a": sym("t"), "b": {"as_int": 2}}, sym("low")),
        _node("_operator.sub", {"a": {"as_int": 65538}, "b": sym("t")}, sym("high")),
        _node("_operator.mul", {"a": sym("low"), "b": sym("high")}, sym("n")),
        _node(f"{aten}zeros.default", {"size": {"as_sym_ints": [{"as_name": "n"}]},
                                       "device": {"as_device": {"type": "cpu"}}},
              {"as_tensor": {"name": "bump"}}),
        _node(f"{aten}sum.default", {"self": {"as_tensor": {"name": "bump"}}},
              {"as_tensor": {"name": "bump_sum"}}),
        _node(f"{aten}add.Tensor", {"self": {"as_tensor": {"name": out}},
                                    "other": {"as_tensor": {"name": "bump_sum"}}},
              {"as_tensor": {"name": "bumped"}}),
    ]
    graph["outputs"] = [{"as_tensor": {"name": "bumped"}}]
    graph["tensor_values"]["bumped"] = graph["tensor_values"][out]
    doc["graph_module"]["signature"]["output_specs"] = [
        {"user_output": {"arg": {"as_tensor": {"name": "bumped"}}}}]
    return with_program(data, doc)


class Grown(nn.Module):
    """:class:`Pooled` plus ``zeros(T, T, 2).sum()``: a factory tensor that grows with the
    length sent (T in 2..65536; 512 MiB of float32 at :data:`GROWN_T`)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        return self.lin(x).sum(1) + torch.zeros(t, t, 2).sum()


@cache
def unplaced(device: str = "absent") -> bytes:
    """:class:`Grown` exported, then its ``zeros`` stripped of the device torch's export always
    names (``absent``), or given ``None`` (``none``): a factory op that, run as written, lands
    on the CPU whatever device the rest of the program runs on."""
    torch.manual_seed(0)
    length = torch.export.Dim("T", min=2, max=65536)
    data = save(Grown(), (torch.randn(1, 5, 4),), ({1: length},))
    doc = program(data)
    zeros = [n for n in doc["graph_module"]["graph"]["nodes"]
             if n["target"] == "torch.ops.aten.zeros.default"]
    assert len(zeros) == 1, zeros
    inputs = [a for a in zeros[0]["inputs"] if a["name"] != "device"]
    if device == "none":
        inputs.append({"name": "device", "arg": {"as_none": True}, "kind": 2})
    zeros[0]["inputs"] = inputs
    return with_program(data, doc)


class Indexing(nn.Module):
    """A table read at indices held in a buffer or a constant (out of range when ``bad``)."""

    def __init__(self, op: str, source: str, bad: bool) -> None:
        super().__init__()
        self.op, self.source = op, source
        self.lin = nn.Linear(3, 2)
        self.table = nn.Parameter(torch.randn(ROWS, 3))
        self.at = [0, 3, ROWS + 2 if bad else ROWS - 1]
        self.register_buffer("ids", torch.tensor(self.at))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = self.get_buffer("ids") if self.source == "buffer" else torch.tensor(self.at)
        if self.op == "embedding":
            rows = F.embedding(ids, self.table)
        elif self.op == "index_select":
            rows = self.table.index_select(0, ids)
        elif self.op == "gather":
            rows = self.table.gather(0, ids[:, None].expand(3, 3))
        else:
            rows = self.table[ids]
        return self.lin(x) + rows.sum()


@cache
def indexing(op: str, source: str, bad: bool = True) -> bytes:
    torch.manual_seed(0)
    return save(Indexing(op, source, bad), (torch.randn(1, 3),))


class Shifted(nn.Module):
    """Ids reach an embedding of :data:`ROWS` rows through ``ids + 5`` (``add.Scalar``): no
    bound on the input says so, and ids of 5 or more read past the table."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids + 5).mean(1))


@cache
def shifted() -> bytes:
    torch.manual_seed(0)
    return save(Shifted(), (torch.tensor([[0, 1, 0]]),))


class Coupled(nn.Module):
    """Each sample's output reads the batch's mean: fine one sample at a time (as exported),
    wrong on a batch, so it must stay on the one-sample route and say why."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x - x.mean(0, keepdim=True) + x)


@cache
def coupled() -> bytes:
    torch.manual_seed(0)
    return save(Coupled(), (torch.randn(1, 3),))
