"""The ways of computing per-sample statistics, behind one interface (:mod:`.base`).

:mod:`.vmap` runs the per-sample function of :mod:`.per_sample` (``vmap(grad)``, or the loop for
models vmap cannot batch) and reduces its gradients; :mod:`service.fast_stats` computes the same
records from one batched forward and backward with closed forms per layer family. The engine
tries them in order; a strategy that cannot serve a call declines and the next one runs.
"""
