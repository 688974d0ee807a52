"""The two documents that started psgrad, reproduced through request parsing and the engine.

(a) The PyTorch tutorial "Per-sample-gradients": its CNN, B=64 random MNIST-shaped inputs, the
per-sample gradients equal a per-sample loop at the tutorial's ``atol=3e-3, rtol=1e-5``.
(b) The MindSpore tutorial's TD(0) with a linear value function: the numbers checked by hand in
docs/requests.md ("TD(0) semantics"), and the batched case (one theta, a batch of transitions:
``in_axes=(None, 0, 0, 0)``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from service import engine
from service.api.body import decode_json_body
from service.registry import ModelRegistry, load_model
from service.validate import parse_request
from tests.support.reference import per_sample_loop

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    return ModelRegistry(CPU)


def run(registry: ModelRegistry, body: dict[str, Any]) -> dict[str, Any]:
    parsed = parse_request(decode_json_body(body, max_elements=1 << 24), registry)
    return engine.compute(parsed.model, parsed.batch, parsed.opts)[0]


def test_pytorch_tutorial_check(registry: ModelRegistry) -> None:
    """The tutorial's closing check: vmap(grad) per-sample gradients == the per-sample loop."""
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(64, 1, 28, 28, generator=gen)
    targets = torch.randint(10, (64,), generator=gen)
    out = run(
        registry,
        {
            "model": "simple-cnn",
            "inputs": {"dtype": "float32", "shape": [64, 1, 28, 28], "data": _b64(data)},
            "targets": targets.tolist(),
            "outputs": ["grads"],
        },
    )

    model = registry.get("simple-cnn").module  # the registered weights, run as the tutorial does
    params = dict(model.named_parameters())
    names = list(params)
    assert names == [
        "conv1.weight",
        "conv1.bias",
        "conv2.weight",
        "conv2.bias",
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
    ]
    loop = per_sample_loop(model, {"inputs": data, "targets": targets}, "nll")
    assert list(out["grads"]) == names
    for name, expected in loop.grads.items():
        assert out["grads"][name].shape == (64, *params[name].shape)
        assert torch.allclose(out["grads"][name], expected, atol=3e-3, rtol=1e-5), name


def _b64(t: torch.Tensor) -> str:
    import base64

    return base64.b64encode(t.contiguous().numpy().astype("<f4").tobytes()).decode()


MINDSPORE = {
    "model": "linear-value",
    "loss": "td0",
    "weights": {"theta": [0.2, -0.2, 0.1]},
    "inputs": [[2, 1, -2]],
    "next_inputs": [[1, 2, 0]],
    "rewards": [2],
    "gamma": 1.0,
    "outputs": ["grads", "updates", "td_errors", "losses"],
}


def test_mindspore_td0_hand_checked(registry: ModelRegistry) -> None:
    """V(s)=0, V(s')=-0.2, delta=1.8; updates = delta s; grads = -2 delta s."""
    out = run(registry, MINDSPORE)
    assert out["td_errors"].tolist() == pytest.approx([1.8], abs=1e-6)
    assert out["losses"].tolist() == pytest.approx([1.8**2], abs=1e-6)
    assert out["updates"]["theta"].tolist() == [pytest.approx([3.6, 1.8, -3.6], abs=1e-6)]
    assert out["grads"]["theta"].tolist() == [pytest.approx([-7.2, -3.6, 7.2], abs=1e-6)]


def test_mindspore_printout_is_the_gradient_at_s_prime(registry: ModelRegistry) -> None:
    """The tutorial prints [-4, -8, 0]: its td_loss reads s' where the formula has s.

    Sending s' as the state reproduces the printout: target = 2 + V(s') = 1.8, delta =
    1.8 - V(s') = 2, grad = -2 * 2 * s' = [-4, -8, 0]. psgrad itself follows the formula.
    """
    out = run(registry, {**MINDSPORE, "inputs": [[1, 2, 0]]})
    assert out["grads"]["theta"].tolist() == [pytest.approx([-4.0, -8.0, 0.0], abs=1e-6)]


@pytest.mark.parametrize("bias", [False, True])
def test_mindspore_td0_batched(registry: ModelRegistry, bias: bool) -> None:
    """One theta, a batch of transitions with dones and gamma: every sample by the formula."""
    rng = np.random.default_rng(5)
    n, dim, gamma = 9, 3, 0.9
    theta = np.array([0.2, -0.2, 0.1])
    b = 0.3 if bias else 0.0
    s, s_next = rng.normal(size=(n, dim)).round(2), rng.normal(size=(n, dim)).round(2)
    r = rng.normal(size=n).round(2)
    dones = np.array([0, 1, 0, 0, 1, 0, 0, 0, 1])
    body = {
        **MINDSPORE,
        "inputs": s.tolist(),
        "next_inputs": s_next.tolist(),
        "rewards": r.tolist(),
        "dones": dones.tolist(),
        "gamma": gamma,
        "weights": {"theta": theta.tolist(), **({"bias": b} if bias else {})},
    }
    if bias:
        # the zoo default has no bias: a linear-value model with one, served by itself
        model = load_model("linear-value", "linear-value", {"dim": 3, "bias": True}, device=CPU)
        parsed = parse_request(
            decode_json_body({**body, "model": "linear-value"}, max_elements=1 << 20), _Only(model)
        )
        out = engine.compute(parsed.model, parsed.batch, parsed.opts)[0]
    else:
        out = run(registry, body)
    value, next_value = s @ theta + b, s_next @ theta + b
    delta = r + gamma * (1 - dones) * next_value - value
    assert np.allclose(out["td_errors"].numpy(), delta, atol=1e-5)
    assert np.allclose(out["updates"]["theta"].numpy(), delta[:, None] * s, atol=1e-5)
    assert np.allclose(out["grads"]["theta"].numpy(), -2 * delta[:, None] * s, atol=1e-5)
    assert np.allclose(out["losses"].numpy(), delta**2, atol=1e-5)
    if bias:
        assert np.allclose(out["updates"]["bias"].numpy(), delta, atol=1e-5)
        assert np.allclose(out["grads"]["bias"].numpy(), -2 * delta, atol=1e-5)


class _Only:
    """A registry that serves one model under its id (parse_request only calls ``get``)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def get(self, ref: str) -> Any:
        assert ref == self.model.id
        return self.model
