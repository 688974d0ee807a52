"""Every statistic of the real-size architectures (GPT-2 with its tied output layer, a BERT
classifier, ResNet-18), in small configurations, equal to the per-sample loop on the original
module: padded sequences with their mask, and each per-layer method forced in turn
(``PSGRAD_FAST_STATS_FORM``) giving the same answers for the same layers. The models are served
on ``PSGRAD_DEVICE`` (the CPU unless set; the loop runs on the CPU), in float32."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from psgrad._errors import InvalidInput
from service import engine
from service.config import get_settings
from service.fast_stats import TUNING
from service.fast_stats._outer import OuterSource
from service.registration import register_exported
from service.registry import ModelRegistry, resolve_device, set_tf32
from service.validate import parse_request
from service.verify import TOLERANCE
from tests.support.accelerator import sized_as_on_an_accelerator
from tests.support.api import settings
from tests.support.realsize import SMALL, ResNet18, export, hf, padded_tokens
from tests.support.reference import (
    assert_close,
    attribution,
    per_sample_loop,
    summarize,
    tolerance,
)

pytest.importorskip("transformers")

NAMES = ("gpt2", "bert", "resnet18")
OUTPUTS = ["norms", "clipped_mean", "mean", "variance", "cosine_mean", "dots"]
# the clipped mean takes a second pass after the backward pass, the others one pass each in it
# (the statistics of a layer taken as the backward pass reaches it); dots alone: M references
REQUESTS = (["clipped_mean"], ["norms", "mean", "variance", "cosine_mean"], ["dots"])
N, LENGTH, M = 5, 9, 2
CLIP = 0.05  # below most norms: clipping changes the answer
TIED = "model.transformer.wte.weight"  # GPT-2's embedding, read again as its output layer


def _case(name: str) -> tuple[nn.Module, str, dict[str, Any]]:
    """The original module, its loss and a batch (padded sequences for the token models)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "resnet18":
        module: nn.Module = ResNet18(width=4, classes=5).eval()
        return module, "cross_entropy", {"inputs": torch.randn(N, 3, 32, 32, generator=gen),
                                         "targets": torch.randint(0, 5, (N,), generator=gen)}
    config = SMALL[name]
    module = hf(name, **config)
    ids, mask = padded_tokens(N, LENGTH, config["vocab_size"], gen)
    batch: dict[str, Any] = {"inputs": {"input_ids": ids, "attention_mask": mask}}
    if name == "gpt2":
        return module, "next_token", {**batch, "targets": ids, "mask": mask}
    return module, "cross_entropy", {**batch, "targets": torch.randint(0, 2, (N,), generator=gen)}


class Registry(ModelRegistry):
    """The three models, each exported and registered the first time a test asks for it (one
    export per test's setup, not all three in the first test's)."""

    def get(self, ref: str) -> Any:
        if ref in NAMES and ref not in self.ids():
            module, loss, batch = _case(ref)
            inputs = batch["inputs"]
            example = tuple(v[:1] for v in inputs.values()) if isinstance(inputs, dict) \
                else (inputs[:1],)
            register_exported(self, ref, export(module, example, 32), settings(),
                              default_loss=loss, losses=[])
        return super().get(ref)


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    set_tf32(False)  # float32 on CUDA, as the workers run
    return Registry(resolve_device(os.environ.get("PSGRAD_DEVICE", "cpu")))


@pytest.fixture
def form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("PSGRAD_FAST_STATS_FORM", request.param)
    get_settings.cache_clear()
    yield request.param
    get_settings.cache_clear()


