"""Registering models at runtime: specs, weights and deletions, every input checked first.

Nothing a client sends is executed or unpickled: an architecture is a zoo family with a JSON
config or a ``sequential`` spec from the allow-list of :mod:`models.sequential`; weights are
safetensors (or JSON tensors) whose names, shapes and dtypes must match the architecture and
whose values must be finite. Before anything is allocated the architecture is built on the meta
device and measured against the limits (layers, parameters, weight bytes, activations); then it
is built for real and run on an example batch (:func:`service.registry.load_model`).

Ids are ``[a-z0-9][a-z0-9._-]{0,63}`` (safe as a file name and a Redis key part). A registered
id may not equal a zoo name: zoo names always mean the zoo model (409 Conflict otherwise).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from models import ZOO, get_family
from models.sequential import trace
from psgrad._contract import shown
from psgrad._errors import (
    BadRequest,
    Conflict,
    DtypeMismatch,
    InvalidModelSpec,
    NonFinite,
    ShapeMismatch,
    TooLarge,
    UnknownModel,
    UnsupportedMediaType,
)
from psgrad._wire import array_from_json, check_header_size
from service.config import Settings, naming_setting, raise_setting
from service.export.child import Child
from service.export.family import ARCHITECTURE as EXPORTED
from service.export.register import check_program
from service.losses import LOSSES
from service.model_store import ID_RE, ModelRecord
from service.registry import LoadedModel, ModelRegistry, load_model, split_ref

P = ParamSpec("P")
R = TypeVar("R")
SPEC_KEYS = ("layers", "input", "default_loss", "losses")
EXPORT_MEDIA_TYPE = "application/x-torch-export"


@dataclass(frozen=True)
class Limits:
    max_layers: int
    max_parameters: int
    max_weight_bytes: int
    max_activations: int
    max_elements: int

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        return cls(settings.max_layers, settings.max_parameters, settings.max_weight_bytes,
                   settings.max_model_activations, settings.max_elements)


def check_id(model_id: str) -> None:
    if not isinstance(model_id, str) or not ID_RE.fullmatch(model_id):
        raise BadRequest(
            f"invalid model id {str(model_id)[:80]!r}: use 1 to 64 characters from a-z, 0-9, "
            "'.', '_' and '-', starting with a letter or digit", id=str(model_id)[:80],
        )
    if model_id in ZOO:
        raise Conflict(f"'{model_id}' is a zoo model name; zoo names always mean the zoo model: "
                       "register yours under another id", id=model_id)


def _loader(fn: Callable[P, R]) -> Callable[P, R]:
    """A registration path whose input nests too deeply for Python (a RecursionError anywhere
    in reading, checking or storing it) answers 422, not 500."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except RecursionError:
            raise InvalidModelSpec("the model's description nests too deeply: send plain "
                                   "lists and objects a few levels deep") from None

    return run


@_loader
def register(registry: ModelRegistry, model_id: str, body: Any, limits: Limits) -> LoadedModel:
    """``PUT /models/{id}``: a new version from a spec and optional inline weights."""
    check_id(model_id)
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object {architecture, config | layers, ...}")
    architecture = body.get("architecture")
    if architecture == EXPORTED:
        raise UnsupportedMediaType(f"an exported program is registered as its .pt2 file: PUT "
                                   f"/models/{model_id} with Content-Type {EXPORT_MEDIA_TYPE}")
    if not isinstance(architecture, str) or architecture not in ZOO:
        known = ZOO.names()
        raise InvalidModelSpec(f"'architecture' must be one of {', '.join(known)}; got "
                               f"{shown(architecture)}", known=known)
    sequential = architecture == "sequential"
    allowed = {"architecture", "weights", *(SPEC_KEYS if sequential else ("config",))}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown fields {', '.join(unknown)}; '{architecture}' takes "
                         f"{', '.join(sorted(allowed))}", unknown=unknown)
    raw = {k: body[k] for k in SPEC_KEYS if k in body} if sequential else body.get("config")
    if raw is not None and not isinstance(raw, dict):
        raise InvalidModelSpec("'config' must be an object")
    layers = raw.get("layers") if sequential and raw else None
    if isinstance(layers, list) and len(layers) > limits.max_layers:
        raise TooLarge(f"the spec has {len(layers)} layers; the limit is {limits.max_layers}: "
                       f"{raise_setting('max_layers', limits.max_layers)}",
                       limit=limits.max_layers)
    family = get_family(architecture)
    config = family.config(raw)
    _, losses = family.loss_info(config)
    for name in losses:
        LOSSES[name]
    meta = _measure(architecture, config, limits)
    weights = body.get("weights")
    state = None
    if weights is not None:
        if not isinstance(weights, dict):
            raise BadRequest("'weights' must map parameter names to tensors")
        state = _check_state(meta, _json_state(weights, meta, limits), limits)
    return _add(registry, model_id, architecture, config, state)


