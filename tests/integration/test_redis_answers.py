"""Answers through Redis in pieces: relayed whole or not at all, expiring, deleted with the job,
dropped on cancel, and a worker killed (-9) mid-answer leaving its job to be retried; with the
pieces in the queue's Redis and in a Redis of their own (``PSGRAD_ANSWER_REDIS_URL``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from psgrad._answer_reader import AnswerReader
from psgrad._errors import InvalidInput, Overloaded
from psgrad._wire import RESPONSE_KEY
from service.broker.redis import keyspace, reader
from service.broker.redis.api import RedisBroker
from service.broker.redis.common import command_parts, pieces
from service.broker.redis.worker import RedisJobSource
from service.broker.redis.writer import AnswerWriter
from service.config import Settings
from service.jobs import AnswerLost, Job, JobStatus, new_job_id, read_answer
from service.model_store import make_store
from service.registry import ModelRegistry, make_registry
from tests.support.api import open_client
from tests.support.client import free_port
from tests.support.cluster import check_answer, cluster, env_of, job_done
from tests.support.redis import SHARED_URL, OwnRedis, prefix_on, queue, redis_or_skip

RESULT = {"model": "x", "grads": {"w": np.arange(300_000, dtype=np.float32)},
          "norms": np.ones(4, np.float32)}


@pytest.fixture
def shared() -> Iterator[redis.Redis]:
    client = redis_or_skip()
    yield client
    client.close()


@pytest.fixture(params=[False, True], ids=["one-redis", "answers-redis"])
def answers_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str | None]:
    """Where the answers' pieces go: the queue's Redis (None), or a private redis-server of
    their own, as docker-compose.yml runs one (reached over a Unix socket), here with a password
    as docs/operations.md sets one up for workers on other hosts."""
    if not request.param:
        yield None
        return
    own = OwnRedis(tmp_path, password="answers-secret", unix_socket=True)
    own.start()
    yield own.url
    own.kill()


@pytest.fixture
def pieces_r(shared: redis.Redis, answers_url: str | None) -> Iterator[redis.Redis]:
    """A client of the Redis that holds the answers' pieces."""
    if answers_url is None:
        yield shared
        return
    client = redis.Redis.from_url(answers_url)
    yield client
    client.close()


@pytest.fixture
def settings(shared: redis.Redis, answers_url: str | None) -> Iterator[Settings]:
    with prefix_on(shared) as prefix:
        yield Settings(redis_url=SHARED_URL, redis_prefix=prefix, visibility_timeout_s=0.5,
                       result_ttl_s=30, heartbeat_s=0.2, answer_redis_url=answers_url)


def job() -> Job:
    fields: dict[str, Any] = {"model": "mlp", "inputs": np.zeros((1, 4), np.float32)}
    return Job(id=new_job_id(), fields=fields, deadline=time.time() + 60)


async def answered(broker: RedisBroker, source: RedisJobSource, n: int) -> list[Job]:
    """``n`` jobs submitted, taken and answered with RESULT."""
    jobs = [job() for _ in range(n)]
    for j in jobs:
        await broker.submit(j)
    taken = source.take(n, 10, 0.0, 1.0)
    source.started(taken)
    for t in taken:
        source.succeed(t, RESULT)
    return jobs


@pytest.fixture(params=[0, reader.RAW_MIN_BYTES], ids=["raw", "client"])
def both_readers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """0: every answer read over its own plain socket (RawStreamReader), as large answers are."""
    monkeypatch.setattr(reader, "RAW_MIN_BYTES", request.param)


