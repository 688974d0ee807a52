"""The documentation's ```python blocks run, each in its own process, against `psgrad serve`.

Every ```python block of README.md and of the pages in docs/ runs (PSGRAD_URL points at the
server); a sketch that is not meant to run is fenced ```py instead.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.client import psgrad_serve

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# the least each page holds: a block moved away or fenced ```py by mistake fails here
EXPECTED = {
    "README.md": 1,  # the quick start
    "docs/client.md": 3,
    "docs/models.md": 2,  # a zoo family, GPT-2 exported with its mask
    "docs/dp.md": 1,
    "docs/verify.md": 1,
    "docs/attribution.md": 1,
    "docs/status-page.md": 1,
}


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


BLOCKS = {
    f"{page.relative_to(ROOT)}:{i}": code
    for page in PAGES
    for i, code in enumerate(python_blocks(page))
}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with psgrad_serve() as u:
        yield u


def test_the_pages_have_their_python_blocks() -> None:
    counts = {str(p.relative_to(ROOT)): len(python_blocks(p)) for p in PAGES}
    short = {page: (counts.get(page, 0), least) for page, least in EXPECTED.items()
             if counts.get(page, 0) < least}
    assert not short, f"pages with fewer ```python blocks than expected (found, expected): {short}"
    assert len(BLOCKS) >= sum(EXPECTED.values())


def _missing_modules(code: str) -> list[str]:
    """The top-level packages a block imports that this environment lacks (transformers, say:
    installed by .ci/run, optional for README's test command)."""
    names = re.findall(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", code, flags=re.M)
    return sorted({n for n in names if importlib.util.find_spec(n) is None})


@pytest.mark.parametrize("code", BLOCKS.values(), ids=BLOCKS.keys())
def test_python_block_runs(url: str, code: str, tmp_path: Path) -> None:
    if missing := _missing_modules(code):
        pytest.skip(f"the block imports {', '.join(missing)}, not installed here")
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {**os.environ, "PSGRAD_URL": url}
    env.pop("PSGRAD_API_KEY", None)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=240, cwd=ROOT)
    assert out.returncode == 0, f"{code}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
