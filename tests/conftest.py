"""Shared fixtures; test folders are tiers (unit, integration, e2e), marked automatically.

``slow`` marks what README's quick command (``pytest -m "not slow"``) leaves to the full run that
``.ci/run`` makes: the integration and e2e tiers (real Redis, servers and worker processes) and
the unit modules that export real models, start every benchmark script or fuzz the whole api.
"""

from __future__ import annotations

import os
from collections import Counter

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
# no registration child started ahead by every app a test makes (tests/unit/test_export_api.py
# turns it on); a registration still starts the next one
os.environ.setdefault("PSGRAD_EXPORT_SPARE", "false")

import pytest

# unit modules of a minute or more each on a 2-core machine (.ci/run prints the slowest tests)
SLOW_UNITS = frozenset({
    "test_benchmark_scripts.py",  # starts every benchmark script
    "test_export_models.py", "test_export_hostile.py", "test_export_fast_stats.py",
    "test_export_api.py", "test_export_no_exec.py",  # export real models, run the checker child
    "test_api_schemathesis.py",  # fuzzes every operation
    "test_fast_stats_realsize.py",  # GPT-2, BERT and ResNet-18 layouts against the loop
    "test_sketch_quality.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = item.path.parts
        for tier in ("unit", "integration", "e2e"):
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
        if "unit" not in parts or item.path.name in SLOW_UNITS:
            item.add_marker(pytest.mark.slow)
        _name_the_operation(item)
    twice = sorted(nodeid for nodeid, n in Counter(item.nodeid for item in items).items() if n > 1)
    if twice:  # pytest-xdist (.ci/run) keys tests by node id: it would run one and drop the rest
        raise pytest.UsageError(f"{len(twice)} node ids name more than one test: {twice[:3]}")


def _name_the_operation(item: pytest.Item) -> None:
    """Schemathesis (4.32) makes one test per API operation without a callspec, and pytest 9
    builds a node id from the callspec alone: all of tests/unit/test_api_schemathesis.py's tests
    would share one id. Each gets its operation's label in brackets, as its name has."""
    label = getattr(item, "operation_label", None)
    if label is not None and label not in item.nodeid:
        item._id = item.parent.id.child(item.originalname).with_params(label)  # type: ignore[attr-defined,union-attr]
