"""The DP accounting equals Opacus's accountants, and the noise is unseeded and Gaussian."""

from __future__ import annotations

import math

import numpy as np
import pytest

# Opacus names torch as a dependency: .ci/run installs it with --no-deps (pip would replace torch)
opacus = pytest.importorskip("opacus")
from opacus.accountants import PRVAccountant, RDPAccountant  # noqa: E402
from opacus.accountants.utils import get_noise_multiplier  # noqa: E402

from service.dp import accounting  # noqa: E402
from service.dp.noise import secure_normal  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the:UserWarning")

CASES = [  # (noise multiplier, sampling rate, steps, delta)
    (1.1, 0.01, 400, 1e-5),
    (1.0, 64 / 1437, 225, 1e-5),
    (0.8, 0.05, 1000, 1e-6),
    (2.0, 0.5, 10, 1e-5),
    (1.3, 64 / 1437, 1, 1e-5),
]


@pytest.mark.parametrize(("sigma", "q", "steps", "delta"), CASES)
def test_rdp_equals_opacus(sigma: float, q: float, steps: int, delta: float) -> None:
    theirs = RDPAccountant()
    theirs.history = [(sigma, q, steps)]
    want = theirs.get_epsilon(delta, alphas=list(accounting.RDP_ORDERS))
    assert accounting.epsilon("rdp", sigma, q, steps, delta) == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize(("sigma", "q", "steps", "delta"), CASES[:3])
def test_prv_within_opacus_prv_bounds(sigma: float, q: float, steps: int, delta: float) -> None:
    """Opacus's PRV answers its upper bound (estimate + eps_error); ours lies in its bracket."""
    theirs = PRVAccountant()
    theirs.history = [(sigma, q, steps)]
    eps_error, delta_error = 0.01, delta / 1000
    dprv = theirs._get_dprv(eps_error=eps_error, delta_error=delta_error)
    low, _, high = dprv.compute_epsilon(delta, delta_error, eps_error)
    ours = accounting.epsilon("prv", sigma, q, steps, delta)
    assert low - 1e-3 <= ours <= high
    assert ours == pytest.approx(theirs.get_epsilon(delta), abs=0.02)


def test_noise_for_target_matches_opacus_rdp() -> None:
    q, steps, delta = 64 / 1437, 224, 1e-5
    for target in (1.0, 3.0, 8.0):
        ours = accounting.noise_for("rdp", target, q, steps, delta)
        theirs = get_noise_multiplier(target_epsilon=target, target_delta=delta, sample_rate=q,
                                      steps=steps, alphas=list(accounting.RDP_ORDERS))
        # Opacus bisects until epsilon is within 0.01 of the target; ours solves to 1e-4
        assert ours == pytest.approx(theirs, rel=0.01)
        assert ours <= theirs * (1 + 1e-4)
        assert accounting.epsilon("rdp", ours, q, steps, delta) <= target


def test_noise_for_target_matches_opacus_prv() -> None:
    q, steps, delta = 64 / 1437, 224, 1e-5
    ours = accounting.noise_for("prv", 3.0, q, steps, delta)
    theirs = get_noise_multiplier(target_epsilon=3.0, target_delta=delta, sample_rate=q,
                                  steps=steps, accountant="prv")
    assert ours == pytest.approx(theirs, rel=0.02)
    assert accounting.epsilon("prv", ours, q, steps, delta) <= 3.0


@pytest.mark.parametrize("name", accounting.ACCOUNTANTS)
def test_max_steps_is_the_last_step_within_budget(name: str) -> None:
    sigma, q, delta, budget = 1.0, 64 / 1437, 1e-5, 2.0
    n = accounting.max_steps(name, sigma, q, delta, budget)
    assert n > 0
    assert accounting.epsilon(name, sigma, q, n, delta) <= budget
    assert accounting.epsilon(name, sigma, q, n + 1, delta) > budget
    assert accounting.max_steps(name, sigma, q, delta, 1e-3) == 0


def test_epsilon_before_any_step_is_zero() -> None:
    assert accounting.epsilon("rdp", 1.0, 0.1, 0, 1e-5) == 0.0
    assert math.isinf(accounting.epsilon("rdp", 0.0, 0.1, 5, 1e-5))


def test_secure_normal_is_gaussian_and_never_repeats() -> None:
    a = secure_normal((200_001,), 2.5).numpy()
    assert a.dtype == np.float64 and a.shape == (200_001,)
    assert abs(a.mean()) < 0.03 and a.std() == pytest.approx(2.5, rel=0.01)
    assert abs(((a / 2.5) ** 4).mean() - 3.0) < 0.1  # Gaussian kurtosis
    b = secure_normal((3, 4), 1.0)
    assert b.shape == (3, 4) and not np.array_equal(b.numpy(), secure_normal((3, 4), 1.0))
