"""Warm-ups: a registered model fast from its first request.

A registration may ask for a warm-up at example shapes (``PUT /models/{id}?warmup=4x64,32x512``,
batch size by sequence length, or ``warmup=4,32`` for samples of one fixed shape). The api
queues one ``norms`` job per shape on random samples of that shape, under the model's default
loss with every parameter (what a plan is keyed by: :func:`service.fast_stats._shared.plan_key`);
a worker computes it as it would any job, and so makes the model's plans and shares them. The
shapes and their jobs are kept with the version (:meth:`ModelStore.set_warmup`) and ``GET
/models/{id}`` shows their progress (:func:`progress`).

A worker starting up computes the same shapes of every model that asked for a warm-up before it
reports ready (:meth:`service.worker.loop.Worker.warm`, within ``PSGRAD_WARMUP_TIMEOUT_S``):
with the plans already shared that is loading the model and one call per shape.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from typing import Any

import numpy as np
import torch

from models.examples import example
from psgrad._errors import InvalidInput, PsgradError, UnknownJob
from service.config import Settings, raise_setting
from service.jobs import Broker, Job, JobStatus, new_job_id
from service.losses import LOSSES
from service.model_store import ModelStore
from service.registry import LoadedModel

__all__ = ["MAX_SHAPES", "Shape", "ask", "example_fields", "parse_shapes", "progress", "wanted"]

MAX_SHAPES = 16
OUTPUTS = ["norms"]  # any statistic makes the same plan; norms answer smallest
Shape = tuple[int, int | None]  # batch size, sequence length (None: the samples' one shape)
_FLOATS = {torch.float64: np.float64, torch.float16: np.float16}
_DIGITS = re.compile(r"[0-9]{1,18}")  # str.isdigit takes '²' and '①', which int() refuses


def parse_shapes(text: str, max_batch_size: int) -> list[Shape]:
    """``"4x64,32x512"`` or ``"4,32"``, each shape once, no batch past ``max_batch_size``
    (what a request may send); refuses anything else (422)."""
    shapes: list[Shape] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        batch, sep, length = part.partition("x")
        if not _DIGITS.fullmatch(batch) or int(batch) < 1 or (
                sep and not (_DIGITS.fullmatch(length) and int(length) >= 1)):
            raise InvalidInput(f"'warmup' has '{part[:40]}': give shapes as batch size x length "
                               "(warmup=4x64,32x512), or batch sizes alone for samples of one "
                               "fixed shape (warmup=4,32)", warmup=text[:200])
        if int(batch) > max_batch_size:
            raise InvalidInput(f"'warmup' has batch size {int(batch)}; a request takes at most "
                               f"{max_batch_size}: warm up at the sizes clients send, or "
                               f"{raise_setting('max_batch_size', max_batch_size)}",
                               warmup=text[:200], limit=max_batch_size)
        shapes.append((int(batch), int(length) if length else None))
    shapes = list(dict.fromkeys(shapes))
    if len(shapes) > MAX_SHAPES:
        raise InvalidInput(f"'warmup' names {len(shapes)} shapes; at most {MAX_SHAPES}: the ones "
                           "clients send most", limit=MAX_SHAPES)
    return shapes


def example_fields(model: LoadedModel, shape: Shape, max_elements: int) -> dict[str, Any]:
    """A ``norms`` request of random samples of ``shape`` under the model's default loss; a
    422 where a tensor would pass ``max_elements``, as a request's would (nothing made)."""
    batch, length = shape
    specs = model.inputs or (model.input,)
    if length is not None and not any(s.dynamic for s in specs):
        raise InvalidInput(f"'{model.id}' takes samples of one shape {list(model.input.shape)}: "
                           f"warm it up at batch sizes alone (warmup={batch})")
    loss = LOSSES[model.default_loss]
    unknown = sorted(set(loss.needs) - {"targets", "mask"})
    if unknown:
        raise InvalidInput(f"a warm-up runs the default loss '{loss.name}' on random samples, "
                           f"which cannot make up its {', '.join(unknown)}: send a first request "
                           "instead")
    gen = torch.Generator().manual_seed(0)
    arrays = {}
    for spec in specs:
        size = list(spec.shape)
        for dim, low, high, _ in spec.dynamic:
            if length is not None and not low <= length <= high:
                raise InvalidInput(f"'{model.id}' takes lengths {low} to {high}, not {length}")
            size[dim] = size[dim] if length is None else length
        if batch * math.prod(size) > max_elements:
            raise InvalidInput(f"a batch of {batch} of '{spec.name}' {size} has "
                               f"{batch * math.prod(size)} elements; a request takes at most "
                               f"{max_elements}: {raise_setting('max_elements', max_elements)}")
        x = example(size, getattr(torch, spec.dtype), spec.high, batch, gen)
        if not x.is_floating_point():
            arrays[spec.name] = x.numpy()
        elif torch.bfloat16 in (model.dtype, x.dtype):  # numpy has none: its values in float32
            arrays[spec.name] = x.to(torch.bfloat16).float().numpy()
        else:
            arrays[spec.name] = x.numpy().astype(_FLOATS.get(model.dtype, np.float32))
    out = model.output_shape
    if loss.tokens:
        targets = torch.randint(0, out[-1], (batch, length or out[0]), generator=gen).numpy()
    elif loss.classification:
        targets = torch.randint(0, out[-1], (batch,), generator=gen).numpy()
    else:
        targets = torch.randn((batch, *out), generator=gen).numpy()
    return {"model": model.ref, "outputs": OUTPUTS, "targets": targets,
            "inputs": arrays if len(specs) > 1 else arrays[specs[0].name]}


