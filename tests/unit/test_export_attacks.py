"""Crafted archives: every attack on torch.export.load is refused or inert in psgrad's loader.

Each archive is a real exported archive with entries modified by the test. "Inert" means the
archive loads and the hostile part is never read: the marker file its payload would create
never appears. Every refusal is a psgrad error with a 4xx status, never another exception.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import random
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from psgrad._errors import InvalidArchive, PsgradError, RefusedProgram, TooLarge
from service.export import ArchiveLimits, ExportLimits, materialise, read_program
from tests.support.export import CASES, entries, exported, program, rewrite, with_program


class _Touch:
    """A pickle whose loading creates ``path``: proof that something unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _refused(data: bytes, cls: type[PsgradError] = PsgradError,
             limits: ExportLimits | None = None) -> PsgradError:
    with pytest.raises(cls) as info:
        read_program(data, limits or ExportLimits())
    assert 400 <= info.value.status < 500, info.value
    return info.value


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "pwned"


def cnn() -> bytes:
    return exported("cnn")[1]


def test_a_sample_inputs_are_never_read(marker: Path) -> None:
    data = rewrite(cnn(), {"data/sample_inputs/model.pt": pickle.dumps(_Touch(marker))})
    read_program(data, ExportLimits())
    assert not marker.exists()
    other = rewrite(cnn(), {"data/sample_inputs/other.pt": pickle.dumps(_Touch(marker))})
    assert "sample_inputs/other.pt" in _refused(other, RefusedProgram).message
    assert not marker.exists()


def test_b_use_pickle_weights_are_refused(marker: Path) -> None:
    config = json.loads(entries(cnn())["data/weights/model_weights_config.json"])
    name = next(iter(config["config"]))
    config["config"][name]["use_pickle"] = True
    path = config["config"][name]["path_name"]
    data = rewrite(cnn(), {"data/weights/model_weights_config.json": json.dumps(config).encode(),
                           f"data/weights/{path}": pickle.dumps(_Touch(marker))})
    assert name in _refused(data, RefusedProgram).message
    assert not marker.exists()


@pytest.mark.parametrize("prefix", ["opaque_obj_", "custom_obj_"])
def test_c_pickled_constants_are_refused(marker: Path, prefix: str) -> None:
    config = {"config": {"evil": {"path_name": f"{prefix}0", "is_param": False,
                                  "use_pickle": True, "tensor_meta": None}}}
    data = rewrite(cnn(), {"data/constants/model_constants_config.json":
                           json.dumps(config).encode(),
                           f"data/constants/{prefix}0": pickle.dumps(_Touch(marker))})
    assert prefix in _refused(data, RefusedProgram).message
    assert not marker.exists()


def _evil_expr(marker: Path) -> dict[str, Any]:
    return {"as_expr": {"expr_str": f"__import__('os').system('touch {marker}')",
                        "hint": {"as_int": 1}}}


def test_d_symbolic_expressions_are_never_evaluated(marker: Path) -> None:
    doc = program(cnn())
    graph = doc["graph_module"]["graph"]
    graph["tensor_values"]["x"]["sizes"][0] = _evil_expr(marker)  # the batch size: refused
    _refused(with_program(cnn(), doc), RefusedProgram)
    doc = program(cnn())
    graph = doc["graph_module"]["graph"]
    graph["tensor_values"]["x"]["sizes"][2] = {**_evil_expr(marker)}
    graph["tensor_values"]["x"]["sizes"][2]["as_expr"]["hint"] = {"as_int": 8}
    graph["sym_int_values"] = {"s0": _evil_expr(marker)}
    doc["range_constraints"] = {f"__import__('os').system('touch {marker}')": {
        "min_val": 1, "max_val": 9}}
    loaded = read_program(with_program(cnn(), doc), ExportLimits())  # inert: never parsed
    assert loaded.program.inputs[0].shape == (1, None, 8)
    config = json.loads(entries(cnn())["data/weights/model_weights_config.json"])
    first = next(iter(config["config"].values()))
    first["tensor_meta"]["sizes"][0] = _evil_expr(marker)
    data = rewrite(cnn(), {"data/weights/model_weights_config.json": json.dumps(config).encode()})
    _refused(data, RefusedProgram)
    assert not marker.exists()


def test_e_guards_code_is_never_executed(marker: Path) -> None:
    doc = program(cnn())
    doc["guards_code"] = [f"import os; os.system('touch {marker}')",
                          f"open('{marker}', 'w')"]
    loaded = read_program(with_program(cnn(), doc), ExportLimits())
    x = CASES["cnn"].example(1)
    materialise(loaded, torch.device("cpu"))(x)
    assert not marker.exists()


