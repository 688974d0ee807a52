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
from service.export.child import limits_dict, run_child
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


def check_program(data: bytes, settings: Settings, *, default_loss: str,
                  losses: list[str], description: str = ""
                  ) -> tuple[dict[str, Any], Any, bytes]:
    """The ``exported`` config and the state of a client's archive, checked in a child, and
    that state's safetensors file as the child wrote it (parsed into the state here)."""
    losses = list(dict.fromkeys([default_loss, *losses]))
    for name in losses:
        LOSSES[name]
    if len(description) > 2000:
        raise InvalidModelSpec("the description is limited to 2000 characters")
    limits = export_limits(settings)
    precheck(data, limits)  # what is too large is refused before a child process starts
    answer, blob = run_child(data, limits_dict(limits),
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
