"""``POST /dp-runs`` refuses what it cannot account for, cheaply: numbers that are not finite
(JSON bodies may carry Infinity and NaN), runs that could never take a step, more planned steps
than the cap, prv below its smallest noise multiplier; and the accounting it does run is
stopped at its CPU-time limit (PSGRAD_DP_ACCOUNTING_CPU_S). Each refusal is a 422 that says
what to do; the cheap ones are checked to compute no epsilon at all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from psgrad._errors import InvalidInput
from service.dp import accounting, runs, steps
from service.dp.runs import DPRun, MemoryRunStore
from tests.support.api import app_of, open_client
from tests.support.redis import ROOT


class Spy:
    """Counts the accountant's evaluations in this process and the children it starts."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.epsilons: list[tuple[Any, ...]] = []
        self.children: list[str] = []
        epsilon, bounded = accounting.epsilon, accounting.bounded

        def counting_epsilon(*args: Any) -> float:
            self.epsilons.append(args)
            return epsilon(*args)

        def counting_bounded(cpu_s: int, fn: Any, *args: Any) -> Any:
            self.children.append(fn.__name__)
            return bounded(cpu_s, fn, *args)

        monkeypatch.setattr(accounting, "epsilon", counting_epsilon)
        monkeypatch.setattr(accounting, "bounded", counting_bounded)

    @property
    def computed(self) -> int:
        return len(self.epsilons) + len(self.children)


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "mlp", "clip_norm": 1.0, "noise_multiplier": 2.0, "expected_batch_size": 8,
            "dataset_size": 200, "delta": 1e-5, "max_epsilon": 2.0, **kw}


def raw(doc: dict[str, Any], **literals: str) -> bytes:
    """The JSON text of ``doc`` with some fields' values written as bare literals."""
    text = json.dumps(doc)[:-1]
    return (text + "".join(f', "{k}": {v}' for k, v in literals.items()) + "}").encode()


async def post(c: Any, content: bytes) -> Any:
    return await c.post("/dp-runs", content=content,
                        headers={"content-type": "application/json"})


