"""Find mislabelled samples by their per-sample gradient norm.

A sample whose label is wrong disagrees with what the rest of the data taught the model, so its
loss, and the norm of its gradient, stays large. Train briefly (the server computes the batch
gradient, ``outputs=["mean"]``, with the current weights), then ask for ``norms`` of every sample
and look at the largest: most of them are the labels we flipped on purpose.

    python examples/find_mislabelled.py [--url http://gpu-host:8000]
"""

from __future__ import annotations

import argparse

import numpy as np

import psgrad

MODEL = "mislabel-demo"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="the psgrad server (default: $PSGRAD_URL)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--flipped", type=int, default=15)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    centers = rng.normal(0.0, 3.0, size=(3, 10))
    labels = rng.integers(0, 3, 300)
    x = (centers[labels] + rng.normal(size=(300, 10))).astype(np.float32)
    flipped = rng.choice(300, args.flipped, replace=False)
    noisy = labels.copy()
    noisy[flipped] = (labels[flipped] + rng.integers(1, 3, args.flipped)) % 3

    with psgrad.Client(base_url=args.url) as client:
        client.models.register(MODEL, architecture="mlp",
                               config={"sizes": [10, 16, 3], "activation": "tanh"})
        try:
            weights = client.models.download_weights(MODEL)
            for _ in range(args.steps):
                step = client.per_sample_grads(MODEL, x, noisy, outputs=["mean"],
                                               weights=weights)
                weights = {k: w - 0.5 * step.mean[k] for k, w in weights.items()}
            result = client.per_sample_grads(MODEL, x, noisy, outputs=["norms", "losses"],
                                             weights=weights)
        finally:
            client.models.delete(MODEL)

    suspects = np.argsort(result.norms)[::-1][: args.flipped]
    found = len(set(suspects.tolist()) & set(flipped.tolist()))
    print(f"the {args.flipped} largest gradient norms hold {found} of the {args.flipped} "
          f"flipped labels (median norm {np.median(result.norms):.3f}, "
          f"largest {result.norms[suspects[0]]:.3f})")
    assert found >= 0.8 * args.flipped, "gradient norms did not single out the flipped labels"


if __name__ == "__main__":
    main()
