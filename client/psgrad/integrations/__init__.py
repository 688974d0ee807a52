"""psgrad beside a training loop: per-sample statistics of the run, sent as it trains.

- :class:`psgrad.integrations.Monitor` (torch-free): in a plain loop, ``monitor.observe(step,
  inputs, targets)`` after each step; the batch goes to psgrad from a child process at the
  lowest CPU priority and the answers are logged. Training never waits on the network: a full
  queue drops the step.
- :class:`psgrad.integrations.StoreWriter`: the run's batches added to gradient stores as it
  trains, the weights pushed as a new model version (and a new store) every checkpoint.
- :class:`psgrad.integrations.transformers.PsgradCallback`: the same for a Hugging Face
  ``Trainer`` (it imports ``transformers``, so it is not imported here).
"""

from psgrad.integrations._monitor import Monitor
from psgrad.integrations._store_writer import StoreWriter

__all__ = ["Monitor", "StoreWriter"]
