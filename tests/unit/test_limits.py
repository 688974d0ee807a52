"""Limits that fit real models: every 413 names the setting to raise and its value, a size
refusal comes before the expensive steps, and the defaults take GPT-2 small and BERT-base.

GPT-2 and BERT are built from transformers' configs with random weights (2 layers where they
are exported and served; full size only on ``meta``, where nothing is allocated).
"""

from __future__ import annotations

import io
import re
from typing import Any

import numpy as np
import pytest
import torch

from service.config import Settings
from service.export import register
from tests.support.api import open_client
from tests.support.export import Logits, exported, token_batch

PT2 = "application/x-torch-export"
MLP = {"architecture": "sequential", "layers": [{"type": "Linear", "args": [4, 2]}],
       "input": {"shape": [4]}, "default_loss": "mse"}
EAGER: dict[str, Any] = {"attn_implementation": "eager"}
HINT = re.compile(r"raise (PSGRAD_[A-Z_]+) \(now (\d+)\)")


def _named(response: Any, setting: str, value: int) -> None:
    assert response.status_code == 413, response.text
    message = response.json()["error"]["message"]
    found = HINT.search(message)
    assert found is not None, message
    assert (found.group(1), int(found.group(2))) == (setting, value), message


def _rows(n: int, width: int = 4) -> list[list[float]]:
    return [[0.5] * width for _ in range(n)]


GRADS = {"model": "mlp", "outputs": ["grads"]}
# (settings, request) -> the setting a 413 must name. Each request is otherwise valid.
CASES: list[tuple[str, dict[str, Any], str, str, Any]] = [
    ("max_body_bytes", {"max_body_bytes": 300}, "post", "/per-sample-grads",
     {**GRADS, "inputs": _rows(8, 784), "targets": [0] * 8}),
    ("max_batch_size", {"max_batch_size": 2}, "post", "/per-sample-grads",
     {**GRADS, "inputs": _rows(3, 784), "targets": [0, 1, 2]}),
    ("max_elements", {"max_elements": 100}, "post", "/per-sample-grads",
     {**GRADS, "inputs": _rows(1, 784), "targets": [0]}),
    ("max_result_bytes", {"max_result_bytes": 1000}, "post", "/per-sample-grads",
     {**GRADS, "inputs": _rows(1, 784), "targets": [0]}),
    ("max_layers", {"max_layers": 1}, "put", "/models/m",
     {**MLP, "layers": [MLP["layers"][0], {"type": "ReLU"}]}),  # type: ignore[index]
    ("max_parameters", {"max_parameters": 5}, "put", "/models/m", MLP),
    ("max_weight_bytes", {"max_weight_bytes": 16}, "put", "/models/m", MLP),
    ("max_model_activations", {"max_model_activations": 1}, "put", "/models/m", MLP),
]


@pytest.mark.parametrize(("setting", "overrides", "method", "path", "body"), CASES,
                         ids=[c[0] for c in CASES])
async def test_every_413_names_the_setting_to_raise_and_its_value(
        setting: str, overrides: dict[str, Any], method: str, path: str, body: Any) -> None:
    async with open_client(**overrides) as c:
        r = await c.request(method.upper(), path, json=body)
        _named(r, f"PSGRAD_{setting.upper()}", overrides[setting])
        assert (await c.get("/healthz")).status_code == 200


@pytest.mark.parametrize(("setting", "value"), [("max_parameters", 100),
                                                ("max_weight_bytes", 100)])
async def test_an_archive_too_large_is_refused_before_its_child_process_starts(
        monkeypatch: pytest.MonkeyPatch, setting: str, value: int) -> None:
    started: list[int] = []

    def child(*args: Any, **kwargs: Any) -> Any:
        started.append(1)
        raise AssertionError("the child process started")

    monkeypatch.setattr(register, "run_child", child)
    async with open_client(**{setting: value}) as c:
        r = await c.put("/models/cnn", content=exported("cnn")[1], headers={"content-type": PT2})
        _named(r, f"PSGRAD_{setting.upper()}", value)
    assert not started


@pytest.mark.parametrize(("path", "media", "slack"), [
    ("/models/m/weights", "application/x-safetensors", 1 << 20),
    ("/models/m", PT2, 64 << 20),
])
async def test_a_body_past_the_weights_limit_names_that_setting(
        path: str, media: str, slack: int) -> None:
    """A weights or archive body is held to PSGRAD_MAX_WEIGHT_BYTES (plus room for the rest of
    the file): its 413 names that setting, not the request body's."""
    async with open_client(max_weight_bytes=16) as c:
        r = await c.put(path, content=bytes(16 + slack + 1), headers={"content-type": media})
        _named(r, "PSGRAD_MAX_WEIGHT_BYTES", 16)


