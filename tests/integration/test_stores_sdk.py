"""``client.stores`` (sync and async) against the real app in process: a store made, filled in
batches from numpy arrays, torch tensors and an iterable of batches, resumed after an
interruption without sending an id twice, and queried; the answers are the HTTP routes' and
equal a numpy reference over the ``projection`` output of the same samples."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

import psgrad
from service.api import create_app
from service.api.routes import stores as stores_route
from service.stores import factors
from tests.support.api import serving, settings
from tests.support.client import running_app
from tests.support.stores import reference

DIM = 32


@pytest.fixture
def transport(tmp_path: Path) -> Iterator[httpx.BaseTransport]:
    app = create_app(settings(data_dir=str(tmp_path / "data"), max_batch_size=16))
    with running_app(app) as t:
        yield t


def data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 784)).astype(np.float32), rng.integers(0, 10, n)


def sketches(client: psgrad.Client, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    out = client.per_sample_grads("mlp", x, y, outputs=["projection"], projection_dim=DIM)
    return np.asarray(out.projection, dtype=np.float64)


def test_a_store_filled_resumed_and_queried(transport: httpx.BaseTransport) -> None:
    with psgrad.Client(base_url="http://app", transport=transport) as client:
        store = client.stores.create("train", "mlp", projection_dim=DIM, dtype="float32")
        assert store.info["samples"] == 0 and store.info["model"].startswith("mlp@")
        x, y = data(50, 1)
        ids = [f"s{i}" for i in range(50)]

        sent: list[int] = []
        real = store._client._calling

        def counting(call: Any) -> Any:
            if call.path.endswith("/samples"):
                sent.append(1)
                if len(sent) == 3:
                    raise psgrad.APIConnectionError("the network went away")
            return real(call)

        store._client._calling = counting  # type: ignore[method-assign]
        with pytest.raises(psgrad.APIConnectionError):
            store.add(x, y, ids=ids, batch_size=10)
        del store._client._calling
        assert client.stores.get("train").info["samples"] == 20  # two batches committed

        info = store.add(torch.from_numpy(x), torch.from_numpy(y), ids=ids, batch_size=10,
                         progress=True)  # resumes: the first 20 ids are skipped
        assert info["samples"] == 50 and info["commits"] == 5
        assert (info["added"], info["skipped"]) == (30, 20)

        more_x, more_y = data(7, 2)
        more_ids = [f"m{i}" for i in range(7)]
        info = store.add(iter([(more_x[:3], more_y[:3], more_ids[:3]),
                               (more_x[3:], more_y[3:], np.asarray(more_ids[3:]))]))
        assert info["samples"] == 57 and store.refresh()["samples"] == 57
        with pytest.raises(psgrad.InvalidInput, match="one kind per store"):
            store.add(more_x[:1], more_y[:1], ids=[7])

        phi = sketches(client, np.concatenate([x, more_x]), np.concatenate([y, more_y]))
        tx, ty = data(3, 3)
        q = sketches(client, tx, ty)
        names = np.asarray(ids + more_ids, dtype=object)
        for score in ("dot", "cosine", "trak"):
            found = store.query(tx, ty, k=4, score=score)
            rows, want = reference(phi, q, score, 4)
            assert found.ids.tolist() == names[rows].tolist()
            np.testing.assert_allclose(found.scores, want, rtol=1e-4,
                                       atol=1e-5 * np.abs(want).max())
        found = store.query(sketches=q, k=2, score="trak", lam=0.5)
        assert found.lam == 0.5 and found.ids.shape == (3, 2)
        top = store.query(k=3, score="self_influence")
        assert top.ids.shape == (1, 3)
        assert [s["id"] for s in client.stores.list()] == ["train"]
        assert store.delete()["deleted"] is True
        with pytest.raises(psgrad.NotFound):
            client.stores.get("train")


async def test_the_async_client_does_the_same(tmp_path: Path) -> None:
    app = create_app(settings(data_dir=str(tmp_path / "data")))
    async with app.router.lifespan_context(app), psgrad.AsyncClient(
            base_url="http://app", transport=httpx.ASGITransport(app=app)) as client:
        store = await client.stores.create("t", "mlp", projection_dim=DIM, dtype="float16")
        x, y = data(12, 4)
        info = await store.add(x, y, ids=np.arange(12), batch_size=5)
        assert info["samples"] == 12 and info["commits"] == 3
        again = await store.add(x, y, ids=np.arange(12))  # all present: skipped, and counted
        assert again["commits"] == 3 and (again["added"], again["skipped"]) == (0, 12)
        found = await store.query(x[:2], y[:2], k=3, score="dot")
        out = await client.per_sample_grads("mlp", x, y, outputs=["projection"],
                                            projection_dim=DIM)
        phi = np.asarray(out.projection).astype(np.float16).astype(np.float64)  # as stored
        rows, want = reference(phi, np.asarray(out.projection[:2], np.float64), "dot", 3)
        assert found.ids.tolist() == rows.tolist()
        np.testing.assert_allclose(found.scores, want, rtol=2e-3)
        assert [s["id"] for s in await client.stores.list()] == ["t"]
        assert (await client.stores.delete("t"))["deleted"] is True


def test_a_store_of_full_gradients_from_the_sdk(transport: httpx.BaseTransport) -> None:
    """``create`` without ``projection_dim``: each row is the sample's gradient, so a query
    scores what ``grads`` answers for the same samples."""
    with psgrad.Client(base_url="http://app", transport=transport) as client:
        store = client.stores.create("full", "value-mlp", loss="mse")
        assert (store.info["projection_kind"], store.info["projection_dim"]) == ("exact", 4801)
        rng = np.random.default_rng(4)
        x, y = rng.standard_normal((20, 8)).astype(np.float32), rng.standard_normal(20)
        store.add(x, y, ids=list(range(20)), batch_size=8)
        tx, ty = x[:3] + 0.5, y[:3]
        found = store.query(tx, ty, k=4, score="cosine")

        def flat(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            grads = client.per_sample_grads("value-mlp", a, b, loss="mse", outputs=["grads"])
            return np.concatenate([np.asarray(g, np.float64).reshape(len(a), -1)
                                   for g in grads.grads.values()], axis=1)

        rows, scores = reference(flat(x, y), flat(tx, ty), "cosine", 4)
        assert np.asarray(found.ids).tolist() == rows.tolist()
        np.testing.assert_allclose(found.scores, scores, rtol=1e-4, atol=1e-6)


def test_rows_imported_from_the_sdk_resume_and_rank_as_samples(
        transport: httpx.BaseTransport) -> None:
    """``store.add_rows``: the sketches a caller kept, sent in batches in the store's dtype,
    skipping held ids on a second run; the store ranks as one filled by ``add``."""
    with psgrad.Client(base_url="http://app", transport=transport) as client:
        x, y = data(30, 6)
        made = client.stores.create("made", "mlp", projection_dim=DIM, dtype="float16")
        made.add(x, y, ids=np.arange(30), batch_size=16)
        kept = client.stores.create("kept", "mlp", projection_dim=DIM, dtype="float16")
        phi = sketches(client, x, y)
        first = kept.add_rows(phi[:20], ids=np.arange(20), batch_size=8)
        assert (first["added"], first["samples"]) == (20, 20)
        again = kept.add_rows(phi, ids=np.arange(30), batch_size=8, progress=True)
        assert (again["added"], again["skipped"], again["samples"]) == (10, 20, 30)
        with pytest.raises(psgrad.InvalidInput, match="the rows reach 7e\\+04, past float16's "
                           "range: make the store with dtype float32"):  # was 'not finite'
            kept.add_rows(np.full((1, DIM), 70000.0, np.float32), ids=[99])
        tx, ty = data(3, 7)
        indexed = client.stores.create("indexed", "mlp", projection_dim=DIM, dtype="float16",
                                       index="IVF2,Flat")
        indexed.add_rows(phi, ids=np.arange(30))
        assert indexed.info["indexed"] and indexed.info["index"] == "IVF2,Flat"
        assert not indexed.query(tx, ty, k=5, score="dot", probes=2).exact
        assert indexed.query(tx, ty, k=5, score="dot", exact=True).exact
        for store in (made, kept, indexed):
            found = store.query(tx, ty, k=5, score="dot")
            rows, scores = reference(phi.astype(np.float16).astype(np.float64),
                                     sketches(client, tx, ty), "dot", 5)
            assert np.asarray(found.ids).tolist() == rows.tolist(), store.id
            np.testing.assert_allclose(found.scores, scores, rtol=2e-3, atol=1e-4)


def test_an_ensemble_from_the_sdk(transport: httpx.BaseTransport) -> None:
    """``create(..., checkpoints=[...])`` over two versions of a registered model: each
    checkpoint's rows are its own projection, and a dot query ranks by their summed scores."""
    with psgrad.Client(base_url="http://app", transport=transport) as client:
        one = client.models.register("ens-mlp", architecture="mlp",
                                     config={"sizes": [784, 16, 10]})
        weights = {k: np.asarray(client.models.download_weights("ens-mlp")[k]) * 2.0
                   for k in one.parameters}
        two = client.models.upload_weights("ens-mlp", weights)
        refs = [f"ens-mlp@{one.version}", f"ens-mlp@{two.version}"]
        store = client.stores.create("ens", "ens-mlp", checkpoints=refs, projection_dim=DIM)
        assert store.info["checkpoints"] == refs
        x, y = data(12, 8)
        store.add(x, y, ids=np.arange(12))
        tx, ty = data(2, 9)

        def sketch(ref: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
            out = client.per_sample_grads(ref, a, b, outputs=["projection"], projection_dim=DIM)
            return np.asarray(out.projection, dtype=np.float64)

        total = sum(sketch(r, tx, ty) @ sketch(r, x, y).T for r in refs)
        found = store.query(tx, ty, k=4, score="dot")
        want = np.argsort(-total, axis=1, kind="stable")[:, :4]
        assert np.asarray(found.ids).tolist() == want.tolist()
        np.testing.assert_allclose(found.scores, np.take_along_axis(total, want, 1),
                                   rtol=1e-4, atol=1e-5)


def test_factors_fitted_in_batches_resumed_and_queried(transport: httpx.BaseTransport) -> None:
    """``fit_factors`` in batches, resumed, then ``ekfac`` and ``kfac`` queries: the same
    answers as a store fitted in one request that the server splits into jobs (its batch limit
    is 16), whose factors are merged as size-weighted means. The resumed call's factors skip
    the samples they hold; its eigenvalues, dropped by the factors' new bases, take all 40."""
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((40, 6)).astype(np.float32), rng.integers(0, 3, 40)
    with psgrad.Client(base_url="http://app", transport=transport) as client:
        client.models.register("small", architecture="mlp", config={"sizes": [6, 5, 3]})
        found = {}
        for name, plan in (("parts", ((25, False), (40, True))), ("whole", ((40, False),))):
            store = client.stores.create(name, "small")
            store.add(x, y, ids=list(range(40)))
            for upto, resume in plan:
                info = store.fit_factors(x[:upto], y[:upto], batch_size=10 if resume or
                                         name == "parts" else 40, resume=resume)
                assert info["factors"]["samples"] == info["factors"]["eigenvalues"] == upto, info
            if name == "parts":
                assert (info["skipped"], info["fitted"]) == (25, 15)
            found[name] = {score: store.query(x[:3], y[:3], k=4, score=score)
                           for score in ("kfac", "ekfac")}
        for score in ("kfac", "ekfac"):
            a, b = found["parts"][score], found["whole"][score]
            assert a.ids.tolist() == b.ids.tolist() and a.score == score
            np.testing.assert_allclose(a.scores, b.scores, rtol=1e-4)
            assert a.damping == pytest.approx(b.damping, rel=1e-4) and a.damping > 0
        fixed = client.stores.get("parts").query(x[:3], y[:3], k=2, score="ekfac", damping=0.5)
        assert fixed.damping == 0.5


def slowed(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    """``owner.name`` made 1 s slower (a busy disk: past the tests' client timeout of 0.5 s);
    the list it answers counts its calls, each appended once the call has ended."""
    real = getattr(owner, name)
    calls: list[int] = []

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(1.0)
        try:
            return real(*args, **kwargs)
        finally:
            calls.append(1)

    monkeypatch.setattr(owner, name, slow)
    return calls


def test_a_factors_batch_whose_answer_is_lost_is_fitted_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each factors batch goes under a ``batch_id`` of its own, which its pass counts once, so
    the SDK sends a batch again after its answer was lost (here read timeouts while the server
    is slow to write the factors) and a 409 saying the batch was counted ends it: each pass
    holds every sample once. (Before batch ids, three tries fitted 30 samples.)"""
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((10, 6)).astype(np.float32), rng.integers(0, 3, 10)
    writes = slowed(monkeypatch, factors, "add")
    corrections = slowed(monkeypatch, factors, "add_eigenvalues")
    app = create_app(settings(data_dir=str(tmp_path / "data")))
    with serving(app) as url, psgrad.Client(url) as client:
        client.models.register("small", architecture="mlp", config={"sizes": [6, 5, 3]})
        client.stores.create("s", "small").add(x, y, ids=list(range(10)))
        with psgrad.Client(url, timeout=httpx.Timeout(0.5, connect=5.0), max_retries=3) as hasty:
            info = hasty.stores.get("s").fit_factors(x, y)
        assert info["fitted"] == 10
        time.sleep(3)  # every try sent has reached its write (or its refusal) by now
        assert client.stores.get("s").info["factors"]["samples"] == 10
        assert client.stores.get("s").info["factors"]["eigenvalues"] == 10
        assert len(writes) >= 2 and len(corrections) >= 2  # sent again, counted once


def test_a_batch_of_samples_whose_answer_is_lost_is_committed_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of samples is committed under its ids once at most, so ``add`` sends it again
    after a lost answer (here read timeouts while the server is slow to commit) and reads the
    store to know which try took: the store holds every sample once, and ``add`` says so."""
    commits = slowed(monkeypatch, stores_route, "commit_all")
    x, y = data(6, 5)
    app = create_app(settings(data_dir=str(tmp_path / "data")))
    with serving(app) as url, psgrad.Client(url) as client:
        client.stores.create("s", "mlp", projection_dim=DIM)
        with psgrad.Client(url, timeout=httpx.Timeout(0.5, connect=5.0), max_retries=3) as hasty:
            info = hasty.stores.get("s").add(x, y, ids=list(range(6)))
        assert (info["samples"], info["added"], info["skipped"]) == (6, 6, 0)
        time.sleep(3)  # every try sent has reached its commit (or its refusal) by now
        store = client.stores.get("s")
        assert store.info["samples"] == 6 and len(commits) >= 2  # sent again, committed once
