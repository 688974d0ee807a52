"""A training run's batches appended to gradient stores as it trains, one store per checkpoint.

Every ``checkpoint_every`` steps the model's weights are pushed to the server as a new version
of the run's model, and a store is made for that version; the batches after it, until the next
checkpoint, are added to it (their sketches at the checkpoint's weights). The stores are
``<store_prefix>-<step>``, one per checkpoint, as TRAK's ensembles of checkpoints want them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from psgrad._client import Client
from psgrad._errors import UnknownModel
from psgrad._stores import Store
from psgrad.integrations._monitor import Background

__all__ = ["StoreWriter"]

Parameters = Callable[[], Any]  # module.named_parameters, or anything giving (name, tensor)


class StoreWriter(Background):
    """Append every ``every``-th step's batch to the store of the latest checkpoint.

        writer = StoreWriter(client, "run-7", architecture="tiny-transformer",
                             projection_dim=1024, checkpoint_every=500)
        for step, (x, y, ids) in enumerate(loader):
            ...                                   # the training step
            writer.observe(step, x, y, ids=ids, parameters=model.named_parameters)
        writer.close()
        writer.stores                             # ["run-7-0", "run-7-500", ...]

    The first step observed is a checkpoint, and then every ``checkpoint_every`` steps after
    it: ``parameters()`` is read then (only then), copied, and pushed as a new version of
    ``model_id`` (registered from ``architecture`` and ``config`` the first time); a store
    ``<store_prefix>-<step>`` (``store_prefix`` defaults to ``model_id``) is made on that
    version with ``projection_dim`` and ``store_options`` (``loss``, ``params``, ``dtype``,
    ...). ``ids`` name the samples in the store (unique across the run). A checkpoint the queue
    had no room for, or the server failed, is taken again at the next step observed: a batch
    is never added to a store of other weights than its checkpoint's.
    """

    name = "psgrad store writer"

    def __init__(self, client: Client, model_id: str, *, architecture: str,
                 projection_dim: int, config: Mapping[str, Any] | None = None,
                 store_prefix: str | None = None, checkpoint_every: int = 1000, every: int = 1,
                 max_pending: int = 4, **store_options: Any) -> None:
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be at least 1; got {checkpoint_every}")
        self.model_id, self.architecture, self.config = model_id, architecture, config
        self.prefix = store_prefix or model_id
        self.projection_dim, self.store_options = projection_dim, store_options
        self.checkpoint_every = checkpoint_every
        self.stores: list[str] = []
        self._next: int | None = None  # the step of the next checkpoint; None: at once
        self._store: Store | None = None
        super().__init__(client, every=every, max_pending=max_pending)

    def observe(self, step: int, inputs: Any, targets: Any = None, *, ids: Sequence[Any],
                parameters: Parameters) -> bool:
        """Queue this step's batch (and, at a checkpoint, the weights ``parameters()`` gives);
        answers whether it was queued."""
        if step % self.every:
            return False
        batch: dict[str, Any] = {"inputs": inputs, "targets": targets, "ids": list(ids)}
        checkpoint = self._next is None or step >= self._next
        if checkpoint:
            batch["weights"] = {name: value for name, value in parameters()}
        queued = self._put(step, batch)
        if checkpoint and queued:
            self._next = step + self.checkpoint_every
        return queued

    def _send(self, step: int, batch: dict[str, Any]) -> None:
        weights = batch.pop("weights", None)
        if weights is not None:
            self._store = None  # until this checkpoint's store exists
            try:
                self._store = self._checkpoint(step, weights)
            except Exception:
                self._next = None  # the next step observed takes it again
                raise
        if self._store is None:
            raise RuntimeError("no store for this batch: its checkpoint failed")
        self._store.add(batch["inputs"], batch["targets"], ids=batch["ids"])

    def _checkpoint(self, step: int, weights: dict[str, Any]) -> Store:
        """Push ``weights`` as a new version of the run's model and make its store."""
        try:
            self.client.models.get(self.model_id)
        except UnknownModel:
            info = self.client.models.register(self.model_id, architecture=self.architecture,
                                               config=self.config, weights=weights)
        else:
            info = self.client.models.upload_weights(self.model_id, weights)
        store = self.client.stores.create(f"{self.prefix}-{step}", info.ref,
                                          projection_dim=self.projection_dim,
                                          **self.store_options)
        self.stores.append(store.id)
        return store
