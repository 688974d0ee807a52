"""The lock (.ci/lock/*.txt) still satisfies what pyproject.toml asks for.

.ci/run, the Dockerfile and README's test command install the lock's exact versions; users who
install the packages get pyproject.toml's ranges. A range changed without refreshing the lock
(``bash .ci/lock/refresh``) fails here, naming the package.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / ".ci" / "lock"
OURS = {"psgrad", "psgrad-server"}  # installed from this repository, never from the lock


def _pins(path: Path) -> dict[str, Version]:
    text = path.read_text()
    pins = {canonicalize_name(m[1]): Version(m[2])
            for m in re.finditer(r"^([A-Za-z0-9_.-]+)==(\S+)", text, flags=re.M)}
    # every pin carries its hashes: pip installs the lock in hash-checking mode
    unhashed = re.findall(r"^([A-Za-z0-9_.-]+==\S+)\s*$", text, flags=re.M)
    assert not unhashed, f"{path.name}: pins without --hash: {unhashed}"
    return pins


def _requirements(lines: list[str]) -> list[Requirement]:
    reqs = [Requirement(line) for line in lines]
    return [r for r in reqs if canonicalize_name(r.name) not in OURS
            and (r.marker is None or r.marker.evaluate({"extra": ""}))]


def _project() -> dict[str, list[str]]:
    server = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    client = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    extras = server["optional-dependencies"]
    ci = [line.strip() for line in (LOCK / "ci.in").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith(("#", "-"))]
    runtime = server["dependencies"] + client["dependencies"]
    return {"runtime": runtime, "test": runtime + extras["dev"] + extras["docs"] + ci}


@pytest.mark.parametrize(("lock", "kind"), [("test.txt", "test"), ("server.txt", "runtime")])
def test_the_lock_pins_a_version_in_range_of_every_requirement(lock: str, kind: str) -> None:
    pins = _pins(LOCK / lock)
    wrong = []
    for req in _requirements(_project()[kind]):
        name = canonicalize_name(req.name)
        if lock == "server.txt" and name == "torch":
            continue  # the image's base brings torch (a CUDA build on a GPU host)
        version = pins.get(name)
        if version is None or not req.specifier.contains(version, prereleases=True):
            wrong.append(f"{req} (locked: {version})")
    assert not wrong, (f"{lock} no longer satisfies pyproject.toml: {wrong}; refresh it with "
                       "`bash .ci/lock/refresh`")


def test_the_server_lock_holds_the_test_locks_versions_and_no_torch() -> None:
    test, server = _pins(LOCK / "test.txt"), _pins(LOCK / "server.txt")
    assert "torch" not in server
    assert {n: v for n, v in server.items() if test.get(n) != v} == {}


def test_torch_is_the_cpu_build_of_2_13_0() -> None:
    """An unpinned torch would be a CUDA build of several GB on this kind of machine."""
    assert str(_pins(LOCK / "test.txt")["torch"]) == "2.13.0+cpu"
