"""Real-size models under the default limits: registration, memory of the first and later
requests, and how fast a model too large is refused.

    python benchmarks/limits.py [--model gpt2|bert] [--batch 4] [--length 64] [--requests 3]

GPT-2 small (124M parameters) or BERT-base (109M) is built from transformers' default config
with random weights (no download), exported as docs/models.md shows (``input_ids`` and
``attention_mask``, eager attention, a dynamic length in 2..512) and registered with a
``psgrad serve`` process started here with the default settings (embedded workers, CPU). It
prints:

- the registration's wall time and status under the defaults, ``--settle`` seconds after the
  server answers (10: as a server started a while before, whose checking child has imported
  torch; 0 registers at once), and the server's peak resident memory during it (the checking
  child's is its own);
- the server's peak resident memory (``VmHWM``, reset before each request through
  ``/proc/PID/clear_refs``) during the first ``norms`` request at B x T, and the largest peak
  of the ``--requests`` after it (the steady peak), and their ratio (goal: at most 1.5; the
  server keeps the memory it frees, ``PSGRAD_KEEP_FREED_MEMORY``, so the later peaks are the
  resident set the first request left, and the ratio is 1);
- the peak resident memory of a fresh process that builds the same model and runs one plain
  forward and backward of the same batch (``--plain``), and the steady peak's ratio to it
  (goal: at most 2);
- the time a server started with ``PSGRAD_MAX_PARAMETERS=50000000`` takes to refuse the same
  archive with 413, and the message (goal: under 2 s);
- after a restart (a server on a ``PSGRAD_MODEL_DIR`` and ``PSGRAD_DATA_DIR`` registers the
  model and answers once; a new one on them answers), the first request's time and the
  server's peak: the stored version's load, as a new worker's, and the stored plan; sent as
  soon as the server answers (its workers' start warm-ups still running), then in another
  restart once ``/readyz`` says ready (as a load balancer sends it), and how long after the
  server answered that was.

GPT-2 small takes several GiB: run it alone on a shared machine. Needs ``transformers``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

import psgrad

ROOT = Path(__file__).resolve().parents[1]


class LM(torch.nn.Module):  # (input_ids, attention_mask) -> logits, as in docs/models.md
    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, attention_mask=attention_mask).logits


def build(name: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    eager: dict[str, Any] = {"attn_implementation": "eager"}
    if name == "gpt2":
        return LM(tf.GPT2LMHeadModel(tf.GPT2Config(**eager))).eval()
    return LM(tf.BertForSequenceClassification(tf.BertConfig(**eager))).eval()


def batch(name: str, size: int, length: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    vocab = 50257 if name == "gpt2" else 30522
    ids = torch.randint(0, vocab, (size, length), generator=gen)
    mask = torch.ones_like(ids)
    body: dict[str, Any] = {"inputs": {"input_ids": ids.tolist(),
                                       "attention_mask": mask.tolist()}, "outputs": ["norms"]}
    if name == "gpt2":
        return {**body, "targets": ids.tolist(), "mask": mask.tolist()}
    return {**body, "targets": [i % 2 for i in range(size)]}


def export(name: str, path: Path) -> None:
    model = build(name)
    length = torch.export.Dim("length", min=2, max=512)
    ids = torch.randint(0, 100, (1, 12))
    ep = torch.export.export(model, (ids, torch.ones_like(ids)),
                             dynamic_shapes=({1: length}, {1: length}))
    torch.export.save(ep, str(path))


def peak(pid: int) -> int:
    """A process's peak resident memory since its last reset, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def plain(name: str, size: int, length: int) -> None:
    """One forward and backward of the model on the batch, in this process; prints VmHWM."""
    model = build(name)
    body = batch(name, size, length)
    ids = torch.tensor(body["inputs"]["input_ids"])
    mask = torch.tensor(body["inputs"]["attention_mask"])
    for p in model.parameters():
        p.requires_grad_(True)
    out = model(ids, mask)
    if name == "gpt2":
        loss = torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    else:
        loss = torch.nn.functional.cross_entropy(out, torch.tensor(body["targets"]))
    loss.backward()
    print(peak(os.getpid()))


