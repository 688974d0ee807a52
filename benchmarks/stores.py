"""Gradient stores: appending against the ``projection`` output's own throughput, and a query
over a large store against one in-process numpy pass over the same matrix.

    python benchmarks/stores.py [--rounds 3] [--batch 256] [--k 1024]
                                [--rows 1000000] [--dim 1024] [--queries 16] [--topk 10]
                                [--skip-append] [--skip-query]
    python benchmarks/stores.py --trak-cost [--trak-dims 1024,4096,8192] [--rounds 3]
    python benchmarks/stores.py --index [--rows 1000000] [--dim 1024] [--factory IVF1024,SQ4]
                                [--queries 16] [--topk 10] [--rounds 20] [--batch 65536]
                                [--no-plain] [--exact-rounds N] [--probes N,M]
                                [--data DIR]

**Append** (the embedded server in process, over httpx's ASGI transport, safetensors bodies
both ways): each round times ``POST /per-sample-grads`` asking ``projection`` for a batch of
``--batch`` simple-cnn samples (k = ``--k``, the answer in safetensors) and ``POST
/stores/{id}/samples`` with the same batch and new ids (the same projection jobs, then the
shards, the Gram matrix and the manifest written), interleaved. Prints each median and the
median of the per-round ratios ``projection time / append time``: the append's throughput as
a fraction of the projection output's (goal: 0.8 or more).

**Query**: a float16 store of ``--rows`` x ``--dim`` random rows is written through
:class:`service.stores.files.StoreFiles` (64 MiB shards; the model is not involved), then, in
interleaved rounds, ``--queries`` test sketches are ranked (top ``--topk``, score ``dot``; and
``trak`` once) by :func:`service.stores.query.search` (reading the shards from the files) and by
one numpy pass over the same matrix held in memory (float16, a chunked float32 matmul of 32768
rows at a time and ``argpartition``: the in-process baseline). Prints the medians, the ratio
(goal: 1.5 or less), whether both found the same ids, and the query's peak of traced memory
(``tracemalloc``: numpy's allocations) against the store's size. The first query may read from
disk; later ones from the page cache, as a warm server would.

**trak against dot** (``--trak-cost``, alone): as a user queries a store, through the embedded
app in process: for each k of ``--trak-dims`` a store of the zoo ``mlp`` holding 1300 samples,
and 100 test samples sent as inputs, score ``dot`` and ``trak`` (default lambda) in
interleaved rounds, asking for the top 10 and for every sample (as benchmarks/lds.py does).
Prints the first ``trak`` query after the commit (it factors), the medians of the later ones
and of ``dot``, and their ratio (goal: 1.2 or less). The process runs as ``psgrad serve`` does
(:func:`service.process_env.configure`: idle BLAS threads asleep, freed memory kept).

**The index** (``--index``, alone): as a user fills and queries a large store, through the
embedded app in process: two float16 stores of ``--dim`` (``mlp``; the model is not involved),
one with ``--factory`` as its index and one without, filled side by side by bulk import
(``POST /stores/{id}/rows``, ``--batch`` rows a request, safetensors) with the same ``--rows``
rows, drawn from 4096 Gaussian clusters (sketches of a real training set have neighbours;
uniform noise in 1024 dimensions has none an index could find). Prints each store's import rate,
the index's cost (the difference; ``--no-plain`` imports into the indexed store alone), the
commit that trained the index against the others, the process's peak memory (resident, less
the shards' mapped pages) while importing and while querying, the first approximate query (it
merges the index's pieces), recall@``--topk`` of the approximate answers against the exact scan
of the same store, and the p50/p99 over ``--rounds`` of a ``dot`` query of ``--queries`` test
rows (sent as ``sketches``), exact and approximate (``--probes`` lists of an IVF index), and of
``trak`` approximate.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import httpx
import numpy as np

from psgrad._wire import REQUEST_KEY, SAFETENSORS, fields_to_safetensors
from service.api import create_app
from service.config import Settings
from service.process_env import configure
from service.stores.files import StoreFiles
from service.stores.index import PROBES
from service.stores.locks import ThreadLocks
from service.stores.query import search
from service.stores.spec import StoreSpec

CHUNK = 32768


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


@contextlib.asynccontextmanager
async def embedded(keep: str | None = None) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the embedded app in this process, over a data directory removed after (or
    over ``keep``, kept)."""
    with (contextlib.nullcontext(keep) if keep else
          tempfile.TemporaryDirectory(prefix="psgrad-bench-stores-")) as data:
        app = create_app(Settings(data_dir=data, device="cpu", batch_max_delay_ms=0,
                                  redis_url=None, api_keys="", admin_keys=""))
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://bench",
                timeout=600) as c:
            yield c


