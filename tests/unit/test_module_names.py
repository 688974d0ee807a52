"""A module's name says what it is, once: no two modules of the server share a file name, except
an HTTP route module named after the concept it serves (``service/api/routes/jobs.py`` serves
``service/jobs.py``)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_two_server_modules_share_a_name_but_a_route_and_its_concept() -> None:
    where: defaultdict[str, list[str]] = defaultdict(list)
    for path in sorted((ROOT / "service").rglob("*.py")):
        if path.name != "__init__.py":
            where[path.stem].append(path.relative_to(ROOT).as_posix())
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    clashes = {name: paths for name, paths in shared.items()
               if paths != [f"service/api/routes/{name}.py", f"service/{name}.py"]}
    assert clashes == {}
    assert "jobs" in shared  # the check sees the route modules
