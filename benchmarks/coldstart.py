"""Cold starts: what a new process pays before its first answer, against its steady time.

For GPT-2 small, BERT-base and ResNet-18 (the real-size benchmark's configurations, random
weights, exported at a batch of one, lengths dynamic), each step in a fresh Python process, as
a new worker or a restarted server would be:

- ``register``: the ``.pt2`` registered (the api's loader and its safety checks, in the child
  the api keeps started ahead), against ``torch.export.load`` plus one forward (a sample: the
  export's batch of one) in the same process, and against a plain process that imports torch,
  loads the program and runs that forward (what a user times as loading the model);
- ``cold``: the first ``norms`` request with no plan anywhere;
- ``shared``: the first request of a process whose plan store holds what ``cold`` made (a
  fresh worker beside another, or a restart), signed as workers sharing a secret sign it;
- ``unsigned``: the same with the store's entry unsigned (no secret: checked before use); the
  check's own time (the plan store's ``check_s``) is printed against the steady time, in this
  step and in ``cold``;
- ``new batch`` and ``new length``: the first request at another batch size and length, in a
  process that has served the first shape.

Each first request is divided by the same process's steady time (the median of ``--rounds``
calls after it). The plan store is what a worker opens (``storage.make_plan_store``): Redis with
``--redis URL`` (a fresh key prefix, deleted after), else a temporary data directory. The engine
is called directly (no HTTP, no queue), after the warm-ups a worker runs as it starts
(torch.func's import, the CPU's compiled loops): the ratios are the plan's and the model's, not
the transport's.

    python benchmarks/coldstart.py --models gpt2,bert,resnet18 --threads 1
    python benchmarks/coldstart.py --models gpt2 --redis redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def child(args: argparse.Namespace) -> None:
    """One fresh process: its steps' first and steady times, printed as one JSON line."""
    if args.steps == "plain":
        plain(args)
        return
    from service.process_env import configure

    configure()  # as a worker process does first (PSGRAD_KEEP_FREED_MEMORY)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import realsize as rs

    from service import engine
    from service.export.child import SPARES
    from service.fast_stats import warm_kernels
    from service.registration import register_exported
    from service.registry import ModelRegistry
    from service.storage import make_plan_store
    from service.strategies import per_sample

    settings = rs.raised(redis_url=args.redis or None, redis_prefix=args.prefix,
                         data_dir=args.data_dir, compile_secret=args.secret, device="cpu")
    plans = make_plan_store(settings)
    if "register" in args.steps:  # as an api with admins does from its start: the spare
        SPARES.keep(settings.export_memory_mb, settings.export_cpu_s)  # starts meanwhile
    per_sample.warm_up()  # what a worker runs as it starts, before it takes a job
    warm_kernels()
    data = Path(args.pt2).read_bytes()
    out: dict[str, Any] = {}
    case = rs.make_case(args.model, args.batch, args.seq)
    if "register" in args.steps:
        start = time.perf_counter()
        ep = torch.export.load(args.pt2)
        with torch.no_grad():
            ep.module()(*(v[:1] for v in case.inputs.values()))  # exported at a batch of one
        out["load_and_forward_s"] = time.perf_counter() - start
        del ep
    start = time.perf_counter()
    registry = ModelRegistry(torch.device("cpu"))
    model = register_exported(registry, case.name, data, settings, default_loss=case.loss,
                              losses=[])
    out["register_s"] = time.perf_counter() - start
    del data, case  # a server holds neither the .pt2 it registered nor another copy of the model
    steps = [(args.batch, args.seq)]
    if "new" in args.steps:
        steps += [(args.batch * 2, args.seq), (args.batch, args.seq * 2)]
    for batch, seq in steps:
        shaped = rs.make_case(args.model, batch, seq)
        parsed = rs.request(registry, shaped, "norms")
        call = rs.on_device(parsed.batch, model.device)
        del shaped  # its module: only the batch is the request's

        def run(parsed: Any = parsed, call: Any = call) -> None:
            engine.compute(parsed.model, call, parsed.opts, plans=plans)

        start = time.perf_counter()
        run()
        first = time.perf_counter() - start
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        out[f"{batch}x{seq}"] = {"first_s": first, "steady_s": statistics.median(times)}
    assert plans is not None
    out["plans"] = {"probes": plans.stats.probes, "checks": plans.stats.checks,
                    "check_s": plans.stats.check_s,
                    "loaded": plans.stats.loaded, "ignored": plans.stats.reasons}
    SPARES.close()
    print(json.dumps(out), flush=True)


def plain(args: argparse.Namespace) -> None:
    """What a user times as loading the model: ``import torch``, ``torch.export.load`` and one
    forward of a sample, in a fresh process (the batch is made outside the time)."""
    start = time.perf_counter()
    import torch

    ep = torch.export.load(args.pt2)
    loaded = time.perf_counter() - start
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import realsize as rs

    case = rs.make_case(args.model, args.batch, args.seq)
    start = time.perf_counter()
    with torch.no_grad():
        ep.module()(*(v[:1] for v in case.inputs.values()))
    print(json.dumps({"plain_s": loaded + time.perf_counter() - start}), flush=True)