async def bench_append(rounds: int, batch: int, k: int) -> None:
    rng = np.random.default_rng(0)
    async with embedded() as c:
        r = await c.put("/stores/bench", json={"model": "simple-cnn", "projection_dim": k,
                                               "dtype": "float16"})
        assert r.status_code == 201, r.text
        at = 0

        def body(extra: dict[str, Any]) -> bytes:
            x = rng.standard_normal((batch, 1, 28, 28)).astype(np.float32)
            y = rng.integers(0, 10, batch)
            return fields_to_safetensors({"inputs": x, "targets": y, **extra}, REQUEST_KEY)

        async def projection() -> float:
            content = body({"model": "simple-cnn", "outputs": ["projection"],
                            "projection_dim": k})
            t = time.perf_counter()
            r = await c.post("/per-sample-grads", content=content, headers={
                "content-type": SAFETENSORS, "accept": SAFETENSORS})
            assert r.status_code == 200, r.text
            return time.perf_counter() - t

        async def append() -> float:
            nonlocal at
            content = body({"ids": np.arange(at, at + batch)})
            at += batch
            t = time.perf_counter()
            r = await c.post("/stores/bench/samples", content=content,
                             headers={"content-type": SAFETENSORS})
            assert r.status_code == 200, r.text
            return time.perf_counter() - t

        await projection()
        await append()  # warm-up: plans, factors
        proj, add, ratios = [], [], []
        for _ in range(rounds):
            p, a = await projection(), await append()
            proj.append(p)
            add.append(a)
            ratios.append(p / a)
    print(f"\n### Append: simple-cnn, B={batch}, k={k} (load {load()})\n")
    print("| | median s | samples/s |\n|---|---|---|")
    for name, times in (("projection output", proj), ("append to a store", add)):
        m = statistics.median(times)
        print(f"| {name} | {m:.3f} | {batch / m:.0f} |")
    print(f"\nappend throughput / projection throughput: median {statistics.median(ratios):.2f} "
          f"(rounds {min(ratios):.2f} to {max(ratios):.2f}; goal >= 0.8)")


def fill(rows: int, dim: int) -> tuple[StoreFiles, np.ndarray]:
    """A float16 store of random rows, and the same matrix in memory."""
    files = StoreFiles(tempfile.mkdtemp(prefix="psgrad-bench-stores-"), ThreadLocks())
    atexit.register(shutil.rmtree, files.root, True)  # 2 GiB at the default size
    spec = StoreSpec(id="big", model="none@0", loss="none", params=("w",), projection_dim=dim,
                     projection_seed=0, projection_kind="any", dtype="float16")
    files.create("big", spec)
    matrix = np.empty((rows, dim), np.float16)
    rng = np.random.default_rng(1)
    per = (64 << 20) // (dim * 2)
    t = time.perf_counter()
    for a in range(0, rows, per):
        block = rng.standard_normal((min(per, rows - a), dim), dtype=np.float32)
        matrix[a:a + len(block)] = block
        files.append("big", spec, list(range(a, a + len(block))), "int", block)
    print(f"\nwrote {rows} x {dim} float16 ({matrix.nbytes / 2**30:.2f} GiB) in "
          f"{time.perf_counter() - t:.1f} s")
    return files, matrix


