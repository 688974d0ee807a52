"""K-FAC and EK-FAC (:mod:`service.curvature`) against their definitions: covariances built here
from the model's own layers, dense ``(F + lambda I)^-1`` solves, eigenvalues as second moments of
the per-sample loop's gradients."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from service.curvature import Curvature, captured, factor_means, fit, linear_layers
from service.registry import LoadedModel, load_model
from tests.support.batches import SMALL_TRANSFORMER, make_batch
from tests.support.reference import assert_close, per_sample_loop

CPU = torch.device("cpu")
DAMPING = 0.05


def _model(arch: str, config: dict[str, Any]) -> LoadedModel:
    model = load_model(arch, arch, config, device=CPU, dtype=torch.float64)
    return model


def _fields(model: LoadedModel, n: int, seed: int) -> dict[str, torch.Tensor]:
    batch = make_batch(model, n, seed, reference=False)
    x = batch.inputs
    return {"inputs": x.double() if x.is_floating_point() else x, "targets": batch.targets}


def _loop(model: LoadedModel, fields: dict[str, torch.Tensor], params: list[str]
          ) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in
            per_sample_loop(model.module, fields, model.default_loss, params=params).grads.items()}


def _dense(curv: Curvature, name: str, kind: str) -> torch.Tensor:
    """``F`` of one layer as a dense matrix over its row-major ``[out, in (+1)]`` entries."""
    basis = curv.bases[name]
    q = torch.kron(basis.q_grads, basis.q_inputs)
    return q @ torch.diag(curv.eigenvalues(name, kind).flatten()) @ q.T  # type: ignore[arg-type]


def _joined(grads: dict[str, torch.Tensor], weight: str, bias: str) -> torch.Tensor:
    return torch.cat([grads[weight], grads[bias].unsqueeze(2)], dim=2)


MLP = ("mlp", {"sizes": [6, 5, 3]})


def test_captured_rows_rebuild_each_samples_gradient() -> None:
    model = _model("tiny-transformer", SMALL_TRANSFORMER)
    params = list(model.params)
    fields = _fields(model, 3, seed=1)
    loop = _loop(model, fields, params)
    layers = linear_layers(model, params, "cross_entropy", 1.0, fields)
    blocks = sorted(f"encoder.{i}.linear{j}.weight" for i in (0, 1) for j in (1, 2))
    assert sorted(layers) == [*blocks, "head.weight"]  # out_proj: read by its parent
    for i, one in enumerate(captured(model, "cross_entropy", 1.0, layers, params, fields)):
        for k in params:
            assert_close(one.grads[k], loop[k][i], k)
        for name, layer in layers.items():
            a, g = one.inputs[name], one.out_grads[name]
            assert a.shape[0] == g.shape[0] > (name != "head.weight")  # every token
            rebuilt = g.T @ a
            want = loop[name][i].reshape(rebuilt.shape[0], -1)
            if layer.bias is not None:
                want = torch.cat([want, loop[layer.bias][i].unsqueeze(1)], 1)
            assert_close(rebuilt, want, name)
    assert not model.module._forward_hooks and all(
        not m._forward_hooks for m in model.module.modules())


def test_fitting_never_runs_the_module_other_threads_run() -> None:
    """``functional_call`` swaps the parameters of the module it runs, and no lock is held while
    an answer's ``kfac_inputs`` are made: both passes (the batch at once, and one sample at a
    time) run a copy of the module, sharing its tensors."""
    model = _model(*MLP)
    fields = _fields(model, 4, seed=5)
    ran: list[bool] = []
    hook = model.module.register_forward_pre_hook(
        lambda module, _args: ran.append(module is model.module))
    try:
        factor_means(model, "cross_entropy", 1.0, list(model.params), fields)
        fit(model, "cross_entropy", 1.0, list(model.params), [fields])
    finally:
        hook.remove()
    assert len(ran) > 4 and not any(ran)


def _mlp_covariances(model: LoadedModel, fields: dict[str, torch.Tensor]
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (A, S) of the two-layer perceptron, by its forward pass written out."""
    p = model.params
    x, y = fields["inputs"].double(), fields["targets"]
    ones = torch.ones(len(x), 1, dtype=x.dtype)
    h = x @ p["fc1.weight"].T + p["fc1.bias"]
    a2 = torch.relu(h)
    logits = a2 @ p["fc2.weight"].T + p["fc2.bias"]
    g2 = torch.softmax(logits, 1) - F.one_hot(y, logits.shape[1]).double()
    g1 = (g2 @ p["fc2.weight"]) * (h > 0)
    n = len(x)
    out = {}
    for name, a, g in (("fc1.weight", x, g1), ("fc2.weight", a2, g2)):
        a = torch.cat([a, ones], 1)
        out[name] = (a.T @ a / n, g.T @ g / n)
    return out


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_preconditioning_is_the_dense_solve(kind: str) -> None:
    model = _model(*MLP)
    params = list(model.params)
    fields = _fields(model, 12, seed=2)
    curv = fit(model, "cross_entropy", 1.0, params, [fields])
    loop = _loop(model, fields, params)
    got = curv.precondition(loop, DAMPING, kind)  # type: ignore[arg-type]
    for name, (a, s) in _mlp_covariances(model, fields).items():
        bias = name.replace("weight", "bias")
        dense = torch.kron(s, a) if kind == "kfac" else _dense(curv, name, kind)
        assert_close(_dense(curv, name, kind), dense, f"{name} F")
        g = _joined(loop, name, bias).flatten(1)
        want = torch.linalg.solve(dense + DAMPING * torch.eye(len(dense), dtype=dense.dtype), g.T).T
        assert_close(_joined(got, name, bias).flatten(1), want, name)


