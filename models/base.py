"""What every model family gives the engine, and the decorator that registers it.

The server never names a model class: it asks a family for a module built from a config, the
per-sample input spec, and the losses that fit. Families register themselves with
:func:`register_model`; ``models/__init__.py`` imports each family file so the decorators run.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from psgrad._errors import InvalidModelSpec, UnknownModel
from service.plugins import Registry


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one sample (no batch dimension); ``high`` bounds integer inputs.

    ``name`` is the input's name in a model that takes several; ``dynamic`` lists the sample
    dimensions whose size a request may choose, as ``(dim, low, high, symbol)`` with the bounds
    inclusive (``shape`` holds the exported example's size there); dimensions that share a
    symbol must be sent with one size.
    """

    shape: tuple[int, ...]
    dtype: str = "float32"
    high: int | None = None
    name: str = "inputs"
    dynamic: tuple[tuple[int, int, int, str], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"shape": list(self.shape), "dtype": self.dtype}
        if self.high is not None:
            out["high"] = self.high
        if self.dynamic:
            out["dynamic"] = {str(d): [lo, hi] for d, lo, hi, _ in self.dynamic}
        return out


class RequestCheck(Protocol):
    """``check(inputs, max_activations)``: one sample's activations at these inputs' sizes;
    raises a 4xx error for inputs the model must not run on."""

    def __call__(self, inputs: Sequence[torch.Tensor], max_activations: int) -> int: ...


class ModelFamily:
    """A family of models: a builder from a config dict with usable defaults."""

    name: ClassVar[str] = ""
    default_config: ClassVar[dict[str, Any]] = {}
    default_loss: ClassVar[str] = "cross_entropy"
    losses: ClassVar[tuple[str, ...]] = ("cross_entropy",)
    # False for families with no usable default config (``sequential``): they are built only
    # from a registered spec, never served or listed under the family's own name.
    standalone: ClassVar[bool] = True
    # False where the registry must not run an example batch (exported programs, checked in
    # their own child process): it then takes the output shape and activation count from
    # :meth:`measured`.
    dry_run: ClassVar[bool] = True

    def build(self, config: dict[str, Any]) -> nn.Module:
        raise NotImplementedError

    def build_empty(self, config: dict[str, Any]) -> nn.Module | None:
        """The module on the meta device, for a family whose every tensor a stored state
        names, each under a name of its own (no tied weights): loading then moves each tensor
        in, never allocating the weights twice. None (the default): build with initial
        weights and copy the state over them."""
        return None

    def input_spec(self, config: dict[str, Any]) -> TensorSpec:
        raise NotImplementedError

    def input_specs(self, config: dict[str, Any]) -> tuple[TensorSpec, ...]:
        """Every input in the order the module takes them (one for the zoo)."""
        return (self.input_spec(config),)

    def loss_info(self, config: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
        """The default loss and the accepted losses (a family may derive them from the config)."""
        return self.default_loss, self.losses

    def batched(self, config: dict[str, Any]) -> bool:
        """Whether the module runs on whole batches (fast statistics need it), not only on a
        batch of one (an exported program whose traced batch could not be made generic)."""
        return True

    def measured(self, config: dict[str, Any]) -> tuple[tuple[int, ...], int]:
        """Per-sample output shape and activation count of an unbatched family's model."""
        raise NotImplementedError

    def request_check(self, config: dict[str, Any], module: nn.Module) -> RequestCheck | None:
        """What checks a request's inputs against ``module`` before it runs (an exported
        program's sizes and indices), or None: fixed shapes, measured at registration."""
        return None

    def describe(self, config: dict[str, Any]) -> dict[str, Any]:
        """Extra fields of ``GET /models/{id}`` (an exported program's inputs, tied names)."""
        return {}

    def config(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """The default config updated with ``overrides``; unknown keys are refused."""
        overrides = overrides or {}
        unknown = sorted(set(overrides) - set(self.default_config))
        if unknown:
            raise InvalidModelSpec(
                f"unknown config keys for '{self.name}': {', '.join(unknown)}; "
                f"known: {', '.join(sorted(self.default_config)) or '(none)'}",
                architecture=self.name,
            )
        return {**copy.deepcopy(self.default_config), **overrides}


ZOO: Registry[str, ModelFamily] = Registry("architecture", UnknownModel)


def register_model(cls: type[ModelFamily]) -> type[ModelFamily]:
    """Class decorator: add one instance of the family to the zoo under its ``name``."""
    ZOO.add(cls.name, cls())
    return cls


def get_family(name: str) -> ModelFamily:
    """The family called ``name``; an unknown name raises :class:`UnknownModel` naming them all."""
    return ZOO[name]