async def test_a_graph_over_its_node_limit_names_the_setting() -> None:
    async with open_client(max_graph_nodes=3) as c:
        r = await c.put("/models/cnn", content=exported("cnn")[1], headers={"content-type": PT2})
        _named(r, "PSGRAD_MAX_GRAPH_NODES", 3)


def _full_size(name: str) -> torch.nn.Module:
    tf = pytest.importorskip("transformers", reason="GPT-2 and BERT need transformers")

    with torch.device("meta"):
        if name == "gpt2":
            return tf.GPT2LMHeadModel(tf.GPT2Config(**EAGER))
        return tf.BertForSequenceClassification(tf.BertConfig(**EAGER))


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_the_defaults_take_gpt2_small_and_bert_base(name: str) -> None:
    """Their parameters (tied weights once) and bytes, counted on ``meta``, are within the
    default limits, and not by a wide margin: a model twice their size is refused."""
    model = _full_size(name)
    unique = {id(p): p for p in model.parameters()}.values()
    n_params = sum(p.numel() for p in unique)
    n_bytes = sum(p.numel() * p.element_size() for p in unique)
    n_bytes += sum(b.numel() * b.element_size() for b in model.buffers())
    defaults = Settings()
    assert 100e6 < n_params <= defaults.max_parameters < 2 * n_params
    assert n_bytes <= defaults.max_weight_bytes < 2 * n_bytes


def _exported_512(name: str) -> bytes:
    """A 2-layer GPT-2 or BERT with 512 positions, exported at length 8 with lengths 2..512."""
    tf = pytest.importorskip("transformers", reason="GPT-2 and BERT need transformers")

    torch.manual_seed(0)
    small: dict[str, Any] = {"vocab_size": 50, **EAGER}
    if name == "gpt2":
        model: torch.nn.Module = tf.GPT2LMHeadModel(tf.GPT2Config(
            n_layer=2, n_embd=64, n_head=2, n_positions=512, bos_token_id=0, eos_token_id=0,
            **small))
    else:
        model = tf.BertForSequenceClassification(tf.BertConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
            max_position_embeddings=512, **{"num_labels": 3, **small}))
    module = Logits(model).eval()
    length = torch.export.Dim("length", min=2, max=512)
    ep = torch.export.export(module, token_batch(1, 8), dynamic_shapes=({1: length},
                                                                          {1: length}))
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    return buf.getvalue()


async def test_bert_with_lengths_up_to_512_registers_under_the_defaults_and_serves_them(
        ) -> None:
    async with open_client() as c:
        r = await c.put("/models/bert", content=_exported_512("bert"),
                        headers={"content-type": PT2})
        assert r.status_code == 200, r.text
        ids, mask = token_batch(2, 512)
        r = await c.post("/per-sample-grads", json={
            "model": "bert", "inputs": {"input_ids": ids.tolist(),
                                        "attention_mask": mask.tolist()},
            "targets": [0, 2], "outputs": ["norms"]})
        assert r.status_code == 200, r.text
        assert np.isfinite(r.json()["norms"]).all()


async def test_a_length_range_is_held_to_the_limit_at_the_length_sent() -> None:
    """Registration measures the example length; the top of the range (512: 12 M activation
    elements here, over the limit of 1 M) is refused only when a request sends it."""
    async with open_client(max_model_activations=1_000_000) as c:
        r = await c.put("/models/gpt", content=_exported_512("gpt2"),
                        headers={"content-type": PT2},
                        params={"default_loss": "next_token"})
        assert r.status_code == 200, r.text
        assert r.json()["config"]["activations"] < 1_000_000
        for length, status in ((64, 200), (512, 413), (16, 200)):
            ids, mask = token_batch(2, length)
            r = await c.post("/per-sample-grads", json={
                "model": "gpt", "inputs": {"input_ids": ids.tolist(),
                                           "attention_mask": mask.tolist()},
                "targets": ids.tolist(), "mask": mask.tolist(), "outputs": ["norms"]})
            assert r.status_code == status, (length, r.text)
            if status == 200:
                assert np.isfinite(r.json()["norms"]).all()
            else:
                _named(r, "PSGRAD_MAX_MODEL_ACTIVATIONS", 1_000_000)