def numpy_pass(matrix: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    """The baseline: one chunked float32 matmul over the matrix in memory, top-k kept."""
    qm = q.astype(np.float32)
    best_s = np.empty((len(q), 0), np.float32)
    best_r = np.empty((len(q), 0), np.int64)
    for a in range(0, len(matrix), CHUNK):
        s = qm @ matrix[a:a + CHUNK].astype(np.float32).T
        part = np.argpartition(-s, k - 1, axis=1)[:, :k]
        best_s = np.concatenate([best_s, np.take_along_axis(s, part, 1)], 1)
        best_r = np.concatenate([best_r, part + a], 1)
        keep = np.argpartition(-best_s, k - 1, axis=1)[:, :k]
        best_s, best_r = np.take_along_axis(best_s, keep, 1), np.take_along_axis(best_r, keep, 1)
    order = np.argsort(-best_s, axis=1)
    return np.take_along_axis(best_r, order, 1)


def bench_query(rounds: int, rows: int, dim: int, queries: int, k: int) -> None:
    files, matrix = fill(rows, dim)
    q = np.random.default_rng(2).standard_normal((queries, dim))
    ours, base, ratios = [], [], []
    same = True
    for _ in range(rounds):
        t = time.perf_counter()
        found = search(files, "big", "big", q, k, "dot")
        o = time.perf_counter() - t
        t = time.perf_counter()
        want = numpy_pass(matrix, q, k)
        b = time.perf_counter() - t
        same &= bool((found.rows == want).all())
        ours.append(o)
        base.append(b)
        ratios.append(o / b)
    t = time.perf_counter()
    search(files, "big", "big", q, k, "trak")
    trak = time.perf_counter() - t
    tracemalloc.start()
    search(files, "big", "big", q, k, "dot")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"\n### Query: {queries} test sketches, top {k}, over {rows} x {dim} float16 "
          f"(load {load()})\n")
    print("| | median s |\n|---|---|")
    print(f"| store query (dot, streamed from 64 MiB shards) | {statistics.median(ours):.3f} |")
    print(f"| numpy pass over the matrix in memory | {statistics.median(base):.3f} |")
    print(f"| store query (trak, once) | {trak:.3f} |")
    print(f"\nquery / numpy: median {statistics.median(ratios):.2f} (rounds {min(ratios):.2f} "
          f"to {max(ratios):.2f}; goal <= 1.5); same ids: {same}; query's traced peak "
          f"{peak / 2**20:.0f} MiB for a store of {matrix.nbytes / 2**20:.0f} MiB")


async def bench_trak(rounds: int, dims: list[int]) -> None:
    rng = np.random.default_rng(0)

    def samples(n: int) -> dict[str, Any]:
        return {"inputs": rng.standard_normal((n, 784)).astype(np.float32),
                "targets": rng.integers(0, 10, n)}

    print(f"\n### trak against dot: zoo mlp, 1300 samples, 100 test samples as inputs "
          f"(load {load()})\n")
    print("| k | top | dot, median s | trak, first after the commit s | trak, median s "
          "| trak / dot |")
    print("|---|---|---|---|---|---|")
    async with embedded() as c:

        async def query(store: str, body: bytes) -> float:
            t = time.perf_counter()
            r = await c.post(f"/stores/{store}/query", content=body,
                             headers={"content-type": SAFETENSORS})
            assert r.status_code == 200, r.text
            return time.perf_counter() - t

        test = samples(100)
        for k in dims:
            store = f"t{k}"
            r = await c.put(f"/stores/{store}", json={"model": "mlp", "projection_dim": k})
            assert r.status_code == 201, r.text
            for a in range(0, 1300, 260):
                content = fields_to_safetensors({**samples(260), "ids": np.arange(a, a + 260)},
                                                REQUEST_KEY)
                r = await c.post(f"/stores/{store}/samples", content=content,
                                 headers={"content-type": SAFETENSORS})
                assert r.status_code == 200, r.text
            for top in (10, 1300):
                bodies = {score: fields_to_safetensors({**test, "k": top, "score": score},
                                                       REQUEST_KEY) for score in ("dot", "trak")}
                await query(store, bodies["dot"])  # the model planned, the sketch set up
                first = await query(store, bodies["trak"])
                dot, trak = [], []
                for _ in range(rounds):
                    dot.append(await query(store, bodies["dot"]))
                    trak.append(await query(store, bodies["trak"]))
                d, t = statistics.median(dot), statistics.median(trak)
                print(f"| {k} | {top} | {d:.3f} | {first:.3f} | {t:.3f} | {t / d:.2f} |")


