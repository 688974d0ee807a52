"""Every store is built once where a process is assembled and handed in (service.storage): the
embedded worker loops share the app's stores, and two apps in one process share none."""

from __future__ import annotations

from pathlib import Path

from service.api import create_app
from service.dp.runs import DPRun, MemoryRunStore, new_run_id
from service.registry import ModelRegistry
from service.storage import open_storage
from tests.support.api import settings


def run() -> DPRun:
    return DPRun(id=new_run_id(), model="mlp", clip_norm=1.0, noise_multiplier=1.0,
                 sample_rate=0.1, expected_batch_size=8.0, delta=1e-5, max_epsilon=1.0,
                 max_steps=3, accountant="rdp")


def test_the_embedded_workers_use_the_apps_stores_and_apps_share_none(tmp_path: Path) -> None:
    s = settings(workers=2, data_dir=str(tmp_path))
    first, second = create_app(s), create_app(s)
    state = first.state.psgrad
    assert state.workers is not None
    for work in state.workers.workers:  # the very objects: a DP step counted by a worker
        assert work.storage is state.storage  # is the step the api's routes read
    assert state.registry.store is state.storage.models
    made = run()
    state.storage.runs.create(made)
    assert isinstance(state.storage.runs, MemoryRunStore)
    assert second.state.psgrad.storage.runs.get(made.id) is None  # no module-level cache
    assert state.storage.sets.files is state.storage.gradients


def test_a_registry_handed_in_keeps_its_model_store(tmp_path: Path) -> None:
    registry = ModelRegistry()
    app = create_app(settings(data_dir=str(tmp_path)), registry=registry)
    assert app.state.psgrad.storage.models is registry.store
    again = open_storage(settings(data_dir=str(tmp_path)))
    assert again.models is not registry.store and again.runs is not app.state.psgrad.storage.runs