async def ask(broker: Broker, store: ModelStore, model: LoadedModel, shapes: list[Shape],
              settings: Settings, tenant: str) -> dict[str, Any]:
    """Queue one job per shape and keep them with the version; the record kept. A shape the
    model cannot take, or a full queue, is recorded as that shape's failure."""
    record: dict[str, Any] = {"asked_at": time.time(), "shapes": []}
    for batch, length in shapes:
        entry: dict[str, Any] = {"batch_size": batch, "length": length, "job": None,
                                 "status": JobStatus.QUEUED.value, "error": None}
        try:
            fields = await asyncio.to_thread(example_fields, model, (batch, length),
                                             settings.max_elements)  # off the event loop
            job = Job(new_job_id(), fields,
                      deadline=time.time() + settings.warmup_timeout_s, tenant=tenant)
            await broker.submit(job)
            entry["job"] = job.id
        except PsgradError as exc:
            entry.update(status=JobStatus.FAILED.value, error=str(exc))
        record["shapes"].append(entry)
    await asyncio.to_thread(store.set_warmup, model.id, model.version, record)
    return record


async def progress(broker: Broker, store: ModelStore, model_id: str, version: str,
                   record: dict[str, Any]) -> dict[str, Any]:
    """The warm-up's status (``running`` until every shape ended, then ``succeeded`` if every
    one did, else ``failed``), each shape's, and the seconds its job spent planning. Shapes
    that ended are written back, so the record outlives the jobs' results."""
    changed = False
    for entry in record["shapes"]:
        if entry["job"] is None or JobStatus(entry["status"]).done:
            continue
        try:
            state = await broker.state(entry["job"])
        except UnknownJob:
            entry.update(status=JobStatus.FAILED.value, error="its job expired before it ended")
            changed = True
            continue
        entry["planning_s"] = round(state.planning_s, 3)
        if state.status.value != entry["status"]:
            entry["status"], changed = state.status.value, True
            if state.status is not JobStatus.SUCCEEDED and state.status.done:
                entry["error"] = ((state.error or {}).get("error", {}).get("message")
                                  or f"its job was {state.status.value}")
    if changed:
        await asyncio.to_thread(store.set_warmup, model_id, version, record)
    statuses = [JobStatus(e["status"]) for e in record["shapes"]]
    done = sum(s is JobStatus.SUCCEEDED for s in statuses)
    overall = ("running" if not all(s.done for s in statuses) else
               "succeeded" if done == len(statuses) else "failed")
    return {"status": overall, "done": done, "total": len(statuses), **record}


def wanted(store: ModelStore) -> list[tuple[str, Shape]]:
    """Every shape of every registered model that asked for a warm-up, at its newest version:
    the shapes its newest version asked for, or its latest earlier version did (new weights,
    ``PUT /models/{id}/weights``, ask for none of their own)."""
    found = []
    for model_id in store.ids():
        versions = store.versions(model_id)
        record = next(filter(None, (store.warmup(model_id, v) for v in reversed(versions))),
                      None)
        for entry in (record or {}).get("shapes", []):
            found.append((f"{model_id}@{versions[-1]}", (entry["batch_size"], entry["length"])))
    return found
