"""What psgrad's training-loop monitor costs the training loop.

    python benchmarks/callback.py [--steps 200] [--rounds 3] [--batch 32] [--every 1,10,100]
                                  [--senders process,thread] [--outputs norms,gns] [--no-weights]

The zoo's ``tiny-transformer`` (2 layers, d_model 64, 32 tokens, 4 classes) trains with plain
SGD in this process, one torch thread, pinned to the first core; ``psgrad serve`` (embedded
mode, one worker, one torch thread) runs in its own process on the second core, as a server
on another host would. Each round runs, for each row, ``--steps`` steps without a monitor,
then as many with a :class:`psgrad.integrations.Monitor` sampling every N steps (each batch
sent with the step's weights unless ``--no-weights``), one second idle before each loop. The
rows are the ways of sending: ``process``, the monitor's default, a child process at the
lowest CPU priority; ``thread`` (``process=False``), the monitor's thread in the training
process; ``none``, a second loop without a monitor, how far two plain loops differ (the
table's noise: this machine's speed drifts by a third over minutes). A row's ratio is the
median over rounds of its loop time over the plain loop's just before it; a first loop, not
counted, warms the process. ``answered`` is the share of the sampled steps the server answered
before the monitor closed (the rest were dropped: the queue holds two batches). Timing stops
at the last step; closing the monitor is not counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODEL = "tiny-transformer"
PAUSE = 1.0  # seconds idle before each loop, monitored or not: a loop after a pause runs slower


def serve(port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PSGRAD_TORCH_THREADS": "1", "PSGRAD_BATCH_MAX_DELAY_MS": "0"}
    command = [sys.executable, "-m", "service.cli", "serve", "--port", str(port),
               "--log-level", "warning"]
    if (os.cpu_count() or 1) > 1:
        command = ["taskset", "-c", "1", *command]
    return subprocess.Popen(command, cwd=ROOT, env=env)


def wait_ready(url: str, seconds: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"psgrad serve did not become ready at {url}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--every", default="1,10,100")
    parser.add_argument("--senders", default="process,thread")
    parser.add_argument("--outputs", default="norms,gns")
    parser.add_argument("--no-weights", dest="weights", action="store_false")
    parser.add_argument("--port", type=int, default=8771)
    args = parser.parse_args()
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {0})

    import torch

    import psgrad
    from models import get_family
    from psgrad.integrations import Monitor

    torch.set_num_threads(1)
    family = get_family(MODEL)
    config = family.config()
    url = f"http://127.0.0.1:{args.port}"
    server = serve(args.port)
    try:
        wait_ready(url)
        gen = torch.Generator().manual_seed(0)
        data = [(torch.randint(0, config["vocab"], (args.batch, config["seq_len"]), generator=gen),
                 torch.randint(0, config["classes"], (args.batch,), generator=gen))
                for _ in range(16)]
        rows = [("none", 0)] + [(sender, int(e)) for sender in args.senders.split(",")
                                for e in args.every.split(",")]
        ratios: dict[tuple[str, int], list[float]] = {row: [] for row in rows}
        answered: dict[tuple[str, int], list[float]] = {row: [] for row in rows}
        plain: list[float] = []
        with psgrad.Client(url, timeout=60.0) as client:
            client.per_sample_grads(MODEL, data[0][0], data[0][1], outputs=["norms"])  # warm
            run(family, config, data, args.steps, None)  # a process's first loop is slower
            for _ in range(args.rounds):
                for sender, every in rows:
                    time.sleep(PAUSE)
                    base, _ = run(family, config, data, args.steps, None)
                    plain.append(base / args.steps)
                    monitor: Any = None if sender == "none" else Monitor(
                        client, MODEL, outputs=args.outputs.split(","), every=every,
                        process=sender == "process")
                    time.sleep(PAUSE)  # and the child's imports, before the clock starts
                    took, sampled = run(family, config, data, args.steps, monitor,
                                        weights=args.weights)
                    counts = monitor.close(timeout=120) if monitor else {"answered": 0}
                    ratios[sender, every].append(took / base)
                    answered[sender, every].append(counts["answered"] / max(1, sampled))
    finally:
        server.terminate()
        server.wait(30)
    print(f"torch {torch.__version__}, {MODEL} B={args.batch} T={config['seq_len']}, "
          f"{args.steps} steps x {args.rounds} rounds, outputs {args.outputs}, weights "
          f"{'sent' if args.weights else 'not sent'}; plain step "
          f"{statistics.median(plain) * 1e3:.1f} ms")
    print("| sent from | sampled every | step time x no monitor | answered |")
    print("|---|---:|---:|---:|")
    for sender, every in rows:
        sent = (f"{statistics.median(answered[sender, every]):.0%}" if sender != "none"
                else "")
        print(f"| {sender} | {every or ''} | {statistics.median(ratios[sender, every]):.3f} | "
              f"{sent} |")


def run(family: Any, config: dict[str, Any], data: list[Any], steps: int, monitor: Any, *,
        weights: bool = True) -> tuple[float, int]:
    """Seconds for ``steps`` training steps from a fresh model, and how many were sampled."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    module = family.build(config).train()
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    sampled = 0
    started = time.perf_counter()
    for step in range(steps):
        x, y = data[step % len(data)]
        opt.zero_grad()
        F.cross_entropy(module(x), y).backward()
        opt.step()
        if monitor is not None:
            fields = {"weights": dict(module.named_parameters())} if weights else {}
            sampled += step % monitor.every == 0
            monitor.observe(step, x, y, **fields)
    return time.perf_counter() - started, sampled


if __name__ == "__main__":
    main()
