"""The two wheels this repository builds, and what each holds: ``psgrad`` (the light client,
client/) and ``psgrad-server`` (service/ and models/, root pyproject.toml).

They are built from a copy of the sources (setuptools writes build/ and *.egg-info next to
them), with the setuptools installed here (no network)."""

from __future__ import annotations

import configparser
import email.message
import email.parser
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import psgrad

ROOT = Path(__file__).resolve().parents[2]
VERSION = psgrad.__version__


@dataclass(frozen=True)
class Wheel:
    names: frozenset[str]  # every file in it
    metadata: email.message.Message
    entry_points: dict[str, dict[str, str]]

    @property
    def top_level(self) -> set[str]:
        return {name.split("/")[0] for name in self.names}

    @property
    def requires(self) -> list[Requirement]:
        return [Requirement(r) for r in self.metadata.get_all("Requires-Dist") or []]


def read_wheel(path: Path) -> Wheel:
    with zipfile.ZipFile(path) as z:
        names = frozenset(z.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(z.read(f"{info}/METADATA").decode())
        points = configparser.ConfigParser()
        if f"{info}/entry_points.txt" in names:
            points.read_string(z.read(f"{info}/entry_points.txt").decode())
    groups = {g: dict(points[g]) for g in points.sections()}
    return Wheel(names, metadata, groups)


def sources(folder: str, suffix: str = ".py") -> set[str]:
    """The tracked files of ``folder`` ending in ``suffix``, as paths inside the repository."""
    listed = subprocess.run(["git", "ls-files", folder], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    return {p for p in listed if p.endswith(suffix) and (ROOT / p).exists()}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Wheel]]:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheels")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for folder in ("client", "service", "models"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), "./client", "."],
                   cwd=src, check=True, capture_output=True, timeout=300)
    built = {p.name.split("-")[0]: read_wheel(p) for p in out.glob("*.whl")}
    assert set(built) == {"psgrad", "psgrad_server"}, sorted(built)
    yield built


def test_the_client_wheel_holds_the_client_alone(wheels: dict[str, Wheel]) -> None:
    client = wheels["psgrad"]
    assert client.metadata["Name"] == "psgrad" and client.metadata["Version"] == VERSION
    assert client.top_level == {"psgrad", f"psgrad-{VERSION}.dist-info"}
    # every module of the package, and its type marker
    assert {p.removeprefix("client/") for p in sources("client/psgrad")} <= client.names
    assert "psgrad/py.typed" in client.names
    assert sorted(r.name for r in client.requires) == ["httpx", "numpy", "safetensors"]
    assert client.entry_points == {"console_scripts": {"psgrad": "psgrad._cli:main"}}


def test_the_server_wheel_holds_service_and_models_and_pins_the_client(
        wheels: dict[str, Wheel]) -> None:
    server = wheels["psgrad_server"]
    assert server.metadata["Name"] == "psgrad-server" and server.metadata["Version"] == VERSION
    assert server.top_level == {"service", "models", f"psgrad_server-{VERSION}.dist-info"}
    assert sources("service") | sources("models") <= server.names
    assert "service/api/status.html" in server.names  # the status page, read at run time
    assert not any(name.startswith("psgrad/") for name in server.names)
    pins = [r for r in server.requires if r.name == "psgrad"]
    assert [str(r.specifier) for r in pins] == [f"=={VERSION}"] and not pins[0].marker
    names = {r.name for r in server.requires if r.marker is None}
    assert {"torch", "fastapi", "uvicorn", "redis", "dp-accounting"} <= names
    # `psgrad serve` and `psgrad worker` come through the client's command; no script of its own
    assert server.entry_points == {"psgrad.commands": {"server": "service.cli"}}
