"""Every refusal of a request: the door's checks, then ``parse_request`` (and the model load).

Each case checks the error class (hence its code and HTTP status) and that the message says what
was wrong; for unknown names (model, loss, output, parameter), that it lists the known ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import ZOO, ModelFamily, TensorSpec, register_model
from psgrad._errors import (
    BadRequest,
    BatchCoupling,
    DtypeMismatch,
    EmptyBatch,
    InvalidInput,
    LossNotSupported,
    NonFinite,
    PsgradError,
    ShapeMismatch,
    TargetOutOfRange,
    TooLarge,
    UnknownLoss,
    UnknownModel,
    UnknownOutput,
    UnknownParameter,
)
from service import engine
from service.api.body import decode_json_body, held_to_contract, precheck
from service.losses import LOSSES
from service.outputs import OUTPUTS
from service.registry import ModelRegistry, load_model
from service.validate import ParsedRequest, parse_request
from tests.support.reference import per_sample_loop

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    return ModelRegistry(CPU)


def parse(registry: ModelRegistry, body: dict[str, Any], **kw: Any) -> ParsedRequest:
    """JSON values decoded as the api decodes them; numpy arrays pass as the binary form does."""
    binary = {k: v for k, v in body.items() if _is_binary(v)}
    fields = decode_json_body(
        {k: v for k, v in body.items() if k not in binary}, max_elements=1 << 22
    )
    precheck(fields)  # the door's checks, as every route runs them first
    held_to_contract(fields)
    return parse_request({**fields, **binary}, registry, **kw)


def _is_binary(value: Any) -> bool:
    if isinstance(value, dict):
        return bool(value) and all(isinstance(v, np.ndarray) for v in value.values())
    return isinstance(value, np.ndarray)


def refused(
    registry: ModelRegistry, body: dict[str, Any], error: type[PsgradError], *words: str, **kw: Any
) -> PsgradError:
    with pytest.raises(error) as info:
        parse(registry, body, **kw)
    exc = info.value
    assert type(exc) is error, f"{type(exc).__name__}: {exc}"
    for word in words:
        assert word in exc.message, f"{word!r} not in {exc.message!r}"
    body_json = exc.to_dict()["error"]
    assert body_json["code"] == error.code and exc.status == error.status
    return exc


def mlp_body(n: int = 2, **extra: Any) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "model": "mlp",
        "inputs": rng.normal(size=(n, 784)).astype(np.float32),
        "targets": list(range(n)),
        **extra,
    }


TD0 = {
    "model": "linear-value",
    "loss": "td0",
    "inputs": [[2, 1, -2], [0, 1, 0]],
    "next_inputs": [[1, 2, 0], [1, 1, 1]],
    "rewards": [2, 0],
}


def test_valid_requests_pass(registry: ModelRegistry) -> None:
    parsed = parse(registry, mlp_body(3, outputs=["norms", "mean"], params=["fc2.bias"]))
    assert parsed.batch.size == 3 and parsed.opts.params == ("fc2.bias",)
    assert parsed.opts.loss == "cross_entropy" and parsed.opts.outputs == ("norms", "mean")
    parsed = parse(registry, {**TD0, "weights": {"theta": [0.2, -0.2, 0.1]}})
    assert parsed.batch.dones is not None and parsed.batch.dones.tolist() == [0, 0]
    assert parsed.opts.gamma == 1.0


def test_autocast_is_bfloat16_on_a_float32_model_or_off(registry: ModelRegistry) -> None:
    assert parse(registry, mlp_body()).opts.autocast == "off"
    assert parse(registry, mlp_body(autocast="bfloat16")).opts.autocast == "bfloat16"
    exc = refused(registry, mlp_body(autocast="float16"), InvalidInput, "'autocast'", "bfloat16")
    assert exc.to_dict()["error"]["details"]["accepted"] == ["off", "bfloat16"]
    wide = ModelRegistry(CPU)
    wide.remember(load_model("mlp", "mlp", device=CPU, dtype=torch.float64), ("mlp", None))
    refused(wide, mlp_body(autocast="bfloat16"), InvalidInput, "float32 model", "float64")
    assert parse(wide, mlp_body()).opts.autocast == "off"


# ------------------------------------------------------------------ unknown names, listed


def test_unknown_model_lists_the_known_ones(registry: ModelRegistry) -> None:
    exc = refused(
        registry,
        {**mlp_body(), "model": "resnet-9000"},
        UnknownModel,
        "resnet-9000",
        "mlp",
        "simple-cnn",
        "linear-value",
    )
    assert "tiny-transformer" in exc.details["known"]
    refused(registry, {**mlp_body(), "model": "mlp@0000"}, UnknownModel, "0000")


def test_unknown_loss_lists_the_known_ones(registry: ModelRegistry) -> None:
    exc = refused(registry, mlp_body(loss="xent"), UnknownLoss, "xent")
    for name in LOSSES:
        assert name in exc.message
    assert exc.details["known"] == sorted(LOSSES)


def test_unknown_output_lists_the_known_ones(registry: ModelRegistry) -> None:
    exc = refused(registry, mlp_body(outputs=["grads", "hessian"]), UnknownOutput, "hessian")
    for name in OUTPUTS:
        assert name in exc.message


@pytest.mark.parametrize("field", ["params", "weights", "reference"])
def test_unknown_parameter_lists_the_model_parameters(registry: ModelRegistry, field: str) -> None:
    value: Any = ["fc9.weight"] if field == "params" else {"fc9.weight": [1.0]}
    exc = refused(registry, mlp_body(**{field: value}), UnknownParameter, "fc9.weight", field)
    assert exc.details["known"] == list(registry.get("mlp").params)
    for name in registry.get("mlp").params:
        assert name in exc.message


# ------------------------------------------------------------------ inputs


def test_inputs_of_the_wrong_per_sample_shape(registry: ModelRegistry) -> None:
    body = mlp_body()
    exc = refused(
        registry, {**body, "inputs": body["inputs"][:, :100]}, ShapeMismatch, "[2, 100]", "784"
    )
    assert exc.details["expected"] == [None, 784]
    refused(registry, {**body, "inputs": body["inputs"].reshape(2, 28, 28)}, ShapeMismatch)
    refused(registry, {**body, "inputs": body["inputs"][0]}, ShapeMismatch)  # no batch dim
    cnn = {"model": "simple-cnn", "inputs": np.zeros((1, 28, 28, 1), np.float32), "targets": [1]}
    refused(registry, cnn, ShapeMismatch, "[1, 28, 28]")
    refused(registry, {**TD0, "next_inputs": [[1, 2], [1, 2]]}, ShapeMismatch, "next_inputs")
    refused(registry, {**TD0, "next_inputs": [[1, 2, 0]]}, ShapeMismatch, "next_inputs")


def test_inputs_of_the_wrong_dtype(registry: ModelRegistry) -> None:
    body = mlp_body()
    refused(
        registry,
        {**body, "inputs": body["inputs"].astype(np.float64)},
        DtypeMismatch,
        "float64",
        "float32",
    )
    refused(registry, {**body, "inputs": body["inputs"] > 0}, DtypeMismatch, "bool")
    tokens = {
        "model": "tiny-transformer",
        "inputs": np.ones((2, 32), np.float32),
        "targets": [0, 1],
    }
    refused(registry, tokens, DtypeMismatch, "integer")
    refused(registry, {**tokens, "inputs": np.full((2, 32), 1000)}, InvalidInput, "[0, 1000)")
    refused(registry, {**tokens, "inputs": np.full((2, 32), -1)}, InvalidInput, "token")
    parsed = parse(registry, {**tokens, "inputs": np.full((2, 32), 999, np.int32)})
    assert parsed.batch.inputs.dtype == torch.int64


def test_a_bfloat16_model_takes_the_floats_that_are_bfloat16_values() -> None:
    """numpy has no bfloat16: its values come as float32 (or float64), taken exactly; one that
    would round is refused, saying how to round it. A float16 model's refusal says how JSON
    sends float16."""
    half = ModelRegistry(CPU)
    half.remember(load_model("mlp", "mlp", device=CPU, dtype=torch.bfloat16), ("mlp", None))
    body = mlp_body()
    exact = torch.from_numpy(body["inputs"]).to(torch.bfloat16)
    for carrier in (np.float32, np.float64):
        parsed = parse(half, {**body, "inputs": exact.double().numpy().astype(carrier)})
        assert parsed.batch.inputs.dtype == torch.bfloat16
        assert torch.equal(parsed.batch.inputs, exact)
    refused(half, body, DtypeMismatch, "float32 values that bfloat16 cannot hold exactly",
            "x.to(torch.bfloat16)")
    fp16 = ModelRegistry(CPU)
    fp16.remember(load_model("mlp", "mlp", device=CPU, dtype=torch.float16), ("mlp", None))
    refused(fp16, body, DtypeMismatch, "float16: send that dtype", "{dtype, shape, data}")
    assert parse(fp16, {**body, "inputs": body["inputs"].astype(np.float16)}).batch.inputs.dtype \
        == torch.float16


def test_integer_inputs_of_a_float_model_are_converted(registry: ModelRegistry) -> None:
    parsed = parse(registry, {**TD0, "inputs": np.array([[2, 1, -2], [0, 1, 0]], np.int64)})
    assert parsed.batch.inputs.dtype == torch.float32


def test_empty_batch(registry: ModelRegistry) -> None:
    refused(
        registry,
        {**mlp_body(), "inputs": np.zeros((0, 784), np.float32), "targets": []},
        EmptyBatch,
        "empty",
    )
    refused(registry, {**TD0, "inputs": [], "next_inputs": [], "rewards": []}, EmptyBatch)


def test_batch_over_the_limit(registry: ModelRegistry) -> None:
    refused(registry, mlp_body(5), TooLarge, "5 samples", "4", max_batch_size=4)
    parse(registry, mlp_body(4), max_batch_size=4)


# ------------------------------------------------------------------ targets and td0 fields


def test_targets_of_the_wrong_length(registry: ModelRegistry) -> None:
    refused(registry, mlp_body(3, targets=[1, 2]), ShapeMismatch, "2 entries", "3 samples")
    refused(registry, mlp_body(3, targets=1), ShapeMismatch, "'targets' is one number for 3 "
            "samples: send a list")
    refused(registry, mlp_body(2, targets=[[1], [2]]), ShapeMismatch, "[B]")
    mse = mlp_body(2, loss="mse")
    refused(registry, {**mse, "targets": np.zeros((2, 9), np.float32)}, ShapeMismatch, "[2, 10]")
    refused(registry, {**mse, "targets": np.zeros((3, 10), np.float32)}, ShapeMismatch)
    refused(registry, {**TD0, "rewards": [1, 2, 3]}, ShapeMismatch, "rewards", "[2]")
    refused(registry, {**TD0, "dones": [0]}, ShapeMismatch, "dones")
    refused(
        registry,
        {k: v for k, v in mlp_body().items() if k != "targets"},
        BadRequest,
        "targets",
        "required",
    )
    refused(registry, {k: v for k, v in TD0.items() if k != "rewards"}, BadRequest, "rewards")


def test_targets_out_of_the_class_range(registry: ModelRegistry) -> None:
    exc = refused(registry, mlp_body(2, targets=[3, 10]), TargetOutOfRange, "[0, 10)", "10")
    assert exc.details["classes"] == 10
    refused(registry, mlp_body(2, targets=[-1, 0]), TargetOutOfRange, "-1")
    refused(registry, mlp_body(2, targets=[1.5, 0]), DtypeMismatch, "integer")
    parsed = parse(registry, mlp_body(2, targets=[9.0, 0.0]))  # whole floats are indices
    assert parsed.batch.targets is not None and parsed.batch.targets.tolist() == [9, 0]


def test_dones_must_be_zero_or_one(registry: ModelRegistry) -> None:
    refused(registry, {**TD0, "dones": [0, 2]}, InvalidInput, "dones")
    parsed = parse(registry, {**TD0, "dones": [True, False]})
    assert parsed.batch.dones is not None and parsed.batch.dones.tolist() == [1.0, 0.0]


# ------------------------------------------------------------------ non-finite values


@pytest.mark.parametrize("extra, loss", [
    ({"rewards": [1.0, 0.0]}, "cross_entropy"), ({"next_inputs": np.ones((2, 784))}, "margin"),
    ({"dones": [0, 1]}, "mse"), ({"gamma": 0.9}, "cross_entropy"),
    ({"mask": np.ones((2, 3))}, "cross_entropy"),
])
def test_a_field_its_loss_does_not_read_is_refused(
        registry: ModelRegistry, extra: dict[str, Any], loss: str) -> None:
    """A field only some losses read (td0's, the token losses' mask), sent with another loss,
    is a 422 naming the field and the losses that read it: refused, not ignored."""
    name = next(iter(extra))
    readers = "td0" if name != "mask" else "token_cross_entropy or next_token"
    refused(registry, {**mlp_body(), "loss": loss, **extra}, InvalidInput,
            f"'{name}' is read by the loss {readers} only, not by '{loss}'")


def test_a_td0_request_refuses_targets(registry: ModelRegistry) -> None:
    refused(registry, {**TD0, "targets": [0, 1]}, InvalidInput,
            "'targets' is read by the loss cross_entropy or nll or margin or mse")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs_and_weights(registry: ModelRegistry, bad: float) -> None:
    body = mlp_body()
    inputs = body["inputs"].copy()
    inputs[1, 5] = bad
    refused(registry, {**body, "inputs": inputs}, NonFinite, "'inputs'")
    weights = np.array([0.2, bad, 0.1], np.float32)
    refused(registry, {**TD0, "weights": {"theta": weights}}, NonFinite, "weights.theta")
    refused(registry, {**TD0, "rewards": np.array([1, bad], np.float32)}, NonFinite, "rewards")
    refused(
        registry,
        {**TD0, "next_inputs": np.array([[1, 2, bad], [0, 0, 0]], np.float32)},
        NonFinite,
        "next_inputs",
    )
    refused(
        registry,
        {"model": "linear-value", "loss": "mse", "inputs": TD0["inputs"],
         "targets": np.array([1, bad], np.float32)},
        NonFinite,
        "targets",
    )
    reference = {"theta": np.array([bad, 0, 0], np.float32)}
    refused(
        registry, {**TD0, "outputs": ["dot"], "reference": reference}, NonFinite, "reference.theta"
    )


def test_values_beyond_the_model_dtype_are_refused_after_the_cast(registry: ModelRegistry) -> None:
    """float64 numbers (as JSON sends them) are cast to the model's float32: one too large for it
    becomes inf there and is refused; the others arrive cast, C-ordered and owned."""
    too_large = np.array([0.2, 1e300, 0.1])
    refused(registry, {**TD0, "weights": {"theta": too_large}}, NonFinite, "weights.theta")
    sent = np.array([[0.2, 0.3], [0.5, 0.7], [0.1, 0.4]]).T[0]  # a strided float64 view
    parsed = parse(registry, {**TD0, "weights": {"theta": sent}})
    theta = parsed.batch.weights["theta"]
    assert theta.dtype == torch.float32 and theta.is_contiguous()
    assert theta.tolist() == [np.float32(v) for v in sent]
    own = np.array([0.2, 0.5, 0.1], np.float32)  # already the model's dtype and C-ordered
    theta = parse(registry, {**TD0, "weights": {"theta": own}}).batch.weights["theta"]
    own[0] = 9.0  # the tensor is a copy all the same: the request's buffer may be reused
    assert theta[0].item() == np.float32(0.2)


# ------------------------------------------------------------------ weights


def test_weights_of_the_wrong_shape(registry: ModelRegistry) -> None:
    exc = refused(
        registry,
        {**TD0, "weights": {"theta": [0.2, -0.2]}},
        ShapeMismatch,
        "weights.theta",
        "[2]",
        "[3]",
    )
    assert exc.details["parameter"] == "theta"
    refused(registry, {**TD0, "weights": {"theta": [[0.2, -0.2, 0.1]]}}, ShapeMismatch)
    refused(
        registry,
        mlp_body(weights={"fc2.bias": np.zeros((10, 1), np.float32)}),
        ShapeMismatch,
        "fc2.bias",
    )
    refused(
        registry,
        {**TD0, "outputs": ["dot"], "reference": {"theta": [1.0]}},
        ShapeMismatch,
        "reference.theta",
    )
    refused(registry, {**TD0, "weights": [0.2, -0.2, 0.1]}, BadRequest, "weights")


def test_scalar_weights_keep_their_shape() -> None:
    """A 0-d parameter (linear-value's bias) stays 0-d, so its gradients are [B], not [B, 1]."""
    model = load_model("linear-value", "linear-value", {"dim": 3, "bias": True}, device=CPU)
    single = _Single(model)
    body = {**TD0, "weights": {"theta": [0.2, -0.2, 0.1], "bias": 0.5}}
    parsed = parse_request(decode_json_body(body, max_elements=100), single)
    assert parsed.batch.weights["bias"].shape == ()
    with pytest.raises(ShapeMismatch):
        parse_request(
            decode_json_body({**body, "weights": {"bias": [0.5]}}, max_elements=100), single
        )
    grads = engine.compute(parsed.model, parsed.batch, parsed.opts)[0]["grads"]
    assert grads["bias"].shape == (2,)


class _Single:
    """A registry that serves one model (parse_request only calls ``get``)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def get(self, ref: str) -> Any:
        return self.model


# ------------------------------------------------------------------ losses and options


def test_a_loss_the_model_does_not_accept(registry: ModelRegistry) -> None:
    exc = refused(
        registry,
        {
            "model": "simple-cnn",
            "loss": "mse",
            "targets": [[0.0] * 10],
            "inputs": np.zeros((1, 1, 28, 28), np.float32),
        },
        LossNotSupported,
        "simple-cnn",
        "mse",
        "nll",
    )
    assert exc.details["accepted"] == ["nll", "margin"]
    refused(registry, mlp_body(loss="td0"), LossNotSupported, "td0", "cross_entropy")
    refused(registry, {**TD0, "loss": "cross_entropy", "targets": [0, 0]}, LossNotSupported)


def test_options_that_do_not_fit(registry: ModelRegistry) -> None:
    refused(registry, mlp_body(outputs=["td_errors"]), InvalidInput, "td0")
    refused(registry, mlp_body(outputs=["updates"]), InvalidInput, "td0")
    refused(registry, mlp_body(outputs=["clipped_mean"]), InvalidInput, "clip_norm")
    refused(registry, mlp_body(outputs=["clipped_mean"], clip_norm=0), InvalidInput, "clip_norm")
    refused(
        registry,
        mlp_body(outputs=["clipped_mean"], clip_norm=1, noise_multiplier=-1),
        InvalidInput,
        "noise_multiplier",
    )
    refused(
        registry,
        mlp_body(outputs=["dot"], params=["fc3.bias"]),
        InvalidInput,
        "reference",
        "fc3.bias",
    )
    for huge in (10**400, -(10**400)):  # past float's range: refused, never a crash
        refused(registry, mlp_body(outputs=["clipped_mean"], clip_norm=1, noise_multiplier=huge),
                InvalidInput, "'noise_multiplier' must be a finite number >= 0")
    refused(registry, mlp_body(seed=-1), InvalidInput, "'seed' must be an integer in [0, 2**63)",
            "got -1")  # out of its range, as noise_multiplier=-1 above
    refused(registry, mlp_body(seed=1.5), BadRequest, "seed")
    refused(registry, {**TD0, "gamma": "0.9"}, BadRequest, "gamma")
    refused(registry, mlp_body(params=[]), BadRequest, "params")
    refused(registry, mlp_body(outputs=[1]), BadRequest, "outputs")
    refused(registry, mlp_body(inputz=[1]), BadRequest, "inputz")
    refused(registry, {k: v for k, v in mlp_body().items() if k != "model"}, BadRequest,
            "'model' is required")
    refused(registry, mlp_body(model=5), BadRequest, "'model' must be a model id", "got 5")



@pytest.mark.parametrize("gamma", [-3, 7.5, 1e30, 10**30, 10**400, -(10**400), -1e-9, 1.000001,
                                   float("nan"), float("inf"), float("-inf")])
def test_gamma_outside_0_1_is_refused(registry: ModelRegistry, gamma: float) -> None:
    refused(registry, {**TD0, "gamma": gamma}, InvalidInput, "'gamma'", "[0, 1]")


@pytest.mark.parametrize("gamma", [0, 0.0, 0.5, 1, 1.0])
def test_gamma_0_and_1_and_between_are_accepted(registry: ModelRegistry, gamma: float) -> None:
    assert parse(registry, {**TD0, "gamma": gamma}).opts.gamma == float(gamma)

# ------------------------------------------------------------------ batch-coupling models


class AlwaysTrainingBatchNorm(nn.BatchNorm1d):
    """A BatchNorm that stays in training mode (``eval()`` does not reach it)."""

    def train(self, mode: bool = True) -> AlwaysTrainingBatchNorm:
        return super().train(True)


class BatchMean(nn.Module):
    """Centres each sample on the batch mean: samples see each other without any buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x - x.mean(0, keepdim=True))