@_loader
def register_exported(registry: ModelRegistry, model_id: str, archive: bytes | Child,
                      settings: Settings, *, default_loss: str, losses: list[str],
                      description: str = "") -> LoadedModel:
    """``PUT /models/{id}`` with a ``.pt2`` body (its bytes, or a child of
    :func:`~service.export.register.checking_child` holding it): checked in a child process,
    then stored."""
    check_id(model_id)
    config, state, encoded = check_program(archive, settings, default_loss=default_loss,
                                           losses=losses, description=description)
    return _add(registry, model_id, EXPORTED, config, state, encoded)


@_loader
def replace_weights(registry: ModelRegistry, model_id: str, body: bytes,
                    limits: Limits) -> LoadedModel:
    """``PUT /models/{id}/weights``: a new version of the newest architecture with these weights."""
    store = registry.store
    check_id(model_id)
    version = store.latest(model_id)
    record = store.get(model_id, version, weights=False) if version else None
    if record is None:
        raise UnknownModel(f"no registered model '{model_id}': register it first with "
                           f"PUT /models/{model_id}")
    if len(body) > limits.max_weight_bytes + (1 << 20):
        raise TooLarge(f"the weights are {len(body)} bytes; the limit is "
                       f"{limits.max_weight_bytes}: "
                       f"{raise_setting('max_weight_bytes', limits.max_weight_bytes)}",
                       limit=limits.max_weight_bytes)
    meta = _measure(record.architecture, record.config, limits)
    state = _check_state(meta, decode_weights(body), limits)
    return _add(registry, model_id, record.architecture, record.config, state)


def export_weights(registry: ModelRegistry, ref: str) -> tuple[str, bytes]:
    """``GET /models/{id}/weights``: the stored safetensors bytes, as they were registered."""
    model_id, version = split_ref(ref)
    if model_id not in ZOO:
        version = registry.resolve(model_id, version)
        record = registry.store.get(model_id, version)
        if record is not None:
            return f"{model_id}@{version}", record.weights
    model = registry.get(ref)
    return model.ref, encode_weights({**model.params, **model.buffers})


def delete(registry: ModelRegistry, ref: str,
           pinned: Callable[[set[str]], list[str]] = lambda refs: []) -> dict[str, Any]:
    """``DELETE /models/{id}`` (every version) or ``DELETE /models/{id}@{version}``; a version
    that ``pinned`` says a store or reference set is kept by refuses the deletion (409)."""
    model_id, version = split_ref(ref)
    if model_id in ZOO:
        raise Conflict(f"'{model_id}' is a zoo model; it cannot be deleted", id=model_id)
    if version is None:  # every version: the id's, if it has any (else the 404 of GET's)
        registry.resolve(model_id, None)
        versions = registry.store.versions(model_id)
    else:  # a 404 for a version of another form, as GET's
        version = registry.resolve(model_id, version)
        versions = [version]
    holders = pinned({f"{model_id}@{v}" for v in versions})
    if holders:
        raise Conflict(f"'{ref}' is pinned by {len(holders)} store(s) and reference set(s): "
                       f"{', '.join(holders[:10])}{', ...' if len(holders) > 10 else ''}; their "
                       "rows were computed with it: delete them first (DELETE /stores/{id}, "
                       "DELETE /reference-sets/{id})", id=model_id, pinned_by=holders[:100])
    gone = registry.store.delete(model_id, version)
    registry.forget(model_id)
    if not gone:
        what = f"'{model_id}' has no version '{version}'" if version else \
            f"no registered model '{model_id}'"
        raise UnknownModel(what, id=model_id)
    return {"id": model_id, "deleted": gone, "versions": registry.store.versions(model_id)}


def encode_weights(state: dict[str, torch.Tensor]) -> bytes:
    return bytes(st_save({k: v.detach().to("cpu").contiguous() for k, v in state.items()}))


def decode_weights(body: bytes) -> dict[str, torch.Tensor]:
    """A safetensors body as tensors; pickles and ``torch.save`` files are named and refused."""
    is_safetensors = len(body) > 8 and body[8:9] == b"{"  # 8-byte header length, then JSON
    if not is_safetensors and (body[:1] == b"\x80" or body[:2] == b"PK"):
        raise BadRequest(
            "the body looks like a pickle or a torch.save file; psgrad never unpickles what a "
            "client sends: save the weights with safetensors (safetensors.torch.save_file("
            "model.state_dict(), path)) and send that file",
        )
    check_header_size(body)  # held to the wire's limits before safetensors parses it
    try:
        state = st_load(body)  # in the file's dtypes: bfloat16 too, which numpy has not
    except (SafetensorError, ValueError) as exc:
        raise BadRequest(f"the body is not a valid safetensors file: {exc}") from exc
    for name in state:
        if "/" in name:
            raise BadRequest(f"'{name.partition('/')[0]}' is not a tensor: tensor names are "
                             "parameter names (such as '0.weight') without '/'")
    return state


