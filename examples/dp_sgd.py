"""DP-SGD with psgrad: the server clips each sample's gradient and the client adds the noise.

Each step sends the current weights with the batch and asks for ``clipped_mean``: every
per-sample gradient clipped to ``clip_norm``, summed, plus N(0, (noise_multiplier * clip_norm)^2)
per element, divided by B (Abadi et al., 2016). The training loop itself is plain numpy: no torch
on this machine. (A real DP run samples batches by Poisson sampling and tracks the privacy
budget with an accountant; both are outside this sketch.)

    python examples/dp_sgd.py [--url http://gpu-host:8000] [--steps 30]
"""

from __future__ import annotations

import argparse

import numpy as np

import psgrad

MODEL = "dp-sgd-demo"


def make_data(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Two classes separated along a random direction in 20 dimensions."""
    labels = rng.integers(0, 2, n)
    direction = rng.normal(size=20)
    x = rng.normal(size=(n, 20)) + np.outer(2.0 * labels - 1.0, direction / 2)
    return x.astype(np.float32), labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="the psgrad server (default: $PSGRAD_URL)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--clip-norm", type=float, default=1.0)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x, y = make_data(rng, 512)
    with psgrad.Client(base_url=args.url) as client:
        client.models.register(MODEL, architecture="mlp",
                               config={"sizes": [20, 16, 2], "activation": "tanh"})
        try:
            weights = client.models.download_weights(MODEL)

            def mean_loss() -> float:
                result = client.per_sample_grads(MODEL, x, y, outputs=["losses"],
                                                 weights=weights)
                return float(result.losses.mean())

            before = mean_loss()
            for step in range(args.steps):
                batch = rng.choice(len(x), args.batch_size, replace=False)
                result = client.per_sample_grads(
                    MODEL, x[batch], y[batch], outputs=["clipped_mean"], weights=weights,
                    clip_norm=args.clip_norm, noise_multiplier=args.noise_multiplier, seed=step)
                weights = {k: w - args.lr * result.clipped_mean[k] for k, w in weights.items()}
            after = mean_loss()
        finally:
            client.models.delete(MODEL)
    print(f"DP-SGD, {args.steps} steps of {args.batch_size} (clip {args.clip_norm}, noise "
          f"{args.noise_multiplier}): mean loss {before:.3f} -> {after:.3f}")
    assert after < before, "training did not reduce the loss"


if __name__ == "__main__":
    main()
