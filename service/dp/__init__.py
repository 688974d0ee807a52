"""DP-SGD as a service: runs with a privacy budget, their accounting, and server-side noise.

- :mod:`service.dp.accounting`: epsilon for (noise multiplier, sampling rate, steps, delta), the
  largest step count a budget allows, and the noise multiplier for a target epsilon, computed by
  Google's ``dp-accounting`` (RDP, and the privacy-loss distribution for ``prv``).
- :mod:`service.dp.noise`: Gaussian noise from the operating system's CSPRNG.
- :mod:`service.dp.runs`: run records and their stores (memory, ``PSGRAD_MODEL_DIR`` files,
  Redis), with the step counter that counts each job once, atomically with the budget check.
- :mod:`service.dp.steps`: the hooks the request validation, the worker and the api call.
"""
