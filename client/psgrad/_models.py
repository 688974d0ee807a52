"""``client.models``, the model registry: ``Models`` (sync) and ``AsyncModels``.

Each exchange is described once by :class:`_Registry` (path, body, how to read the answer); the
two namespaces only send it, with or without ``await``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

import httpx

from psgrad._arrays import param_arrays, state_dict_bytes, weights_from_bytes
from psgrad._base import BaseClient, Call
from psgrad._contract import shown
from psgrad._errors import BadRequest
from psgrad._types import ModelInfo
from psgrad._wire import SAFETENSORS, fields_to_json

if TYPE_CHECKING:
    from psgrad._async_client import AsyncClient
    from psgrad._client import Client

__all__ = ["AsyncModels", "Models"]

TORCH_EXPORT = "application/x-torch-export"


def model_path(model_id: str, suffix: str = "") -> str:
    if not isinstance(model_id, str) or not model_id:
        raise BadRequest("a model id is required")
    return f"/models/{quote(model_id, safe='@')}{suffix}"


def _object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise BadRequest(f"{name} must be a JSON object ({{...}}); got {shown(value)}")
    return dict(value)


def _sequence(value: Any, name: str) -> list[Any]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise BadRequest(f"'{name}' must be a list of layers ([{{...}}, ...]); got "
                         f"{shown(value)}")
    return list(value)


def register_body(
    architecture: str,
    config: Mapping[str, Any] | None,
    layers: Sequence[Mapping[str, Any]] | None,
    input: Mapping[str, Any] | None,
    default_loss: str | None,
    losses: Sequence[str] | None,
    weights: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The JSON of ``PUT /models/{id}``; weights keep their dtypes (they define the model)."""
    body: dict[str, Any] = {"architecture": architecture}
    extra = {
        "config": None if config is None else _object(config, "'config'"),
        "layers": None if layers is None else [_object(x, "each layer")
                                               for x in _sequence(layers, "layers")],
        "input": None if input is None else _object(input, "'input'"),
        "default_loss": default_loss,
        "losses": None if losses is None else list(losses),
    }
    body.update({k: v for k, v in extra.items() if v is not None})
    state = param_arrays(weights, "weights")
    if state is not None:
        body["weights"] = fields_to_json({"w": state}, binary=True)["w"]
    return body


def exported_bytes(program: Any) -> bytes:
    """The archive's bytes: a ``.pt2`` path, bytes, or an ``ExportedProgram`` saved here (torch
    is imported only then: the client needs no torch otherwise)."""
    if isinstance(program, bytes | bytearray):
        return bytes(program)
    if isinstance(program, str | os.PathLike):
        return Path(program).read_bytes()
    import io

    import torch

    buf = io.BytesIO()
    torch.export.save(program, buf)
    return buf.getvalue()


Warmup = Sequence["int | tuple[int, int]"]  # batch sizes, or (batch size, length) pairs


def warmup_text(shapes: Warmup | None) -> str:
    """The ``warmup`` query parameter: ``4,8x64`` for ``[4, (8, 64)]``; empty for none."""
    return ",".join(f"{s[0]}x{s[1]}" if isinstance(s, tuple) else str(s) for s in shapes or ())


def _model_info(response: httpx.Response) -> ModelInfo:
    return ModelInfo.from_dict(response.json())


def _model_list(response: httpx.Response) -> list[ModelInfo]:
    doc = response.json()
    items = doc.get("models", []) if isinstance(doc, dict) else doc
    return [ModelInfo.from_dict(m) for m in items]


def _deleted(response: httpx.Response) -> dict[str, Any]:
    return response.json() if response.content else {}


class _Registry:
    """The exchanges of the model registry, shared by ``Models`` and ``AsyncModels``."""

    def __init__(self, client: BaseClient) -> None:
        self._client = client

    @staticmethod
    def _list() -> Call[list[ModelInfo]]:
        return Call("GET", "/models", _model_list)

    @staticmethod
    def _get(model_id: str) -> Call[ModelInfo]:
        return Call("GET", model_path(model_id), _model_info)

    @staticmethod
    def _register(model_id: str, body: dict[str, Any], warmup: Warmup | None
                  ) -> Call[ModelInfo]:
        query = urlencode({"warmup": warmup_text(warmup)}) if warmup else ""
        return Call("PUT", model_path(model_id) + (f"?{query}" if query else ""), _model_info,
                    json=body)

    @staticmethod
    def _register_exported(model_id: str, program: Any, default_loss: str | None,
                           losses: Sequence[str] | None, description: str | None,
                           warmup: Warmup | None) -> Call[ModelInfo]:
        query = urlencode({k: v for k, v in (("default_loss", default_loss),
                                             ("losses", list(losses or ())),
                                             ("description", description),
                                             ("warmup", warmup_text(warmup))) if v},
                          doseq=True)
        return Call("PUT", model_path(model_id) + (f"?{query}" if query else ""), _model_info,
                    content=exported_bytes(program), headers={"Content-Type": TORCH_EXPORT})

    @staticmethod
    def _upload(model_id: str, state_dict: Mapping[str, Any]) -> Call[ModelInfo]:
        return Call(
            "PUT",
            model_path(model_id, "/weights"),
            _model_info,
            content=state_dict_bytes(state_dict),
            headers={"Content-Type": SAFETENSORS},
        )

    @staticmethod
    def _download(model_id: str, as_torch: bool) -> Call[dict[str, Any]]:
        def read(response: httpx.Response) -> dict[str, Any]:
            return weights_from_bytes(response.content, as_torch)

        return Call("GET", model_path(model_id, "/weights"), read, headers={"Accept": SAFETENSORS})

    @staticmethod
    def _delete(model_id: str) -> Call[dict[str, Any]]:
        return Call("DELETE", model_path(model_id), _deleted)


