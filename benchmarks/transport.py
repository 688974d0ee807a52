"""Full per-sample gradients over the wire: what each way of serving adds to the engine.

For simple-cnn norms at B=64, grads at B=64 (293 MiB) and grads at B=256 (1.2 GB), one
interleaved run times:

- engine: parse + engine call + the answer as numpy arrays, in this process;
- floor: one loopback socket transfer of the answer's bytes (its safetensors size) into a
  preallocated buffer, measured in the same run: what any server must pay to hand the answer on;
- embedded: the SDK (safetensors received from the socket into the answer's arrays, in the
  memory of its earlier answers once they are dropped, as each round's are) against
  ``psgrad serve`` with its in-process worker thread;
- redis-1 / redis-2: the same through ``psgrad serve`` on Redis with one and with two
  ``psgrad worker`` processes (the answer goes worker -> Redis -> api -> client in pieces).

Medians per case and method, and the goals: embedded <= engine + 1.5 x floor, Redis <= engine +
2.5 x floor. A second table subtracts from each HTTP call the server's own queue and compute
time (the answer's ``timing``): on a shared machine the engine's time varies by a factor of two
between calls, which the first table's differences inherit. A third gives the CPU each process
(client, api, workers, Redis) spent per call, read from ``/proc``, and the least time the
answer's socket crossings can take on this host's cores. Needs Redis at PSGRAD_REDIS_URL
(default the local one; keys under a fresh prefix, deleted at the end), or with
``--private-redis`` a ``redis-server`` of its own (no persistence; with ``--appendonly`` an
append-only file in a temporary folder, as docker-compose.yml runs Redis: every piece of every
answer is then also written to that file; with ``--answers-redis`` also a second one without
persistence for the answers' pieces, as docker-compose.yml's ``redis-answers``, and with
``--unix-socket`` reached over a socket file, as compose's api and workers reach it), and about
10 GB of free memory for the B=256 case (each client keeps the memory of its last answers to read
the next into). A shared 2-core machine: the figures are noisy, read the ratios.

    python benchmarks/transport.py [--repeats 3] [--cases norms:64,grads:64,grads:256]
                                   [--device cuda]
                                   [--private-redis [--appendonly]
                                    [--answers-redis [--unix-socket]]]

With ``--device cuda`` every server and the in-process engine compute on the GPU; the engine's
time then includes copying its answer to host memory, which every server pays as well.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np
import torch
from batching import URL, cpu_s, free_port, private_redis, redis_pid, serve, start, stop, wait_ready

import psgrad
from psgrad._wire import RESPONSE_KEY, parts_size, safetensors_parts
from service import engine
from service.answer_fields import to_wire
from service.registry import ModelRegistry, set_tf32
from service.validate import parse_request

METHODS = ("engine", "floor", "embedded", "redis-1", "redis-2")
GOALS = {"embedded": 1.5, "redis-1": 2.5, "redis-2": 2.5}
CROSSINGS = {"embedded": 1, "redis-1": 3, "redis-2": 3}  # sockets an answer's bytes cross
Processes = dict[str, list[int | None]]  # a role (client, api, workers, redis) -> its pids


def fields(output: str, batch: int) -> dict[str, Any]:
    rng = np.random.default_rng(batch)
    return {"model": "simple-cnn", "outputs": [output],
            "inputs": rng.random((batch, 1, 28, 28), dtype=np.float32),
            "targets": rng.integers(0, 10, batch)}


def in_process(registry: ModelRegistry, request: dict[str, Any]) -> Callable[[], Any]:
    def run() -> Any:
        parsed = parse_request(request, registry)
        out = engine.compute(parsed.model, parsed.batch, parsed.opts)[0]
        return {k: to_wire(v) for k, v in out.items() if k != "meta"}

    return run


class Floor:
    """One loopback transfer of ``size`` bytes into a preallocated buffer, per call."""

    def __init__(self, size: int) -> None:
        self.payload = np.ones(size, np.uint8).data
        self.buffer = np.empty(size, np.uint8).data

    def __call__(self) -> None:
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]

            def send() -> None:
                conn, _ = server.accept()
                with conn:
                    conn.sendall(self.payload)

            sender = threading.Thread(target=send)
            sender.start()
            with socket.create_connection(("127.0.0.1", port)) as conn:
                got = 0
                while got < len(self.buffer):
                    got += conn.recv_into(self.buffer[got:], len(self.buffer) - got)
            sender.join()


def over_sdk(client: psgrad.Client, request: dict[str, Any]) -> Callable[[], Any]:
    def run() -> Any:
        return client.per_sample_grads(request["model"], request["inputs"],
                                       request["targets"], outputs=request["outputs"])

    return run


def warm_up(fn: Callable[[], Any], workers: list[int | None], calls_each: int = 2) -> None:
    """Call ``fn`` until every worker process has served ``calls_each`` calls (the worker whose
    CPU rose most served it); without worker processes, ``calls_each`` calls. A worker's first
    answers fill its caches and touch fresh memory: three times the compute of a warm one, which
    the timed rounds must not pay (two workers take calls in turn, so one warm-up call left the
    second worker cold for the first rounds)."""
    served = dict.fromkeys(workers or [None], 0)
    for _ in range(4 * calls_each * len(served)):  # bounded: a worker may never get a call
        before = {pid: cpu_s(pid) for pid in served}
        fn()
        served[max(served, key=lambda pid: cpu_s(pid) - before[pid])] += 1
        if min(served.values()) >= calls_each:
            return


def answer_bytes(result: dict[str, Any]) -> int:
    answer = {"model": "simple-cnn", **result}
    return parts_size(safetensors_parts(answer, RESPONSE_KEY))


def timed(fn: Callable[[], Any]) -> tuple[float, float | None]:
    """Seconds end to end and, for an answer over HTTP, those beyond the server's own queue and
    compute (its ``timing``): what moving the request and the answer cost, engine noise aside."""
    started = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - started
    timing = getattr(out, "timing", None)
    if not timing:
        return elapsed, None
    return elapsed, elapsed - (timing["queue_ms"] + timing["compute_ms"]) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default="norms:64,grads:64,grads:256")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--private-redis", action="store_true",
                        help="a redis-server of its own on a free port, no persistence")
    parser.add_argument("--appendonly", action="store_true",
                        help="with --private-redis: an append-only file, as docker-compose.yml")
    parser.add_argument("--unix-socket", action="store_true",
                        help="with --answers-redis: the answers' Redis reached over a Unix socket "
                        "(docker-compose.yml's redis-answers)")
    parser.add_argument("--answers-redis", action="store_true",
                        help="with --private-redis: the answers' pieces in a second one, without "
                        "persistence (docker-compose.yml's redis-answers)")
    args = parser.parse_args()
    if (args.appendonly or args.answers_redis) and not args.private_redis:
        parser.error("--appendonly and --answers-redis need --private-redis")
    if args.unix_socket and not args.answers_redis:
        parser.error("--unix-socket needs --answers-redis")
    servers = []
    with tempfile.TemporaryDirectory(prefix="psgrad-redis-") as tmp:
        try:
            url, answers_url = URL, None
            if args.private_redis:
                servers.append(private_redis(tmp if args.appendonly else None))
                url = servers[-1][1]
            if args.answers_redis:
                servers.append(private_redis(socket_dir=tmp if args.unix_socket else None))
                answers_url = servers[-1][1]
            run(args, url, answers_url)
        finally:
            for proc, _ in servers:
                stop(proc)
    print("Redis: " + ("its own, append-only file on (as docker-compose.yml)" if args.appendonly
                       else "its own, no persistence" if args.private_redis
                       else "PSGRAD_REDIS_URL's (its persistence as configured there)")
          + ("; the answers' pieces in a second one, no persistence" if answers_url else "")
          + (", over a Unix socket" if args.unix_socket else ""))


def run(args: argparse.Namespace, redis_url: str, answers_url: str | None) -> None:
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",")]
    prefixes = [f"psgrad-bench-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    procs = []
    urls: dict[str, str] = {}
    me: Processes = {"client": [os.getpid()]}
    pids: dict[str, Processes] = {"engine": me, "floor": me}
    try:
        port = free_port()
        procs.append(serve(port, workers=1, device=args.device))
        urls["embedded"] = f"http://127.0.0.1:{port}"
        pids["embedded"] = {**me, "api": [procs[-1].pid]}
        for name, prefix, n in (("redis-1", prefixes[0], 1), ("redis-2", prefixes[1], 2)):
            port = free_port()
            settings = {"redis_url": redis_url, "redis_prefix": prefix, "device": args.device,
                        **({"answer_redis_url": answers_url} if answers_url else {})}
            api = serve(port, **settings)
            workers = [start(["worker", "--device", args.device], **settings) for _ in range(n)]
            procs += [api, *workers]
            urls[name] = f"http://127.0.0.1:{port}"
            pids[name] = {**me, "api": [api.pid], "workers": [w.pid for w in workers],
                          "redis": [redis_pid(u) for u in (redis_url, answers_url) if u]}
        for url in urls.values():
            wait_ready(url)
        clients = {name: psgrad.Client(url, timeout=900) for name, url in urls.items()}
        set_tf32(False)  # as the servers' workers run
        registry = ModelRegistry(torch.device(args.device))
        runs: dict[tuple[str, int], dict[str, Callable[[], Any]]] = {}
        sizes: dict[tuple[str, int], int] = {}
        for output, batch in cases:
            request = fields(output, batch)
            engine_run = in_process(registry, request)
            sizes[(output, batch)] = answer_bytes(engine_run())
            runs[(output, batch)] = {"engine": engine_run,
                                     "floor": Floor(sizes[(output, batch)]),
                                     **{n: over_sdk(c, request) for n, c in clients.items()}}
            for method, fn in runs[(output, batch)].items():
                warm_up(fn, pids[method].get("workers", []))
        times: dict[tuple[str, int], dict[str, list[float]]] = {
            case: {m: [] for m in METHODS} for case in runs}
        beyond: dict[tuple[str, int], dict[str, list[float]]] = {
            case: {m: [] for m in GOALS} for case in runs}
        cpu: dict[tuple[str, int], dict[str, list[dict[str, float]]]] = {
            case: {m: [] for m in METHODS} for case in runs}
        for rep in range(args.repeats):
            for case, methods in runs.items():
                for method, fn in methods.items():
                    before = cpu_ms(pids[method])
                    elapsed, wire = timed(fn)
                    after = cpu_ms(pids[method])
                    cpu[case][method].append({k: after[k] - v for k, v in before.items()})
                    times[case][method].append(elapsed)
                    if wire is not None:
                        beyond[case][method].append(wire)
            print(f"  round {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
        for client in clients.values():
            client.close()
    finally:
        for proc in procs:
            stop(proc)
        import redis

        r = redis.Redis.from_url(redis_url)
        for prefix in prefixes:
            doomed = list(r.scan_iter(match=f"{prefix}:*"))
            if doomed:
                r.delete(*doomed)
        r.close()
    print(f"device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))
    report(times, beyond, sizes, args.repeats)
    report_cpu(cpu, times)


def report(times: dict[tuple[str, int], dict[str, list[float]]],
           beyond: dict[tuple[str, int], dict[str, list[float]]],
           sizes: dict[tuple[str, int], int], repeats: int) -> None:
    print(f"simple-cnn, medians of {repeats} interleaved rounds (ms); goal: embedded <= engine "
          "+ 1.5 x floor, Redis <= engine + 2.5 x floor")
    print("| case | answer | engine | floor | embedded | Redis, 1 worker | Redis, 2 workers |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    verdicts = []
    for (output, batch), per in times.items():
        med = {m: statistics.median(v) * 1e3 for m, v in per.items()}
        size = sizes[(output, batch)]
        cells = [f"{med['engine']:.0f}", f"{med['floor']:.0f}"]
        for method, k in GOALS.items():
            excess = (med[method] - med["engine"]) / med["floor"]
            cells.append(f"{med[method]:.0f} (engine + {excess:.1f} x floor)")
            if output == "grads":  # a few hundred bytes: the floor is a connection setup
                verdicts.append(f"{output} B={batch} {method}: "
                                f"{'met' if excess <= k else 'MISSED'} ({excess:.2f} <= {k})")
        answer = f"{size / 2**20:.1f} MiB" if size > 2**20 else f"{size} B"
        print(f"| {output} B={batch} | {answer} | " + " | ".join(cells) + " |")
    print()
    print("\n".join(verdicts))
    print()
    print("time beyond the server's own queue + compute (its answer's timing), median ms (x floor):"
          " the wire's share, whatever the engine's noise")
    print("| case | floor | embedded | Redis, 1 worker | Redis, 2 workers |")
    print("|---|---:|---:|---:|---:|")
    for (output, batch), per in beyond.items():
        floor = statistics.median(times[(output, batch)]["floor"]) * 1e3
        cells = [f"{statistics.median(v) * 1e3:.0f} ({statistics.median(v) * 1e3 / floor:.1f})"
                 for v in per.values()]
        print(f"| {output} B={batch} | {floor:.0f} | " + " | ".join(cells) + " |")


def cpu_ms(processes: Processes) -> dict[str, float]:
    """CPU milliseconds so far of each role's processes (a pid of None: not measurable)."""
    return {role: 1e3 * sum(cpu_s(pid) for pid in group) for role, group in processes.items()}


