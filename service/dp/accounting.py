"""Privacy accounting of DP-SGD steps with Google's ``dp-accounting`` (no home-made analysis).

One DP-SGD step is a Poisson-subsampled Gaussian mechanism: each record joins the batch with
probability ``sample_rate`` and the clipped sum gets N(0, (noise_multiplier * clip_norm)^2) noise;
``steps`` steps are its self-composition. Two accountants:

- ``rdp``: Renyi DP (Mironov et al. 2019) at the integer orders :data:`RDP_ORDERS`, converted to
  (epsilon, delta) with the improved bound of Balle et al. 2020 (``RdpAccountant``). At integer
  orders the sampled Gaussian's RDP is an exact finite sum, so this equals Opacus's
  ``RDPAccountant`` given the same orders. Fractional orders are left out on purpose: the two
  libraries evaluate them by different series that disagree (by a third at order 1.1).
- ``prv``: the privacy-loss random variable's distribution, composed numerically
  (``PLDAccountant``, pessimistic discretisation, so an upper bound): a tight epsilon, the
  quantity Opacus's ``PRVAccountant`` bounds by another discretisation.

Results are cached: a run asks for the same few values on every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import dp_accounting
from dp_accounting import mechanism_calibration
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from psgrad._errors import InvalidInput
from service.lru import LockedLRU

ACCOUNTANTS = ("rdp", "prv")
RDP_ORDERS: tuple[float, ...] = (*range(2, 65), 72, 80, 96, 128, 192, 256)
PLD_INTERVAL = 1e-3  # the PLD's grid of privacy-loss values (pessimistic: errs upwards)
MAX_STEPS = 10**6  # a budget that allows more is reported as this many steps
MAX_NOISE = 1e4

_CACHE: LockedLRU[tuple[Any, ...], float] = LockedLRU(4096)


def _accountant(name: str) -> Callable[[], dp_accounting.PrivacyAccountant]:
    if name == "rdp":
        return lambda: rdp_privacy_accountant.RdpAccountant(orders=list(RDP_ORDERS))
    if name == "prv":
        return lambda: pld_privacy_accountant.PLDAccountant(
            value_discretization_interval=PLD_INTERVAL)
    raise InvalidInput(f"unknown accountant '{name}'; known: {', '.join(ACCOUNTANTS)}",
                       known=list(ACCOUNTANTS))


def _event(noise_multiplier: float, sample_rate: float, steps: int) -> dp_accounting.DpEvent:
    step = dp_accounting.PoissonSampledDpEvent(
        sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
    return dp_accounting.SelfComposedDpEvent(step, steps)


def epsilon(accountant: str, noise_multiplier: float, sample_rate: float, steps: int,
            delta: float) -> float:
    """Epsilon spent by ``steps`` steps at ``delta`` (0 before the first step)."""
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    key = (accountant, noise_multiplier, sample_rate, steps, delta)

    def make() -> float:
        acc = _accountant(accountant)()
        acc.compose(_event(noise_multiplier, sample_rate, steps))
        return float(acc.get_epsilon(delta))

    return _CACHE.get_or_make(key, make)


def max_steps(accountant: str, noise_multiplier: float, sample_rate: float, delta: float,
              max_epsilon: float) -> int:
    """The most steps whose epsilon stays within ``max_epsilon`` (at most :data:`MAX_STEPS`)."""

    def eps(n: int) -> float:
        return epsilon(accountant, noise_multiplier, sample_rate, n, delta)

    if eps(1) > max_epsilon:
        return 0
    if eps(MAX_STEPS) <= max_epsilon:
        return MAX_STEPS
    lo, hi = 1, 2
    while eps(hi) <= max_epsilon:  # epsilon grows with the steps: find a bracket, then bisect
        lo, hi = hi, min(2 * hi, MAX_STEPS)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if eps(mid) <= max_epsilon else (lo, mid)
    return lo


def noise_for(accountant: str, target_epsilon: float, sample_rate: float, steps: int,
              delta: float) -> float:
    """The smallest noise multiplier (to 1e-4) whose ``steps`` steps spend ``target_epsilon``.

    ``dp_accounting.mechanism_calibration`` (Brent's method over the noise multiplier); the
    answer is checked and nudged up so that it never exceeds the target.
    """
    try:
        sigma = float(mechanism_calibration.calibrate_dp_mechanism(
            _accountant(accountant), lambda s: _event(s, sample_rate, steps),
            target_epsilon, delta,
            bracket_interval=mechanism_calibration.LowerEndpointAndGuess(0.0, 1.0), tol=1e-4))
    except mechanism_calibration.NoBracketIntervalFoundError:
        sigma = math.inf
    while sigma <= MAX_NOISE and epsilon(accountant, sigma, sample_rate, steps,
                                         delta) > target_epsilon:
        sigma += 1e-4
    if not sigma <= MAX_NOISE:
        raise InvalidInput(f"no noise multiplier up to {MAX_NOISE:g} reaches epsilon "
                           f"{target_epsilon:g} in {steps} steps: raise the target or take "
                           "fewer steps")
    return sigma
