"""Every benchmark script starts the way the docs run it (``python benchmarks/x.py``), from any
working directory: its imports (the repository's tests.support among them) resolve."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py")
                 if "__main__" in p.read_text())  # the others are modules the scripts share
# comparison libraries a benchmark may name that the suite does not install (pyproject's bench)
OPTIONAL = {"dattri", "backpack", "unfoldNd", "einops", "matplotlib"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_script_starts(script: Path, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    missing = re.search(r"No module named '([\w.]+)'", done.stderr)
    if done.returncode and missing and missing.group(1).split(".")[0] in OPTIONAL:
        pytest.skip(f"{missing.group(1)} is not installed (a comparison library)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
