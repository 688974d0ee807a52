"""Where a small request's time goes: simple-cnn ``norms`` at B=64, in process and over HTTP.

    python benchmarks/request_overhead.py [--device cuda] [--rounds 30] [--no-http]

On an H100, compare.py's "psgrad engine, in process" took 5 ms for this call, transport.py's
in-process "engine" 30 ms, and the SDK 36 ms against the embedded server and 17 ms through Redis
and a worker process. One process times, interleaved, medians in ms:

- ``engine``: ``engine.compute`` on a request parsed once (compare.py's call);
- ``parsed``: parse the request, compute, the answer as wire arrays (transport.py's call);
- ``thread``: ``parsed`` in one long-lived thread, as the embedded server's worker loop runs it;
- ``idle``: ``parsed`` after 50 ms of nothing, as a request arrives after a pause;
- ``http``: the SDK against ``psgrad serve`` (embedded broker, one worker thread) in a child
  process on the same device.

Then ``torch.profiler``'s busiest ops (CPU and, on CUDA, GPU time) for ``engine`` and
``parsed``, so the difference between them has names.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from batching import free_port, serve, stop, wait_ready
from transport import fields, in_process

import psgrad
from service import engine
from service.registry import ModelRegistry, set_tf32
from service.validate import parse_request

Fn = Callable[[], Any]


def in_thread(fn: Fn) -> tuple[Fn, Callable[[], None]]:
    """``fn`` run by one long-lived thread per call, and how to end that thread."""
    jobs: queue.Queue[threading.Event | None] = queue.Queue()

    def loop() -> None:
        while (done := jobs.get()) is not None:
            fn()
            done.set()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def call() -> None:
        done = threading.Event()
        jobs.put(done)
        done.wait()

    return call, lambda: jobs.put(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--no-http", dest="http", action="store_false")
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    set_tf32(False)
    registry = ModelRegistry(device)
    request = fields("norms", 64)
    parsed = parse_request(request, registry)
    full = in_process(registry, request)
    fns: dict[str, Fn] = {
        "engine": lambda: (engine.compute(parsed.model, parsed.batch, parsed.opts), sync()),
        "parsed": full}
    fns["thread"], end = in_thread(full)
    fns["idle"] = lambda: full()  # the pause is taken outside the timed call
    server = None
    if args.http:
        port = free_port()
        server = serve(port, workers=1, device=args.device)
        wait_ready(f"http://127.0.0.1:{port}")
        client = psgrad.Client(f"http://127.0.0.1:{port}", timeout=300)
        fns["http"] = lambda: client.per_sample_grads(
            "simple-cnn", request["inputs"], request["targets"], outputs=["norms"])
    try:
        for fn in fns.values():
            for _ in range(3):
                fn()
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                if name == "idle":
                    time.sleep(0.05)
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    finally:
        end()
        if server is not None:
            stop(server)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"simple-cnn norms B=64 on {name}, torch {torch.__version__}: median ms "
          f"(min-max) of {args.rounds} interleaved rounds")
    for key, ts in times.items():
        print(f"  {key:8} {statistics.median(ts) * 1e3:7.2f}  "
              f"({min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f})")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    for key in ("engine", "parsed"):
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(5):
                fns[key]()
        sorts = ["self_cpu_time_total"] + (["self_cuda_time_total"] if len(activities) > 1 else [])
        for sort in sorts:
            print(f"\n{key}: 5 calls, by {sort}")
            print(prof.key_averages().table(sort_by=sort, row_limit=12,
                                            max_name_column_width=50))


if __name__ == "__main__":
    main()