def _measure(architecture: str, config: dict[str, Any], limits: Limits) -> torch.nn.Module:
    """Build on the meta device (nothing allocated) and hold it to the limits."""
    try:
        with torch.device("meta"):
            module = get_family(architecture).build(config)
    except InvalidModelSpec:
        raise
    except (TypeError, ValueError, RuntimeError, KeyError, IndexError) as exc:
        raise InvalidModelSpec(f"'{architecture}' cannot be built from this config: {exc}"
                               ) from exc
    tensors = [*module.parameters(), *module.buffers()]
    n_params = sum(p.numel() for p in module.parameters())
    n_bytes = sum(t.numel() * t.element_size() for t in tensors)
    if n_params > limits.max_parameters:
        raise TooLarge(f"the model has {n_params} parameters; the limit is "
                       f"{limits.max_parameters}: "
                       f"{raise_setting('max_parameters', limits.max_parameters)}",
                       limit=limits.max_parameters)
    if n_bytes > limits.max_weight_bytes:
        raise TooLarge(f"the model's weights take {n_bytes} bytes; the limit is "
                       f"{limits.max_weight_bytes}: "
                       f"{raise_setting('max_weight_bytes', limits.max_weight_bytes)}",
                       limit=limits.max_weight_bytes)
    if architecture == "sequential":
        trace(config, module, limits.max_activations)
    return module


def _json_state(weights: dict[str, Any], meta: torch.nn.Module,
                limits: Limits) -> dict[str, torch.Tensor]:
    """Inline JSON weights; nested lists carry no dtype, so they take the parameter's own."""
    own = dict(meta.named_parameters()) | dict(meta.named_buffers())
    state = {}
    for name, value in weights.items():
        try:
            arr = array_from_json(value, name=f"weights.{name}", max_elements=limits.max_elements)
        except TooLarge as exc:
            raise naming_setting(exc, "max_elements", limits.max_elements) from None
        t = torch.from_numpy(np.array(arr, order="C"))
        if isinstance(value, list) and name in own and not t.dtype.is_complex:
            t = t.to(own[name].dtype)
        state[name] = t
    return state


def _check_state(meta: torch.nn.Module, state: dict[str, torch.Tensor],
                 limits: Limits) -> dict[str, torch.Tensor]:
    own = dict(meta.named_parameters()) | dict(meta.named_buffers())
    unknown, missing = sorted(set(state) - set(own)), sorted(set(own) - set(state))
    if unknown or missing:
        raise ShapeMismatch(
            f"the weights do not match the architecture: unknown {unknown or 'none'}, missing "
            f"{missing or 'none'}; GET /models/{{id}} lists the parameters (buffers such as "
            "BatchNorm running statistics are sent too)", unknown=unknown, missing=missing,
        )
    total = sum(t.numel() * t.element_size() for t in state.values())
    if total > limits.max_weight_bytes:
        raise TooLarge(f"the weights take {total} bytes; the limit is {limits.max_weight_bytes}: "
                       f"{raise_setting('max_weight_bytes', limits.max_weight_bytes)}",
                       limit=limits.max_weight_bytes)
    for name, t in state.items():
        want = own[name]
        if tuple(t.shape) != tuple(want.shape):
            raise ShapeMismatch(f"weight '{name}' has shape {list(t.shape)}; the model needs "
                                f"{list(want.shape)}", parameter=name)
        if t.dtype != want.dtype:
            raise DtypeMismatch(f"weight '{name}' has dtype {str(t.dtype)[6:]}; the model needs "
                                f"{str(want.dtype)[6:]}", parameter=name)
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise NonFinite(f"weight '{name}' contains NaN or infinity", parameter=name)
    return state


def _add(registry: ModelRegistry, model_id: str, architecture: str, config: dict[str, Any],
         state: dict[str, torch.Tensor] | None, encoded: bytes | None = None) -> LoadedModel:
    """Build, check and store a version; ``encoded``: ``state``'s safetensors file, stored as
    it is (an exported program's, whose module is built in the dtypes of that state and takes
    every name of it: encoding the module's state again took GPT-2's registration 1.3 s)."""
    model = load_model(model_id, architecture, config, state, device=registry.device,
                       consume=True)  # every caller's state is parsed for this version alone
    weights = encoded if encoded is not None else encode_weights({**model.params,
                                                                  **model.buffers})
    record = ModelRecord(model_id, model.version, architecture, model.config, weights,
                         time.time(), model.describe())
    registry.store.put(record)
    registry.remember(model)
    return model
