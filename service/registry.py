"""Loaded models: build a model version once, check it, and keep it ready on the device.

A *model version* is an architecture, a config and a set of weights; its ``version`` is a digest
of all three, so ``id@version`` always means the same numbers. Zoo families are addressable by
their name with their default config and seeded weights (the same on every host).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from models import TensorSpec, get_family
from psgrad._errors import BatchCoupling, InvalidModelSpec, ShapeMismatch, UnknownModel

ZOO_SEED = 0


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` is CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class LoadedModel:
    """One model version on one device, in eval mode, with its parameters split out."""

    id: str
    version: str
    architecture: str
    config: dict[str, Any]
    module: nn.Module
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    input: TensorSpec
    output_shape: tuple[int, ...]
    default_loss: str
    losses: tuple[str, ...]
    activation_numel: int
    route: str = "vmap"  # "loop" for layers that vmap cannot batch (recurrent layers)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        return f"{self.id}@{self.version}"

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.params.values())).dtype

    def describe(self) -> dict[str, Any]:
        """The document of ``GET /models/{id}``; parameters in the module's own order."""
        return {
            "id": self.id,
            "version": self.version,
            "architecture": self.architecture,
            "config": self.config,
            "default_loss": self.default_loss,
            "losses": list(self.losses),
            "input": self.input.to_dict(),
            "output": {"shape": list(self.output_shape)},
            "parameters": {
                name: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
                for name, p in self.params.items()
            },
            **self.extra,
        }


def weights_digest(architecture: str, config: dict[str, Any],
                   state: dict[str, torch.Tensor]) -> str:
    """The version: a digest of the architecture, its config and every weight's bytes."""
    h = hashlib.sha256(json.dumps([architecture, config], sort_keys=True).encode())
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def build_module(architecture: str, config: dict[str, Any]) -> nn.Module:
    """Build with seeded initial weights so that every host builds the same zoo model."""
    family = get_family(architecture)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ZOO_SEED)
        return family.build(config)


def load_model(model_id: str, architecture: str, config: dict[str, Any] | None = None,
               state: dict[str, torch.Tensor] | None = None, *,
               device: torch.device | None = None, dtype: torch.dtype | None = None
               ) -> LoadedModel:
    """Build, load ``state`` (names and shapes checked), check, and move to ``device``."""
    family = get_family(architecture)
    config = family.config(config)
    module = build_module(architecture, config)
    if dtype is not None:
        module = module.to(dtype)
    if state is not None:
        load_state(module, state)
    module.eval().requires_grad_(False)
    device = device or resolve_device()
    module.to(device)
    params = {k: v.detach() for k, v in module.named_parameters()}
    if not params:
        raise InvalidModelSpec(f"'{model_id}' has no parameters to differentiate")
    buffers = {k: v.detach() for k, v in module.named_buffers()}
    spec = family.input_spec(config)
    default_loss, losses = family.loss_info(config)
    output_shape, activations = _dry_run(module, spec, device)
    route = "loop" if any(isinstance(m, nn.RNNBase) and not getattr(m, "vmap_safe", False)
                          for m in module.modules()) else "vmap"
    state_now = {**params, **buffers}
    return LoadedModel(
        id=model_id, version=weights_digest(architecture, config, state_now),
        architecture=architecture, config=config, module=module, params=params, buffers=buffers,
        input=spec, output_shape=output_shape, default_loss=default_loss, losses=losses,
        activation_numel=activations, route=route,
    )


def load_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``module``; every name and shape must match, non-finite refused."""
    own = dict(module.named_parameters()) | dict(module.named_buffers())
    unknown = sorted(set(state) - set(own))
    missing = sorted(set(own) - set(state))
    if unknown or missing:
        raise ShapeMismatch(
            f"weights do not match the architecture: unknown {unknown or 'none'}, "
            f"missing {missing or 'none'}", unknown=unknown, missing=missing,
        )
    with torch.no_grad():
        for name, value in state.items():
            if tuple(value.shape) != tuple(own[name].shape):
                raise ShapeMismatch(
                    f"weight '{name}' has shape {list(value.shape)}; the model needs "
                    f"{list(own[name].shape)}", parameter=name,
                )
            own[name].copy_(value)


def _dry_run(module: nn.Module, spec: TensorSpec, device: torch.device
             ) -> tuple[tuple[int, ...], int]:
    """Run an example batch: per-sample output shape, activation count, and a coupling check.

    A model whose output for one sample depends on the others in the batch (batch statistics)
    or that changes its buffers in forward cannot give per-sample gradients; it is refused.
    """
    gen = torch.Generator().manual_seed(1)
    if spec.dtype.startswith("int"):
        x = torch.randint(0, spec.high or 2, (3, *spec.shape), generator=gen)
    else:
        x = torch.randn((3, *spec.shape), generator=gen, dtype=getattr(torch, spec.dtype))
    x = x.to(device)
    if x.is_floating_point():
        x = x.to(next(module.parameters()).dtype)
    before = {k: v.clone() for k, v in module.named_buffers()}
    numel = [0]

    def count(_m: nn.Module, _i: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            numel[0] += out.numel()

    hooks = [m.register_forward_hook(count) for m in module.modules()]
    try:
        with torch.no_grad():
            batched = module(x)
            for h in hooks:
                h.remove()
            singles = torch.cat([module(x[i : i + 1]) for i in range(3)])
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise InvalidModelSpec(f"the model fails on an example batch: {exc}") from exc
    finally:
        for h in hooks:
            h.remove()
    if not isinstance(batched, torch.Tensor) or batched.shape[:1] != (3,):
        raise InvalidModelSpec("the model must return one tensor with the batch dimension first")
    changed = [k for k, v in module.named_buffers() if not torch.equal(v, before[k])]
    if changed or not torch.allclose(batched, singles, atol=1e-4, rtol=1e-4):
        raise BatchCoupling(
            "the model's output for one sample depends on the other samples in the batch "
            f"(batch statistics{' updating ' + ', '.join(changed) if changed else ''}); "
            "per-sample gradients need layers that treat samples independently: use "
            "BatchNorm with eval statistics, or LayerNorm/GroupNorm",
        )
    return tuple(batched.shape[1:]), numel[0] // 3


class ModelRegistry:
    """Resolves ``id`` or ``id@version`` to a :class:`LoadedModel`, built once and cached.

    This base resolves zoo families by name; the registered-model store extends :meth:`_record`.
    """

    def __init__(self, device: torch.device | None = None, cache_size: int = 16) -> None:
        self.device = device or resolve_device()
        self._cache: OrderedDict[tuple[str, str | None], LoadedModel] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def get(self, ref: str) -> LoadedModel:
        model_id, _, version = ref.partition("@")
        key = (model_id, version or None)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        model = self._load(model_id, version or None)
        with self._lock:
            self._cache[key] = model
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return model

    def _load(self, model_id: str, version: str | None) -> LoadedModel:
        from models import ZOO

        if model_id not in ZOO:
            raise UnknownModel(
                f"unknown model '{model_id}'; known: {', '.join(sorted(ZOO))}", known=sorted(ZOO)
            )
        model = load_model(model_id, model_id, device=self.device)
        if version and version != model.version:
            raise UnknownModel(
                f"'{model_id}' has no version '{version}'; its version is {model.version}",
            )
        return model
