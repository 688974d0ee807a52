"""``psgrad serve`` started in a directory holding a ``service.py`` and a ``models.py``: nothing
the server starts (the export checker, the privacy accountant's fork server and its children)
imports them in place of the server's own packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

import psgrad
from psgrad import dp
from tests.support.client import PSGRAD_SCRIPT, psgrad_serve
from tests.support.export import CASES, exported

SHADOW = 'raise SystemExit("shadowed: imported from the working directory")\n'


def test_children_never_import_from_the_working_directory(tmp_path: Path) -> None:
    for name in ("service.py", "models.py"):
        (tmp_path / name).write_text(SHADOW)
    # the trap works: a plain interpreter there imports them
    trapped = subprocess.run([sys.executable, "-c", "import service"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60, check=False)
    assert trapped.returncode == 1 and "shadowed" in trapped.stderr

    case = CASES["cnn"]
    _module, archive = exported("cnn")
    with psgrad_serve(cwd=tmp_path, command=[PSGRAD_SCRIPT]) as url, \
            psgrad.Client(url) as client:
        # checked in a child interpreter (service.export.child)
        info = client.models.register_exported("shadow-cnn", archive,
                                               default_loss="cross_entropy")
        assert info.architecture == "exported"
        # target_epsilon: the noise is searched for in a child of the fork server
        run = dp.create_run(client, "shadow-cnn", clip_norm=1.0, target_epsilon=2.0, delta=1e-5,
                            sample_rate=0.01, dataset_size=1000, steps=100)
        assert 0.3 < run.noise_multiplier < 10 and run.doc["max_steps"] == 100
        x = case.example(4).numpy()
        step = run.step(x, np.array([0, 1, 2, 0]))
        assert step.steps == 1 and 0 < step.epsilon <= 2.0
        # the prv epsilon shown beside the run's own is computed in a child too
        shown = run.refresh()["epsilon"]
        assert shown["rdp"] == step.epsilon and 0 < shown["prv"] < shown["rdp"]
