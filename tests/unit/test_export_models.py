"""Real models exported and registered over HTTP: several named inputs, a dynamic sequence
length, the token losses; every answer equals the per-sample loop on the original module."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from psgrad._wire import REQUEST_KEY, fields_to_safetensors
from tests.support.api import open_client
from tests.support.export import TOL, VOCAB, exported_hf, token_batch
from tests.support.reference import per_sample_loop

pytest.importorskip("transformers")

PT2 = "application/x-torch-export"


def _check(got: dict[str, Any], module: nn.Module, data: dict[str, Any], loss: str) -> None:
    want = per_sample_loop(module, data, loss)
    for k, g in want.grads.items():
        np.testing.assert_allclose(np.asarray(got["grads"][k]), g.numpy(), **TOL, err_msg=k)
    np.testing.assert_allclose(got["norms"], want.norms.numpy(), **TOL)
    np.testing.assert_allclose(got["losses"], want.losses.numpy(), **TOL)


async def test_gpt2_padded_batch_next_token_loss_at_a_length_other_than_exported() -> None:
    module, data = exported_hf("gpt2")
    ids, mask = token_batch(3, 6)  # exported at 8
    async with open_client() as c:
        r = await c.put("/models/gpt", content=data, headers={"content-type": PT2},
                        params={"default_loss": "next_token"})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert [u["name"] for u in doc["inputs"]] == ["input_ids", "attention_mask"]
        assert doc["inputs"][0]["dynamic"] == {"0": [2, 32]} and doc["inputs"][0]["high"] == VOCAB
        r = await c.post("/per-sample-grads", json={
            "model": "gpt", "inputs": {"input_ids": ids.tolist(), "attention_mask": mask.tolist()},
            "targets": ids.tolist(), "mask": mask.tolist(),
            "outputs": ["grads", "norms", "losses"]})
        assert r.status_code == 200, r.text
    _check(r.json(), module, {"inputs": {"input_ids": ids, "attention_mask": mask},
                              "targets": ids, "mask": mask}, "next_token")


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_the_sdk_sends_gpt2_named_inputs_and_a_mask(chunk_size: int | None) -> None:
    """docs/models.md's GPT-2 example through psgrad.Client: named inputs as a dict of tensors and
    the token mask; split into requests of 2 samples, each slices both (the merger's
    per-sample fields come from the contract)."""
    import psgrad
    from service.api import create_app
    from tests.support.api import settings
    from tests.support.client import running_app

    module, data = exported_hf("gpt2")
    ids, mask = token_batch(3, 6)
    with running_app(create_app(settings())) as t, psgrad.Client("http://app", transport=t) as c:
        c.models.register_exported("gpt", data, default_loss="next_token")
        got = c.per_sample_grads("gpt", {"input_ids": ids, "attention_mask": mask}, ids,
                                 mask=mask, outputs=["grads", "norms", "losses"],
                                 chunk_size=chunk_size)
    assert got.meta["requests"] == (1 if chunk_size is None else 2)
    _check(got.outputs, module, {"inputs": {"input_ids": ids, "attention_mask": mask},
                                 "targets": ids, "mask": mask}, "next_token")


async def test_the_async_sdk_sends_named_inputs_and_a_mask() -> None:
    import psgrad

    module, data = exported_hf("gpt2")
    ids, mask = token_batch(2, 5)
    async with open_client() as http, psgrad.AsyncClient(http_client=http) as c:
        await c.models.register_exported("gpt", data, default_loss="next_token")
        got = await c.per_sample_grads(
            "gpt", {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}, ids.numpy(),
            mask=mask.numpy(), outputs=["grads", "norms", "losses"])
        job = await c.submit("gpt", {"input_ids": ids, "attention_mask": mask}, ids, mask=mask,
                             outputs=["norms"])
        queued = await job.result(timeout=60)
    data_ = {"inputs": {"input_ids": ids, "attention_mask": mask}, "targets": ids, "mask": mask}
    _check(got.outputs, module, data_, "next_token")
    np.testing.assert_allclose(queued.norms, got.norms, **TOL)


async def test_bert_classifier_over_safetensors_with_named_input_tensors() -> None:
    module, data = exported_hf("bert")
    ids, mask = token_batch(3, 10)
    y = torch.tensor([0, 2, 1])
    body = fields_to_safetensors({
        "model": "bert", "inputs": {"input_ids": ids.numpy(), "attention_mask": mask.numpy()},
        "targets": y.numpy(), "outputs": ["grads", "norms", "losses"]}, REQUEST_KEY)
    async with open_client() as c:
        r = await c.put("/models/bert", content=data, headers={"content-type": PT2})
        assert r.status_code == 200, r.text
        r = await c.post("/per-sample-grads", content=body,
                         headers={"content-type": "application/x-safetensors"})
        assert r.status_code == 200, r.text
    _check(r.json(), module, {"inputs": {"input_ids": ids, "attention_mask": mask},
                              "targets": y}, "cross_entropy")


async def test_token_cross_entropy_without_a_mask() -> None:
    module, data = exported_hf("gpt2")
    ids, mask = token_batch(2, 5)
    targets = torch.roll(ids, 1, dims=1)
    async with open_client() as c:
        await c.put("/models/gpt", content=data, headers={"content-type": PT2},
                    params={"default_loss": "next_token", "losses": ["token_cross_entropy"]})
        r = await c.post("/per-sample-grads", json={
            "model": "gpt", "loss": "token_cross_entropy", "targets": targets.tolist(),
            "inputs": {"input_ids": ids.tolist(), "attention_mask": mask.tolist()},
            "outputs": ["grads", "norms", "losses"]})
        assert r.status_code == 200, r.text
    _check(r.json(), module, {"inputs": {"input_ids": ids, "attention_mask": mask},
                              "targets": targets}, "token_cross_entropy")


BAD = [
    # well-formed (the schema admits a tensor or an object of them) but not this model's: 422
    ({"inputs": [[1, 2, 3]]}, 422, "invalid_input"),  # several inputs need an object
    ({"inputs": {"input_ids": [[1, 2, 3]]}}, 422, "invalid_input"),  # one missing
    ({"inputs": {"input_ids": [[1] * 40], "attention_mask": [[1] * 40]},
      "targets": [[1] * 40]}, 422, "shape_mismatch"),  # beyond the exported range
    ({"inputs": {"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1]]}}, 422, "shape_mismatch"),
    ({"inputs": {"input_ids": [[1, 2, VOCAB]], "attention_mask": [[1, 1, 1]]}}, 422,
     "invalid_input"),  # an id beyond the embedding
    ({"targets": [[1, 2]]}, 422, "shape_mismatch"),
    ({"targets": [[1, 2, VOCAB]]}, 422, "target_out_of_range"),
    ({"mask": [[1, 2, 1]]}, 422, "invalid_input"),
    ({"loss": "token_cross_entropy"}, 422, "loss_not_supported"),
]


async def test_bad_token_requests_are_4xx_naming_what_to_change() -> None:
    async with open_client() as c:
        await c.put("/models/gpt", content=exported_hf("gpt2")[1], headers={"content-type": PT2},
                    params={"default_loss": "next_token"})
        for change, status, code in BAD:
            request = {"model": "gpt", "targets": [[1, 2, 3]], "outputs": ["norms"],
                       "inputs": {"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 1]]},
                       **change}
            r = await c.post("/per-sample-grads", json=request)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), (change, r.text)
        # the mask's message says what is wrong with it: its shape, or its values (it showed
        # the right shape as what was sent)
        for mask, said in (([[1, 0.5, 2]], "got 2 other values (first: 0.5)"),
                           ([[1, 1]], "got shape [1, 2]")):
            r = await c.post("/per-sample-grads", json={
                "model": "gpt", "targets": [[1, 2, 3]], "outputs": ["norms"], "mask": mask,
                "loss": "next_token",
                "inputs": {"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 1]]}})
            assert r.status_code == 422 and said in r.json()["error"]["message"], r.text


def test_the_sdk_and_the_cli_register_a_program_path_or_object(tmp_path: Any,
                                                                capsys: Any) -> None:
    import psgrad
    from psgrad._cli import main as cli_main
    from service.api import create_app
    from tests.support.api import settings
    from tests.support.client import running_app
    from tests.support.export import CASES, exported

    module, data = exported("resnet")
    path = tmp_path / "model.pt2"
    path.write_bytes(data)
    x, y = CASES["resnet"].example(2), CASES["resnet"].target(2)
    with running_app(create_app(settings())) as t, psgrad.Client("http://app", transport=t) as c:
        c.models.register_exported("res", path, default_loss="cross_entropy",
                                          description="a resnet")
        c.models.register_exported(
            "res2", torch.export.export(module, (x[:1],)), losses=["nll"])
        assert "nll" in c.models.get("res2").losses
        got = c.per_sample_grads("res", x.numpy(), y.numpy(), outputs=["norms"])
    want = per_sample_loop(module, {"inputs": x, "targets": y}, "cross_entropy")
    np.testing.assert_allclose(got.norms, want.norms.numpy(), **TOL)
    with pytest.raises(SystemExit):
        cli_main(["models", "register", "x", "--url", "http://127.0.0.1:9"])
