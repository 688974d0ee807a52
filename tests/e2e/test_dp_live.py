"""The DP example in short mode and ``psgrad dp show`` against ``psgrad serve``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import psgrad
from psgrad import dp
from tests.support.client import psgrad_serve

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with psgrad_serve() as u:
        yield u


def test_dp_digits_example_short(url: str) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "dp_digits.py"), "--url", url,
                          "--short"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "psgrad DP run" in out.stdout and "psgrad, no privacy" in out.stdout


def test_psgrad_dp_show(url: str) -> None:
    with psgrad.Client(base_url=url) as client:
        run = dp.create_run(client, "mlp", clip_norm=1.0, noise_multiplier=1.0, delta=1e-5,
                            sample_rate=0.01, dataset_size=1000, max_epsilon=2.0)
    env = {**os.environ, "PSGRAD_URL": url}
    out = subprocess.run([sys.executable, "-m", "psgrad._cli", "dp", "show", run.id],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["id"] == run.id and doc["steps"] == 0 and doc["epsilon"] == {"rdp": 0.0,
                                                                           "prv": 0.0}
    listed = subprocess.run([sys.executable, "-m", "psgrad._cli", "dp", "list"],
                            capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert run.id in listed.stdout
    missing = subprocess.run([sys.executable, "-m", "psgrad._cli", "dp", "show", "dp-nope"],
                             capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert missing.returncode == 1 and "UnknownDPRun" in missing.stderr
