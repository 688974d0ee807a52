"""A DP-SGD training loop through the SDK against Opacus in process, epoch for epoch.

scikit-learn's digits (1437 training images of 8x8), a 64-64-10 ReLU MLP, B=64, clip 1.0, noise
1.1: every step is one request with the current weights, asking for ``clipped_mean``, to a
``psgrad serve`` on loopback (embedded broker, default batching window: the lone client must not
pay it). Opacus runs the same steps in this process (``make_private``, no Poisson sampling).
Epochs interleave; medians per epoch and the ratio. Also the median time a step spent queued
(``timing.queue_ms``) and computing (``compute_ms``) on the server.

    pip install --no-deps opacus && pip install scikit-learn    # never let pip replace torch
    python benchmarks/dp_sgd.py [--epochs 5]

Goal: psgrad within 2.5x of Opacus per epoch. A shared 2-core machine: read the ratio.

Both sides run with one intra-op thread by default (``--torch-threads``): for a model this small
torch's OpenMP threads only spin, and in the server they spin beside the event loop's thread
(a step computed in 1.1 ms with two threads, 0.6 ms with one; with ``OMP_WAIT_POLICY=PASSIVE``
0.7 ms).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batching import free_port, serve, stop, wait_ready

import psgrad

MODEL = "dp-digits"
B, CLIP, NOISE, LR = 64, 1.0, 1.1, 0.5


def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, _, y_train, _ = train_test_split(x / 16.0, y, test_size=0.2, random_state=0)
    return x_train.astype(np.float32), y_train.astype(np.int64)


def opacus_epoch_runner(x: np.ndarray, y: np.ndarray) -> Callable[[], None]:
    from opacus import PrivacyEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    data = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    loader = torch.utils.data.DataLoader(data, batch_size=B, shuffle=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt, loader = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=NOISE,
        max_grad_norm=CLIP, poisson_sampling=False)
    loss_fn = nn.CrossEntropyLoss()

    def epoch() -> None:
        for xb, yb in loader:
            opt.zero_grad()
            loss_fn(model(xb), yb).backward()
            opt.step()

    return epoch


def psgrad_epoch_runner(client: psgrad.Client, x: np.ndarray, y: np.ndarray,
                        queued: list[float], computed: list[float]) -> Callable[[], None]:
    weights = client.models.download_weights(MODEL)
    rng = np.random.default_rng(0)
    step = 0

    def epoch() -> None:
        nonlocal weights, step
        order = rng.permutation(len(x))
        for start in range(0, len(x), B):
            idx = order[start:start + B]
            r = client.per_sample_grads(MODEL, x[idx], y[idx], outputs=["clipped_mean"],
                                        weights=weights, clip_norm=CLIP,
                                        noise_multiplier=NOISE, seed=step)
            weights = {k: w - LR * r.clipped_mean[k] for k, w in weights.items()}
            queued.append(r.timing["queue_ms"])
            computed.append(r.timing["compute_ms"])
            step += 1

    return epoch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="intra-op threads of the server's worker and of Opacus in this "
                        "process alike (0: torch's own choice)")
    args = parser.parse_args()
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    x, y = digits()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = serve(port, workers=1, device="cpu", torch_threads=args.torch_threads)
    try:
        wait_ready(base)
        with psgrad.Client(base) as client:
            client.models.register(MODEL, architecture="mlp",
                                   config={"sizes": [64, 64, 10], "activation": "relu"})
            queued: list[float] = []
            computed: list[float] = []
            runners = {"opacus": opacus_epoch_runner(x, y),
                       "psgrad": psgrad_epoch_runner(client, x, y, queued, computed)}
            for run in runners.values():
                run()  # warm up
            queued.clear()
            computed.clear()
            times: dict[str, list[float]] = {name: [] for name in runners}
            for _ in range(args.epochs):
                for name, run in runners.items():
                    start = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - start)
            client.models.delete(MODEL)
    finally:
        stop(server)
    o, p = statistics.median(times["opacus"]), statistics.median(times["psgrad"])
    steps = -(-len(x) // B)
    print(f"DP-SGD on digits ({len(x)} samples, {steps} steps of B={B} per epoch), "
          f"median of {args.epochs} epochs:")
    print(f"  Opacus in process:           {o * 1e3:8.1f} ms/epoch")
    print(f"  psgrad SDK -> psgrad serve:  {p * 1e3:8.1f} ms/epoch "
          f"({p / steps * 1e3:.2f} ms/step; on the server: queued "
          f"{statistics.median(queued):.2f} ms, computing {statistics.median(computed):.2f} ms "
          "median per step)")
    print(f"  ratio: {p / o:.2f}x (goal: <= 2.5x)")


if __name__ == "__main__":
    main()