def serve(port: int, **env: str) -> subprocess.Popen[bytes]:
    environ = {**os.environ, "PSGRAD_DEVICE": "cpu", "PYTHONPATH": str(ROOT), **env}
    proc = subprocess.Popen([sys.executable, "-c", "from service.cli import main; main()",
                             "serve", "--port", str(port), "--log-level", "warning"],
                            env=environ)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt2", "bert"], default="gpt2")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain:
        plain(args.model, args.batch, args.length)
        return
    gib = 1 << 30
    loss = "next_token" if args.model == "gpt2" else "cross_entropy"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{args.model}.pt2"
        export(args.model, path)
        data = path.read_bytes()
        print(f"{args.model}: archive {len(data) / 2**20:.0f} MiB, B={args.batch} "
              f"T={args.length}, norms")
        done = subprocess.run([sys.executable, __file__, "--plain", "--model", args.model,
                               "--batch", str(args.batch), "--length", str(args.length)],
                              capture_output=True, check=True, env={**os.environ,
                                                                    "PYTHONPATH": str(ROOT)})
        plain_peak = int(done.stdout.split()[-1])
        proc = serve(args.port)
        time.sleep(args.settle)
        url = f"http://127.0.0.1:{args.port}"
        try:
            with httpx.Client(base_url=url, timeout=1200) as c, \
                    psgrad.Client(url, timeout=1200) as client:
                idle = peak(proc.pid)
                reset_peak(proc.pid)
                start = time.perf_counter()
                info = client.models.register_exported(args.model, data, default_loss=loss)
                took = time.perf_counter() - start
                print(f"registration under the defaults (psgrad.Client): {info.ref} in "
                      f"{took:.1f} s, server peak {peak(proc.pid) / gib:.2f} GiB (idle "
                      f"{idle / gib:.2f} GiB)")
                body = {"model": args.model, **batch(args.model, args.batch, args.length)}
                peaks, times = [], []
                for _ in range(1 + args.requests):
                    reset_peak(proc.pid)
                    start = time.perf_counter()
                    r = c.post("/per-sample-grads", json=body)
                    times.append(time.perf_counter() - start)
                    assert r.status_code == 200, r.text
                    peaks.append(peak(proc.pid))
        finally:
            stop(proc)
        steady = max(peaks[1:])
        print(f"first request: peak {peaks[0] / gib:.2f} GiB in {times[0]:.1f} s; later: "
              f"peak {steady / gib:.2f} GiB, {min(times[1:]):.1f}-{max(times[1:]):.1f} s")
        print(f"plain forward+backward in a fresh process: peak {plain_peak / gib:.2f} GiB")
        print(f"first / steady = {peaks[0] / steady:.2f} (goal <= 1.5); steady / plain = "
              f"{steady / plain_peak:.2f} (goal <= 2)")
        proc = serve(args.port, PSGRAD_MAX_PARAMETERS="50000000")
        try:
            with psgrad.Client(url, timeout=600) as client:
                start = time.perf_counter()
                try:
                    client.models.register_exported(args.model, data, default_loss=loss)
                    refusal = "registered"
                except psgrad.PsgradError as exc:
                    refusal = f"{exc.status} {exc.message}"
                took = time.perf_counter() - start
        finally:
            stop(proc)
        print(f"PSGRAD_MAX_PARAMETERS=50000000: {took:.2f} s (goal < 2 s): {refusal}")
        restarted(args.model, data, loss, body, args.port, Path(tmp))


def restarted(name: str, data: bytes, loss: str, body: dict[str, Any], port: int,
              folder: Path) -> None:
    """A restart's first request: a server on ``folder``'s model and data directories
    registers the model and answers once (its plan stored); a new server on them loads the
    stored version (as a new worker does) and answers, once sent as soon as it answers and
    once when ``/readyz`` says ready; prints each answer's time and the server's peak."""
    gib, url = 1 << 30, f"http://127.0.0.1:{port}"
    env = {"PSGRAD_MODEL_DIR": str(folder / "models"), "PSGRAD_DATA_DIR": str(folder / "data")}
    proc = serve(port, **env)
    try:
        with psgrad.Client(url, timeout=1200) as client:
            client.models.register_exported(name, data, default_loss=loss)
        assert httpx.post(f"{url}/per-sample-grads", json=body, timeout=1200).status_code == 200
    finally:
        stop(proc)
    for on_ready in (False, True):
        proc = serve(port, **env)
        try:
            when = "as soon as it answers"
            if on_ready:  # polled finely: the client's wait_ready follows Retry-After (1 s)
                answered = time.perf_counter()
                while httpx.get(f"{url}/readyz").status_code != 200:
                    time.sleep(0.05)
                when = (f"once /readyz says ready ({time.perf_counter() - answered:.1f} s after "
                        "it answers)")
            idle = peak(proc.pid)
            reset_peak(proc.pid)
            start = time.perf_counter()
            r = httpx.post(f"{url}/per-sample-grads", json=body, timeout=1200)
            took = time.perf_counter() - start
            assert r.status_code == 200, r.text
            print(f"after a restart, sent {when}: first request (the stored version loaded, "
                  f"its plan stored) in {took:.1f} s, server peak {peak(proc.pid) / gib:.2f} GiB "
                  f"(idle {idle / gib:.2f} GiB)")
        finally:
            stop(proc)


if __name__ == "__main__":
    main()
