"""psgrad beside a training loop: per-sample statistics of the run, sent as it trains.

- :class:`psgrad.integrations.Monitor` (torch-free): in a plain loop, ``monitor.observe(step,
  inputs, targets)`` after each step; the batch goes to psgrad from a background thread and the
  answers are logged. Training never waits on the network: a full queue drops the step.
- :class:`psgrad.integrations.transformers.PsgradCallback`: the same for a Hugging Face
  ``Trainer`` (it imports ``transformers``, so it is not imported here).
"""

from psgrad.integrations._monitor import Monitor

__all__ = ["Monitor"]
