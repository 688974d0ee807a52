"""Loaded torch.export graphs give the per-sample gradients of the modules they came from."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, vmap

from service.export import ExportLimits, materialise, read_program
from tests.support.export import CASES, TOL, exported

CPU = torch.device("cpu")


def _per_sample_vmap(name: str, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    case = CASES[name]
    loaded = read_program(exported(name)[1], ExportLimits())
    module = materialise(loaded, CPU)
    params = {k: loaded.tensors[k] for k in loaded.params}
    buffers = {k: v for k, v in loaded.tensors.items() if k not in params}

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(module, (p, buffers), (xi.unsqueeze(0),))
        return case.loss(out, xi, yi)

    return vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)  # type: ignore[no-any-return]


def _per_sample_loop(name: str, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    case = CASES[name]
    module = exported(name)[0]
    named = dict(module.named_parameters())
    rows = []
    for i in range(len(x)):
        loss = case.loss(module(x[i : i + 1]), x[i], y[i])
        rows.append(dict(zip(named, torch.autograd.grad(loss, list(named.values())),
                             strict=True)))
    return {k: torch.stack([r[k] for r in rows]) for k in named}


@pytest.mark.parametrize("name", sorted(CASES))
def test_per_sample_grads_equal_the_loop_on_the_original(name: str) -> None:
    case = CASES[name]
    x, y = case.example(4), case.target(4)
    got, want = _per_sample_vmap(name, x, y), _per_sample_loop(name, x, y)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=k)


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_equals_the_original(name: str) -> None:
    module, data = exported(name)
    loaded = read_program(data, ExportLimits())
    x = CASES[name].example(1)
    with torch.no_grad():
        torch.testing.assert_close(materialise(loaded, CPU)(x), module(x), rtol=1e-6, atol=1e-6)


def test_tied_weights_are_one_parameter() -> None:
    loaded = read_program(exported("gpt")[1], ExportLimits())
    assert "wte.weight" in loaded.params and "head.weight" not in loaded.params
    assert loaded.aliases["head.weight"] == "wte.weight"
    assert loaded.output_shape == (7, 17)


def test_dry_run_counts_activations_and_bounds_them() -> None:
    from psgrad._errors import TooLarge

    data = exported("resnet")[1]
    assert read_program(data, ExportLimits()).activations > 0
    with pytest.raises(TooLarge) as info:
        read_program(data, ExportLimits(max_activations=100))
    assert info.value.status == 413


def test_buffers_are_batch_norm_statistics_not_parameters() -> None:
    loaded = read_program(exported("resnet")[1], ExportLimits())
    assert "bn.running_mean" in loaded.tensors and "bn.running_mean" not in loaded.params
    module = materialise(loaded, CPU)
    ref = exported("resnet")[0]
    torch.testing.assert_close(module.bn.running_var, ref.bn.running_var)
