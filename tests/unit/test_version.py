"""One version number: both distributions', the package's, the server's pin on the client, and
what ``psgrad --version`` prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tomllib
from packaging.requirements import Requirement

import psgrad
from psgrad._cli import main

ROOT = Path(__file__).resolve().parents[2]


def project(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        return dict(tomllib.load(f)["project"])


def test_the_version_is_one_number() -> None:
    client, server = project(ROOT / "client" / "pyproject.toml"), project(ROOT / "pyproject.toml")
    assert client["name"] == "psgrad" and server["name"] == "psgrad-server"
    assert client["version"] == server["version"] == psgrad.__version__
    pins = [Requirement(r) for r in server["dependencies"] if Requirement(r).name == "psgrad"]
    assert [str(r.specifier) for r in pins] == [f"=={psgrad.__version__}"]


def test_psgrad_version_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"psgrad {psgrad.__version__}"