class Counter(nn.Module):
    """Updates a buffer in forward (like running statistics) though its outputs are per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x)


class FunctionalBatchNorm(nn.Module):
    """Batch statistics through ``F.batch_norm`` (no BatchNorm module for a check to spot)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(self.fc(x), None, None, training=True)


BUILDERS: dict[str, Any] = {
    "test-functional-bn": FunctionalBatchNorm,
    "test-train-bn": lambda: nn.Sequential(nn.Linear(4, 3), AlwaysTrainingBatchNorm(3)),
    "test-batch-mean": BatchMean,
    "test-counter": Counter,
    "test-eval-bn": lambda: nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Tanh()),
}


@pytest.fixture(scope="module")
def test_families() -> Iterator[None]:
    """Test-only families in the zoo, removed afterwards so nothing else lists them."""
    for name, builder in BUILDERS.items():

        class Family(ModelFamily):
            default_config: ClassVar[dict[str, Any]] = {}

            def build(self, config: dict[str, Any], builder: Any = builder) -> nn.Module:
                return builder()  # type: ignore[no-any-return]

            def input_spec(self, config: dict[str, Any]) -> TensorSpec:
                return TensorSpec((4,))

        Family.name = name
        register_model(Family)
    yield
    for name in BUILDERS:
        ZOO.pop(name, None)


