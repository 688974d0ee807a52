"""``PUT /models/{id}`` with a ``.pt2`` body: checked in a child process, stored as JSON + weights.

The archive never reaches the api's own interpreter beyond its bytes: the child answers the
pruned program and the safetensors of its tensors, and the version is stored like every other
(an ``exported`` architecture whose config is the program), so every worker rebuilds it with
the same strict graph builder.
"""

from __future__ import annotations

from typing import Any

from safetensors.torch import load as st_load

from psgrad._errors import InvalidModelSpec
from service.config import Settings
from service.export.archive import SLACK, ArchiveLimits
from service.export.child import SPARES, Child, limits_dict, run_child
from service.export.module import ExportLimits
from service.export.precheck import precheck
from service.losses import LOSSES


def export_limits(settings: Settings) -> ExportLimits:
    return ExportLimits(
        archive=ArchiveLimits(max_unpacked_bytes=settings.max_weight_bytes + SLACK),
        max_nodes=settings.max_graph_nodes, max_weight_bytes=settings.max_weight_bytes,
        max_parameters=settings.max_parameters, max_activations=settings.max_model_activations,
        batch_check_s=settings.export_cpu_s / 3,
    )


def checking_child(settings: Settings) -> Child:
    """A started checking child (the spare where one waits) for an archive the caller writes
    into its ``archive`` file as it arrives, then hands to :func:`check_program`; the caller
    ends it (``with``) where it never gets there, and calls :func:`next_spare` once the
    upload is over, whole or not: a spare started beside the upload, importing torch,
    slowed it."""
    return SPARES.take(settings.export_memory_mb, settings.export_cpu_s, refill=False)


def next_spare(settings: Settings) -> None:
    """Start the checking child the next registration takes, unless one waits."""
    SPARES.keep(settings.export_memory_mb, settings.export_cpu_s)


def check_program(archive: bytes | Child, settings: Settings, *, default_loss: str,
                  losses: list[str], description: str = ""
                  ) -> tuple[dict[str, Any], Any, bytes]:
    """The ``exported`` config and the state of a client's archive (its bytes, or a child of
    :func:`checking_child` holding it), checked in a child, and that state's
    safetensors file as the child wrote it (parsed into the state here)."""
    losses = list(dict.fromkeys([default_loss, *losses]))
    for name in losses:
        LOSSES[name]
    if len(description) > 2000:
        raise InvalidModelSpec("the description is limited to 2000 characters")
    limits = export_limits(settings)
    # what is too large is refused before a child process does any work
    precheck(archive.archive if isinstance(archive, Child) else archive, limits)
    answer, blob = run_child(archive, limits_dict(limits),
                             memory_mb=settings.export_memory_mb, cpu_s=settings.export_cpu_s,
                             timeout_s=settings.export_timeout_s)
    state = st_load(blob)
    config = {
        "program": answer["program"], "inputs": answer["inputs"],
        "tensors": {k: [list(t.shape), str(t.dtype).removeprefix("torch.")]
                    for k, t in state.items()},
        "parameters": answer["parameters"], "aliases": answer["aliases"],
        "output_shape": answer["output_shape"], "activations": answer["activations"],
        "batched": bool(answer["batched"]),
        **({"batch_check": str(answer["batch_check"])} if answer.get("batch_check") else {}),
        "default_loss": default_loss, "losses": losses, "description": description,
    }
    return config, state, blob