def clustered(rng: np.random.Generator, centers: np.ndarray, n: int) -> np.ndarray:
    """``n`` rows near random ``centers`` (noise a quarter of a center's scale)."""
    which = rng.integers(0, len(centers), n)
    noise = rng.standard_normal((n, centers.shape[1]), dtype=np.float32) * 0.25
    return (centers[which] + noise).astype(np.float16)


class Peak:
    """The process's peak memory above its start, sampled every 0.1 s: resident less what is
    file-backed (the shards' mapped pages, which the page cache holds, not the process)."""

    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process()
        self.base = self.now()
        self.top = self.base
        self.stop = threading.Event()
        threading.Thread(target=self.sample, daemon=True).start()

    def now(self) -> int:
        info = self.proc.memory_info()
        return int(info.rss - info.shared)

    def sample(self) -> None:
        while not self.stop.wait(0.1):
            self.top = max(self.top, self.now())

    def take(self) -> float:
        """GiB above the start at the peak since the last take."""
        top, self.top = max(self.top, self.now()), self.now()
        return (top - self.base) / 2**30


async def bench_index(rows: int, dim: int, factory: str, queries: int, topk: int, rounds: int,
                      batch: int, plain: bool, exact_rounds: int,
                      probes: list[int | None], data: str | None) -> None:
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((4096, dim), dtype=np.float32)
    test = clustered(rng, centers, queries).astype(np.float32)
    names = ("plain", "indexed") if plain else ("indexed",)
    took: dict[str, list[float]] = {name: [] for name in names}
    async with embedded(data) as c:
        held = {name: (await c.get(f"/stores/{name}")).json().get("samples", 0)
                for name in names}
        for name in names:
            r = await c.put(f"/stores/{name}", json={
                "model": "mlp", "projection_dim": dim, "dtype": "float16",
                "index": factory if name == "indexed" else None})
            assert r.status_code in (200, 201), r.text
        peak, start = Peak(), time.perf_counter()
        for a in range(min(held.values()), rows, batch):
            part = clustered(rng, centers, min(batch, rows - a))
            body = fields_to_safetensors({"rows": part, "ids": np.arange(a, a + len(part))},
                                         REQUEST_KEY)
            for name in names:
                t = time.perf_counter()
                r = await c.post(f"/stores/{name}/rows", content=body,
                                 headers={"content-type": SAFETENSORS})
                took[name].append(time.perf_counter() - t)
                assert r.status_code == 200, r.text
            print(f"imported {a + len(part)} of {rows} rows in "
                  f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        doc = (await c.get("/stores/indexed")).json()
        assert doc["indexed"], doc
        importing = peak.take()

        async def query(body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
            content = fields_to_safetensors({"sketches": test, "k": topk, **body}, REQUEST_KEY)
            t = time.perf_counter()
            r = await c.post("/stores/indexed/query", content=content,
                             headers={"content-type": SAFETENSORS})
            assert r.status_code == 200, r.text
            return time.perf_counter() - t, r.json()

        asked = {p: {} if p is None else {"probes": p} for p in probes}
        times: dict[str, list[float]] = {"exact dot": []}
        recall: dict[int | None, list[float]] = {p: [] for p in probes}
        first, _ = await query({"score": "dot", **asked[probes[0]]})  # the pieces merged
        await query({"score": "trak"})  # the trak factor, once per commit
        for n in range(rounds):
            if n < exact_rounds:
                t_exact, exact = await query({"score": "dot", "exact": True})
                times["exact dot"].append(t_exact)
            for p, extra in asked.items():
                t_approx, approx = await query({"score": "dot", **extra})
                t_trak, _ = await query({"score": "trak", **extra})
                assert approx["exact"] is False and exact["exact"] is True
                times.setdefault(f"approximate dot, {p or PROBES} probes", []).append(t_approx)
                times.setdefault(f"approximate trak, {p or PROBES} probes", []).append(t_trak)
                recall[p].append(np.mean([len(set(a) & set(e)) / topk for a, e in
                                          zip(approx["ids"], exact["ids"], strict=True)]))
        querying = peak.take()
    size = rows * dim * 2
    print(f"\n### Index {factory}: {rows} rows x {dim} float16 "
          f"({size / 2**30:.2f} GiB), bulk import in requests of {batch} rows, {queries} "
          f"queries, top {topk} (load {load()})\n")
    memory = (f"peak memory above the start (resident, less the shards' mapped pages) "
              f"{importing:.2f} GiB while importing, {querying:.2f} GiB while querying; the "
              f"first approximate query (merging the index) {first:.1f} s")
    if took["indexed"]:
        total = {name: sum(t) for name, t in took.items()}
        trained = int(np.argmax(took["indexed"]))
        others = took["indexed"][:trained] + took["indexed"][trained + 1:] or [0.0]
        print(f"import: indexed store {rows / total['indexed']:.0f} rows/s"
              + (f", plain store {rows / total['plain']:.0f} rows/s (the index's cost: "
                 f"{total['indexed'] - total['plain']:.1f} s)" if plain else "")
              + f"; the commit that trained the index (request {trained + 1} of "
              f"{len(took['indexed'])}) {took['indexed'][trained]:.1f} s, the others' median "
              f"{statistics.median(others):.1f} s; {memory}")
    else:
        print(f"import: none (--data: the stores held their rows already); {memory}")
    for p, values in recall.items():
        print(f"recall@{topk} of the approximate answers ({p or PROBES} probes) against the "
              f"exact scan: {statistics.mean(values):.3f} (min {min(values):.3f})")
    print()
    print("| query | p50 ms | p99 ms |\n|---|---|---|")
    for name, values in times.items():
        ms = np.asarray(values) * 1e3
        print(f"| {name} | {np.percentile(ms, 50):.1f} | {np.percentile(ms, 99):.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--queries", type=int, default=16)
    ap.add_argument("--topk", type=int, default=10)
    ap.add_argument("--skip-append", action="store_true")
    ap.add_argument("--skip-query", action="store_true")
    ap.add_argument("--trak-cost", action="store_true", help="only the trak / dot comparison")
    ap.add_argument("--trak-dims", default="1024,4096,8192")
    ap.add_argument("--index", action="store_true", help="only the index's import and queries")
    ap.add_argument("--factory", default="IVF1024,SQ4")
    ap.add_argument("--data", help="--index: a data directory kept after the run; its stores "
                    "are filled up to --rows (not again), so that a second run only queries")
    ap.add_argument("--probes", help="--index: an IVF index's lists searched per query, "
                    "comma-separated values each measured (default: the service's)")
    ap.add_argument("--no-plain", action="store_true",
                    help="--index: import only into the indexed store (half the disk and time)")
    ap.add_argument("--exact-rounds", type=int, default=0, metavar="N",
                    help="--index: time the exact scan in the first N rounds only (default: all)")
    args = ap.parse_args()
    if args.index:
        rounds = max(args.rounds, 20)
        asyncio.run(bench_index(args.rows, args.dim, args.factory, args.queries, args.topk,
                                rounds, max(args.batch, 65536), not args.no_plain,
                                min(args.exact_rounds or rounds, rounds),
                                [int(p) for p in args.probes.split(",")] if args.probes
                                else [None], args.data))
        return
    if args.trak_cost:
        configure()  # as psgrad serve runs (idle BLAS threads asleep): may restart in place
        asyncio.run(bench_trak(args.rounds, [int(d) for d in args.trak_dims.split(",")]))
        return
    if not args.skip_append:
        asyncio.run(bench_append(args.rounds, args.batch, args.k))
    if not args.skip_query:
        bench_query(args.rounds, args.rows, args.dim, args.queries, args.topk)


if __name__ == "__main__":
    main()
