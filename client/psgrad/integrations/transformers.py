"""A Hugging Face ``Trainer`` callback that sends training batches to psgrad.

    from psgrad.integrations.transformers import PsgradCallback

    trainer = Trainer(model=model, args=args, train_dataset=data)
    PsgradCallback(client, "my-model", every=10, outputs=["norms", "gns"]).attach(trainer)
    trainer.train()

The model psgrad serves must be the trained model's architecture (registered as an exported
program or from the zoo); ``weights`` says how the trained model's parameters are named there,
and they are sent with each batch, so the statistics are of the weights of that step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from psgrad._client import Client
from psgrad.integrations._monitor import Monitor

__all__ = ["PsgradCallback"]

Weights = Callable[[Any], Mapping[str, Any]]


class PsgradCallback(TrainerCallback):
    """Every ``every`` optimizer steps, the step's last batch goes to psgrad (a
    :class:`~psgrad.integrations.Monitor` sends it beside the training) and each answer's
    statistics are logged through the trainer (``trainer.log``: ``psgrad/norm_mean``,
    ``psgrad/gns``, ...) at the next step's end, so the trainer's history and every logging
    integration (TensorBoard, W&B, the console) have them. :meth:`attach` adds the callback to
    a trainer and keeps it for that; a callback given as ``Trainer(callbacks=[...])`` adds the
    latest answer to the trainer's own log entries instead (``on_log``), which reach the
    integrations listed after it.

    The batch is read from the keyword arguments of the model's forward pass (``inputs_key``,
    ``targets_key``, and ``mask_key`` sent as ``mask`` where given). ``weights(model)`` returns
    the parameters to send as the step's weights, named as the served model names them
    (default: none sent; the served weights are used). Other options go to the monitor.
    """

    def __init__(self, client: Client, model: str, *, every: int = 1,
                 outputs: Sequence[str] = ("norms", "gns"), inputs_key: str = "input_ids",
                 targets_key: str | None = "labels", mask_key: str | None = None,
                 weights: Weights | None = None, **options: Any) -> None:
        self.monitor = Monitor(client, model, outputs=outputs, every=every, **options)
        self.keys = (inputs_key, targets_key, mask_key)
        self.weights = weights
        self._batch: dict[str, Any] = {}
        self._hook: Any = None
        self._trainer: Any = None
        self._logged = 0  # records passed to trainer.log

    def attach(self, trainer: Any) -> PsgradCallback:
        """Add this callback to ``trainer`` and log each answer through it."""
        trainer.add_callback(self)
        self._trainer = trainer
        return self

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, model: Any = None, **kwargs: Any) -> None:
        def keep(module: Any, inputs: tuple[Any, ...], named: dict[str, Any]) -> None:
            if module.training:
                self._batch = named

        if model is not None:
            self._hook = model.register_forward_pre_hook(keep, with_kwargs=True)

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, model: Any = None, **kwargs: Any) -> None:
        inputs_key, targets_key, mask_key = self.keys
        batch = self._batch
        if inputs_key not in batch:
            return
        fields: dict[str, Any] = {}
        if mask_key is not None and batch.get(mask_key) is not None:
            fields["mask"] = batch[mask_key]
        if self.weights is not None and model is not None:
            fields["weights"] = dict(self.weights(model))
        targets = batch.get(targets_key) if targets_key is not None else None
        self.monitor.observe(state.global_step, batch[inputs_key], targets, **fields)
        self._log_answers()

    def _log_answers(self) -> None:
        """The answers that came since the last call, through ``trainer.log``."""
        records = self.monitor.records
        while self._trainer is not None and self._logged < len(records):
            self._trainer.log(_numbers(records[self._logged]))
            self._logged += 1

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs is not None and self._trainer is None:
            logs.update(_numbers(self.monitor.latest()))

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.monitor.close()
        self._log_answers()


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    """A record's statistics that a trainer's log takes: its numbers, the step aside."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, float)}