@pytest.mark.parametrize(("field", "literal"), [
    ("clip_norm", "Infinity"), ("clip_norm", "NaN"), ("noise_multiplier", "Infinity"),
    ("noise_multiplier", "NaN"), ("max_epsilon", "Infinity"), ("delta", "NaN"),
    ("expected_batch_size", "Infinity"), ("sample_rate", "NaN"), ("epochs", "Infinity"),
    ("target_epsilon", "-Infinity"),
])
async def test_a_number_that_is_not_finite_is_refused(
        field: str, literal: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    doc = {k: v for k, v in body().items() if k != field}
    async with open_client() as c:
        r = await post(c, raw(doc, **{field: literal}))
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_input"
        assert field in error["message"] and "finite" in error["message"]
        assert (await c.get("/dp-runs")).json()["runs"] == []
    assert spy.computed == 0


def test_make_run_refuses_non_finite_numbers_from_any_caller(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    for field in ("clip_norm", "noise_multiplier", "delta", "max_epsilon"):
        with pytest.raises(InvalidInput, match=f"{field} must be finite"):
            steps.make_run(body(**{field: float("nan")}))
    with pytest.raises(InvalidInput, match="finite"):
        steps.make_run(body(clip_norm=float("inf")))
    assert spy.computed == 0


async def test_a_run_that_could_never_take_a_step_is_refused_with_its_first_step() -> None:
    """max_epsilon below one step's epsilon: 422 naming that epsilon; at it, one step."""
    first = accounting.epsilon("rdp", 2.0, 8 / 200, 1, 1e-5)
    async with open_client() as c:
        r = await c.post("/dp-runs", json=body(max_epsilon=first * 0.999))
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert "could never take a step" in error["message"]
        assert f"{first:.4g}" in error["message"] and "raise max_epsilon" in error["message"]
        assert error["details"]["first_step_epsilon"] == pytest.approx(first, rel=1e-12)
        assert (await c.get("/dp-runs")).json()["runs"] == []
        made = await c.post("/dp-runs", json=body(max_epsilon=first))
        assert made.status_code == 201, made.text
        assert made.json()["max_steps"] >= 1


async def test_more_planned_steps_than_the_cap_are_refused_before_any_accounting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    async with open_client() as c:
        # 1e4 epochs at sample_rate 1e-3: 1e7 steps, past the cap of 1e6
        r = await c.post("/dp-runs", json={
            "model": "mlp", "clip_norm": 1.0, "target_epsilon": 3.0, "sample_rate": 1e-3,
            "expected_batch_size": 1.0, "delta": 1e-5, "epochs": 1e4})
        assert r.status_code == 422, r.text
        message = r.json()["error"]["message"]
        assert f"{int(1e4 / 1e-3)} steps" in message and str(accounting.MAX_STEPS) in message
        r = await c.post("/dp-runs", json=body(steps=accounting.MAX_STEPS + 1))
        assert r.status_code == 422 and "steps" in r.json()["error"]["message"]
    assert spy.computed == 0


async def test_prv_below_its_smallest_noise_is_refused_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case (prv, sigma 0.01, a budget of 1e6 steps): a minute of CPU before; now a
    422 with no epsilon computed. Under rdp a run at sigma 0.2 (below prv's smallest) is made,
    and reading it after a step leaves prv out rather than computing it."""
    spy = Spy(monkeypatch)
    small = body(noise_multiplier=0.01, max_epsilon=1e3, sample_rate=1e-6,
                 expected_batch_size=None, dataset_size=10**6, accountant="prv")
    small["expected_batch_size"], small["sample_rate"] = 1.0, None
    async with open_client() as c:
        r = await c.post("/dp-runs", json=small)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert "at least 0.3" in error["message"] and "'rdp'" in error["message"]
        assert error["details"]["min_noise_multiplier"] == accounting.PRV_MIN_NOISE
        assert spy.computed == 0
        made = await c.post("/dp-runs", json=body(noise_multiplier=0.2, max_epsilon=1e3,
                                                  expected_batch_size=1, dataset_size=100))
        assert made.status_code == 201, made.text
        run_id = made.json()["id"]
        app_of(c).state.psgrad.storage.runs.count(run_id, "job-1")  # the app's memory store
        view = (await c.get(f"/dp-runs/{run_id}")).json()
        assert view["steps"] == 1 and set(view["epsilon"]) == {"rdp"}
        assert view["epsilon_spent"] == view["epsilon"]["rdp"] > 0
    assert all(args[0] == "rdp" or args[3] == 0 for args in spy.epsilons)  # prv: 0 steps only
    assert "epsilon" not in spy.children  # prv at sigma 0.01 was never evaluated


async def test_prv_target_that_needs_too_little_noise_is_refused() -> None:
    async with open_client() as c:
        r = await c.post("/dp-runs", json=body(
            noise_multiplier=None, target_epsilon=900.0, max_epsilon=None, steps=1,
            accountant="prv"))
        assert r.status_code == 422, r.text
        assert "below 0.3" in r.json()["error"]["message"]


async def test_accounting_past_its_cpu_limit_is_stopped_and_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """prv at sigma 0.3, q 0.05, a budget of epsilon 1000: about 10 s of CPU to search (5594
    steps); with a limit of 1 s the child is stopped, nothing is made, and the api process
    itself evaluated nothing."""
    spy = Spy(monkeypatch)
    heavy = body(noise_multiplier=0.3, max_epsilon=1e3, accountant="prv", dataset_size=None,
                 expected_batch_size=None)
    heavy.update(sample_rate=0.05, dataset_size=1000)
    async with open_client(dp_accounting_cpu_s=1) as c:
        r = await c.post("/dp-runs", json=heavy)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert "PSGRAD_DP_ACCOUNTING_CPU_S" in error["message"] and error["details"]["limit"] == 1
        assert (await c.get("/dp-runs")).json()["runs"] == []
    assert spy.children == ["plan"] and spy.epsilons == []


def test_bounded_answers_and_errors_cross_the_process_boundary() -> None:
    assert accounting.bounded(5, accounting.epsilon, "rdp", 1.0, 0.01, 10, 1e-5) == \
        accounting.epsilon("rdp", 1.0, 0.01, 10, 1e-5)
    with pytest.raises(InvalidInput, match="unknown accountant 'gdp'"):
        accounting.bounded(5, accounting.epsilon, "gdp", 1.0, 0.01, 10, 1e-5)
    # one prv step at sigma 0.02 takes over ten seconds of CPU: stopped at one
    with pytest.raises(InvalidInput, match="more than 1 s of CPU"):
        accounting.bounded(1, accounting.epsilon, "prv", 0.02, 0.01, 1, 1e-5)


def test_a_made_run_keeps_its_numbers() -> None:
    """The numbers computed in the child are the ones the run keeps."""
    run = steps.make_run(body())
    assert isinstance(run, DPRun)
    assert run.max_steps == accounting.max_steps("rdp", 2.0, 8 / 200, 1e-5, 2.0) > 0


def test_a_run_of_the_same_numbers_is_planned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second run of the same numbers (a job restarted) starts no child: its plan is kept."""
    spy = Spy(monkeypatch)
    numbers = body(noise_multiplier=2.5, max_epsilon=1.75)
    first, second = steps.make_run(numbers), steps.make_run(numbers)
    assert (first.noise_multiplier, first.max_steps) == (second.noise_multiplier,
                                                         second.max_steps)
    assert spy.children == ["plan"]


def test_the_accountants_child_does_not_run_the_main_script_again(tmp_path: Path) -> None:
    """multiprocessing runs the parent's main script again in each child unless told not to:
    under ``psgrad serve`` that cost every POST /dp-runs 1.3-1.7 s, and it counted against
    the accounting's CPU limit."""
    marker = tmp_path / "imports"
    script = tmp_path / "main.py"
    script.write_text(
        "import pathlib\n"
        f"with pathlib.Path({str(marker)!r}).open('a') as f:\n    f.write('x')\n"
        "if __name__ == '__main__':\n"
        "    from service.dp import accounting\n"
        "    print(accounting.bounded(5, accounting.epsilon, 'rdp', 1.0, 0.01, 10, 1e-5))\n")
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout) == accounting.epsilon("rdp", 1.0, 0.01, 10, 1e-5)
    assert marker.read_text() == "x"  # the parent's run alone


@pytest.mark.parametrize(("noise", "used"), [(1.0, "prv"), (0.05, "rdp")])
def test_a_steps_epsilon_is_bounded_and_falls_back_to_rdp(noise: float, used: str) -> None:
    """Each step's epsilon is the run's accountant's within the CPU limit; past it (prv at a
    noise it cannot evaluate cheaply, as a run recorded before the limits may hold) the step is
    still answered, with rdp's epsilon, never smaller, and says so."""
    store = MemoryRunStore()
    run = DPRun(id=runs.new_run_id(), model="mlp", clip_norm=1.0, noise_multiplier=noise,
                sample_rate=0.01, expected_batch_size=2.0, delta=1e-5, max_epsilon=1e9,
                max_steps=10, accountant="prv")
    store.create(run)
    out = steps.on_result("job-1", {"dp_run": run.id}, {"clipped_mean": 1}, store, cpu_s=5)
    dp = out["dp"]
    assert (dp["accountant"], dp["steps"]) == (used, 1)
    assert dp["epsilon"] == accounting.epsilon(used, noise, 0.01, 1, 1e-5)
    assert ("fallback" in dp) == (used == "rdp")
    if used == "rdp":
        assert "PSGRAD_DP_ACCOUNTING_CPU_S" in dp["fallback"]
