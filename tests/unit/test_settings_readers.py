"""Which process reads each setting (``service.config.READ_BY``), checked against the code.

The table is what docker-compose*.yml and deploy/kubernetes/ are tested against (each process
gets exactly the settings it reads), so it must be right: every setting is in it, and a setting
read in a module that only one process imports is declared read by that process (a module both
import cannot tell which of them reads it; the table decides, with a comment where it is not
plain). The listening addresses are settings whose defaults keep every process on loopback.
"""

from __future__ import annotations

import re
from pathlib import Path

import grimp
import pytest

import service.cli
from psgrad._cli import build_parser
from service.config import API, READ_BY, WORKER, Settings, read_by

ROOT = Path(__file__).resolve().parents[2]
# Read from the Settings object, but not from the environment: the worker's device is its
# --device flag (service/worker_process.py copies the settings with it).
FROM_A_FLAG = {("device", WORKER)}


def test_every_setting_is_in_the_table_and_nothing_else() -> None:
    assert set(READ_BY) == set(Settings.model_fields), (
        "service/config.py READ_BY must list every setting: "
        f"missing {sorted(set(Settings.model_fields) - set(READ_BY))}, "
        f"unknown {sorted(set(READ_BY) - set(Settings.model_fields))}")
    for name, readers in READ_BY.items():
        assert readers <= {API, WORKER}, (name, readers)


def modules_of(process_roots: list[str], graph: grimp.ImportGraph) -> set[str]:
    """The modules a process imports (lazy imports inside functions included)."""
    out: set[str] = set()
    for root in process_roots:
        out |= {root} | graph.find_upstream_modules(root)
    return out


@pytest.fixture(scope="module")
def reach() -> dict[str, set[str]]:
    graph = grimp.build_graph("service", "models", "psgrad")
    # `psgrad serve` is service.cli's serve() and the app; cli's worker() imports
    # service.worker_process only for `psgrad worker`
    api = {"service.cli"} | modules_of(
        sorted(m for m in graph.modules if m.startswith("service.api")), graph)
    return {API: api, WORKER: modules_of(["service.worker_process"], graph)}


def readers_in_code(field: str, reach: dict[str, set[str]]) -> dict[str, set[str]]:
    """{module: the processes that import it} for each module that reads ``settings.<field>``."""
    found = {}
    pattern = re.compile(rf"\bsettings\.{field}\b")
    for path in (ROOT / "service").rglob("*.py"):
        if path.name == "config.py" or not pattern.search(path.read_text()):
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[module] = {p for p, modules in reach.items() if module in modules}
    return found


def test_a_setting_read_where_only_one_process_runs_is_declared_for_it(
        reach: dict[str, set[str]]) -> None:
    assert "service.broker.redis.worker" in reach[WORKER]
    assert "service.broker.redis.worker" not in reach[API]
    assert "service.api.body" in reach[API] and "service.api.body" not in reach[WORKER]
    wrong = []
    for field, declared in READ_BY.items():
        for module, processes in readers_in_code(field, reach).items():
            if len(processes) == 1:
                (only,) = processes
                embedded = not declared and only == API  # `psgrad serve` without Redis
                if only not in declared and (field, only) not in FROM_A_FLAG and not embedded:
                    wrong.append(f"{field}: read in {module}, which only `{only}` runs")
    assert not wrong, "add these to service/config.py READ_BY:\n" + "\n".join(wrong)


def test_result_ttl_is_read_by_the_workers_that_store_results(
        reach: dict[str, set[str]]) -> None:
    """The soak's finding: setting it for the api alone changed nothing."""
    found = readers_in_code("result_ttl_s", reach)
    assert found["service.broker.redis.worker"] == {WORKER}
    assert "result_ttl_s" in read_by(WORKER) and "result_ttl_s" in read_by(API)


def test_every_listening_address_is_a_setting_on_loopback_by_default() -> None:
    defaults = Settings()
    assert defaults.listen_host == "127.0.0.1"
    assert defaults.worker_metrics_host == "127.0.0.1"
    assert READ_BY["listen_host"] == {API} and READ_BY["worker_metrics_host"] == {WORKER}
    # `psgrad serve` without --host takes PSGRAD_LISTEN_HOST (nothing on the command line wins)
    serve = build_parser([service.cli]).parse_args(["serve"])
    assert serve.host is None and serve.port is None


def test_serve_takes_its_address_from_the_settings_and_keeps_its_refusal() -> None:
    """PSGRAD_LISTEN_HOST beyond loopback without keys is refused as --host would be."""
    from service.cli import EXIT_REFUSED, serve

    assert serve(settings=Settings(listen_host="0.0.0.0")) == EXIT_REFUSED
