"""Find mislabelled training samples with TracIn-style scores computed by psgrad.

scikit-learn's bundled digits (8x8 images, 10 classes): 10% of the training labels are flipped to
another class, the zoo ``mlp`` is trained on them here for a few epochs, and psgrad scores every
training sample at the trained weights (TracIn with one checkpoint):

- self-influence ``|g_i|^2`` (``self_influence``): a flipped label disagrees with what the rest
  of the data taught the model, so its gradient stays large;
- influence on a clean validation set ``sum_v <g_i, g_v>`` (``influence`` against a reference
  set of the validation samples kept on the server): a flipped label pulls against it.

Each score is computed with exact gradients and with projections (sketches) of k = 256, 1024
and 4096 dimensions, and ranked; precision@n says how many of the n largest suspects are the
flipped labels (n = the number flipped; chance is 10%).

    python examples/find_mislabelled.py [--url http://gpu-host:8000] [--train 1400 --val 397]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import OrderedDict

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

import psgrad

MODEL = "digits-tracin"
SIZES = [64, 128, 10]  # the zoo mlp's config: its parameters are fc1.*, fc2.*


def train(x: np.ndarray, y: np.ndarray, epochs: int) -> dict[str, np.ndarray]:
    """A few epochs of Adam on the noisy labels, in this process (the zoo mlp's layout)."""
    torch.manual_seed(0)
    net = nn.Sequential(OrderedDict(fc1=nn.Linear(SIZES[0], SIZES[1]), act1=nn.ReLU(),
                                    fc2=nn.Linear(SIZES[1], SIZES[2])))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    xt, yt = torch.tensor(x), torch.tensor(y)
    gen = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        for idx in torch.randperm(len(xt), generator=gen).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(net(xt[idx]), yt[idx]).backward()
            opt.step()
    return {k: v.detach().numpy() for k, v in net.state_dict().items()}


def digits_data(n_train: int, n_val: int) -> tuple[np.ndarray, ...]:
    """Training samples with 10% of the labels flipped, clean validation samples, and which
    training samples were flipped (fixed seeds)."""
    digits = load_digits()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(digits.target))
    x = (digits.data[order] / 16.0).astype(np.float32)
    labels = digits.target[order].astype(np.int64)
    x_train, y_clean = x[:n_train], labels[:n_train]
    x_val, y_val = x[n_train : n_train + n_val], labels[n_train : n_train + n_val]
    flipped = rng.choice(n_train, n_train // 10, replace=False)
    y_train = y_clean.copy()
    y_train[flipped] = (y_clean[flipped] + rng.integers(1, 10, len(flipped))) % 10
    return x_train, y_train, x_val, y_val, flipped


def precision(scores: np.ndarray, flipped: np.ndarray, *, largest: bool) -> float:
    n = len(flipped)
    order = np.argsort(-scores if largest else scores, kind="stable")[:n]
    return len(set(order.tolist()) & set(flipped.tolist())) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="the psgrad server (default: $PSGRAD_URL)")
    parser.add_argument("--train", type=int, default=800, help="training samples")
    parser.add_argument("--val", type=int, default=200, help="clean validation samples")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--dims", default="256,1024,4096", help="projection sizes k")
    args = parser.parse_args()

    x_train, y_train, x_val, y_val, flipped = digits_data(args.train, args.val)
    weights = train(x_train, y_train, args.epochs)
    dims = [None, *(int(k) for k in args.dims.split(",") if k)]
    rows = []
    with psgrad.Client(base_url=args.url) as client:
        client.models.register(MODEL, architecture="mlp", config={"sizes": SIZES},
                               weights=weights)
        try:
            for k in dims:
                start = time.perf_counter()
                client.reference_sets.put(f"{MODEL}-val", MODEL, x_val, y_val,
                                          projection_dim=k)
                result = client.per_sample_grads(
                    MODEL, x_train, y_train, outputs=["self_influence", "influence"],
                    reference_set=f"{MODEL}-val")
                seconds = time.perf_counter() - start
                rows.append((
                    "exact" if k is None else f"k={k}",
                    precision(result.self_influence, flipped, largest=True),
                    precision(result.influence.sum(1), flipped, largest=False),
                    seconds,
                ))
        finally:
            with contextlib.suppress(psgrad.NotFound):
                client.reference_sets.delete(f"{MODEL}-val")
            client.models.delete(MODEL)

    n = len(flipped)
    print(f"digits: {args.train} training samples ({n} labels flipped), {args.val} clean "
          f"validation samples, mlp {SIZES} trained {args.epochs} epochs")
    print(f"{'gradients':>10}  {'P@' + str(n) + ' self-influence':>20}  "
          f"{'P@' + str(n) + ' val. influence':>20}  {'seconds':>8}")
    for name, p_self, p_val, seconds in rows:
        print(f"{name:>10}  {p_self:>20.3f}  {p_val:>20.3f}  {seconds:>8.2f}")
    exact = rows[0]
    # chance is 0.1: self-influence finds most flipped labels, validation influence fewer
    assert exact[1] >= 0.6 and exact[2] >= 0.3, "the scores did not single out flipped labels"


if __name__ == "__main__":
    main()
