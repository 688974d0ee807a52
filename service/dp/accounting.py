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

The work is bounded. ``prv``'s grid of privacy-loss values grows as 1 / sigma^2 (one step at
sigma 0.01 took 47 s of CPU), so it takes a noise multiplier of at least :data:`PRV_MIN_NOISE`,
refused before anything is computed; and the searches of ``POST /dp-runs`` (the noise multiplier
for a target, the budget in steps) run in a child process under a CPU-time limit
(:func:`bounded`, ``PSGRAD_DP_ACCOUNTING_CPU_S``), killed past it, so no request holds a core
for longer whatever the run's numbers.
"""

from __future__ import annotations

import importlib.machinery
import math
import multiprocessing
import multiprocessing.forkserver
import os
import resource
import sys
import threading
import types
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import dp_accounting
from dp_accounting import mechanism_calibration
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from psgrad._errors import InvalidInput, PsgradError, error_from_body
from service.lru import LockedLRU

ACCOUNTANTS = ("rdp", "prv")
RDP_ORDERS: tuple[float, ...] = (*range(2, 65), 72, 80, 96, 128, 192, 256)
PLD_INTERVAL = 1e-3  # the PLD's grid of privacy-loss values (pessimistic: errs upwards)
MAX_STEPS = 10**6  # a budget that allows more is reported as this many steps
MAX_NOISE = 1e4
# prv below this noise: one evaluation takes from a second (0.1) to a minute (0.01) of CPU
PRV_MIN_NOISE = 0.3
LIMIT_NAME = "PSGRAD_DP_ACCOUNTING_CPU_S"

R = TypeVar("R")

_CACHE: LockedLRU[tuple[Any, ...], float] = LockedLRU(4096)
_PLANNED: LockedLRU[tuple[Any, ...], tuple[float, int, float]] = LockedLRU(1024)
_FORK_SERVER = threading.Lock()
_NO_MAIN = types.ModuleType("__main__")  # what a child of :func:`bounded` sees of the parent's
_NO_MAIN.__spec__ = importlib.machinery.ModuleSpec("service.dp.__main__", None)


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


def epsilon_within(cpu_s: int, accountant: str, noise_multiplier: float, sample_rate: float,
                   steps: int, delta: float) -> float | None:
    """:func:`epsilon` computed in a child under ``cpu_s`` seconds of CPU (see :func:`bounded`),
    or None where that is not enough or the accountant does not take this noise: for an
    epsilon shown beside the run's own, never needed to count a step."""
    if steps <= 0 or accountant == "rdp":  # rdp: milliseconds at any setting
        return epsilon(accountant, noise_multiplier, sample_rate, steps, delta)
    if accountant == "prv" and noise_multiplier < PRV_MIN_NOISE:
        return None
    key = (accountant, noise_multiplier, sample_rate, steps, delta)
    try:
        return _CACHE.get_or_make(key, lambda: bounded(
            cpu_s, epsilon, accountant, noise_multiplier, sample_rate, steps, delta))
    except InvalidInput:
        return None


def max_steps(accountant: str, noise_multiplier: float, sample_rate: float, delta: float,
              max_epsilon: float) -> int:
    """The most steps whose epsilon stays within ``max_epsilon`` (at most :data:`MAX_STEPS`)."""

    def eps(n: int) -> float:
        return epsilon(accountant, noise_multiplier, sample_rate, n, delta)

    if eps(1) > max_epsilon:
        return 0
    lo, hi = 1, 2
    # epsilon grows with the steps: find a bracket, then bisect. Upwards from 1, so that no
    # step count far past the budget is evaluated (prv's cost grows with the epsilon)
    while eps(hi) <= max_epsilon:
        if hi == MAX_STEPS:
            return MAX_STEPS
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
    low = PRV_MIN_NOISE if accountant == "prv" else 0.0
    if low and epsilon(accountant, low, sample_rate, steps, delta) <= target_epsilon:
        raise InvalidInput(
            f"epsilon {target_epsilon:g} in {steps} step(s) needs a noise multiplier below "
            f"{PRV_MIN_NOISE:g}, the smallest the prv accountant takes (its work grows as "
            "1 / sigma^2): use accountant 'rdp', a smaller target_epsilon or more steps")
    try:
        sigma = float(mechanism_calibration.calibrate_dp_mechanism(
            _accountant(accountant), lambda s: _event(s, sample_rate, steps),
            target_epsilon, delta,
            bracket_interval=mechanism_calibration.LowerEndpointAndGuess(low, max(1.0, 2 * low)),
            tol=1e-4))
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


