"""Exported programs as a model family: the registry builds them like any other model.

A stored version's config is what the child process checked (:mod:`service.export.child`):
the pruned program, the shapes of its tensors, the tied names and the dry run's measures.
:meth:`ExportedFamily.build` rebuilds the fx module through the same strict graph builder, so a
version read back from a file or from Redis is held to the same allow-list as a fresh archive.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from models import TensorSpec, register_model
from models.base import ModelFamily
from psgrad._errors import InvalidModelSpec
from service.export.graph import parse_program
from service.export.module import build_module

ARCHITECTURE = "exported"


@register_model
class ExportedFamily(ModelFamily):
    name: ClassVar[str] = ARCHITECTURE
    standalone: ClassVar[bool] = False
    batched: ClassVar[bool] = False
    default_config: ClassVar[dict[str, Any]] = {
        "program": None, "inputs": [], "tensors": {}, "parameters": [], "aliases": {},
        "output_shape": [], "activations": 0, "default_loss": "cross_entropy",
        "losses": ["cross_entropy"], "description": "",
    }

    def build(self, config: dict[str, Any]) -> nn.Module:
        program = parse_program(config["program"], max_nodes=1 << 30)  # bounded at registration
        specs = {k: (list(shape), getattr(torch, dtype))
                 for k, (shape, dtype) in config["tensors"].items()}
        return build_module(program, specs, tuple(config["parameters"]), config["aliases"])

    def input_spec(self, config: dict[str, Any]) -> TensorSpec:
        inputs = config["inputs"]
        if len(inputs) != 1:
            raise InvalidModelSpec("psgrad serves exported programs with one input for now")
        return TensorSpec(tuple(inputs[0]["hints"][1:]), inputs[0]["dtype"])

    def loss_info(self, config: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
        return config["default_loss"], tuple(config["losses"])

    def measured(self, config: dict[str, Any]) -> tuple[tuple[int, ...], int]:
        return tuple(config["output_shape"]), int(config["activations"])

    def describe(self, config: dict[str, Any]) -> dict[str, Any]:
        tied = {k: v for k, v in config["aliases"].items() if k != v}
        summary = {k: v for k, v in config.items() if k not in ("program", "tensors", "aliases")}
        return {"config": summary, "inputs": [{k: u[k] for k in ("name", "shape", "dtype")}
                           for u in config["inputs"]],
                "tied": tied, "description": config["description"]}
