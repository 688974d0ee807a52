"""The docs site's Python API page names every public object of the client."""

from __future__ import annotations

import re
from pathlib import Path

import psgrad
from psgrad import _errors

PAGE = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"


def test_python_api_page_documents_every_public_name() -> None:
    documented = set(re.findall(r"^::: psgrad\.(\w+)", PAGE.read_text(), flags=re.M))
    assert "_errors" in documented  # the error classes, all of them, from their module
    missing = set(psgrad.__all__) - documented - set(_errors.__all__)
    assert not missing, f"add `::: psgrad.NAME` to docs/python-api.md for: {sorted(missing)}"