@pytest.mark.usefixtures("both_readers")
async def test_a_canceled_answer_is_dropped_and_its_reader_stops(
        settings: Settings, shared: redis.Redis, pieces_r: redis.Redis) -> None:
    async with queue(settings) as (broker, source):
        j = job()
        await broker.submit(j)
        taken = source.take(1, 10, 0.0, 1.0)
        source.started(taken)
        writer = AnswerWriter(source.r, source.pr, keyspace.job_keys(settings.redis_prefix, j.id),
                              taken[0].attempts, ttl_s=30, piece_bytes=64 << 10)
        from psgrad._wire import safetensors_parts

        head, *data = safetensors_parts(RESULT, RESPONSE_KEY)
        cut = list(pieces(data, 64 << 10))
        writer.open(cut[0])
        assert writer.begin(bytes(head))
        writer.add(cut[1])
        assert pieces_r.xlen(writer.key) == 2
        if pieces_r is not shared:  # the bytes are in the answers' Redis alone
            assert not shared.exists(writer.key)
        state = await broker.wait(j.id, 5)  # the header landed: the answer is readable
        assert state.status is JobStatus.RUNNING and state.answer is not None
        reading = asyncio.create_task(read_answer(state.answer))
        await asyncio.sleep(0.2)
        assert not reading.done()
        assert (await broker.cancel(j.id)).status is JobStatus.CANCELED
        key = keyspace.job_answer(settings.redis_prefix, j.id)
        assert not shared.exists(key) and not pieces_r.exists(writer.key)
        with pytest.raises(AnswerLost):
            await asyncio.wait_for(reading, 10)
        for piece in cut[2:4]:  # the worker goes on writing: its pieces re-create nothing
            writer.add(piece)
        assert not pieces_r.exists(writer.key)
        source.succeed(taken[0], RESULT)  # nothing stored over 'canceled'
        assert not shared.exists(key) and not pieces_r.exists(writer.key)
        assert (await broker.state(j.id)).status is JobStatus.CANCELED


@pytest.mark.usefixtures("both_readers")
async def test_answers_expire_and_are_deleted_with_the_job(
        settings: Settings, shared: redis.Redis, pieces_r: redis.Redis) -> None:
    short = settings.model_copy(update={"result_ttl_s": 2})
    async with queue(short) as (broker, source):
        jobs = await answered(broker, source, 2)
        head, data = (keyspace.job_answer(short.redis_prefix, jobs[0].id),
                      keyspace.job_pieces(short.redis_prefix, jobs[0].id, 1))
        assert 0 < shared.ttl(head) <= 2 and 0 < pieces_r.ttl(data) <= 2
        read = await read_answer((await broker.state(jobs[0].id)).answer)  # type: ignore[arg-type]
        np.testing.assert_array_equal(read["grads"]["w"], RESULT["grads"]["w"])
        assert pieces_r.exists(keyspace.job_pieces(short.redis_prefix, jobs[1].id, 1))
        await broker.forget(jobs[1].id)
        assert not shared.exists(keyspace.job_answer(short.redis_prefix, jobs[1].id))
        assert not pieces_r.exists(keyspace.job_pieces(short.redis_prefix, jobs[1].id, 1))
        await asyncio.sleep(2.5)
        assert not shared.exists(head) and not pieces_r.exists(data)


@pytest.mark.usefixtures("both_readers")
async def test_a_consumed_answer_leaves_redis_as_it_is_read(
        settings: Settings, pieces_r: redis.Redis) -> None:
    """Read once (the sync route): the entries go as they are read; read whole otherwise."""
    async with queue(settings) as (broker, source):
        source.piece_bytes = 64 << 10  # 19 pieces of grads, 1 of norms
        jobs = await answered(broker, source, 2)
        kept, consumed = (keyspace.job_pieces(settings.redis_prefix, j.id, 1) for j in jobs)
        assert pieces_r.xlen(kept) == pieces_r.xlen(consumed) == 20
        for j, consume in ((jobs[0], False), (jobs[1], True)):
            answer = (await broker.state(j.id)).answer
            assert answer is not None
            read = await read_answer(answer, consume=consume)
            np.testing.assert_array_equal(read["grads"]["w"], RESULT["grads"]["w"])
            np.testing.assert_array_equal(read["norms"], RESULT["norms"])
        assert pieces_r.xlen(kept) == 20 and pieces_r.xlen(consumed) <= 1
        assert 0 < pieces_r.ttl(consumed) <= 30