@pytest.mark.usefixtures("test_families")
@pytest.mark.parametrize(
    "name", ["test-train-bn", "test-batch-mean", "test-counter", "test-functional-bn"]
)
def test_batch_coupling_models_are_refused(name: str) -> None:
    with pytest.raises(BatchCoupling) as info:
        load_model(name, name, device=CPU)
    assert "depends on the other samples" in info.value.message
    assert info.value.status == 422
    body = {"model": name, "inputs": np.ones((2, 4), np.float32), "targets": [0, 1]}
    refused(ModelRegistry(CPU), body, BatchCoupling, "LayerNorm")
    if name == "test-counter":
        assert "calls" in info.value.message
    if name == "test-train-bn":
        assert "'1' (AlwaysTrainingBatchNorm)" in info.value.message
    if name == "test-batch-mean":  # told by its outputs, within bfloat16's looser tolerance too
        with pytest.raises(BatchCoupling):
            load_model(name, name, device=CPU, dtype=torch.bfloat16)


@pytest.mark.usefixtures("test_families")
def test_batch_norm_with_eval_statistics_is_accepted_and_exact() -> None:
    model = load_model("test-eval-bn", "test-eval-bn", device=CPU)
    bn = model.module[1]
    assert isinstance(bn, nn.BatchNorm1d) and not bn.training
    with torch.no_grad():  # non-trivial running statistics, sent as weights would be
        bn.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
        bn.running_var.copy_(torch.tensor([2.0, 0.5, 1.5]))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 2, 1])
    opts = engine.Options("cross_entropy", ("grads",), tuple(model.params))
    grads = engine.compute(model, engine.Batch(inputs=x, targets=y), opts)[0]["grads"]
    loop = per_sample_loop(model.module, {"inputs": x, "targets": y}, "cross_entropy")
    for i in range(3):
        for name, g in loop.grads.items():
            assert torch.allclose(grads[name][i], g[i], atol=3e-3, rtol=1e-5), name


