"""Exported programs as a model family: the registry builds them like any other model.

A stored version's config is what the child process checked (:mod:`service.export.child`):
the pruned program (its batch made generic where :mod:`service.export.batch` could, which
``batched`` says), the shapes of its tensors, the tied names and the dry run's measures.
:meth:`ExportedFamily.build` rebuilds the module through the same strict graph builder, so a
version read back from a file or from Redis is held to the same allow-list as a fresh archive.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from models import TensorSpec, register_model
from models.base import ModelFamily, RequestCheck
from psgrad._errors import InvalidModelSpec
from service.export.graph import parse_program
from service.export.guard import RequestCheck as ExportedCheck
from service.export.interpreter import ExportedModule
from service.export.module import build_module

ARCHITECTURE = "exported"
OPTIONAL = ("batch_check",)


@register_model
class ExportedFamily(ModelFamily):
    name: ClassVar[str] = ARCHITECTURE
    standalone: ClassVar[bool] = False
    dry_run: ClassVar[bool] = False
    default_config: ClassVar[dict[str, Any]] = {
        "program": None, "inputs": [], "tensors": {}, "parameters": [], "aliases": {},
        "output_shape": [], "activations": 0, "batched": False,
        "default_loss": "cross_entropy", "losses": ["cross_entropy"], "description": "",
    }

    def build(self, config: dict[str, Any]) -> nn.Module:
        return self.build_on(config, None)  # the program was bounded at registration

    def build_empty(self, config: dict[str, Any]) -> nn.Module:
        return self.build_on(config, torch.device("meta"))  # its state names every tensor

    def config(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """The stored config; ``batch_check`` (why a program runs one sample at a time) is kept
        only where registration wrote it, so versions stored before it existed keep their
        digest."""
        given = dict(overrides or {})
        why = {k: given.pop(k) for k in OPTIONAL if k in given}
        return {**super().config(given), **why}

    def request_check(self, config: dict[str, Any], module: nn.Module) -> RequestCheck:
        program = parse_program(config["program"], max_nodes=1 << 30)
        assert isinstance(module, ExportedModule)
        return ExportedCheck(module, program, lambda: self.build_on(config, torch.device("meta")))

    def build_on(self, config: dict[str, Any], device: torch.device | None) -> ExportedModule:
        program = parse_program(config["program"], max_nodes=1 << 30)
        specs = {k: (list(shape), getattr(torch, dtype))
                 for k, (shape, dtype) in config["tensors"].items()}
        return build_module(program, specs, tuple(config["parameters"]), config["aliases"],
                            device)

    def input_spec(self, config: dict[str, Any]) -> TensorSpec:
        return self.input_specs(config)[0]

    def input_specs(self, config: dict[str, Any]) -> tuple[TensorSpec, ...]:
        inputs = config["inputs"]
        if not inputs:
            raise InvalidModelSpec("the program takes no tensor input")
        return tuple(TensorSpec(tuple(u["hints"][1:]), u["dtype"], u.get("high"), u["name"],
                                tuple((d, lo, hi, str(sym)) for d, lo, hi, sym
                                      in u.get("dynamic", ())))
                     for u in inputs)

    def batched(self, config: dict[str, Any]) -> bool:
        return bool(config["batched"])  # decided, and checked, at registration

    def loss_info(self, config: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
        return config["default_loss"], tuple(config["losses"])

    def measured(self, config: dict[str, Any]) -> tuple[tuple[int, ...], int]:
        return tuple(config["output_shape"]), int(config["activations"])

    def describe(self, config: dict[str, Any]) -> dict[str, Any]:
        tied = {k: v for k, v in config["aliases"].items() if k != v}
        summary = {k: v for k, v in config.items() if k not in ("program", "tensors", "aliases")}
        return {"config": summary, "inputs": [{"name": s.name, **s.to_dict()}
                                              for s in self.input_specs(config)],
                "tied": tied, "description": config["description"]}