def run_child(model: str, pt2: Path, store: dict[str, str], steps: str,
              args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--pt2", str(pt2),
           "--batch", str(args.batch), "--seq", str(args.seq), "--rounds", str(args.rounds),
           "--threads", str(args.threads), "--steps", steps,
           *(x for k, v in store.items() for x in (f"--{k}", v))]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{model} {steps}: the child failed\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def unsign(store: dict[str, str]) -> None:
    """Reseal every stored plan without a secret, as a writer without one would have."""
    sys.path.insert(0, str(ROOT))
    from service.fast_stats._shared import _sign

    def resealed(raw: bytes) -> bytes:
        entry = json.loads(raw)
        entry.pop("seal")
        return _sign(entry, b"")

    if store.get("redis"):
        import redis

        client = redis.Redis.from_url(store["redis"])
        for key in client.scan_iter(match=f"{store['prefix']}:plan:*"):
            client.set(key, resealed(client.get(key) or b"{}"))
        return
    for path in Path(store["data-dir"], "plans").glob("*.json"):
        path.write_bytes(resealed(path.read_bytes()))


def clear(store: dict[str, str]) -> None:
    if store.get("redis"):
        import redis

        client = redis.Redis.from_url(store["redis"])
        doomed = list(client.scan_iter(match=f"{store['prefix']}:*"))
        if doomed:
            client.delete(*doomed)
    shutil.rmtree(store["data-dir"], ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt2,bert,resnet18")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--redis", default="", help="a Redis URL: plans kept there")
    # the child's own arguments
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--pt2", help=argparse.SUPPRESS)
    parser.add_argument("--steps", default="", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", default="psgrad", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--secret", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import realsize as rs

    work = Path(tempfile.mkdtemp(prefix="psgrad-coldstart-"))
    print(f"# cold starts, B={args.batch}, T={args.seq} (ResNet-18: 224x224), threads "
          f"{args.threads or torch.get_num_threads()}, plans in "
          f"{'Redis' if args.redis else 'a data directory'}; first / steady in one process")
    try:
        for name in args.models.split(","):
            case = rs.make_case(name, args.batch, args.seq)
            pt2 = work / f"{name}.pt2"
            pt2.write_bytes(rs.export(case.module, tuple(v[:1] for v in case.inputs.values()),
                                      rs.MAX_LENGTH))
            store = {"prefix": f"psgrad-coldstart-{uuid.uuid4().hex[:8]}",
                     "data-dir": str(work / "data"), "secret": "coldstart-secret"}
            if args.redis:
                store["redis"] = args.redis
            try:
                base = run_child(name, pt2, store, "plain", args)
                cold = run_child(name, pt2, store, "register", args)
                shared = run_child(name, pt2, store, "new", args)
                unsign(store)
                unsigned = run_child(name, pt2, {**store, "secret": ""}, "", args)
            finally:
                clear(store)
            report(name, args, {**cold, **base}, shared, unsigned)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(name: str, args: argparse.Namespace, cold: dict[str, Any], shared: dict[str, Any],
           unsigned: dict[str, Any]) -> None:
    shape = f"{args.batch}x{args.seq}"
    wider = f"{args.batch * 2}x{args.seq}"
    longer = f"{args.batch}x{args.seq * 2}"
    rows = [
        ("register", cold["register_s"], cold["load_and_forward_s"], "x load+forward"),
        ("cold (no plan anywhere)", cold[shape]["first_s"], cold[shape]["steady_s"], "x steady"),
        ("shared (signed plan)", shared[shape]["first_s"], shared[shape]["steady_s"], "x steady"),
        ("shared, unsigned (checked)", unsigned[shape]["first_s"], unsigned[shape]["steady_s"],
         "x steady"),
        (f"new batch size ({wider})", shared[wider]["first_s"], shared[wider]["steady_s"],
         "x steady"),
        (f"new length ({longer})", shared[longer]["first_s"], shared[longer]["steady_s"],
         "x steady"),
    ]
    print(f"\n{name}: probes cold {cold['plans']['probes']}, shared {shared['plans']['probes']}"
          f", unsigned {unsigned['plans']['probes']} (checks {unsigned['plans']['checks']})")
    for reason in cold["plans"]["ignored"] + shared["plans"]["ignored"] + unsigned["plans"][
            "ignored"]:
        print(f"  ignored: {reason}")
    rows.insert(1, ("register", cold["register_s"], cold["plain_s"], "x a plain process's"))
    for label, first, base, unit in rows:
        bound = f"  (2x + 5 s: {2 * base + 5:.1f} s)" if unit == "x steady" else ""
        print(f"  {label:28s} {first:8.2f} s  {base:8.2f} s  {first / base:6.2f} {unit}{bound}")
    for label, run in (("the check, cold", cold), ("the check, unsigned", unsigned)):
        check, steady = run["plans"]["check_s"], run[shape]["steady_s"]
        print(f"  {label:28s} {check:8.2f} s  {steady:8.2f} s  {check / steady:6.2f} x steady"
              "  (goal: 1)")


if __name__ == "__main__":
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    main()