class Models(_Registry):
    """``client.models``: the model registry."""

    _client: Client

    def list(self) -> list[ModelInfo]:
        """Every model the server knows (``GET /models``)."""
        return self._client._call(self._list())

    def get(self, model_id: str) -> ModelInfo:
        """What ``model_id`` (or ``id@version``) takes: input shape, parameters, losses."""
        return self._client._call(self._get(model_id))

    def register(
        self,
        model_id: str,
        *,
        architecture: str,
        config: Mapping[str, Any] | None = None,
        layers: Sequence[Mapping[str, Any]] | None = None,
        input: Mapping[str, Any] | None = None,
        default_loss: str | None = None,
        losses: Sequence[str] | None = None,
        weights: Mapping[str, Any] | None = None,
        warmup: Warmup | None = None,
    ) -> ModelInfo:
        """Register a model (``PUT /models/{id}``): a zoo ``architecture`` with ``config``, or
        ``architecture="sequential"`` with ``layers`` and ``input``; ``weights`` (numpy or torch
        state dict) are sent inline, else the architecture's initial weights are used.
        ``warmup``: batch sizes, or (batch size, length) pairs, that a worker computes now so
        that the first requests find the model planned (progress: ``get(id).warmup``)."""
        body = register_body(architecture, config, layers, input, default_loss, losses, weights)
        return self._client._call(self._register(model_id, body, warmup))

    def register_exported(self, model_id: str, program: Any, *, default_loss: str | None = None,
                          losses: Sequence[str] | None = None,
                          description: str | None = None,
                          warmup: Warmup | None = None) -> ModelInfo:
        """Register a torch.export program: a ``.pt2`` path, its bytes, or an
        ``ExportedProgram``. The server reads it with its own strict loader (never pickle).
        ``warmup``: as in :meth:`register`."""
        return self._client._call(self._register_exported(model_id, program, default_loss,
                                                          losses, description, warmup))

    def upload_weights(self, model_id: str, state_dict: Mapping[str, Any]) -> ModelInfo:
        """New weights for ``model_id`` (a new version); names and shapes must match."""
        return self._client._call(self._upload(model_id, state_dict))

    def download_weights(self, model_id: str, *, as_torch: bool = False) -> dict[str, Any]:
        """The weights of ``model_id`` (or ``id@version``) as {name: array}."""
        return self._client._call(self._download(model_id, as_torch))

    def delete(self, model_id: str) -> dict[str, Any]:
        """Delete a model, or one version with ``id@version``; returns the server's answer."""
        return self._client._call(self._delete(model_id))


class AsyncModels(_Registry):
    """``client.models`` of ``AsyncClient``: ``Models``' methods, awaited."""

    _client: AsyncClient

    async def list(self) -> list[ModelInfo]:
        """Every model the server knows (``GET /models``)."""
        return await self._client._call(self._list())

    async def get(self, model_id: str) -> ModelInfo:
        """What ``model_id`` (or ``id@version``) takes: input shape, parameters, losses."""
        return await self._client._call(self._get(model_id))

    async def register(
        self,
        model_id: str,
        *,
        architecture: str,
        config: Mapping[str, Any] | None = None,
        layers: Sequence[Mapping[str, Any]] | None = None,
        input: Mapping[str, Any] | None = None,
        default_loss: str | None = None,
        losses: Sequence[str] | None = None,
        weights: Mapping[str, Any] | None = None,
        warmup: Warmup | None = None,
    ) -> ModelInfo:
        """Register a model; see ``Models.register``."""
        body = register_body(architecture, config, layers, input, default_loss, losses, weights)
        return await self._client._call(self._register(model_id, body, warmup))

    async def register_exported(self, model_id: str, program: Any, *,
                                default_loss: str | None = None,
                                losses: Sequence[str] | None = None,
                                description: str | None = None,
                                warmup: Warmup | None = None) -> ModelInfo:
        """``Models.register_exported``, awaited."""
        return await self._client._call(self._register_exported(model_id, program, default_loss,
                                                                losses, description, warmup))

    async def upload_weights(self, model_id: str, state_dict: Mapping[str, Any]) -> ModelInfo:
        """New weights for ``model_id`` (a new version); names and shapes must match."""
        return await self._client._call(self._upload(model_id, state_dict))

    async def download_weights(self, model_id: str, *, as_torch: bool = False) -> dict[str, Any]:
        """The weights of ``model_id`` (or ``id@version``) as {name: array}."""
        return await self._client._call(self._download(model_id, as_torch))

    async def delete(self, model_id: str) -> dict[str, Any]:
        """Delete a model, or one version with ``id@version``; returns the server's answer."""
        return await self._client._call(self._delete(model_id))
