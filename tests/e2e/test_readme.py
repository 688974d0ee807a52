"""README's ```python blocks run, each in its own process, against `psgrad serve` (PSGRAD_URL)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.client import psgrad_serve

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with psgrad_serve() as u:
        yield u


def test_readme_has_python_blocks() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(url: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {**os.environ, "PSGRAD_URL": url}
    env.pop("PSGRAD_API_KEY", None)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=240, cwd=README.parent)
    assert out.returncode == 0, f"{code}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
