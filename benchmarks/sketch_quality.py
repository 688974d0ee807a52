"""Sketch accuracy: the worst pairwise inner-product error of each projection kind over the zoo's
per-sample gradients, beside a dense Gaussian projection's of the same k.

    python benchmarks/sketch_quality.py [--models mlp,simple-cnn,tiny-transformer]
                                        [--k 1024,2048] [--seeds 4] [--samples 24]

For each model (default configuration, a batch of ``--samples``, gradients by the per-sample
loop) and k: ``max |<Pa, Pb> - <a, b>| / (|a| |b|)`` over every pair of samples (each with itself
too), for the service's sketches on the fast path (``tensorsketch``, the default, and
``kronecker``) and for a dense Gaussian projection (drawn over the span of the gradients, which
has the same distribution: ``tests/support/sketches.py``). Prints the median and worst over the
seeds and each kind's worst over the dense median; the goal is at most 2
(``tests/unit/test_sketch_quality.py`` holds the default kind to it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from service.strategies.projection import KINDS, Projection

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support: from the root
from tests.support.sketches import dense_worst, service_sketches, worst_pair, zoo_gradients


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,simple-cnn,tiny-transformer")
    parser.add_argument("--k", default="1024,2048")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--samples", type=int, default=24)
    args = parser.parse_args()
    print(f"worst pair error over {args.samples} samples, {args.seeds} seeds "
          "(median / worst); x dense = worst over the dense median\n")
    print("| model | k | dense | " + " | ".join(f"{k} | x dense" for k in KINDS) + " |")
    print("|---|---|---|" + "---|---|" * len(KINDS))
    for arch in args.models.split(","):
        model, batch, flat = zoo_gradients(arch, args.samples)
        gram = flat @ flat.t()
        for k in map(int, args.k.split(",")):
            dense = statistics.median(dense_worst(gram, k, s) for s in range(2 * args.seeds))
            cells = [f"{dense:.3f}"]
            for kind in KINDS:
                errs = [worst_pair(service_sketches(model, batch, Projection(k, s, kind)), gram)
                        for s in range(args.seeds)]
                cells += [f"{statistics.median(errs):.3f} / {max(errs):.3f}",
                          f"{max(errs) / dense:.2f}"]
            print(f"| {arch} | {k} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
