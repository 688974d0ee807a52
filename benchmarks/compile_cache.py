"""Does ``PSGRAD_COMPILE=1`` pay on this CPU? simple-cnn and mlp, full per-sample ``grads``.

For each model, two fresh child processes, each with an empty inductor disk cache of its own:

- cold: the first compiled call (tracing + inductor + C++ build), then eager and compiled steps
  interleaved (medians), the artifacts stored in Redis as a worker stores them;
- warm start: a second "worker" that loads those artifacts from Redis before its first call.

    python benchmarks/compile_cache.py [--batch 16] [--repeats 15]

Needs Redis at PSGRAD_REDIS_URL (default redis://127.0.0.1:6379/0); its keys go under a fresh
prefix and are deleted at the end. Shared 2-core machine: read the ratios, not the times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

URL = os.environ.get("PSGRAD_REDIS_URL", "redis://127.0.0.1:6379/0")
MODELS = ("simple-cnn", "mlp")


def child(model_name: str, batch: int, repeats: int, prefix: str) -> dict[str, Any]:
    import numpy as np
    import redis
    import torch

    from service import engine
    from service.compile_cache import CompiledFunctions
    from service.config import Settings
    from service.registry import ModelRegistry
    from service.validate import parse_request

    registry = ModelRegistry(torch.device("cpu"))
    model = registry.get(model_name)
    rng = np.random.default_rng(0)
    fields = {"model": model_name, "outputs": ["grads"],
              "inputs": rng.standard_normal((batch, *model.input.shape)).astype(np.float32),
              "targets": rng.integers(0, 10, batch)}
    parsed = parse_request(fields, registry)
    client = redis.Redis.from_url(URL)
    cache = CompiledFunctions(Settings(redis_url=URL, redis_prefix=prefix,
                                       compile_secret="bench"), client, writer=True)

    def run(compiled: CompiledFunctions | None) -> float:
        start = time.perf_counter()
        engine.compute(parsed.model, parsed.batch, parsed.opts, compiled=compiled)
        return time.perf_counter() - start

    first = run(cache)
    eager, comp = [], []
    for _ in range(repeats):  # interleaved: both see the same machine load
        eager.append(run(None))
        comp.append(run(cache))
    client.close()
    from torch._dynamo.utils import counters

    hits = {"fx_graph_hits": counters["inductor"]["fxgraph_cache_hit"],
            "aot_hits": counters["aot_autograd"]["autograd_cache_hit"]}
    return {**hits, "first_s": first, "eager_s": statistics.median(eager),
            "compiled_s": statistics.median(comp), "loaded": cache.stats.loaded,
            "stored": cache.stats.stored}


def spawn(model_name: str, batch: int, repeats: int, prefix: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as cache_dir:  # no inductor disk cache from earlier runs
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir,
               "TRITON_CACHE_DIR": os.path.join(cache_dir, "triton")}
        out = subprocess.run(
            [sys.executable, __file__, "--child", model_name, "--batch", str(batch),
             "--repeats", str(repeats), "--prefix", prefix],
            env=env, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--child")
    parser.add_argument("--prefix")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.batch, args.repeats, args.prefix)))
        return
    import redis

    prefix = f"psgrad-bench-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(URL)
    try:
        print(f"B={args.batch}, outputs=grads, medians of {args.repeats} interleaved steps")
        print(f"{'model':<11} {'eager ms':>9} {'compiled ms':>12} {'speed-up':>9} "
              f"{'cold first call s':>18} {'warm-start first call s':>24} {'break-even steps':>17}")
        notes: list[str] = []
        for name in MODELS:
            cold = spawn(name, args.batch, args.repeats, prefix)
            warm = spawn(name, args.batch, args.repeats, prefix)
            assert cold["stored"] == 1 and warm["loaded"] == 1, (cold, warm)
            eager = statistics.median([cold["eager_s"], warm["eager_s"]])
            compiled = statistics.median([cold["compiled_s"], warm["compiled_s"]])
            gain = eager - compiled
            even = f"{(cold['first_s'] - eager) / gain:.0f}" if gain > 0 else "never"
            notes.append(f"{name} warm start: {warm['fx_graph_hits']} inductor graph and "
                         f"{warm['aot_hits']} AOTAutograd cache hits from the loaded artifacts")
            print(f"{name:<11} {eager * 1e3:>9.1f} {compiled * 1e3:>12.1f} "
                  f"{eager / compiled:>8.2f}x {cold['first_s']:>18.1f} "
                  f"{warm['first_s']:>24.1f} {even:>17}")
        print("\n".join(notes))
    finally:
        doomed = list(client.scan_iter(match=f"{prefix}:*"))
        if doomed:
            client.delete(*doomed)
        client.close()


if __name__ == "__main__":
    main()
