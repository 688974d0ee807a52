"""Turn a decoded request (JSON values and numpy arrays) into engine arguments, checked
against its model.

The door has held every field to the contract already (its type, range or choices, the losses
and outputs named: :func:`service.api.body.held_to_contract`); what is left needs the model: the
tensors' shapes and dtypes, parameter names, the loss against the model's kind, the references.
Every refusal here is a typed error with a message that says what to change; nothing reaches the
engine that could fail inside ``vmap`` for a reason the client could have been told about.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from psgrad._contract import ANSWER_DTYPES, AUTOCASTS
from psgrad._contract import OUTPUTS as DECLARED
from psgrad._errors import InvalidInput, LossNotSupported, ShapeMismatch, TooLarge
from service.config import raise_setting
from service.dp.steps import bind
from service.engine import Batch, Options
from service.losses import LOSSES, Loss
from service.outputs import OUTPUTS
from service.registry import LoadedModel, ModelRegistry
from service.validate.attribution import ReferenceSets, projection_of, references
from service.validate.tensors import (
    batch_inputs,
    check_names,
    mask_of,
    param_tensors,
    sample_inputs,
    targets_of,
    tensor_of,
    token_targets,
    vector,
)

if TYPE_CHECKING:
    from service.dp.runs import RunStore

GNS = frozenset(o.name for o in DECLARED if o.combine == "gns")  # estimates across the batch


@dataclass
class ParsedRequest:
    model: LoadedModel
    opts: Options
    batch: Batch
    answer_dtype: str = "float32"  # the answer's floating tensors: float32, float16, bfloat16
    verify: int = 0  # samples the worker recomputes with the per-sample loop (service.verify)
    verify_seed: int | None = None  # picks them; None: the job id does

    def group_key(self) -> tuple[Any, ...]:
        """Requests with equal keys can run as one engine call on the concatenated batch."""
        b = self.batch
        return (
            self.model.ref, self.opts,
            _digest(b.weights), _digest(b.reference), _digest(b.references),
            _digest({} if b.sketches is None else {"": b.sketches}),
            tuple((k, v.dtype, tuple(v.shape[1:])) for k, v in b.samples().items()),
        )


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def asked_outputs(fields: Mapping[str, Any]) -> list[str]:
    """The outputs a request asks for: a list, or one name; absent, null or [] means
    ``['grads']``."""
    outputs = fields.get("outputs") or ["grads"]
    return [outputs] if isinstance(outputs, str) else list(outputs)


def parse_request(fields: dict[str, Any], registry: ModelRegistry, **limits: Any
                  ) -> ParsedRequest:
    """:func:`check_request` against the model the request names, loaded from ``registry``."""
    return check_request(fields, registry.get(fields["model"]), **limits)


def check_request(fields: dict[str, Any], model: LoadedModel, *,
                  max_batch_size: int | None = None,
                  max_activations: int | None = None,
                  dp_runs: RunStore | None = None,
                  reference_sets: ReferenceSets | None = None) -> ParsedRequest:
    """Check a decoded request against ``model`` (the one it names) and build the engine's
    arguments.

    ``dp_runs`` holds the DP runs a ``dp_run`` field may name (:mod:`service.dp`),
    ``reference_sets`` the reference sets a ``reference_set`` field may name. A model with a
    request check (exported programs) is held, at the sizes sent, to ``max_activations``
    (``PSGRAD_MAX_MODEL_ACTIVATIONS``) and its indices to their tables, before it runs.
    """
    opts = _options(fields, model, dp_runs)
    loss = LOSSES[opts.loss]
    inputs, named = batch_inputs(fields.get("inputs"), model)
    size = int(inputs.shape[0])
    if max_batch_size is not None and size > max_batch_size:
        raise TooLarge(
            f"the batch has {size} samples; the limit is {max_batch_size}: split it into "
            f"smaller batches (the SDK does this for you) or "
            f"{raise_setting('max_batch_size', max_batch_size)}", limit=max_batch_size, size=size,
        )
    noisy = [name for name in opts.outputs if name in GNS]
    if noisy and size < 2:
        raise InvalidInput(f"output '{noisy[0]}' estimates the gradients' variance across the "
                           f"samples, which takes at least 2; got a batch of {size}: send more "
                           f"samples", min=2, size=size)
    if model.check is not None:
        numel = model.check([inputs, *named.values()], max_activations or 1 << 62)
        if numel != model.activation_numel:  # chunks are sized for what these sizes take
            model = replace(model, activation_numel=numel)
    batch = Batch(inputs=inputs, named=named)
    _unread(fields, loss)
    if "targets" in loss.needs:
        batch.targets = (token_targets(fields.get("targets"), model, batch) if loss.tokens
                         else targets_of(fields.get("targets"), model, loss.classification, size))
    if fields.get("mask") is not None:
        batch.mask = mask_of(fields["mask"], batch, model)
    if opts.loss == "td0":
        if named:
            raise LossNotSupported("loss 'td0' takes models with one input")
        batch.next_inputs = sample_inputs(fields.get("next_inputs"), model, "next_inputs")
        if batch.next_inputs.shape[0] != size:
            raise ShapeMismatch(f"'next_inputs' has {batch.next_inputs.shape[0]} samples, "
                                f"'inputs' has {size}")
        batch.rewards = vector(fields.get("rewards"), "rewards", size, model.dtype)
        dones = fields.get("dones")
        batch.dones = (torch.zeros(size, dtype=model.dtype) if dones is None
                       else vector(dones, "dones", size, model.dtype))
        if not bool(((batch.dones == 0) | (batch.dones == 1)).all()):
            raise InvalidInput("'dones' must hold only 0 and 1 (or false and true)")
    batch.weights = param_tensors(fields.get("weights"), model, "weights")
    if opts.reference_count:  # dots or influence: M references per parameter, or M sketches
        reference = param_tensors(fields.get("reference"), model, "reference", stacked=True)
        raw = fields.get("reference_sketches")
        sketches = None if raw is None else tensor_of(raw, "reference_sketches", model.dtype)
        opts = references(model, opts, batch, reference, sketches, fields.get("reference_set"),
                          reference_sets)
        return ParsedRequest(model, opts, batch, verify=_as_int(fields.get("verify")) or 0,
                             verify_seed=_as_int(fields.get("verify_seed")))
    batch.reference = param_tensors(fields.get("reference"), model, "reference")
    if "dot" in opts.outputs:
        missing = [p for p in opts.params if p not in batch.reference]
        if missing:
            raise InvalidInput(
                f"output 'dot' needs 'reference' for every selected parameter; missing: "
                f"{', '.join(missing)}", missing=missing,
            )
    batch.reference = {k: v for k, v in batch.reference.items() if k in opts.params}
    return ParsedRequest(model, opts, batch, fields.get("answer_dtype") or ANSWER_DTYPES[0],
                         verify=_as_int(fields.get("verify")) or 0,
                         verify_seed=_as_int(fields.get("verify_seed")))


LOSS_FIELDS = {"targets": "targets", "mask": "mask", "next_inputs": "next_inputs",
               "rewards": "rewards", "dones": "dones", "gamma": "next_inputs"}  # read with


def _unread(fields: dict[str, Any], loss: Loss) -> None:
    """A 422 for a field that only some losses read, sent to another (``rewards`` with
    ``cross_entropy``): refused, not ignored, so that a mistaken loss or field is said."""
    for name, need in LOSS_FIELDS.items():
        if fields.get(name) is not None and need not in loss.needs:
            readers = [n for n, other in LOSSES.items() if need in other.needs]
            raise InvalidInput(f"'{name}' is read by the loss {' or '.join(readers)} only, not "
                               f"by '{loss.name}': leave it out, or ask for that loss")


def check_options(fields: dict[str, Any], model: LoadedModel) -> Options:
    """A request's options (loss, outputs, parameters, projection, ...) checked against
    ``model`` without a batch: a gradient store checks its definition with it."""
    return _options(fields, model)


def _options(fields: dict[str, Any], model: LoadedModel,
             dp_runs: RunStore | None = None) -> Options:
    """The options of ``fields`` (held to the contract at the door:
    :func:`service.api.body.held_to_contract`) against ``model``."""
    loss_name = fields.get("loss") or model.default_loss
    loss = LOSSES[loss_name]
    if loss_name not in model.losses:
        raise LossNotSupported(
            f"model '{model.id}' does not accept loss '{loss_name}'; it accepts: "
            f"{', '.join(model.losses)}", accepted=list(model.losses),
        )
    if loss.scalar_output and math.prod(model.output_shape) != 1:
        raise LossNotSupported(f"loss '{loss_name}' needs a model with one output per sample; "
                               f"'{model.id}' gives shape {list(model.output_shape)}")
    outputs = asked_outputs(fields)
    for name in outputs:
        if OUTPUTS[name].td0_only and loss_name != "td0":
            raise InvalidInput(f"output '{name}' is only defined for loss 'td0'")
    params = fields.get("params")
    if params is None:
        selected = tuple(model.params)
    else:
        check_names(params, model, "params")
        selected = tuple(p for p in model.params if p in set(params))
    gamma = 1.0 if fields.get("gamma") is None else float(fields["gamma"])
    autocast = _autocast(fields.get("autocast"), model)
    if fields.get("dp_run") is not None:  # the run sets clip, noise and divisor (service.dp)
        plain = Options(loss=loss_name, outputs=tuple(dict.fromkeys(outputs)), params=selected,
                        gamma=gamma, autocast=autocast)
        return bind(fields, plain, model.id, dp_runs)
    clip_norm = fields.get("clip_norm")
    return Options(
        loss=loss_name, outputs=tuple(dict.fromkeys(outputs)), params=selected,
        clip_norm=None if clip_norm is None else float(clip_norm),
        noise_multiplier=float(fields.get("noise_multiplier") or 0.0),
        seed=_as_int(fields.get("seed")), gamma=gamma, projection=projection_of(fields, outputs),
        reference_count=-1 if {"dots", "influence"} & set(outputs) else 0, autocast=autocast,
    )


def _autocast(value: Any, model: LoadedModel) -> str:
    """The precision of the model's forward and backward: 'off' (the model's dtype) or
    'bfloat16' (torch.autocast, a float32 model only)."""
    value = value or AUTOCASTS[0]
    if value != AUTOCASTS[0] and model.dtype != torch.float32:
        raise InvalidInput(f"'autocast' needs a float32 model; '{model.id}' computes in "
                           f"{str(model.dtype).removeprefix('torch.')}: leave 'autocast' out")
    return str(value)


def _as_int(value: Any) -> int | None:
    """An integer field as an int (the door took ``3.0`` for 3, as JSON Schema's integers)."""
    return None if value is None else int(value)