def test_scalar_weights_keep_their_shape_in_safetensors() -> None:
    """The binary form too: a 0-d weight arrives 0-d, and a 0-d answer (the bias' mean) leaves
    0-d (``np.ascontiguousarray`` had made both [1])."""
    from psgrad._wire import fields_from_safetensors, fields_to_safetensors

    model = load_model("linear-value", "linear-value", {"dim": 3, "bias": True}, device=CPU)
    request = {
        **{k: v for k, v in TD0.items() if k not in ("inputs", "next_inputs", "rewards")},
        "inputs": np.array(TD0["inputs"], np.float32),
        "next_inputs": np.array(TD0["next_inputs"], np.float32),
        "rewards": np.array(TD0["rewards"], np.float32),
        "weights": {"theta": np.array([0.2, -0.2, 0.1], np.float32), "bias": np.float32(0.5)},
        "outputs": ["mean"],
    }
    request["weights"]["bias"] = np.asarray(request["weights"]["bias"])
    fields = fields_from_safetensors(fields_to_safetensors(request, "request"), "request")
    assert fields["weights"]["bias"].shape == ()
    parsed = parse_request(fields, _Single(model))
    mean = engine.compute(parsed.model, parsed.batch, parsed.opts)[0]["mean"]
    answer = {"mean": {k: v.numpy() for k, v in mean.items()}}
    back = fields_from_safetensors(fields_to_safetensors(answer, "response"), "response")
    assert back["mean"]["bias"].shape == () and back["mean"]["theta"].shape == (3,)