def test_ekfac_eigenvalues_are_second_moments_in_the_kfac_basis() -> None:
    model = _model("tiny-transformer", SMALL_TRANSFORMER)
    params = [k for k in model.params if "weight" in k or "bias" in k]
    fields = _fields(model, 6, seed=3)
    curv = fit(model, "cross_entropy", 1.0, params, [fields])
    loop = _loop(model, fields, params)
    for name, layer in curv.layers.items():
        g = loop[name].reshape(len(loop[name]), loop[name].shape[1], -1)
        if layer.bias is not None:
            g = torch.cat([g, loop[layer.bias].unsqueeze(2)], 2)
        basis = curv.bases[name]
        want = (basis.q_grads.T @ g @ basis.q_inputs).square().mean(0)
        assert_close(curv.corrected[name], want, name)
    assert curv.samples == 6


def test_parameters_outside_linear_layers_get_their_diagonal_fisher() -> None:
    model = _model("tiny-transformer", SMALL_TRANSFORMER)
    params = list(model.params)
    fields = _fields(model, 5, seed=4)
    curv = fit(model, "cross_entropy", 1.0, params, [fields])
    covered = {p for layer in curv.layers.values() for p in (layer.weight, layer.bias) if p}
    others = sorted(set(params) - covered)
    assert others and sorted(curv.diagonal) == others  # embeddings and norms, none dropped
    loop = _loop(model, fields, params)
    got = curv.precondition(loop, DAMPING, "ekfac")
    assert sorted(got) == sorted(params)
    for k in others:
        assert_close(got[k], loop[k] / (loop[k].square().mean(0) + DAMPING), k)


def test_fitting_in_batches_equals_fitting_at_once() -> None:
    model = _model(*MLP)
    params = list(model.params)
    a, b = _fields(model, 4, seed=5), _fields(model, 7, seed=6)
    whole = {k: torch.cat([a[k], b[k]]) for k in a}
    parts = fit(model, "cross_entropy", 1.0, params, [a, b])
    once = fit(model, "cross_entropy", 1.0, params, [whole])
    g = _loop(model, whole, params)
    for kind in ("kfac", "ekfac"):
        got = parts.precondition(g, DAMPING, kind)  # type: ignore[arg-type]
        want = once.precondition(g, DAMPING, kind)  # type: ignore[arg-type]
        for k in params:
            assert_close(got[k], want[k], f"{kind} {k}")


def test_a_layer_without_its_bias_selected_has_no_column_of_ones() -> None:
    model = _model(*MLP)
    params = ["fc1.weight", "fc2.weight", "fc2.bias"]
    fields = _fields(model, 8, seed=7)
    layers = linear_layers(model, params, "cross_entropy", 1.0, fields)
    assert layers["fc1.weight"].bias is None and layers["fc2.weight"].bias == "fc2.bias"
    curv = fit(model, "cross_entropy", 1.0, params, [fields])
    assert curv.bases["fc1.weight"].q_inputs.shape == (6, 6)
    a, _ = _mlp_covariances(model, fields)["fc1.weight"]
    assert_close(curv.bases["fc1.weight"].q_inputs @ torch.diag(curv.bases["fc1.weight"].l_inputs)
                 @ curv.bases["fc1.weight"].q_inputs.T, a[:6, :6], "A")


def test_damping_must_be_positive() -> None:
    model = _model(*MLP)
    params = list(model.params)
    fields = _fields(model, 3, seed=8)
    curv = fit(model, "cross_entropy", 1.0, params, [fields])
    with pytest.raises(ValueError, match="damping"):
        curv.precondition(_loop(model, fields, params), 0.0, "kfac")


