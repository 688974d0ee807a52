"""Fast statistics against the vmap path, Opacus ghost clipping and a plain forward+backward.

    python benchmarks/fast_stats.py [--rounds 5] [--models mlp,simple-cnn,tiny-transformer]

For each model (``mlp`` 784-512-512-10 at B=1024, ``simple-cnn`` at B=256, ``tiny-transformer``
at B=64) and output (``norms``, ``clipped_mean``): the median time over interleaved rounds in
this process (every method once per round; ratios are the median of per-round ratios, so
each compares runs made moments apart on our shared machine), and the peak
memory of one steady-state call measured in a fresh subprocess per method (the resident-set
high-water mark after ``/proc/self/clear_refs``, minus the resident set just before the call,
with glibc's mmap threshold fixed so freed blocks leave the resident set). Every method runs with
``THP_MEM_ALLOC_ENABLE=1``. Prints a Markdown table and whether the issue's goals are met.

Opacus (ghost clipping, ``GradSampleModuleFastGradientClipping``) runs if installed (``pip
install --no-deps opacus opt_einsum``: without ``--no-deps`` pip replaces torch).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # before torch allocates anything

import torch
import torch.nn.functional as F
from torch.func import functional_call

from service import engine
from service.engine import Batch, Options
from service.registry import LoadedModel, load_model

CASES = {"mlp": 1024, "simple-cnn": 256, "tiny-transformer": 64}
OUTPUTS = ("norms", "clipped_mean")
METHODS = ("floor", "fast", "vmap", "opacus")
CLIP = 1.0


def setup(arch: str) -> tuple[LoadedModel, Batch]:
    model = load_model(arch, arch, None, device=torch.device("cpu"))
    batch_size = CASES[arch]
    gen = torch.Generator().manual_seed(0)
    spec = model.input
    if spec.dtype == "int64":
        x = torch.randint(0, spec.high or 2, (batch_size, *spec.shape), generator=gen)
    else:
        x = torch.randn((batch_size, *spec.shape), generator=gen)
    y = torch.randint(0, model.output_shape[-1], (batch_size,), generator=gen)
    return model, Batch(inputs=x, targets=y)


def _loss(model: LoadedModel, out: torch.Tensor, y: torch.Tensor, reduction: str) -> Any:
    fn = F.nll_loss if model.default_loss == "nll" else F.cross_entropy
    return fn(out, y, reduction=reduction)


def method(model: LoadedModel, batch: Batch, name: str, output: str) -> Callable[[], Any] | None:
    """A callable that computes ``output`` for the batch by ``name`` (None: does not apply)."""
    opts = Options(
        loss=model.default_loss, outputs=(output,), params=tuple(model.params), clip_norm=CLIP
    )
    if name in ("fast", "vmap"):
        fast = name == "fast"
        return lambda: engine.compute(model, batch, opts, fast_stats=fast)
    assert batch.targets is not None
    x, y = batch.inputs, batch.targets
    if name == "floor":

        def floor() -> Any:
            params = {k: v.detach().requires_grad_() for k, v in model.params.items()}
            out = functional_call(model.module, (params, model.buffers), (x,))
            return torch.autograd.grad(_loss(model, out, y, "mean"), list(params.values()))

        return floor
    return _opacus(model, x, y, output)


def _opacus(
    model: LoadedModel, x: torch.Tensor, y: torch.Tensor, output: str
) -> Callable[[], Any] | None:
    try:
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
    except ImportError:
        return None
    module = copy.deepcopy(model.module).train().requires_grad_(True)
    try:
        gsm = GradSampleModuleFastGradientClipping(
            module, max_grad_norm=CLIP, use_ghost_clipping=True, loss_reduction="mean"
        )
    except Exception:  # an unsupported layer: Opacus does not apply
        return None
    params = [p for p in gsm.parameters() if p.requires_grad]

    def run() -> Any:
        for p in params:
            p.grad = None
        per = _loss(model, gsm(x), y, "none")
        per.mean().backward(retain_graph=output == "clipped_mean")
        norms = gsm.get_norm_sample()
        if output == "norms":
            return norms
        coef = gsm.get_clipping_coef()
        for p in params:
            p.grad = None
        gsm.disable_hooks()
        (coef * per).sum().backward()
        gsm.enable_hooks()
        return [p.grad / x.shape[0] for p in params]  # type: ignore[operator]

    try:
        run()
    except Exception:  # fails on this model: reported as n/a
        return None
    return run


def time_all(arch: str, rounds: int) -> dict[tuple[str, str], list[float]]:
    """Seconds per (output, method) and round, methods interleaved within each round."""
    model, batch = setup(arch)
    fns = {
        (o, m): fn
        for o in OUTPUTS
        for m in METHODS
        if (fn := method(model, batch, m, o)) is not None
    }
    return interleave(fns, rounds)


def interleave(fns: dict[Any, Callable[[], Any]], rounds: int,
               clock: Callable[[], float] = time.perf_counter) -> dict[Any, list[float]]:
    """Seconds per key and round: every callable warmed once, then once per round (wall time,
    or ``clock``: ``time.process_time`` for the CPU time of one thread's work)."""
    for fn in fns.values():
        fn()  # warm: plans, transformed functions, allocator
    times: dict[Any, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            gc.collect()
            start = clock()
            fn()
            times[key].append(clock() - start)
    return times


def ratio(
    times: dict[tuple[str, str], list[float]], key: tuple[str, str], base: tuple[str, str]
) -> float:
    """The median over rounds of the time ratio within a round: robust to a machine whose load
    changes between rounds (ours is shared), since both were measured moments apart."""
    return statistics.median(a / b for a, b in zip(times[key], times[base], strict=True))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_child(arch: str, output: str, name: str) -> None:
    """In a fresh process: the extra resident memory at the peak of one warm call."""
    model, batch = setup(arch)
    fn = method(model, batch, name, output)
    print(json.dumps(None if fn is None else steady_peak(fn)))


def steady_peak(fn: Callable[[], Any]) -> int:
    """The extra resident memory at the peak of one call after a warm one."""
    fn()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the resident-set high-water mark
    base = _status("VmRSS")
    fn()
    return _status("VmHWM") - base


def peak(arch: str, output: str, name: str) -> int | None:
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(
        [sys.executable, __file__, "--child", arch, output, name],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    value: int | None = json.loads(done.stdout.strip().splitlines()[-1])
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        peak_child(*args.child)
        return
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE')}, "
        f"medians of {args.rounds} interleaved rounds; x floor = median per-round ratio\n"
    )
    print("| model | B | output | method | time ms | x floor | peak MiB | x floor |")
    print("|---|---|---|---|---|---|---|---|")
    goals = []
    for arch in args.models.split(","):
        times = time_all(arch, args.rounds)
        for output in OUTPUTS:
            mem = {m: peak(arch, output, m) for m in METHODS if (output, m) in times}
            floor, floor_m = (output, "floor"), mem["floor"] or 1
            for m in METHODS:
                if (output, m) not in times:
                    print(f"| {arch} | {CASES[arch]} | {output} | {m} | n/a | | | |")
                    continue
                t, p = statistics.median(times[(output, m)]), mem[m] or 0
                print(
                    f"| {arch} | {CASES[arch]} | {output} | {m} | {t * 1e3:.1f} | "
                    f"{ratio(times, (output, m), floor):.2f} | {p / 2**20:.1f} | "
                    f"{p / floor_m:.2f} |"
                )
            fast_t, fast_m = ratio(times, (output, "fast"), floor), mem["fast"] or 0
            goals.append(
                (f"{arch} {output}: fast within 1.5x of the floor in time", fast_t, fast_t <= 1.5)
            )
            goals.append(
                (
                    f"{arch} {output}: fast within 2x of the floor in peak memory",
                    fast_m / floor_m,
                    fast_m <= 2 * floor_m,
                )
            )
            speedup = 1 / ratio(times, (output, "fast"), (output, "vmap"))
            if arch in ("mlp", "simple-cnn"):
                need = 10 if arch == "mlp" else 2
                goals.append(
                    (
                        f"{arch} {output}: fast at least {need}x faster than vmap",
                        speedup,
                        speedup >= need,
                    )
                )
    print("\n| goal | ratio | met |\n|---|---|---|")
    for text, value, met in goals:
        print(f"| {text} | {value:.2f} | {'yes' if met else 'NO'} |")


if __name__ == "__main__":
    main()