@pytest.mark.usefixtures("both_readers")
async def test_an_answer_whose_pieces_are_gone_is_lost_not_awaited(
        settings: Settings, pieces_r: redis.Redis) -> None:
    """A succeeded job whose pieces left Redis (expired first, or the answers' Redis restarted):
    its reader raises within a poll or two instead of waiting for bytes that cannot come."""
    async with queue(settings) as (broker, source):
        (j,) = await answered(broker, source, 1)
        pieces_r.delete(keyspace.job_pieces(settings.redis_prefix, j.id, 1))
        state = await broker.state(j.id)
        assert state.status is JobStatus.SUCCEEDED and state.answer is not None
        started = time.monotonic()
        with pytest.raises(AnswerLost):
            await asyncio.wait_for(read_answer(state.answer), 10)
        assert time.monotonic() - started < 3 * reader.POLL_MS / 1000


async def test_the_api_is_ready_only_with_its_answers_redis(
        shared: redis.Redis, tmp_path: Path) -> None:
    """With a Redis of their own for the answers, ``/readyz`` needs it too (no answer could be
    written or read without it): here one that answers, and one where nothing listens."""
    own = OwnRedis(tmp_path)
    own.start()
    answers_url = own.url
    with prefix_on(shared) as prefix:
        source = RedisJobSource(Settings(redis_url=SHARED_URL, redis_prefix=prefix), name="w")
        source.beat()
        try:
            for url, ready in ((answers_url, True), (f"redis://127.0.0.1:{free_port()}/0", False)):
                broker = RedisBroker(Settings(redis_url=SHARED_URL, redis_prefix=prefix,
                                              answer_redis_url=url))
                try:
                    assert await broker.ready() is ready
                finally:
                    await broker.close()
        finally:
            source.close()
            own.kill()


