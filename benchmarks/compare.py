"""psgrad side by side with the libraries users would call instead: torch.func, Opacus, BackPACK.

    python benchmarks/compare.py [--device cuda] [--quick] [--cell-seconds 1.5]

On the same seeded data, for simple-cnn B=64 and B=256, mlp (784-512-512-10) B=256 and B=1024,
tiny-transformer B=64 and TD(0) with value-mlp B=4096, and for the outputs ``grads``, ``norms``
and ``clipped_mean``: the per-sample loop (batch of one, ``torch.autograd.grad``), the PyTorch
tutorial's ``vmap(grad)``, Opacus ``GradSampleModule`` (hooks) and ghost clipping, BackPACK
``BatchGrad`` and ``BatchL2Grad``, psgrad's engine in process, and psgrad over HTTP (safetensors,
the SDK) with the embedded broker and with Redis plus one ``psgrad worker``.

Each method runs in its own fresh subprocess per case: one call measures the peak memory (the
resident-set high-water mark after ``/proc/self/clear_refs`` and ``malloc_trim``, minus the
resident set just before; ``torch.cuda.max_memory_allocated`` on CUDA; over HTTP, the sum of
the client's and the server processes' peaks), its result is compared with the loop's, then the
median time of repeated warm calls (as many as fit in ``--cell-seconds``, at least 3, or 2 for
calls over a second; at most 10). Every process runs with ``THP_MEM_ALLOC_ENABLE=1``. Writes
``benchmarks/results/compare.md``, ``compare.json`` and ``compare.png``.

Optional dependencies (the ``bench`` extra), installed so that pip never replaces torch::

    pip install --no-deps opacus backpack-for-pytorch unfoldNd einops opt_einsum
    pip install matplotlib scipy
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # before torch allocates anything

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_methods as cm
import compare_report

from service.registry import set_tf32

HERE = Path(__file__).resolve().parent
PSGRAD = str(Path(sys.executable).with_name("psgrad"))
REDIS_URL = os.environ.get("PSGRAD_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
CASES = [
    cm.Case("simple-cnn", 64),
    cm.Case("simple-cnn", 256),
    cm.Case("mlp", 256),
    cm.Case("mlp", 1024),
    cm.Case("tiny-transformer", 64),
    cm.Case("value-mlp", 4096),
]
QUICK_CASES = [cm.Case("simple-cnn", 8), cm.Case("value-mlp", 64)]
ORDER = ("norms", "clipped_mean", "grads")  # smallest answer first: later calls reuse less
HTTP_METHODS = ("psgrad-http", "psgrad-redis")
METHODS = (*cm.IN_PROCESS, *HTTP_METHODS)
BIG_ANSWER = str(16 << 30)  # PSGRAD_MAX_RESULT_BYTES: the default 1 GiB refuses the largest grads


# --- memory and timing, inside a child ----------------------------------------------------------


def _status(field: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak(pid: int | str = "self") -> bool:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # reset the resident-set high-water mark to the current resident set
        return True
    except OSError:
        return False


def _trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap back: the next call re-faults


class Peak:
    """Peak extra memory of the block: this process (or the CUDA allocator) plus ``pids``."""

    def __init__(self, device: torch.device, pids: list[int]) -> None:
        self.device, self.pids, self.bytes = device, pids, 0

    def __enter__(self) -> Peak:
        _trim()
        self.base: dict[int | str, int] = {}
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.cuda_base = torch.cuda.memory_allocated()
        everyone: list[int | str] = ["self", *self.pids]
        for pid in everyone:
            _reset_peak(pid)
            self.base[pid] = _status("VmRSS", pid)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self.cuda_base
            pids: list[int | str] = list(self.pids)
        else:
            pids = ["self", *self.pids]
        self.bytes += sum(max(0, _status("VmHWM", p) - self.base[p]) for p in pids)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# --- comparison with the loop's numbers ---------------------------------------------------------


def save_reference(path: Path, results: dict[str, cm.Result]) -> None:
    from safetensors.torch import save_file

    flat: dict[str, torch.Tensor] = {}
    for output, result in results.items():
        value = result[output]
        items = value.items() if isinstance(value, dict) else [("", value)]
        for k, v in items:
            flat[f"{output}/{k}"] = v.detach().to("cpu", torch.float32).contiguous()
    save_file(flat, str(path))


def check(got: cm.Result, output: str, ref_path: Path, block: int = 64) -> tuple[float, bool]:
    """Largest absolute difference from the loop's result and whether ``allclose`` holds
    (``atol=3e-3, rtol=1e-5``, the tutorial's check), in blocks of samples to bound memory."""
    from safetensors import safe_open

    worst, ok = 0.0, True
    value = got[output]
    items = value.items() if isinstance(value, dict) else [("", value)]
    with safe_open(str(ref_path), framework="pt") as ref:
        for k, v in items:
            a = torch.as_tensor(v).detach()
            want = ref.get_slice(f"{output}/{k}")
            rows = a.shape[0] if a.dim() else 1
            step = block if output == "grads" else rows
            for lo in range(0, rows, step):
                hi = min(rows, lo + step)
                w = want[lo:hi] if a.dim() else want[:]
                x = (a[lo:hi] if a.dim() else a).to("cpu", torch.float32)
                diff = (x - w).abs()
                worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
                ok = ok and bool(torch.allclose(x, w, atol=3e-3, rtol=1e-5))
    return worst, ok


# --- children -----------------------------------------------------------------------------------


Calls = dict[str, Callable[[], Any]]


def prepare_in_process(job: dict[str, Any]) -> tuple[Calls, dict[str, Any]]:
    """One method on one case in this fresh process: per output, the peak memory of its first
    call and the difference from the loop's result; returns the warm callables to time."""
    device = torch.device(job["device"])
    s = cm.setup(cm.Case(job["arch"], job["batch"]), device)
    factory = cm.IN_PROCESS[job["method"]]
    clip: float = job.get("clip") or 0.0  # the loop sets it from its own norms
    ref = Path(job["ref"])
    out: dict[str, Any] = {}
    calls: Calls = {}
    for output in ORDER if job["method"] != "loop" else ("grads", "norms", "clipped_mean"):
        with Peak(device, []) as peak:
            fn = factory(s, output, clip)
            result = cm.first_call(fn) if callable(fn) else fn
            _sync(device)
        if isinstance(result, cm.NotApplicable):
            out[output] = {"na": result.reason}
            continue
        if job["method"] == "loop" and output == "grads":  # the reference for every method
            clip = float(cm.norms_of(result["grads"]).median())
            refs = {o: cm.from_grads(o, result["grads"], clip) for o in cm.OUTPUTS}
            save_reference(ref, refs)
            del refs
            out["clip"] = clip
        diff, ok = (0.0, True) if job["method"] == "loop" else check(result, output, ref)
        del result
        out[output] = {"mem": peak.bytes, "diff": diff, "ok": ok}
        calls[output] = fn  # type: ignore[assignment]
    return calls, out


def prepare_http(job: dict[str, Any]) -> tuple[Calls, dict[str, Any]]:
    """psgrad over HTTP through the SDK (safetensors both ways) against a fresh server."""
    import psgrad

    case = cm.Case(job["arch"], job["batch"])
    s = cm.setup(case, torch.device("cpu"))
    data = {k: v.numpy() for k, v in s.data.items()}
    clip, ref = job["clip"], Path(job["ref"])
    client = psgrad.Client(base_url=job["url"], timeout=600, max_retries=0)
    out: dict[str, Any] = {}
    calls: Calls = {}
    for output in ORDER:
        extra: dict[str, Any] = {"clip_norm": clip, "noise_multiplier": 0.0}
        if s.td0:
            extra |= {k: data[k] for k in ("next_inputs", "rewards", "dones")}
            extra["gamma"] = cm.GAMMA
        # Client.per_sample_grads and Client.td0 are thin wrappers over these two calls; td0()
        # takes no clip_norm, so every request is built here the same way.
        fields = client._grads_fields(
            case.arch,
            data["inputs"],
            data.get("targets"),
            loss=s.model.default_loss,
            outputs=[output],
            **extra,
        )

        def fn(fields: Any = fields, output: str = output) -> cm.Result:
            answer = client._compute(fields, as_torch=False, progress=False, chunk_size=None)
            return {output: getattr(answer, output)}

        try:
            with Peak(torch.device("cpu"), job["pids"]) as peak:
                result = fn()
        except psgrad.PsgradError as exc:
            out[output] = {"na": f"HTTP {exc.http_status} {exc.code}: {exc.message}"[:200]}
            continue
        diff, ok = check(result, output, ref)
        del result
        out[output] = {"mem": peak.bytes, "diff": diff, "ok": ok}
        calls[output] = fn
    return calls, out


def child(job: dict[str, Any]) -> None:
    """Prepare, answer ``READY <json>``, then time one call per output named on stdin."""
    warnings.simplefilter("ignore")  # library deprecation chatter; results are checked instead
    torch.manual_seed(0)
    set_tf32(False)  # float32 on CUDA for every method, the loop too, as psgrad's workers run
    http = job["method"] in HTTP_METHODS
    calls, out = prepare_http(job) if http else prepare_in_process(job)
    device = torch.device("cpu" if http else job["device"])
    print("READY " + json.dumps(out), flush=True)
    for line in sys.stdin:
        output = line.strip()
        if not output:
            break
        gc.collect()
        start = time.perf_counter()
        calls[output]()
        _sync(device)
        elapsed = time.perf_counter() - start
        _trim()  # hand freed memory back: nine idle methods must not hold a case's peak each
        print(f"TIME {elapsed}", flush=True)


class Child:
    """A method's process for one case: prepared once, then timed call by call."""

    def __init__(self, job: dict[str, Any]) -> None:
        env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def _line(self, tag: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return line[len(tag) + 1 :]
        self.proc.wait()
        assert self.proc.stderr is not None
        tail = (self.proc.stderr.read().strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"exit {self.proc.returncode}: {tail}"[:300])

    def ready(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self._line("READY"))
        return result

    def time(self, output: str) -> float:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(output + "\n")
            self.proc.stdin.flush()
        except OSError as exc:  # the child died (e.g. out of memory): _line says how
            with contextlib.suppress(RuntimeError):
                self._line("TIME")
            raise RuntimeError(f"lost the process: {exc}; exit {self.proc.poll()}") from None
        return float(self._line("TIME"))

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- servers ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env(device: str, **settings: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSGRAD_")}
    env.update({f"PSGRAD_{k.upper()}": str(v) for k, v in settings.items()})
    env |= {
        "THP_MEM_ALLOC_ENABLE": "1",
        "PSGRAD_DEVICE": device,
        "PSGRAD_MAX_RESULT_BYTES": BIG_ANSWER,
        "PSGRAD_REQUEST_TIMEOUT_S": "1800",
    }
    return env


def _wait_ready(url: str, procs: list[subprocess.Popen[bytes]], timeout: float = 180) -> None:
    import httpx

    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a psgrad process exited during start-up")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@contextlib.contextmanager
def server(mode: str, device: str) -> Iterator[tuple[str, list[int]]]:
    """A fresh ``psgrad serve`` on a free loopback port (plus one ``psgrad worker`` for Redis)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [PSGRAD, "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    prefix = f"psgrad-compare-{uuid.uuid4().hex[:8]}"
    settings: dict[str, Any] = {}
    if mode == "redis":  # socket timeout: the 2 s default fails storing answers of ~400 MB here
        settings = {"redis_url": REDIS_URL, "redis_prefix": prefix, "redis_timeout_s": 120}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [subprocess.Popen(serve, env=_env(device, **settings), **quiet)]  # type: ignore[call-overload]
    try:
        if mode == "redis":
            worker = [PSGRAD, "worker", "--device", device]
            procs.append(subprocess.Popen(worker, env=_env(device, **settings), **quiet))  # type: ignore[call-overload]
        _wait_ready(url, procs)
        yield url, [p.pid for p in procs]
    finally:
        _stop(procs)
        if mode == "redis":
            import redis

            client = redis.Redis.from_url(REDIS_URL)
            doomed = list(client.scan_iter(match=f"{prefix}:*"))
            if doomed:
                client.delete(*doomed)
            client.close()


# --- the run ------------------------------------------------------------------------------------


def wanted_runs(first: float, cell_seconds: float) -> int:
    """Timed calls for a cell: as many as fit in ``cell_seconds``, at least 3 (2 past 1 s)."""
    return max(2 if first > 1.0 else 3, min(10, math.ceil(cell_seconds / max(first, 1e-6))))


def run_case(case: cm.Case, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Prepare every method one after another (memory, agreement), then time them in
    interleaved rounds so that they share the machine's load alike."""
    ref = tmp / f"{case.arch}-{case.batch}.safetensors"
    base = {
        "arch": case.arch,
        "batch": case.batch,
        "device": args.device,
        "ref": str(ref),
        "cell_seconds": args.cell_seconds,
    }
    results: dict[str, Any] = {}
    children: dict[str, Child] = {}
    with contextlib.ExitStack() as stack:

        def close_all() -> None:
            for c in children.values():
                c.close()

        stack.callback(close_all)
        for method in ["loop", *(m for m in args.methods if m != "loop")]:
            started = time.monotonic()
            job = {**base, "method": method}
            try:
                if method in HTTP_METHODS:
                    mode = "redis" if method == "psgrad-redis" else "embedded"
                    url, pids = stack.enter_context(server(mode, args.device))
                    job |= {"url": url, "pids": pids}
                children[method] = Child(job)
                results[method] = children[method].ready()
            except RuntimeError as exc:
                results[method] = {"error": str(exc)}
                children.pop(method, None)
                if method == "loop":
                    return results
            base.setdefault("clip", results["loop"].get("clip"))
            print(
                f"  {case.label:<22} {method:<14} prepared in {time.monotonic() - started:5.1f} s",
                flush=True,
            )
        started = time.monotonic()
        todo = {
            (m, o): 0
            for m, c in children.items()
            for o in ORDER
            if o in results[m] and "na" not in results[m][o]
        }
        times: dict[tuple[str, str], list[float]] = {k: [] for k in todo}
        while any(len(times[k]) < n or n == 0 for k, n in todo.items()):
            for key, n in todo.items():
                if n and len(times[key]) >= n:
                    continue
                method, output = key
                try:
                    times[key].append(children[method].time(output))
                except RuntimeError as exc:
                    results[method] = {"error": str(exc)}
                    todo = {k: v for k, v in todo.items() if k[0] != method}
                    break
                if n == 0:
                    todo[key] = wanted_runs(times[key][0], args.cell_seconds)
        for (method, output), ts in times.items():
            if "error" not in results[method]:
                results[method][output]["times"] = ts
        print(f"  {case.label:<22} timed in {time.monotonic() - started:5.1f} s", flush=True)
    ref.unlink(missing_ok=True)
    return results


def machine(args: argparse.Namespace) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    if args.device == "cuda":
        cpu += f"; GPU {torch.cuda.get_device_name()}"
    versions = {}
    for pkg in ("torch", "opacus", "backpack-for-pytorch", "psgrad", "numpy", "matplotlib"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = "not installed"
    versions["python"] = platform.python_version()
    with contextlib.suppress(Exception):
        import redis

        versions["redis server"] = redis.Redis.from_url(REDIS_URL).info()["redis_version"]
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": args.device,
        "versions": versions,
        "command": "python benchmarks/compare.py " + " ".join(sys.argv[1:]),
        "thp": os.environ.get("THP_MEM_ALLOC_ENABLE"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--quick", action="store_true", help="small batches: a smoke run")
    parser.add_argument(
        "--cell-seconds",
        type=float,
        default=1.5,
        help="time spent on each cell's repeats (at least 3 runs, 2 past 1 s)",
    )
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--cases", default="", help="e.g. mlp:256,value-mlp:4096")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    args.methods = [m for m in args.methods.split(",") if m]
    cases = QUICK_CASES if args.quick else CASES
    if args.cases:
        cases = [cm.Case(a, int(b)) for a, b in (c.split(":") for c in args.cases.split(","))]
    info = machine(args)
    print(
        f"{info['cpu']}, {info['cores']} cores, torch {info['versions']['torch']}, "
        f"THP_MEM_ALLOC_ENABLE={info['thp']}",
        flush=True,
    )
    started = time.monotonic()
    results: dict[str, Any] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"machine": info, "cases": [], "methods": args.methods, "results": results}
    with tempfile.TemporaryDirectory(prefix="psgrad-compare-") as tmp:
        for case in cases:  # the report is rewritten after each case: a crash keeps the rest
            results[case.label] = run_case(case, args, Path(tmp))
            doc["cases"].append(case.label)
            info["minutes"] = round((time.monotonic() - started) / 60, 1)
            (args.out / "compare.json").write_text(json.dumps(doc, indent=1))
            text = compare_report.markdown(doc)
            (args.out / "compare.md").write_text(text)
    compare_report.chart(doc, args.out / "compare.png")
    print(text)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
