"""Shared fixtures; test folders are tiers (unit, integration, e2e), marked automatically."""

from __future__ import annotations

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = item.path.parts
        for tier in ("unit", "integration", "e2e"):
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