HALF_WRITER = """
import os, signal, sys, numpy as np
from psgrad._wire import RESPONSE_KEY, safetensors_parts
from service.broker.redis import keyspace
from service.broker.redis.common import pieces
from service.broker.redis.worker import RedisJobSource
from service.broker.redis.writer import AnswerWriter
from service.config import Settings

source = RedisJobSource(Settings(), name="doomed")
taken = []
while not taken:
    taken = source.take(1, 10, 0.0, 1.0)
source.started(taken)
result = {"grads": {"w": np.ones(1_000_000, np.float32)}}
head, *data = safetensors_parts(result, RESPONSE_KEY)
writer = AnswerWriter(source.r, source.pr, keyspace.job_keys(source.prefix, taken[0].id),
                      taken[0].attempts, ttl_s=60)
cut = list(pieces(data, 64 << 10))
writer.open(cut[0])
writer.begin(bytes(head))
for piece in cut[1:5]:
    writer.add(piece)
print("half written", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


async def test_a_worker_killed_mid_answer_leaves_the_job_to_be_retried(
        tmp_path: Path, shared: redis.Redis, answers_url: str | None) -> None:
    with prefix_on(shared) as prefix:
        async with cluster(tmp_path, SHARED_URL, prefix, n_workers=0,
                           answer_redis_url=answers_url) as c:
            rng = np.random.default_rng(1)
            request = {"model": "mlp", "inputs": rng.standard_normal((1, 784)).tolist(),
                       "targets": [3]}  # grads: 2.7 MB
            created = await c.client.post("/jobs", json=request)
            job_id = created.json()["job_id"]
            doomed = subprocess.run([sys.executable, "-c", HALF_WRITER], env=env_of(c.settings),
                                    capture_output=True, timeout=120,
                                    cwd=str(Path(__file__).resolve().parents[2]))
            assert doomed.returncode == -9, doomed.stderr.decode()[-2000:]
            state = await c.broker.state(job_id)  # attempt 1's half answer is all there is
            assert state.status is JobStatus.RUNNING and state.answer is not None
            reading = asyncio.create_task(read_answer(state.answer))
            view = (await c.client.get(f"/jobs/{job_id}")).json()
            assert view["status"] == "running" and view["result"] is None
            half = await c.client.get(f"/jobs/{job_id}",
                                      headers={"Accept": "application/x-safetensors"})
            assert half.headers["content-type"].startswith("application/json")
            c.start_worker()  # takes the job over after the visibility timeout
            with pytest.raises(AnswerLost):
                await asyncio.wait_for(reading, 60)
            view = await job_done(c.client, job_id)
            assert view["status"] == "succeeded", view
            assert c.job_hash(job_id)["answer"] == "2"
            reference = registry_of(c.settings)
            check_answer(view["result"], request, reference)
            binary = await c.client.get(f"/jobs/{job_id}",
                                        headers={"Accept": "application/x-safetensors"})
            reader = AnswerReader(RESPONSE_KEY)
            reader.feed(binary.content)
            check_answer(reader.fields(), request, reference)
            reference.store.close()


async def test_the_sync_route_relays_the_answer_and_forgets_it(
        tmp_path: Path, shared: redis.Redis, pieces_r: redis.Redis,
        answers_url: str | None) -> None:
    with prefix_on(shared) as prefix:
        async with cluster(tmp_path, SHARED_URL, prefix, n_workers=1,
                           answer_redis_url=answers_url) as c:
            rng = np.random.default_rng(2)
            request = {"model": "mlp", "inputs": rng.standard_normal((2, 784)).tolist(),
                       "targets": [3, 1], "answer_dtype": "float16"}
            r = await c.client.post("/per-sample-grads", json=request,
                                    headers={"Accept": "application/x-safetensors"})
            assert r.status_code == 200, r.text
            assert int(r.headers["content-length"]) == len(r.content)
            reader = AnswerReader(RESPONSE_KEY)
            reader.feed(r.content)
            fields = reader.fields()
            assert fields["grads"]["fc1.weight"].dtype == np.float16
            await asyncio.sleep(0.3)  # the background task forgets the job once relayed
            assert not list(shared.scan_iter(match=f"{prefix}:job:*:answer"))
            assert not list(pieces_r.scan_iter(match=f"{prefix}:job:*:pieces:*"))



async def test_a_small_answer_goes_whole_with_the_jobs_end_and_only_from_its_owner(
        settings: Settings, shared: redis.Redis, pieces_r: redis.Redis) -> None:
    """Answers of at most ANSWER_INLINE_BYTES are written by the end script itself: the stream
    holds the whole file in its one 'head' entry (then 'end'), read without another round trip;
    a larger answer of the same engine call still goes in pieces. A delivery whose job was taken
    over (a newer attempt) stores nothing and does not end the job."""
    async with queue(settings) as (broker, source):
        small_job, big_job, stale_job = job(), job(), job()
        for j in (small_job, big_job, stale_job):
            await broker.submit(j)
        taken = {t.id: t for t in source.take(3, 10, 0.0, 1.0)}
        assert source.started(list(taken.values())) == list(taken.values())
        small = {"model": "x", "norms": np.arange(4, dtype=np.float32)}
        source.succeed_all([(taken[small_job.id], small), (taken[big_job.id], RESULT)])

        entries = shared.xrange(keyspace.job_answer(settings.redis_prefix, small_job.id))
        assert [e[1][b"k"] for e in entries] == [b"head", b"end"]
        state = await broker.state(small_job.id)
        assert state.status is JobStatus.SUCCEEDED and state.answer is not None
        assert state.answer.size == len(entries[0][1][b"d"]) <= keyspace.ANSWER_INLINE_BYTES
        assert getattr(state.answer, "complete", False)  # nothing more to read
        read = await read_answer(state.answer)
        np.testing.assert_array_equal(read["norms"], small["norms"])
        big = await read_answer((await broker.state(big_job.id)).answer)  # type: ignore[arg-type]
        np.testing.assert_array_equal(big["grads"]["w"], RESULT["grads"]["w"])
        big_entries = shared.xrange(keyspace.job_answer(settings.redis_prefix, big_job.id))
        assert [e[1][b"k"] for e in big_entries] == [b"head", b"end"]  # the bytes: in pieces
        assert pieces_r.xlen(keyspace.job_pieces(settings.redis_prefix, big_job.id, 1)) > 1
        assert not pieces_r.exists(keyspace.job_pieces(settings.redis_prefix, small_job.id, 1))

        # another delivery took the stale one's job over: its small answer is not stored
        shared.hincrby(keyspace.job_state(settings.redis_prefix, stale_job.id), "attempts", 1)
        source.succeed(taken[stale_job.id], small)
        assert (await broker.state(stale_job.id)).status is JobStatus.RUNNING
        assert not shared.exists(keyspace.job_answer(settings.redis_prefix, stale_job.id))



async def test_payloads_live_beside_the_answers_and_go_when_their_job_ends(
        settings: Settings, shared: redis.Redis, pieces_r: redis.Redis,
        answers_url: str | None) -> None:
    """A request's payload is written once and read once, like an answer: with an answers'
    Redis it goes there, out of the queue's append-only file (whose rewrites it drove). It stays
    while its job may still run (a retry reads it again) and goes when the job ends, is canceled
    or is refused by a full queue; a job whose payload is gone fails with what to do."""
    full = settings.model_copy(update={"max_queue_depth": 4})
    p = full.redis_prefix
    async with queue(full) as (broker, source):
        done, canceled, retried, lost = jobs = [job() for _ in range(4)]
        for j in jobs:
            await broker.submit(j)
        for j in jobs:
            assert pieces_r.exists(keyspace.job_payload(p, j.id))
            assert bool(shared.exists(keyspace.job_payload(p, j.id))) is (answers_url is None)
        refused = job()
        with pytest.raises(Overloaded):
            await broker.submit(refused)
        assert not pieces_r.exists(keyspace.job_payload(p, refused.id))

        pieces_r.delete(keyspace.job_payload(p, lost.id))
        taken = {t.id: t for t in source.take(4, 10, 0.0, 1.0)}
        assert set(taken) == {done.id, canceled.id, retried.id}
        gone = await broker.state(lost.id)
        assert gone.status is JobStatus.FAILED and gone.error is not None
        assert "send it again" in gone.error["error"]["message"]
        source.started(list(taken.values()))
        source.succeed(taken[done.id], RESULT)
        assert not pieces_r.exists(keyspace.job_payload(p, done.id))
        await broker.cancel(canceled.id)
        assert not pieces_r.exists(keyspace.job_payload(p, canceled.id))
        source.fail(taken[retried.id], {"error": {"code": "internal_error", "message": "x"}},
                    retry=True)
        assert pieces_r.exists(keyspace.job_payload(p, retried.id))
        [again] = source.take(1, 10, 0.0, 1.0)
        assert again.id == retried.id and again.attempts == 2
        np.testing.assert_array_equal(again.fields["inputs"], retried.fields["inputs"])
        source.started([again])
        source.succeed(again, RESULT)
        assert not pieces_r.exists(keyspace.job_payload(p, retried.id))
        assert not shared.exists(keyspace.job_payload(p, retried.id))


async def test_a_keyed_job_is_queued_once_and_its_payload_left_as_it_is(
        settings: Settings, pieces_r: redis.Redis) -> None:
    """A keyed job (an ``Idempotency-Key``'s) submitted again is not queued again: the same
    request answers False, another one a 422; its payload stays for the job that holds it, and
    is not written again for a job that has ended."""
    p = settings.redis_prefix
    async with queue(settings) as (broker, source):
        first = replace(job(), digest="d1")
        payload = keyspace.job_payload(p, first.id)
        assert await broker.submit(first)
        again = replace(job(), id=first.id, digest="d1")
        assert not await broker.submit(again)
        with pytest.raises(InvalidInput, match="Idempotency-Key"):
            await broker.submit(replace(again, digest="d2"))
        assert pieces_r.exists(payload)
        taken = source.take(4, 10, 0.0, 1.0)
        assert [t.id for t in taken] == [first.id]
        source.started(taken)
        source.succeed(taken[0], RESULT)
        assert not await broker.submit(again)
        assert not pieces_r.exists(payload)
        assert source.take(4, 10, 0.0, 0.2) == []  # nothing queued again
        assert (await broker.state(first.id)).status is JobStatus.SUCCEEDED


def test_pieces_are_sent_as_views_of_the_answer() -> None:
    piece = memoryview(np.arange(4096, dtype=np.uint8))
    parts = command_parts(b"XADD", b"k", b"*", b"d", piece)
    assert parts[1] is piece  # the piece's own memory, never a copy
    assert b"".join(parts) == (b"*5\r\n$4\r\nXADD\r\n$1\r\nk\r\n$1\r\n*\r\n$1\r\nd\r\n$4096\r\n"
                               + piece.tobytes() + b"\r\n")


def test_a_refused_piece_raises_and_leaves_no_unread_replies(
        settings: Settings, pieces_r: redis.Redis) -> None:
    """An error reply mid-answer (here the stream's key holds a string) is raised, and the
    connection with the later pieces' replies unread is dropped, not lent to the next command."""
    source = RedisJobSource(settings, name="w")
    writer = AnswerWriter(source.r, source.pr, keyspace.job_keys(source.prefix, "j"), 1, ttl_s=30,
                          piece_bytes=64 << 10)
    writer.open = lambda first: pieces_r.set(writer.key, b"not a stream")  # type: ignore
    writer.begin = lambda head: True  # type: ignore[method-assign]
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        writer.write_parts(b"", [memoryview(np.zeros(1 << 20, np.uint8))])
    for i in range(5):  # every later command gets its own reply
        assert source.pr.echo(f"after {i}") == f"after {i}".encode()
    pieces_r.delete(writer.key)
    source.close()


async def test_answers_over_a_unix_socket_are_read_by_the_plain_socket_reader(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``unix://`` Redis URL (api, workers and Redis on one host): large answers still go
    through :class:`RawStreamReader`, over the socket file, not redis-py's slower parser."""
    own = OwnRedis(tmp_path, unix_socket=True)
    own.start()
    monkeypatch.setattr(reader, "RAW_MIN_BYTES", 0)
    opened: list[bool] = []
    open_reader = reader.RawStreamReader.open

    def spy(client: Any) -> reader.RawStreamReader | None:
        reader = open_reader(client)
        opened.append(reader is not None)
        return reader

    monkeypatch.setattr(reader.RawStreamReader, "open", spy)
    settings = Settings(redis_url=own.url, redis_prefix="unix-test", result_ttl_s=30)
    try:
        async with queue(settings) as (broker, source):
            jobs = await answered(broker, source, 2)
            for j in jobs:
                answer = (await broker.state(j.id)).answer
                read = await read_answer(answer)  # type: ignore[arg-type]
                np.testing.assert_array_equal(read["grads"]["w"], RESULT["grads"]["w"])
                np.testing.assert_array_equal(read["norms"], RESULT["norms"])
            assert opened == [True, True]
    finally:
        own.kill()


async def test_readiness_without_a_worker_for_workers_scaled_to_zero(
        shared: redis.Redis, tmp_path: Path) -> None:
    """``/readyz?need_worker=false`` (deploy/kubernetes/'s readiness probe): ready once jobs can
    be queued, with no worker alive (KEDA starts one when the job is queued), and not ready
    without either Redis."""
    own = OwnRedis(tmp_path)
    own.start()
    with prefix_on(shared) as prefix:
        async with open_client(redis_url=SHARED_URL, redis_prefix=prefix,
                               answer_redis_url=own.url) as c:
            assert (await c.get("/readyz")).status_code == 503  # no worker alive
            scaled = await c.get("/readyz", params={"need_worker": "false"})
            assert scaled.status_code == 200 and scaled.json()["ready"] is True
            own.kill()
            assert (await c.get("/readyz", params={"need_worker": "false"})).status_code == 503


def registry_of(settings: Settings) -> ModelRegistry:
    """A registry over the deployment's Redis model store (as a worker process reads it)."""
    return make_registry(settings, make_store(settings))
