"""benchmarks/compare.py's methods agree with the per-sample loop on tiny models.

Opacus and BackPACK are optional (the ``bench`` extra, installed with ``--no-deps``): their
methods are skipped with the reason when missing. The loop is the tests' own
(:mod:`tests.support.reference`), written independently of the benchmark's loop.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import compare  # noqa: E402
import compare_methods as cm  # noqa: E402
import compare_report  # noqa: E402

from tests.support.reference import per_sample_loop  # noqa: E402

CASES = [
    cm.Case("mlp", 5, {"sizes": [6, 5, 3]}),
    cm.Case("value-mlp", 6, {"sizes": [3, 4]}),
    cm.Case("simple-cnn", 2),
]
pytestmark = [  # the libraries' own hook and deprecation warnings
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def reference(s: cm.Setup) -> dict[str, torch.Tensor]:
    """Per-sample gradients of the benchmark's batch, by the tests' per-sample loop."""
    return per_sample_loop(s.model.module, s.data, s.model.default_loss, gamma=cm.GAMMA).grads


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.arch)
def prepared(request: pytest.FixtureRequest) -> tuple[cm.Setup, dict[str, torch.Tensor], float]:
    s = cm.setup(request.param, torch.device("cpu"))
    grads = reference(s)
    clip = float(cm.norms_of(grads).median())  # half the samples are clipped
    return s, grads, clip


@pytest.mark.parametrize("output", cm.OUTPUTS)
@pytest.mark.parametrize("method", list(cm.IN_PROCESS))
def test_method_agrees_with_the_loop(
    prepared: tuple[cm.Setup, dict[str, torch.Tensor], float], method: str, output: str
) -> None:
    s, grads, clip = prepared
    fn = cm.IN_PROCESS[method](s, output, clip)
    if isinstance(fn, cm.NotApplicable):
        if "not installed" in fn.reason:
            pytest.skip(fn.reason)
        assert output == "grads" and method in ("opacus-ghost", "backpack-l2"), fn.reason
        return
    want = cm.from_grads(output, grads, clip)
    got = fn()
    assert cm.agrees(got, want), (method, output, cm.max_abs_diff(got, want))
    assert cm.max_abs_diff(got, want) < 1e-4


def test_clipped_mean_by_hand() -> None:
    g = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}  # norms 5 and 0.5
    out = cm.from_grads("clipped_mean", g, 1.0)["clipped_mean"]["w"]
    torch.testing.assert_close(out, torch.tensor([(0.6 + 0.3) / 2, (0.8 + 0.4) / 2]))


def test_check_flags_a_disagreement(tmp_path: Path) -> None:
    grads = {"w": torch.randn(130, 3, 2), "b": torch.randn(130, 2)}
    ref = tmp_path / "ref.safetensors"
    compare.save_reference(ref, {"grads": {"grads": grads}})
    diff, ok = compare.check({"grads": grads}, "grads", ref)
    assert ok and diff == 0.0
    bad = {k: v.clone() for k, v in grads.items()}
    bad["w"][129, 2, 1] += 0.01  # in the last block of samples
    diff, ok = compare.check({"grads": bad}, "grads", ref)
    assert not ok and diff == pytest.approx(0.01, rel=1e-3)


def test_report_marks_disagreement_and_not_applicable(tmp_path: Path) -> None:
    def cell(ms: float, ok: bool = True) -> dict[str, object]:
        return {"times": [ms / 1e3] * 3, "mem": 2**20, "diff": 0.0 if ok else 0.5, "ok": ok}

    doc = {
        "machine": {
            "cpu": "test cpu",
            "cores": 2,
            "torch_threads": 2,
            "device": "cpu",
            "thp": "1",
            "versions": {"torch": "x"},
            "command": "c",
            "date": "d",
            "minutes": 0.1,
        },
        "cases": ["mlp B=4"],
        "methods": ["loop", "vmap", "backpack-l2"],
        "results": {
            "mlp B=4": {
                "loop": {o: cell(100) for o in cm.OUTPUTS},
                "vmap": {"grads": cell(10, ok=False), "norms": cell(20), "clipped_mean": cell(25)},
                "backpack-l2": {
                    "grads": {"na": "BatchL2Grad gives squared norms only"},
                    "norms": cell(5),
                    "clipped_mean": cell(8),
                },
            }
        },
    }
    text = compare_report.markdown(doc)
    assert "| torch.func vmap(grad), tutorial code | 10.0 (0.10) † |" in text
    assert "n/a: BatchL2Grad gives squared norms only" in text
    assert "**NO** †" in text
    pytest.importorskip("matplotlib")
    compare_report.chart(doc, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