def report_cpu(cpu: dict[tuple[str, int], dict[str, list[dict[str, float]]]],
               times: dict[tuple[str, int], dict[str, list[float]]]) -> None:
    """CPU per call of every process that took part, and the least time the sockets allow.

    Each socket an answer crosses costs at least what the floor's one transfer of the same
    bytes costs in CPU (the kernel copies it in and out). Spread over every core of this host,
    ``crossings x floor CPU / cores`` is the least wall time the crossings alone can take,
    before any framing, Redis's own copies or Python: a goal below it cannot be met on this
    host without moving fewer bytes or crossing fewer sockets.
    """
    cores = len(os.sched_getaffinity(0))
    print()
    print("CPU per call, median ms, by process; the least wall time of the answer's socket "
          f"crossings (each costs the floor's CPU) on this host's {cores} cores, in floors")
    print("| case | method | client | api | workers | redis | total | crossings | least |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for (output, batch), per in cpu.items():
        if output != "grads":
            continue
        floor = statistics.median(times[(output, batch)]["floor"]) * 1e3
        floor_cpu = statistics.median(sum(c.values()) for c in per["floor"])
        for method in ("engine", "floor", *GOALS):
            calls = per[method]
            med = {role: statistics.median(c[role] for c in calls) for role in calls[0]}
            total = statistics.median(sum(c.values()) for c in calls)
            cells = [f"{med[role]:.0f}" if role in med else "" for role in
                     ("client", "api", "workers", "redis")]
            n = CROSSINGS.get(method)
            least = [str(n), f"{n * floor_cpu / cores / floor:.1f}"] if n else ["", ""]
            print("| " + " | ".join([f"grads B={batch}", method, *cells, f"{total:.0f}", *least])
                  + " |")


if __name__ == "__main__":
    main()