@pytest.mark.parametrize("target", [
    "torch.os.system", "builtins.eval", "torch.ops.aten.add_.Tensor",
    "torch.ops.aten.bernoulli.default", "torch.ops.higher_order.cond",
    "torch.ops.mylib.custom.default", "torch.ops.aten.add.out",
])
def test_f_ops_off_the_allow_list_are_refused(target: str) -> None:
    doc = program(cnn())
    doc["graph_module"]["graph"]["nodes"][0]["target"] = target
    error = _refused(with_program(cnn(), doc), RefusedProgram)
    assert target in error.message and error.details["op"] == target


def test_g_aotinductor_libraries_are_refused() -> None:
    data = rewrite(cnn(), {"data/aotinductor/model/model.so": b"\x7fELF" + bytes(64),
                           "data/aotinductor/model/metadata.json": b"{}"})
    assert "aotinductor" in _refused(data, RefusedProgram).message


def test_h_from_file_is_refused() -> None:
    doc = program(exported("gpt")[1])
    nodes = doc["graph_module"]["graph"]["nodes"]
    ones = next(n for n in nodes if n["target"] == "torch.ops.aten.ones.default")
    ones["target"] = "torch.ops.aten.from_file.default"
    ones["inputs"] = [{"name": "filename", "arg": {"as_string": "/etc/passwd"}, "kind": 1},
                      {"name": "shared", "arg": {"as_bool": False}, "kind": 1},
                      {"name": "size", "arg": {"as_int": 49}, "kind": 1}]
    error = _refused(with_program(exported("gpt")[1], doc), RefusedProgram)
    assert "from_file" in error.message


def test_strings_outside_their_fixed_set_are_refused() -> None:
    doc = program(exported("gpt")[1])
    gelu = next(n for n in doc["graph_module"]["graph"]["nodes"]
                if n["target"] == "torch.ops.aten.gelu.default")
    gelu["inputs"][1]["arg"] = {"as_string": "__import__('os')"}
    error = _refused(with_program(exported("gpt")[1], doc), RefusedProgram)
    assert error.details["argument"] == "approximate"


def test_batch_norm_in_training_mode_is_refused() -> None:
    data = exported("resnet")[1]
    doc = program(data)
    bn = next(n for n in doc["graph_module"]["graph"]["nodes"]
              if n["target"] == "torch.ops.aten.batch_norm.default")
    bn["inputs"][5]["arg"] = {"as_bool": True}
    assert _refused(with_program(data, doc), RefusedProgram).details["argument"] == "training"


def test_devices_are_replaced_by_the_serving_device() -> None:
    doc = program(exported("gpt")[1])
    ones = next(n for n in doc["graph_module"]["graph"]["nodes"]
                if n["target"] == "torch.ops.aten.ones.default")
    device = next(a for a in ones["inputs"] if a["name"] == "device")
    device["arg"] = {"as_device": {"type": "cuda", "index": 7}}
    loaded = read_program(with_program(exported("gpt")[1], doc), ExportLimits())
    module = materialise(loaded, torch.device("cpu"))
    assert module(CASES["gpt"].example(1)).device.type == "cpu"


def test_a_second_output_or_a_buffer_mutation_is_refused() -> None:
    doc = program(cnn())
    sig = doc["graph_module"]["signature"]
    sig["output_specs"].insert(0, {"buffer_mutation": {"arg": {"name": "x"}, "buffer_name": "b"}})
    _refused(with_program(cnn(), doc), RefusedProgram)


def test_schema_version_is_pinned() -> None:
    doc = program(cnn())
    doc["schema_version"] = {"major": 9, "minor": 0}
    assert "schema version" in _refused(with_program(cnn(), doc), RefusedProgram).message


def test_unexpected_entries_are_refused() -> None:
    for name in ("extra/module_info.json", "models/other.json", "data/weights/evil.py",
                 "../escape", "data/constants/tensor_x"):
        _refused(rewrite(cnn(), {name: b"{}"}))


def test_payload_views_are_bounds_checked() -> None:
    config = json.loads(entries(cnn())["data/weights/model_weights_config.json"])
    first = next(iter(config["config"].values()))
    first["tensor_meta"]["storage_offset"] = {"as_int": 10_000}
    data = rewrite(cnn(), {"data/weights/model_weights_config.json": json.dumps(config).encode()})
    assert "past the end" in _refused(data, InvalidArchive).message


