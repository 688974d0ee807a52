"""``client.reference_sets``: sets of per-sample sketches (or gradients) kept on the server.

``put`` has the server compute a batch's sketches (``projection_dim``) or full gradients and keep
them under an id; ``per_sample_grads(..., outputs=["influence"], reference_set=id)`` then scores
a batch against them without sending them again. A set is a small gradient store: the same id
is ``client.stores.get(id)`` (its rows under the ids 0 to M - 1, for top-k ``query``), and any
store of yours up to the server's ``PSGRAD_MAX_REFERENCE_SET_BYTES`` is a ``reference_set``.
Each exchange is described once by :class:`_Sets`; ``ReferenceSets`` sends it and
``AsyncReferenceSets`` awaits it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from psgrad._base import BaseClient, Call, Steps, json_doc, resource_path
from psgrad._request import grads_fields
from psgrad._wire import REQUEST_KEY, SAFETENSORS, fields_to_safetensors

if TYPE_CHECKING:
    from psgrad._async_client import AsyncClient
    from psgrad._client import Client

__all__ = ["AsyncReferenceSets", "ReferenceSets"]


def _path(set_id: str) -> str:
    return resource_path("reference-sets", "reference set", set_id)


_doc = json_doc


class _Sets:
    def __init__(self, client: BaseClient) -> None:
        self._client = client

    def _put(self, set_id: str, model: str, inputs: Any, targets: Any, loss: str | None,
             params: Sequence[str] | None, projection_dim: int | None,
             projection_seed: int | None, projection_kind: str | None
             ) -> Steps[dict[str, Any]]:
        """The batch's arrays in the model's dtype (asked once a model, as for a gradients
        request), then sent."""
        fields = grads_fields(model, inputs, targets, loss=loss, params=params,
                              projection_dim=projection_dim, projection_seed=projection_seed,
                              projection_kind=projection_kind)
        del fields["outputs"]  # the server asks for sketches or gradients itself
        fields = yield from self._client._preparing(fields)
        done: dict[str, Any] = yield from self._client._calling(Call(
            "PUT", _path(set_id), _doc, content=fields_to_safetensors(fields, REQUEST_KEY),
            headers={"Content-Type": SAFETENSORS}))
        return done

    @staticmethod
    def _get(set_id: str) -> Call[dict[str, Any]]:
        return Call("GET", _path(set_id), _doc)

    @staticmethod
    def _delete(set_id: str) -> Call[dict[str, Any]]:
        return Call("DELETE", _path(set_id), _doc)


class ReferenceSets(_Sets):
    """``client.reference_sets``."""

    _client: Client

    def put(self, set_id: str, model: str, inputs: Any, targets: Any = None, *,
            loss: str | None = None, params: Sequence[str] | None = None,
            projection_dim: int | None = None, projection_seed: int | None = None,
            projection_kind: str | None = None) -> dict[str, Any]:
        """Compute and keep the batch's sketches (with ``projection_dim``) or full gradients
        as the store ``set_id`` (replacing a set of that id; a larger store of that id is
        refused with 409); returns its description."""
        return self._client._drive(self._put(set_id, model, inputs, targets, loss, params,
                                             projection_dim, projection_seed, projection_kind))

    def get(self, set_id: str) -> dict[str, Any]:
        """How the set was made: model version, loss, parameters, projection, count, bytes."""
        return self._client._call(self._get(set_id))

    def delete(self, set_id: str) -> dict[str, Any]:
        return self._client._call(self._delete(set_id))


class AsyncReferenceSets(_Sets):
    """``client.reference_sets`` of ``AsyncClient``: ``ReferenceSets``' methods, awaited."""

    _client: AsyncClient

    async def put(self, set_id: str, model: str, inputs: Any, targets: Any = None, *,
                  loss: str | None = None, params: Sequence[str] | None = None,
                  projection_dim: int | None = None, projection_seed: int | None = None,
                  projection_kind: str | None = None) -> dict[str, Any]:
        """See ``ReferenceSets.put``."""
        return await self._client._drive(self._put(set_id, model, inputs, targets, loss, params,
                                                   projection_dim, projection_seed,
                                                   projection_kind))

    async def get(self, set_id: str) -> dict[str, Any]:
        return await self._client._call(self._get(set_id))

    async def delete(self, set_id: str) -> dict[str, Any]:
        return await self._client._call(self._delete(set_id))
