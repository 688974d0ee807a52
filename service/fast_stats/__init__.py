"""Summary statistics without materialising every per-sample gradient (``PSGRAD_FAST_STATS``).

One batched forward pass records, for every op that reads a selected parameter, what its layer
family needs (:mod:`._capture`); one backward pass of the summed per-sample losses gives each
op output's gradient ``g``, row i being sample i's own (:mod:`._run`). Each parameter's
statistics then come from the closed form of its family (``families/``: ``linear``, ``conv``,
``embedding``, ``layer_norm``, ``add``), the per-sample replay of the ops that read it
(``direct``), or the per-sample vjp of the smallest enclosing module (``vmap``) (:mod:`._replay`);
tied weights sum their parts (``tied``). What is captured how is planned once per model
structure by a probe (:mod:`._plan`). ``clipped`` needs every norm first, so it takes a second
pass over the saved inputs and gradients (``G^T diag(c) A`` for a linear layer), never a second
backward.

:class:`FastStats` is the strategy: it fills the same per-parameter records as the ``vmap``
strategy, or declines. A layer family is one module in ``families/`` (a class decorated with
``@register_family(torch_function, ...)``, see :mod:`._family`) and one import line in
``families/__init__.py``.
"""

from service.fast_stats import families  # noqa: F401  (register the layer families)
from service.fast_stats._family import FAMILIES, Family, register_family
from service.fast_stats._kernels import warm_up as warm_kernels
from service.fast_stats._shared import FileBackend, RedisBackend, SharedPlans
from service.fast_stats._tuning import TUNING, Tuning
from service.fast_stats.strategy import FastStats

__all__ = ["FAMILIES", "TUNING", "Family", "FastStats", "FileBackend", "RedisBackend",
           "SharedPlans", "Tuning", "register_family", "warm_kernels"]
