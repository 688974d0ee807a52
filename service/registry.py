"""Loaded models: build a model version once, check it, and keep it ready on the device.

A *model version* is an architecture, a config and a set of weights; its ``version`` is a digest
of all three, so ``id@version`` always means the same numbers. Zoo families are addressable by
their name with their default config and seeded weights (the same on every host).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file as st_load_file
from torch import nn

from models import ZOO, TensorSpec, get_family
from models.base import RequestCheck
from models.examples import example, one_at_a_time
from psgrad._errors import (
    BatchCoupling,
    InternalError,
    InvalidModelSpec,
    ShapeMismatch,
    UnknownModel,
)
from service.config import Settings
from service.export import family as _exported  # noqa: F401  (registers the 'exported' family)
from service.lru import LockedLRU
from service.model_store import VERSION_RE, MemoryModelStore, ModelStore, is_safe_id

ZOO_SEED = 0
_BUILD_LOCK = threading.Lock()


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` is CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def set_tf32(allowed: bool) -> None:
    """Let CUDA's convolutions and matrix products round through TF32, or keep them float32.

    torch lets cuDNN's convolutions use TF32 by default: on an H100 every batched method's
    simple-cnn per-sample gradients (psgrad's and the libraries') then differed from the
    per-sample loop's by 1.2e-2, past the 3e-3 every result is checked at. Process-wide; CPUs
    ignore it.
    """
    torch.backends.cudnn.allow_tf32 = allowed
    torch.backends.cuda.matmul.allow_tf32 = allowed


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
    # False: the module runs one sample at a time only (an exported graph whose traced batch
    # of one could not be made generic, :mod:`service.export.batch`)
    batched: bool = True
    structure: str = ""  # digest of architecture and config: versions that differ only in weights
    extra: dict[str, Any] = field(default_factory=dict)
    # every input in the module's order when it takes several (``input`` is the first)
    inputs: tuple[TensorSpec, ...] = ()
    # checks a request's inputs before the model runs (exported programs: sizes, indices)
    check: RequestCheck | None = None
    # derived once from the fields above (``dataclasses.replace`` derives them again)
    ref: str = field(init=False)  # "id@version"
    dtype: torch.dtype = field(init=False)  # the parameters' (a model has at least one)
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        self.ref = f"{self.id}@{self.version}"
        first = next(iter(self.params.values()))
        self.dtype, self.device = first.dtype, first.device

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
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)  # hashed where it lies
    return h.hexdigest()[:16]


def build_module(architecture: str, config: dict[str, Any], *, empty: bool = False
                 ) -> nn.Module:
    """Build with seeded initial weights so that every host builds the same zoo model;
    ``empty``: for a state to load, on the meta device where the family can
    (:meth:`~models.base.ModelFamily.build_empty`)."""
    family = get_family(architecture)
    module = family.build_empty(config) if empty else None
    if module is not None:
        return module
    # The global RNG is shared by threads: two workers building at once drew each other's
    # numbers (other weights, another version for the same zoo id). One build at a time.
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(ZOO_SEED)
        return family.build(config)


def load_model(model_id: str, architecture: str, config: dict[str, Any] | None = None,
               state: dict[str, torch.Tensor] | None = None, *,
               device: torch.device | None = None, dtype: torch.dtype | None = None,
               consume: bool = False) -> LoadedModel:
    """Build, load ``state`` (names and shapes checked; ``consume``: a state parsed for this
    load alone, emptied as :func:`load_state` moves it in), check, and move to ``device``."""
    family = get_family(architecture)
    config = family.config(config)
    module = build_module(architecture, config, empty=state is not None)
    if dtype is not None:
        module = module.to(dtype)
    if state is not None:
        load_state(module, state, consume=consume)
    module.eval().requires_grad_(False)
    device = device or resolve_device()
    module.to(device)
    params = {k: v.detach() for k, v in module.named_parameters()}
    if not params:
        raise InvalidModelSpec(f"'{model_id}' has no parameters to differentiate")
    buffers = {k: v.detach() for k, v in module.named_buffers()}
    specs = family.input_specs(config)
    spec = specs[0]
    default_loss, losses = family.loss_info(config)
    if family.dry_run:
        output_shape, activations = _dry_run(module, spec, device)
    else:
        output_shape, activations = family.measured(config)
    route = "loop" if any(isinstance(m, nn.RNNBase) and not getattr(m, "vmap_safe", False)
                          for m in module.modules()) else "vmap"
    state_now = {**params, **buffers}
    return LoadedModel(
        id=model_id, version=weights_digest(architecture, config, state_now),
        architecture=architecture, config=config, module=module, params=params, buffers=buffers,
        input=spec, output_shape=output_shape, default_loss=default_loss, losses=losses,
        activation_numel=activations, route=route, batched=family.batched(config),
        structure=weights_digest(architecture, config, {}), extra=family.describe(config),
        inputs=specs if len(specs) > 1 else (), check=family.request_check(config, module),
    )


def load_state(module: nn.Module, state: dict[str, torch.Tensor], *,
               consume: bool = False) -> None:
    """Load ``state`` into ``module``: every name and shape must match, checked before any
    tensor moves. A tensor of the module on the meta device (:func:`build_module`'s
    ``empty``) becomes a copy in its dtype, any other is copied over. ``consume`` drops each
    from ``state`` once in, so that a model loading from bytes holds its weights twice at
    most (the bytes and the module's), not three times with the parsed tensors."""
    own = dict(module.named_parameters()) | dict(module.named_buffers())
    unknown = sorted(set(state) - set(own))
    missing = sorted(set(own) - set(state))
    if unknown or missing:
        raise ShapeMismatch(
            f"weights do not match the architecture: unknown {unknown or 'none'}, "
            f"missing {missing or 'none'}", unknown=unknown, missing=missing,
        )
    for name, value in state.items():
        if tuple(value.shape) != tuple(own[name].shape):
            raise ShapeMismatch(
                f"weight '{name}' has shape {list(value.shape)}; the model needs "
                f"{list(own[name].shape)}", parameter=name,
            )
    with torch.no_grad():
        for name in list(state):
            value, target = state.pop(name) if consume else state[name], own[name]
            if not target.is_meta:
                target.copy_(value)
                continue
            moved = value.to(dtype=target.dtype, copy=True)
            owner, _, leaf = name.rpartition(".")
            holder = module.get_submodule(owner)
            if isinstance(target, nn.Parameter):
                holder._parameters[leaf] = nn.Parameter(moved, requires_grad=False)
            else:
                holder._buffers[leaf] = moved


_COUPLING_FIX = ("per-sample gradients need layers that treat samples independently: use "
                 "BatchNorm with eval (running) statistics, or LayerNorm/GroupNorm")


def _dry_run(module: nn.Module, spec: TensorSpec, device: torch.device
             ) -> tuple[tuple[int, ...], int]:
    """Run an example batch: per-sample output shape, activation count, and a coupling check.

    A model whose output for one sample depends on the others in the batch (batch statistics)
    or that changes its buffers in forward cannot give per-sample gradients; it is refused.
    """
    batch_stats = [
        f"'{name}' ({type(m).__name__})" for name, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        and (m.training or m.running_mean is None or m.running_var is None)
    ]
    if batch_stats:
        raise BatchCoupling(
            f"layer(s) {', '.join(batch_stats)} normalise with batch statistics (training mode "
            "or no running statistics): one sample's output depends on the other samples in "
            f"the batch; {_COUPLING_FIX}",
            layers=batch_stats,
        )
    gen = torch.Generator().manual_seed(1)
    x = example(spec.shape, getattr(torch, spec.dtype), spec.high, 3, gen).to(device)
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
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise InvalidModelSpec(f"the model fails on an example batch: {exc}") from exc
    finally:
        for h in hooks:
            h.remove()
    if not isinstance(batched, torch.Tensor) or batched.shape[:1] != (3,):
        raise InvalidModelSpec("the model must return one tensor with the batch dimension first")
    try:
        with torch.no_grad():
            singles = one_at_a_time(module, (x,))
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise BatchCoupling(  # runs on a batch of three, fails on one sample alone
            f"the model runs on a batch but fails on one sample alone ({exc}): it depends on "
            f"the other samples in the batch; {_COUPLING_FIX}"
        ) from exc
    changed = [k for k, v in module.named_buffers() if not torch.equal(v, before[k])]
    # a batch's kernels may round otherwise than one sample's: a few units in the last place
    # of the dtype (bfloat16's 2**-7 on one host's CPU); batch statistics move outputs wholly
    tol = max(1e-4, 8 * torch.finfo(batched.dtype).eps) if batched.is_floating_point() else 0
    if changed or not torch.allclose(batched, singles, atol=tol, rtol=tol):
        raise BatchCoupling(
            "the model's output for one sample depends on the other samples in the batch "
            f"(batch statistics{' updating ' + ', '.join(changed) if changed else ''}); "
            f"{_COUPLING_FIX}",
        )
    return tuple(batched.shape[1:]), numel[0] // 3


class ModelRegistry:
    """Resolves ``id`` or ``id@version`` to a :class:`LoadedModel`, built once and cached.

    Zoo families answer to their own name. Registered models come from ``store`` (memory, files
    or Redis: :mod:`service.model_store`); a plain registered id means its newest version, asked
    of the store on every call, so versions added or deleted by another process count at once.
    """

    def __init__(self, device: torch.device | None = None, cache_size: int = 16,
                 store: ModelStore | None = None) -> None:
        self.device = device or resolve_device()
        self.store: ModelStore = store if store is not None else MemoryModelStore()
        self._cache: LockedLRU[tuple[str, str | None], LoadedModel] = LockedLRU(cache_size)

    def get(self, ref: str) -> LoadedModel:
        model_id, wanted = split_ref(ref)
        if not _is_zoo(model_id):
            wanted = self.resolve(model_id, wanted)
        return self._cache.get_or_make((model_id, wanted), lambda: self._load(model_id, wanted))

    def check(self, ref: str) -> None:
        """404 now for a ``ref`` no model answers to: an unknown id, or an unknown version
        (a registered model's from the store; a zoo model's version is its build's digest, so
        ``zoo@version`` builds it, as serving it would)."""
        model_id, wanted = split_ref(ref)
        if not _is_zoo(model_id):
            self.resolve(model_id, wanted)
        elif wanted is not None:
            self.get(ref)

    def remember(self, model: LoadedModel, key: tuple[str, str | None] | None = None) -> None:
        self._cache.put(key or (model.id, model.version), model)

    def forget(self, model_id: str) -> None:
        """Drop cached versions of ``model_id`` (the store is the truth; this frees memory)."""
        self._cache.drop(lambda key: key[0] != model_id)

    def resolve(self, model_id: str, version: str | None) -> str:
        """The stored version that ``id`` (newest) or ``id@version`` means."""
        if not is_safe_id(model_id):
            raise UnknownModel(f"unknown model {model_id[:80]!r}: model ids are 1 to 64 of "
                               "a-z, 0-9, '.', '_', '-'")
        if version is None:
            found = self.store.latest(model_id)
            if found is not None:
                return found
        elif VERSION_RE.fullmatch(version) and self.store.has(model_id, version):
            return version  # another form is no version, as an unknown one (one 404 for both)
        if version is not None and self.store.latest(model_id):
            raise UnknownModel(f"'{model_id}' has no version {version[:40]!r}; it has: "
                               f"{', '.join(self.store.versions(model_id))}", id=model_id)
        known = self.ids()[:50]  # a store may hold many ids: GET /models lists them all
        raise UnknownModel(f"unknown model '{model_id}'; known: {', '.join(known)}"
                           f"{', ...' if len(known) == 50 else ''}", known=known)

    def ids(self) -> list[str]:
        """Every servable id: zoo names, then registered ids."""
        return [*sorted(n for n in ZOO if _is_zoo(n)), *self.store.ids()]

    def describe(self, ref: str) -> dict[str, Any]:
        """The ``GET /models/{id}`` document; registered models also list their versions.

        A registered version's document is stored with it, so listing never builds a model.
        """
        model_id, wanted = split_ref(ref)
        if _is_zoo(model_id):
            model = self.get(ref)
            return {**model.describe(), "versions": [model.version]}
        version = self.resolve(model_id, wanted)
        doc = self.store.doc(model_id, version) or self.get(f"{model_id}@{version}").describe()
        return {**doc, "versions": self.store.versions(model_id)}

    def _load(self, model_id: str, version: str | None) -> LoadedModel:
        if not _is_zoo(model_id):
            return self._load_registered(model_id, version or "")
        model = load_model(model_id, model_id, device=self.device)
        if version is not None and version != model.version:
            raise UnknownModel(
                f"'{model_id}' has no version {version[:40]!r}; its version is {model.version}",
            )
        return model

    def _load_registered(self, model_id: str, version: str) -> LoadedModel:
        file = self.store.weights_file(model_id, version)
        record = self.store.get(model_id, version, weights=file is None)
        deleted = UnknownModel(f"'{model_id}@{version}' was deleted", id=model_id)
        if record is None:
            raise deleted
        architecture, config, stored = record.architecture, record.config, record.version
        try:  # our own stored safetensors, never a pickle; a file mapped, not read whole
            state = st_load(record.weights) if file is None else st_load_file(file)
        except FileNotFoundError:
            raise deleted from None
        del record  # its bytes, before the module takes the weights a second time
        model = load_model(model_id, architecture, config, state, device=self.device,
                           consume=True)
        if model.version != stored:
            raise InternalError(f"'{model_id}@{version}' rebuilt as version {model.version}: "
                                "the stored record is inconsistent")
        return model


def make_registry(settings: Settings, store: ModelStore) -> ModelRegistry:
    """The registry a process serves from: its device, over its model store (the one
    :func:`service.storage.open_storage` built)."""
    return ModelRegistry(resolve_device(settings.device), store=store)


def split_ref(ref: str) -> tuple[str, str | None]:
    """``id`` (newest: None) or ``id@version``; ``id@`` names the empty version, which no
    model has (a 404 like any unknown version, never the newest)."""
    model_id, at, version = ref.partition("@")
    return model_id, version if at else None


def _is_zoo(name: str) -> bool:
    family = ZOO.get(name)
    return family is not None and family.standalone
