"""One small ``sequential`` spec per allow-listed layer type, and the same model in stock torch.

:func:`reference_model` builds each case from stock ``torch.nn`` layers (``nn.GRU`` itself, not
psgrad's unrolled copy) loaded with the registered weights, for
:func:`tests.support.reference.per_sample_loop` to differentiate one sample at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from service import registration

LIMITS = registration.Limits(max_layers=8, max_parameters=10_000, max_weight_bytes=100_000,
                             max_activations=100_000, max_elements=1_000_000)
# The smallest registered spec: one Linear layer, 4 -> 2.
MLP = {"architecture": "sequential", "layers": [{"type": "Linear", "args": [4, 2]}],
       "input": {"shape": [4]}}


def _l(kind: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"type": kind, "args": list(args), "kwargs": kwargs}


@dataclass
class Case:
    name: str
    layers: list[dict[str, Any]]
    shape: list[int]
    dtype: str = "float32"
    loss: str = "cross_entropy"
    classes: int = 2
    covers: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"architecture": "sequential", "layers": self.layers,
                                "input": {"shape": self.shape, "dtype": self.dtype},
                                "default_loss": self.loss}
        return spec

    def batch(self, n: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        if self.dtype == "int64":
            x = torch.randint(0, 7, (n, *self.shape), generator=gen)
        else:
            x = torch.randn((n, *self.shape), generator=gen)
        return x, torch.randint(0, self.classes, (n,), generator=gen)


def _mlp(*middle: dict[str, Any]) -> list[dict[str, Any]]:
    return [_l("Linear", 4, 4), *middle, _l("Linear", 4, 2)]


CASES = [
    Case("linear", [_l("Linear", 4, 2)], [4]),
    Case("bilinear", [_l("Bilinear", 3, 3, 2)], [3]),
    Case("conv1d", [_l("Conv1d", 2, 3, 3, padding="same", padding_mode="reflect"),
                    _l("Flatten"), _l("Linear", 18, 2)], [2, 6]),
    Case("conv2d", [_l("Conv2d", 1, 2, 3), _l("Flatten"), _l("Linear", 18, 2)], [1, 5, 5]),
    Case("conv3d", [_l("Conv3d", 1, 2, 2), _l("Flatten"), _l("Linear", 36, 2)], [1, 3, 4, 4]),
    Case("convtranspose1d", [_l("ConvTranspose1d", 2, 2, 3), _l("Flatten"),
                             _l("Linear", 12, 2)], [2, 4]),
    Case("convtranspose2d", [_l("ConvTranspose2d", 1, 2, 2, stride=1), _l("Flatten"),
                             _l("Linear", 32, 2)], [1, 3, 3]),
    Case("embedding", [_l("Embedding", 7, 4, padding_idx=0), _l("Mean", dim=1),
                       _l("Linear", 4, 2)], [5], dtype="int64"),
    Case("layernorm", _mlp(_l("LayerNorm", [4])), [4]),
    Case("groupnorm", [_l("GroupNorm", 2, 4), _l("Flatten"), _l("Linear", 12, 2)], [4, 3]),
    Case("instancenorm1d", [_l("InstanceNorm1d", 3, affine=True), _l("Flatten"),
                            _l("Linear", 15, 2)], [3, 5]),
    Case("instancenorm2d", [_l("InstanceNorm2d", 2, affine=True), _l("Flatten"),
                            _l("Linear", 18, 2)], [2, 3, 3]),
    Case("rmsnorm", _mlp(_l("RMSNorm", [4], eps=1e-5)), [4]),
    Case("batchnorm1d", _mlp(_l("BatchNorm1d", 4)), [4]),
    Case("batchnorm2d", [_l("BatchNorm2d", 2), _l("Flatten"), _l("Linear", 18, 2)], [2, 3, 3]),
    Case("relu", _mlp(_l("ReLU")), [4]),
    Case("leakyrelu", _mlp(_l("LeakyReLU", 0.1)), [4]),
    Case("elu", _mlp(_l("ELU", alpha=0.5)), [4]),
    Case("gelu", _mlp(_l("GELU", approximate="tanh")), [4]),
    Case("silu", _mlp(_l("SiLU")), [4]),
    Case("tanh", _mlp(_l("Tanh")), [4]),
    Case("sigmoid", _mlp(_l("Sigmoid")), [4]),
    Case("softplus", _mlp(_l("Softplus", beta=2.0)), [4]),
    Case("softmax", _mlp(_l("Softmax", dim=-1)), [4]),
    Case("logsoftmax", [_l("Linear", 4, 3), _l("LogSoftmax", dim=1)], [4], loss="nll",
         classes=3),
    Case("dropout", _mlp(_l("Dropout", 0.5)), [4]),
    Case("maxpool1d", [_l("Conv1d", 1, 2, 3), _l("MaxPool1d", 2), _l("Flatten"),
                       _l("Linear", 6, 2)], [1, 8]),
    Case("maxpool2d", [_l("Conv2d", 1, 2, 3), _l("MaxPool2d", 2), _l("Flatten"),
                       _l("Linear", 8, 2)], [1, 6, 6]),
    Case("avgpool1d", [_l("Conv1d", 1, 2, 3), _l("AvgPool1d", 2), _l("Flatten"),
                       _l("Linear", 6, 2)], [1, 8]),
    Case("avgpool2d", [_l("Conv2d", 1, 2, 3), _l("AvgPool2d", 2), _l("Flatten"),
                       _l("Linear", 8, 2)], [1, 6, 6]),
    Case("adaptiveavgpool1d", [_l("Conv1d", 1, 2, 3), _l("AdaptiveAvgPool1d", 3),
                               _l("Flatten"), _l("Linear", 6, 2)], [1, 8]),
    Case("adaptiveavgpool2d", [_l("Conv2d", 1, 2, 3), _l("AdaptiveAvgPool2d", [2, 2]),
                               _l("Flatten"), _l("Linear", 8, 2)], [1, 6, 6]),
    Case("flatten", [_l("Flatten"), _l("Linear", 6, 2)], [2, 3]),
    Case("unflatten", [_l("Linear", 6, 6), _l("Unflatten", 1, [2, 3]), _l("Conv1d", 2, 2, 3),
                       _l("Flatten"), _l("Linear", 2, 2)], [6]),
    Case("identity", _mlp(_l("Identity")), [4]),
    Case("rnn", [_l("RNN", 3, 5, nonlinearity="relu"), _l("SelectStep", index=-1),
                 _l("Linear", 5, 2)], [4, 3]),
    Case("gru", [_l("GRU", 3, 5, batch_first=True), _l("SelectStep", index=-1),
                 _l("Linear", 5, 2)], [4, 3]),
    Case("lstm", [_l("LSTM", 3, 4, num_layers=2, bidirectional=True), _l("Mean", dim=1),
                  _l("Linear", 8, 2)], [4, 3]),
    Case("transformerencoderlayer",
         [_l("TransformerEncoderLayer", 8, 2, 16, dropout=0.1, activation="gelu"),
          _l("SelectStep", index=0), _l("Linear", 8, 2)], [4, 8]),
]


class _RefBilinear(nn.Bilinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, x)


def first_output(cls: type[nn.Module]) -> type[nn.Module]:
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return cls.forward(self, x)[0]

    return type(f"Ref{cls.__name__}", (cls,), {"forward": forward})


class _Fn(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _ref_layer(layer: dict[str, Any]) -> nn.Module:
    kind, args = layer["type"], [tuple(a) if isinstance(a, list) else a for a in layer["args"]]
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in layer["kwargs"].items()}
    if kind in ("RNN", "GRU", "LSTM", "TransformerEncoderLayer"):
        kwargs["batch_first"] = True
    if kind == "Bilinear":
        return _RefBilinear(*args, **kwargs)
    if kind in ("RNN", "GRU", "LSTM"):
        return first_output(getattr(nn, kind))(*args, **kwargs)
    if kind == "SelectStep":
        index = kwargs["index"]
        return _Fn(lambda x: x[:, index])
    if kind == "Mean":
        dim = kwargs["dim"]
        return _Fn(lambda x: x.mean(dim))
    return getattr(nn, kind)(*args, **kwargs)


def reference_model(case: Case, state: dict[str, torch.Tensor]) -> nn.Module:
    model = nn.Sequential(OrderedDict((str(i), _ref_layer(layer))
                                      for i, layer in enumerate(case.layers)))
    model.load_state_dict(state, strict=True)
    return model.eval()


def perturbed(state: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """Other weights of the same shapes: running variances stay positive, counts unchanged."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        if not v.is_floating_point():
            out[k] = v.clone()
        elif k.endswith("running_var"):
            out[k] = torch.rand(v.shape, generator=gen) + 0.5
        else:
            out[k] = v + 0.3 * torch.randn(v.shape, generator=gen)
    return out