def _references(registry: ModelRegistry, name: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return {k: torch.randn((M, *v.shape), generator=gen)
            for k, v in registry.get(name).params.items()}


def _compute(registry: ModelRegistry, name: str, batch: dict[str, Any],
             references: dict[str, torch.Tensor],
             requests: tuple[list[str], ...] = REQUESTS, *,
             autocast: str = "off", fast_stats: bool = True) -> dict[str, Any]:
    def arrays(v: Any) -> Any:
        return {k: t.numpy() for k, t in v.items()} if isinstance(v, dict) else v.numpy()

    fields = {k: arrays(v) for k, v in batch.items()}
    answers = {}
    for outputs in requests:  # dots alone: M references
        extra = {"reference": arrays(references)} if outputs == ["dots"] else {}
        parsed = parse_request({"model": name, "outputs": outputs, "clip_norm": CLIP,
                                "autocast": autocast, **fields, **extra}, registry)
        [out] = engine.compute(parsed.model, parsed.batch, parsed.opts, fast_stats=fast_stats)
        answers.update(out)
        answers[f"{outputs[0]}_meta"] = out["meta"]
    return answers


@pytest.mark.parametrize("form", ["auto", "gram", "materialise"], indirect=True)
@pytest.mark.parametrize("name", NAMES)
def test_every_statistic_equals_the_loop(registry: ModelRegistry, name: str, form: str) -> None:
    module, loss, batch = _case(name)
    references = _references(registry, name)
    got = _compute(registry, name, batch, references)
    meta = got["norms_meta"]
    assert meta["route"] == got["dots_meta"]["route"] == "fast_stats"
    assert "vmap" not in meta["method"].values(), meta["method"]  # no whole-model replay
    several = [k for k, v in meta["form"].items() if v in ("gram", "materialise")]
    assert several, meta["form"]  # weights read at several positions: the choice applies
    if form != "auto":
        assert all(meta["form"][k] == form for k in several), meta["form"]
    want = _loop(module, loss, batch, references)
    assert float(want["norms"].min()) > CLIP  # every sample clipped
    for output in OUTPUTS:
        assert_close(got[output], want[output], f"{name} {form} {output}", **tolerance(output))


@pytest.mark.parametrize("name", NAMES)
def test_sized_as_on_an_accelerator_every_statistic_equals_the_loop(
        registry: ModelRegistry, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of per-sample gradients as a GPU sizes them (each layer's in one piece, where the
    CPU's cache takes several slices and sets of samples here) and a mean's norm fused."""
    monkeypatch.setattr(TUNING, "piece_bytes", 1 << 10)  # the CPU's pieces: many per layer
    monkeypatch.setattr(TUNING, "min_rows", 1)
    module, loss, batch = _case(name)
    references = _references(registry, name)
    with sized_as_on_an_accelerator():
        got = _compute(registry, name, batch, references)
    assert got["norms_meta"]["route"] == "fast_stats"
    want = _loop(module, loss, batch, references)
    for output in OUTPUTS:
        assert_close(got[output], want[output], f"{name} {output}", **tolerance(output))


def _loop(module: nn.Module, loss: str, batch: dict[str, Any],
          references: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Every statistic of the batch from the per-sample loop on the original module."""
    loop = per_sample_loop(module, batch, loss)
    [want] = summarize(loop, [N], clip_norm=CLIP)
    want["dots"] = attribution(loop, references)["dots"]
    return want


@pytest.mark.parametrize("fast", [True, False], ids=["fast_stats", "vmap"])
@pytest.mark.parametrize("name", NAMES)
def test_under_bfloat16_autocast_every_statistic_is_the_loop_to_bfloat16_precision(
        registry: ModelRegistry, name: str, fast: bool) -> None:
    """``autocast: bfloat16``: the forward and backward round through bfloat16, the statistics
    are formed in float32. Each equals the float32 loop's within bfloat16's tolerance (the one a
    verified request under autocast is held to), and differs from the float32 answer: autocast
    did run."""
    module, loss, batch = _case(name)
    references = _references(registry, name)
    try:
        half = _compute(registry, name, batch, references, autocast="bfloat16", fast_stats=fast)
    except InvalidInput as exc:  # vmap of the exported BatchNorm on the CPU: its kernel refuses
        cpu = registry.device.type == "cpu"  # bfloat16 inputs with float32 weights
        assert (name, fast, cpu) == ("resnet18", False, True), exc.message
        assert "does not run under autocast bfloat16 on cpu" in exc.message
        return
    full = _compute(registry, name, batch, references, fast_stats=fast)
    assert half["norms_meta"]["route"] == ("fast_stats" if fast else "vmap")
    want = _loop(module, loss, batch, references)
    atol, rtol = TOLERANCE[torch.bfloat16]
    for output in OUTPUTS:
        assert_close(half[output], want[output], f"{name} bfloat16 {output}", atol=atol,
                     rtol=rtol)
    assert not torch.equal(half["norms"], full["norms"])


@pytest.mark.parametrize("form", ["gram", "materialise"], indirect=True)
def test_the_tied_embedding_and_output_layer_are_one_parameter_in_closed_form(
        registry: ModelRegistry, form: str) -> None:
    """GPT-2's ``wte`` is read by the embedding and by the output layer: its per-sample
    gradient is the sum of both parts, its norm has their cross term, never the sum built."""
    module, loss, batch = _case("gpt2")
    got = _compute(registry, "gpt2", batch, _references(registry, "gpt2"))
    meta = got["norms_meta"]
    assert meta["method"][TIED] == "tied"
    assert meta["form"][TIED] == f"tied:embedding+{form}"
    assert "model.lm_head.weight" not in meta["method"]  # one parameter, counted once
    loop = per_sample_loop(module, batch, loss, params=[TIED])
    parsed = parse_request({"model": "gpt2", "outputs": ["layer_norms"], "params": [TIED],
                            "inputs": {k: v.numpy() for k, v in batch["inputs"].items()},
                            "targets": batch["targets"].numpy(),
                            "mask": batch["mask"].numpy()}, registry)
    [out] = engine.compute(parsed.model, parsed.batch, parsed.opts)
    assert_close(out["layer_norms"][TIED], loop.norms, f"tied {form}")


def test_both_forms_give_the_same_answers_for_the_same_layers(
        registry: ModelRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    batch = _case("bert")[2]
    references = _references(registry, "bert")
    answers = {}
    for form in ("gram", "materialise"):
        monkeypatch.setenv("PSGRAD_FAST_STATS_FORM", form)
        get_settings.cache_clear()
        answers[form] = _compute(registry, "bert", batch, references)
    get_settings.cache_clear()
    forms = {f: a["norms_meta"]["form"] for f, a in answers.items()}
    layers = [k for k, v in forms["gram"].items() if v == "gram"]
    assert layers and all(forms["materialise"][k] == "materialise" for k in layers)
    for output in OUTPUTS:
        assert_close(answers["gram"][output], answers["materialise"][output], output,
                     **tolerance(output))


@pytest.mark.parametrize("way", ["pairs", "pieces"])
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_cosine_by_pairwise_products_or_pieces(registry: ModelRegistry, name: str, way: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``cosine_mean`` with every weight over several positions taking the pairwise products
    (GPT-2's tied output layer with the embedding's part and their cross terms: its mean is the
    tied parameter's), or building its gradients a piece at a time (the default; GPT-2's tied
    layer still by pairs), equals the loop."""
    monkeypatch.setattr(OuterSource, "pairs_cheaper", lambda self, n: self.t > 1)
    if way == "pairs":
        monkeypatch.setattr(TUNING, "whole_piece_bytes", 0)
    module, loss, batch = _case(name)
    got = _compute(registry, name, batch, {}, (["cosine_mean"],))
    [want] = summarize(per_sample_loop(module, batch, loss), [N], clip_norm=CLIP)
    assert_close(got["cosine_mean"], want["cosine_mean"], f"{name} cosine_mean")


@pytest.mark.parametrize("kind", ["tensorsketch", "kronecker"])
@pytest.mark.parametrize("name", NAMES)
def test_sketches_are_the_projected_loop(registry: ModelRegistry, name: str, kind: str) -> None:
    """``projection`` on the fast path (HF ``Conv1D``'s transposed weights, GPT-2's tied
    embedding and output layer, BatchNorm replayed) is each kind's matrix applied to the loop's
    per-sample gradients."""
    module, loss, batch = _case(name)
    fields = {k: {a: b.numpy() for a, b in v.items()} if isinstance(v, dict) else v.numpy()
              for k, v in batch.items()}
    parsed = parse_request({"model": name, "outputs": ["projection"], "projection_dim": 256,
                            "projection_kind": kind, **fields}, registry)
    [out] = engine.compute(parsed.model, parsed.batch, parsed.opts)
    assert out["meta"]["route"] == "fast_stats" and out["meta"]["projection_kind"] == kind
    proj = parsed.opts.projection
    assert proj is not None
    loop = per_sample_loop(module, batch, loss)
    assert_close(out["projection"], sum(proj.project(k, g.double())
                                        for k, g in loop.grads.items()))