def test_truncated_archives_are_invalid() -> None:
    data = cnn()
    for cut in (0, 10, len(data) // 3, len(data) // 2, len(data) - 30):
        _refused(data[:cut])  # a cut may expose the zip torch.save nests inside: refused too
    _refused(b"\x80\x04not a zip at all", InvalidArchive)


def _central_record(data: bytes, name: str) -> int:
    """Where the central directory's record of entry ``name`` (below the root) starts."""
    at = data.index(b"PK\x01\x02")
    while not data[at + 46:].startswith(b"archive/" + name.encode()):
        at = data.index(b"PK\x01\x02", at + 4)
    return at


def test_a_payload_unlike_its_header_is_invalid() -> None:
    data = bytearray(cnn())
    weight = entries(bytes(data))["data/weights/weight_0"]
    at = data.index(weight)
    data[at + 3] ^= 0xFF  # its checksum no longer holds
    assert "cannot be read" in _refused(bytes(data), InvalidArchive).message
    data[at + 3] ^= 0xFF
    record = _central_record(bytes(data), "data/weights/weight_0")
    data[record + 24:record + 28] = struct.pack("<I", len(weight) + 4)  # says it is longer
    assert "the size its header says" in _refused(bytes(data), InvalidArchive).message


def test_oversized_entries_and_archives_are_too_large() -> None:
    _refused(cnn(), TooLarge, ExportLimits(archive=ArchiveLimits(max_json_bytes=1000)))
    _refused(cnn(), TooLarge, ExportLimits(archive=ArchiveLimits(max_unpacked_bytes=1000)))
    _refused(cnn(), TooLarge, ExportLimits(archive=ArchiveLimits(max_entries=5)))
    _refused(cnn(), TooLarge, ExportLimits(max_weight_bytes=100))


def test_zip_bombs_are_refused_before_unpacking() -> None:
    bomb = rewrite(cnn(), {"data/weights/weight_0": bytes(50 * 1024 * 1024)},
                   compression=zipfile.ZIP_DEFLATED)
    assert len(bomb) < 1024 * 1024
    assert "zip bomb" in _refused(bomb, TooLarge).message


@pytest.mark.parametrize("blob", [b"{not json", b"[]", b"null", b'{"graph_module": 5}',
                                  b"[" * 100_000, b'{"a": 1e999999}', b"\xff\xfe"])
def test_nonsense_json_is_a_4xx(blob: bytes) -> None:
    _refused(rewrite(cnn(), {"models/model.json": blob}))
    _refused(rewrite(cnn(), {"data/weights/model_weights_config.json": blob}))


_ODD = [None, True, -1, 0, 2**70, 1.5, float("nan"), "x", "Infinity", [], [1, 2], {}, {"a": 1},
        {"as_int": 3}, {"as_tensor": {"name": "x"}}, {"as_string": "/etc/passwd"}, "9" * 5000]


def _leaves(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in _leaves(v, (*path, k))] + [path]
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in _leaves(v, (*path, i))] + [path]
    return [path]


def test_mutated_programs_never_raise_anything_but_a_4xx() -> None:
    """Random values at random places of a real program: a 4xx or a working program."""
    rng = random.Random(0)
    base = program(cnn())
    base["graph_module"]["graph"]["nodes"] = base["graph_module"]["graph"]["nodes"][:6]
    base["graph_module"]["graph"]["outputs"] = [{"as_tensor": {"name": "relu"}}]
    base["graph_module"]["signature"]["output_specs"] = [
        {"user_output": {"arg": {"as_tensor": {"name": "relu"}}}}]
    for n in base["graph_module"]["graph"]["nodes"]:
        n["metadata"] = {}
    read_program(with_program(cnn(), base), ExportLimits())  # the trimmed program works
    paths = [p for p in _leaves(base) if p]
    for _ in range(300):
        doc = copy.deepcopy(base)
        for _ in range(rng.randint(1, 3)):
            path = rng.choice(paths)
            holder = doc
            try:
                for key in path[:-1]:
                    holder = holder[key]
                holder[path[-1]] = copy.deepcopy(rng.choice(_ODD))
            except (KeyError, IndexError, TypeError):
                continue
        try:
            read_program(with_program(cnn(), doc), ExportLimits())
        except PsgradError as exc:
            assert 400 <= exc.status < 500, exc


def test_loading_creates_no_file(tmp_path: Path) -> None:
    before = set(os.listdir(tmp_path))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        read_program(exported("resnet")[1], ExportLimits())
    finally:
        os.chdir(cwd)
    assert set(os.listdir(tmp_path)) == before
