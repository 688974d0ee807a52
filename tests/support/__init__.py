"""What the tests share, one module per thing it owns.

- :mod:`~tests.support.reference`: the per-sample loop and the losses written out, the slow
  reference every gradient and statistic is checked against.
- :mod:`~tests.support.layers`: one ``sequential`` case per allow-listed layer type, and the same
  model built from stock ``torch.nn``.
- :mod:`~tests.support.api`: an app on the embedded broker with its lifespan run, its client, and
  request bodies.
- :mod:`~tests.support.client`: the real app in-process for the sync SDK client, ``psgrad serve``
  in a subprocess, free ports.
- :mod:`~tests.support.redis`: key prefixes on the shared Redis, private Redis servers, worker
  processes, waiting, Prometheus samples.
"""