def test_ekfac_default_damping_is_a_tenth_of_the_fishers_mean_eigenvalue() -> None:
    model = _model("tiny-transformer", SMALL_TRANSFORMER)
    params = list(model.params)
    fields = _fields(model, 4, seed=9)
    curv = fit(model, "cross_entropy", 1.0, params, [fields])
    loop = _loop(model, fields, params)
    # trace(F) of the empirical Fisher: the mean squared gradient norm, over P parameters
    trace = sum(float(g.square().sum()) for g in loop.values()) / 4
    width = sum(model.params[k].numel() for k in params)
    assert curv.default_damping("ekfac") == pytest.approx(0.1 * trace / width, rel=1e-9)
    kfac = curv.default_damping("kfac")
    assert kfac > 0 and kfac != pytest.approx(curv.default_damping("ekfac"))


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_whitening_twice_is_preconditioning_once(kind: str) -> None:
    model = _model("tiny-transformer", SMALL_TRANSFORMER)
    params = list(model.params)
    fields = _fields(model, 4, seed=10)
    curv = fit(model, "cross_entropy", 1.0, params, [fields])
    g = _loop(model, fields, params)
    half = curv.precondition(curv.precondition(g, DAMPING, kind, power=0.5),  # type: ignore[arg-type]
                             DAMPING, kind, power=0.5)  # type: ignore[arg-type]
    assert_close(half, curv.precondition(g, DAMPING, kind))  # type: ignore[arg-type]


async def test_the_kfac_output_is_the_mean_factors_of_its_samples_chunked_or_not(
        tmp_path: Path) -> None:
    """``kfac_inputs`` (with ``kfac_grads`` and ``kfac_tokens``) through the service, one request
    and split by the SDK into three, against the factors written out by hand."""
    import httpx
    import numpy as np

    import psgrad
    from service.api import create_app
    from service.config import Settings

    model = _model(*MLP)
    weights = {k: v.float().numpy() for k, v in model.params.items()}
    fields = _fields(model, 12, seed=11)
    want = _mlp_covariances(model, fields)
    x, y = fields["inputs"].float().numpy(), fields["targets"].numpy()
    app = create_app(Settings(data_dir=str(tmp_path), device="cpu", redis_url=None, api_keys="",
                              admin_keys="", batch_max_delay_ms=0))
    async with (app.router.lifespan_context(app),
                psgrad.AsyncClient("http://app", transport=httpx.ASGITransport(app=app)) as c):
        await c.models.register("small", architecture="mlp", config={"sizes": [6, 5, 3]})
        await c.models.upload_weights("small", weights)
        for chunk in (None, 5):
            r = await c.per_sample_grads("small", x, y, outputs=["kfac_inputs"],
                                         chunk_size=chunk)
            assert r.meta["requests"] == (1 if chunk is None else 3)
            assert sorted(r.kfac_inputs) == sorted(want)
            for name, (a, s) in want.items():
                np.testing.assert_allclose(r.kfac_inputs[name], a.numpy(), rtol=1e-4, atol=1e-6)
                np.testing.assert_allclose(r.kfac_grads[name], s.numpy(), rtol=1e-4, atol=1e-7)
                assert float(r.kfac_tokens[name]) == pytest.approx(1.0)


def test_the_answer_size_counts_the_factors() -> None:
    from service import engine
    from service.engine import Options

    model = _model(*MLP)
    params = tuple(model.params)
    plain = engine.output_bytes(model, Options(loss="cross_entropy", params=params,
                                               outputs=("losses",)), 4)
    with_factors = engine.output_bytes(model, Options(loss="cross_entropy", params=params,
                                                      outputs=("losses", "kfac_inputs")), 4)
    # fc1: 7 x 7 inputs, 5 x 5 grads, one token count; fc2: 6 x 6, 3 x 3, one; and the
    # table's one value per parameter of a per-parameter output
    assert with_factors - plain == 8 * (49 + 25 + 1 + 36 + 9 + 1 + len(params))


@pytest.mark.parametrize("arch", ["mlp", "tiny-transformer"])
def test_the_batch_at_once_sums_the_samples_one_at_a_time(arch: str) -> None:
    """The first pass over a whole batch (one forward, one backward of the summed losses)
    equals the per-sample loop's sums, for samples of one token and of many."""
    from service.curvature import _at_once, covariances

    model = _model(*MLP) if arch == "mlp" else _model(arch, SMALL_TRANSFORMER)
    params = list(model.params)
    fields = _fields(model, 6, seed=12)
    layers = linear_layers(model, params, "cross_entropy", 1.0, fields)
    at_once = _at_once(model, "cross_entropy", layers, params, fields, None)
    assert at_once is not None and at_once.samples == 6
    loop = list(captured(model, "cross_entropy", 1.0, layers, params, fields))
    for name in layers:
        a = torch.cat([one.inputs[name] for one in loop])
        g = torch.cat([one.out_grads[name] for one in loop])
        assert_close(at_once.inputs[name], a.T @ a, name)
        assert_close(at_once.grads[name], g.T @ g, name)
        assert at_once.tokens[name] == len(a)
    assert covariances(model, "cross_entropy", 1.0, layers, params, fields).samples == 6
    assert _at_once(model, "mse", layers, params, fields, None) is None  # no batched form