def plan(accountant: str, noise_multiplier: float | None, target_epsilon: float | None,
         sample_rate: float, steps: int | None, delta: float,
         max_epsilon: float) -> tuple[float, int, float]:
    """A new run's numbers: (the noise multiplier, given or solved for ``target_epsilon`` in
    ``steps``; the most steps within ``max_epsilon``; the epsilon of its first step). Run it
    through :func:`bounded`."""
    sigma = noise_multiplier
    if sigma is None:
        assert target_epsilon is not None and steps
        sigma = noise_for(accountant, target_epsilon, sample_rate, steps, delta)
    n = max_steps(accountant, sigma, sample_rate, delta, max_epsilon)
    return sigma, n, epsilon(accountant, sigma, sample_rate, 1, delta)


def planned(cpu_s: int, *args: Any) -> tuple[float, int, float]:
    """:func:`plan` of these numbers under :func:`bounded`, kept: a second run of the same
    numbers (a training job restarted, a sweep's repeats) costs no child and no search."""
    return _PLANNED.get_or_make(args, lambda: bounded(cpu_s, plan, *args))


def check_noise(accountant: str, noise_multiplier: float) -> None:
    """Refuse, before any work, a noise multiplier the accountant cannot evaluate cheaply."""
    if accountant == "prv" and noise_multiplier < PRV_MIN_NOISE:
        raise InvalidInput(
            f"the prv accountant takes a noise_multiplier of at least {PRV_MIN_NOISE:g} (got "
            f"{noise_multiplier:g}; its work grows as 1 / sigma^2, minutes of CPU at 0.01): use "
            "accountant 'rdp', which is fast at any noise", accountant=accountant,
            min_noise_multiplier=PRV_MIN_NOISE)


def bounded(cpu_s: int, fn: Callable[..., R], *args: Any) -> R:
    """``fn(*args)`` in a child process that may use ``cpu_s`` seconds of CPU, then is killed.

    The accountant's calls cannot be interrupted in a thread, and their cost depends on the
    run's numbers; a child forked from a fork server (started once per process with this module
    loaded, so a call costs milliseconds, not an interpreter's start) bounds it. ``fn`` must be
    a module-level function; what it raises comes back (a :class:`PsgradError`, or a
    ``ValueError`` for what dp-accounting refuses).

    Raises:
        InvalidInput: the child used its CPU time (422, naming the setting).
    """
    ctx = _fork_server()
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, cpu_s, fn, args), daemon=True)
    with _FORK_SERVER:
        # multiprocessing has each child run the parent's main script again (psgrad's console
        # script: 1.3-1.7 s a run, every POST /dp-runs); a main named *.__main__ is left out
        main = sys.modules["__main__"]
        sys.modules["__main__"] = _NO_MAIN
        try:
            child.start()
        finally:
            sys.modules["__main__"] = main
    send.close()
    try:
        # the wall clock is a backstop only (a loaded host): the child's own limit is CPU time
        if receive.poll(4 * cpu_s + 10):
            kind, value = receive.recv()
        else:
            kind, value = "limit", None
    except EOFError:  # the kernel stopped it at its CPU limit
        kind, value = "limit", None
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receive.close()
    if kind == "ok":
        return value
    if kind == "error":
        raise error_from_body(value, int(value.get("status", 422)))
    if kind == "value":
        raise ValueError(value)
    raise InvalidInput(
        f"the privacy accounting of this run needs more than {cpu_s} s of CPU ({LIMIT_NAME}) "
        "and was stopped: use accountant 'rdp' (fast at any setting), a larger noise "
        "multiplier or a smaller max_epsilon, or ask the operator to raise the limit",
        limit=cpu_s, setting=LIMIT_NAME)


def _fork_server() -> Any:
    """The fork server's context, the server running (started with this module loaded).

    The server is ``python -c ...``, which puts the working directory first on ``sys.path``
    (and Python 3.11's fork server ignores the parent's path), so a ``service.py`` there would
    be imported in place of this package. It starts with ``PYTHONSAFEPATH`` (Python's ``-P``),
    set only while it starts: the children fork from it, with what it imported.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # effective when the server starts
    with _FORK_SERVER:
        before = os.environ.get("PYTHONSAFEPATH")
        os.environ["PYTHONSAFEPATH"] = "1"
        try:
            multiprocessing.forkserver.ensure_running()  # (re)starts it if it is not running
        finally:
            if before is None:
                del os.environ["PYTHONSAFEPATH"]
            else:
                os.environ["PYTHONSAFEPATH"] = before
    return ctx


def _child(send: Connection, cpu_s: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    # SIGXCPU (which ends the process) at the soft limit, SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    try:
        send.send(("ok", fn(*args)))
    except PsgradError as exc:
        send.send(("error", {**exc.to_dict(), "status": exc.status}))
    except (ArithmeticError, ValueError) as exc:
        send.send(("value", str(exc)))
    finally:
        send.close()
