"""Error mapping, retries and Retry-After in the SDK (httpx.MockTransport, no server)."""

from __future__ import annotations

import email.utils
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import numpy as np
import pytest

import psgrad
from psgrad import _errors, dp
from psgrad._base import repeatable
from psgrad._wire import RESPONSE_KEY, fields_to_safetensors

Handler = Callable[[httpx.Request], httpx.Response]


def ok(request: httpx.Request) -> httpx.Response:
    body = fields_to_safetensors({"model": "m@1", "batch_size": 1,
                                  "norms": np.ones(1, np.float32)}, RESPONSE_KEY)
    return httpx.Response(200, content=body, headers={"content-type": "application/x-safetensors"})


def error(status: int, code: str, *, headers: dict[str, str] | None = None,
          **details: object) -> httpx.Response:
    return httpx.Response(status, headers=headers, json={"error": {
        "code": code, "message": f"{code} happened", "details": details}})


def scripted(*answers: httpx.Response | Exception) -> tuple[Handler, list[httpx.Request]]:
    """A handler that plays ``answers`` in order (raising exceptions), then answers 200."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) <= len(answers):
            answer = answers[len(seen) - 1]
            if isinstance(answer, Exception):
                raise answer
            return answer
        return ok(request)

    return handler, seen


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record the client's sleeps instead of sleeping."""
    waited: list[float] = []
    monkeypatch.setattr(psgrad._client.time, "sleep", waited.append)  # type: ignore[attr-defined]
    return waited


def client_for(handler: Handler, **kwargs: object) -> psgrad.Client:
    return psgrad.Client(base_url="http://fake", transport=httpx.MockTransport(handler),
                         **kwargs)  # type: ignore[arg-type]


def call(client: psgrad.Client) -> psgrad.GradsResult:
    return client.per_sample_grads("m", np.ones((1, 2), np.float32), outputs=["norms"])


CODES = sorted((cls.code, cls) for cls in _errors._BY_CODE.values() if cls.status >= 400)


@pytest.mark.parametrize(("code", "cls"), CODES, ids=[c for c, _ in CODES])
def test_each_error_code_raises_its_class_with_message_and_request_id(
        code: str, cls: type[psgrad.PsgradError]) -> None:
    handler, _ = scripted(*[error(cls.status, code, headers={"X-Request-ID": "req-42"},
                                  limit=3)] * 5)
    with client_for(handler, max_retries=0) as client, pytest.raises(cls) as info:
        call(client)
    exc = info.value
    assert type(exc) is cls and isinstance(exc, psgrad.PsgradError)
    assert exc.code == code and exc.message == f"{code} happened"
    assert exc.request_id == "req-42" and exc.details["limit"] == 3
    assert exc.http_status == cls.status


@pytest.mark.parametrize(("status", "cls"), [
    (400, psgrad.BadRequest), (401, psgrad.Unauthorized), (403, psgrad.Forbidden),
    (404, psgrad.NotFound), (408, psgrad.RequestTimeout), (409, psgrad.Conflict),
    (413, psgrad.TooLarge), (415, psgrad.UnsupportedMediaType), (422, psgrad.InvalidInput),
    (429, psgrad.RateLimited), (500, psgrad.InternalError), (502, psgrad.InternalError),
    (503, psgrad.Overloaded), (504, psgrad.DeadlineExceeded),
])
def test_statuses_without_a_known_code_map_to_the_status_class(
        status: int, cls: type[psgrad.PsgradError]) -> None:
    handler, _ = scripted(httpx.Response(status, text="<html>proxy says no</html>"))
    with client_for(handler, max_retries=0) as client, pytest.raises(cls) as info:
        call(client)
    assert type(info.value) is cls and info.value.http_status == status
    assert "proxy says no" in info.value.message


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
def test_retryable_statuses_are_retried_with_jittered_backoff(status: int,
                                                              sleeps: list[float]) -> None:
    handler, seen = scripted(error(status, "x"), error(status, "x"))
    with client_for(handler, max_retries=2) as client:
        assert call(client).norms.tolist() == [1.0]
    assert len(seen) == 3
    assert 0.375 <= sleeps[0] <= 0.5 and 0.75 <= sleeps[1] <= 1.0  # 0.5 * 2**n, minus <25%


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 413, 422])
def test_other_statuses_are_not_retried(status: int, sleeps: list[float]) -> None:
    handler, seen = scripted(error(status, "whatever"))
    with client_for(handler, max_retries=3) as client, pytest.raises(psgrad.PsgradError):
        call(client)
    assert len(seen) == 1 and sleeps == []


def test_retries_give_up_after_max_retries(sleeps: list[float]) -> None:
    handler, seen = scripted(*[error(503, "overloaded")] * 10)
    with client_for(handler, max_retries=3) as client, pytest.raises(psgrad.Overloaded):
        call(client)
    assert len(seen) == 4 and len(sleeps) == 3


def test_retry_after_seconds_and_http_date_are_honoured(sleeps: list[float]) -> None:
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    handler, _ = scripted(error(429, "rate_limited", headers={"Retry-After": "3"}),
                          error(503, "overloaded", headers={"Retry-After": when}))
    with client_for(handler, max_retries=2) as client:
        call(client)
    assert sleeps[0] == 3.0
    assert 25.0 <= sleeps[1] <= 30.0


def test_a_retry_after_beyond_the_cap_raises_at_once_with_retry_after(
        sleeps: list[float]) -> None:
    handler, seen = scripted(error(503, "overloaded", headers={"Retry-After": "3600"}))
    with client_for(handler, max_retries=2) as client, pytest.raises(psgrad.Overloaded) as info:
        call(client)
    assert len(seen) == 1 and sleeps == [] and info.value.retry_after == 3600.0


def test_connection_errors_are_retried_then_raised(sleeps: list[float]) -> None:
    handler, seen = scripted(httpx.ConnectError("refused"), httpx.ReadTimeout("slow"))
    with client_for(handler, max_retries=2) as client:
        call(client)
    assert len(seen) == 3 and len(sleeps) == 2
    handler, _ = scripted(*[httpx.ConnectError("refused")] * 3)
    with client_for(handler, max_retries=2) as client, \
            pytest.raises(psgrad.APIConnectionError, match="could not reach"):
        call(client)
    handler, _ = scripted(httpx.ReadTimeout("slow"))
    with client_for(handler, max_retries=0) as client, pytest.raises(psgrad.APITimeoutError):
        call(client)


def queued(request: httpx.Request) -> httpx.Response:
    return httpx.Response(202, json={"job_id": "j1", "status": "queued"})


def submit(client: psgrad.Client) -> psgrad.Job:
    """``POST /jobs`` alone (integer inputs: no model's dtype to ask first)."""
    return client.submit("m", np.ones((1, 2), np.int64), outputs=["norms"])


def dp_step(client: psgrad.Client) -> psgrad.GradsResult:
    """A DP run's step: ``POST /per-sample-grads`` with ``dp_run``, which counts once sent."""
    return client.per_sample_grads("m", np.ones((1, 2), np.int64), outputs=["clipped_mean"],
                                   dp_run="dp-1")


def adds(client: psgrad.Client) -> httpx.Response:
    """A store's samples sent by hand, with no id of the try to tell a repeat by."""
    return client._send("POST", "/stores/s/samples", json={"ids": [1]})


LOST = [httpx.ReadTimeout("slow"), httpx.RemoteProtocolError("dropped"),
        httpx.WriteError("broken pipe"), error(500, "internal_error"), error(502, "x"),
        error(504, "deadline_exceeded")]


@pytest.mark.parametrize("lost", LOST, ids=lambda a: type(a).__name__ if isinstance(
    a, Exception) else str(a.status_code))
def test_a_request_that_adds_is_not_sent_again_when_its_answer_is_lost(
        lost: httpx.Response | Exception, sleeps: list[float]) -> None:
    """A store's samples sent by hand would count twice: after a lost answer the client
    raises, saying why, where a computation alone is sent again, and a job or a DP step under
    the same Idempotency-Key, which the server queues once."""
    handler, seen = scripted(lost)
    with client_for(handler, max_retries=2) as client, pytest.raises(psgrad.PsgradError) as info:
        adds(client)
    assert len(seen) == 1 and sleeps == []
    assert isinstance(lost, httpx.Response) or "not sent again" in info.value.message
    handler, seen = scripted(lost)
    with client_for(handler, max_retries=2) as client:
        assert call(client).norms.tolist() == [1.0]
    assert len(seen) == 2 and "Idempotency-Key" not in seen[0].headers
    handler, seen = scripted(lost, *[queued(httpx.Request("POST", "http://fake/jobs"))] * 2)
    with client_for(handler, max_retries=2) as client:
        assert submit(client).id == "j1"
        keys = [r.headers["Idempotency-Key"] for r in seen]
        assert len(keys) == 2 and keys[0] == keys[1] and len(keys[0]) == 32
        submit(client)  # a new request: a new key
        assert seen[-1].headers["Idempotency-Key"] != keys[0]
    handler, seen = scripted(lost)
    with client_for(handler, max_retries=2) as client:
        assert dp_step(client).norms.tolist() == [1.0]
        keys = [r.headers["Idempotency-Key"] for r in seen]
        assert len(keys) == 2 and keys[0] == keys[1] and len(keys[0]) == 32
        dp_step(client)  # a new step: a new key
        assert seen[-1].headers["Idempotency-Key"] != keys[0]


@pytest.mark.parametrize("refused", [httpx.ConnectError("refused"), httpx.ConnectTimeout("slow"),
                                     error(408, "x"), error(429, "rate_limited"),
                                     error(503, "overloaded")],
                         ids=lambda a: type(a).__name__ if isinstance(a, Exception)
                         else str(a.status_code))
def test_a_request_that_adds_is_sent_again_where_it_surely_was_not_applied(
        refused: httpx.Response | Exception, sleeps: list[float]) -> None:
    handler, seen = scripted(refused, queued(httpx.Request("POST", "http://fake/jobs")))
    with client_for(handler, max_retries=2) as client:
        assert submit(client).id == "j1"
    assert len(seen) == 2 and len(sleeps) == 1


def test_a_dp_run_whose_answer_is_lost_is_sent_again_under_its_key(sleeps: list[float]) -> None:
    made = httpx.Response(201, json={"id": "dp-1", "model": "m"})
    handler, seen = scripted(httpx.ReadTimeout("slow"), made, made)
    with client_for(handler, max_retries=2) as client:
        assert dp.create_run(client, "m", clip_norm=1.0, delta=1e-5, noise_multiplier=1.0,
                             sample_rate=0.1, expected_batch_size=8).id == "dp-1"
        keys = [r.headers["Idempotency-Key"] for r in seen]
        assert len(keys) == 2 and keys[0] == keys[1]
        dp.create_run(client, "m", clip_norm=1.0, delta=1e-5, noise_multiplier=1.0,
                      sample_rate=0.1, expected_batch_size=8)
        assert seen[-1].headers["Idempotency-Key"] != keys[0]  # a new run: a new key


@pytest.mark.parametrize("release", [httpx.Response(200, json={}), error(404, "unknown_job"),
                                     httpx.ConnectError("refused")],
                         ids=["200", "404", "unreachable"])
def test_a_kept_answer_is_released_once_in_hand(release: httpx.Response | Exception,
                                                sleeps: list[float]) -> None:
    """A DP step's answer names the job that keeps it (``Content-Location``): the client
    deletes it once it has the answer, and a release that fails (the job expired, the server
    gone) costs the step nothing."""
    def kept(request: httpx.Request) -> httpx.Response:
        answer = ok(request)
        answer.headers["content-location"] = "/jobs/j7"
        return answer

    handler, seen = scripted(kept(httpx.Request("POST", "http://fake")), *[release] * 3)
    with client_for(handler, max_retries=2) as client:
        assert dp_step(client).norms.tolist() == [1.0]
    assert [(r.method, r.url.path) for r in seen][:2] == [("POST", "/per-sample-grads"),
                                                           ("DELETE", "/jobs/j7")]
    handler, seen = scripted()
    with client_for(handler, max_retries=2) as client:
        call(client)  # an answer that names no kept job: nothing to release
    assert [r.method for r in seen] == ["POST"]


async def test_the_async_client_does_not_send_again_what_adds() -> None:
    handler, seen = scripted(httpx.ReadTimeout("slow"))
    async with psgrad.AsyncClient(base_url="http://fake", transport=httpx.MockTransport(handler),
                                  max_retries=2) as client:
        with pytest.raises(psgrad.APITimeoutError, match="not sent again"):
            await client._send("POST", "/stores/s/samples", json={"ids": [1]})
        assert len(seen) == 1
        handler, seen = scripted(httpx.ReadTimeout("slow"))
        client._http._transport = httpx.MockTransport(handler)
        await client.per_sample_grads("m", np.ones((1, 2), np.int64),
                                      outputs=["clipped_mean"], dp_run="dp-1")
        assert len(seen) == 2 and len({r.headers["Idempotency-Key"] for r in seen}) == 1
        handler, seen = scripted(httpx.ReadTimeout("slow"),
                                 queued(httpx.Request("POST", "http://fake/jobs")))
        client._http._transport = httpx.MockTransport(handler)
        job = await client.submit("m", np.ones((1, 2), np.int64), outputs=["norms"])
        assert job.id == "j1" and len({r.headers["Idempotency-Key"] for r in seen}) == 1
    assert len(seen) == 2


def test_which_requests_may_be_sent_again() -> None:
    may = [("GET", "/jobs/j1", None), ("PUT", "/stores/s", None), ("DELETE", "/models/m", None),
           ("POST", "/per-sample-grads", {"outputs": ["norms"]}),
           ("POST", "/stores/s/query", None), ("POST", "/stores/s/lookup", None)]
    for path in ("/jobs", "/per-sample-grads"):  # queued once, whatever
        may.append(("POST", path, {"dp_run": "dp-1"}, {"Idempotency-Key": "k1"}))
    never = [("POST", "/per-sample-grads", {"dp_run": "dp-1"}), ("POST", "/jobs", None),
             ("POST", "/dp-runs", None), ("POST", "/stores/s/samples", None),
             ("POST", "/stores/s/rows", None), ("POST", "/stores/s/factors", None),
             ("POST", "/stores/s/factors/eigenvalues", None)]
    assert all(repeatable(*r) for r in may) and not any(repeatable(*r) for r in never)


async def test_the_async_client_retries_and_maps_errors_the_same_way(
        monkeypatch: pytest.MonkeyPatch) -> None:
    waited: list[float] = []

    async def fake_sleep(delay: float) -> None:
        waited.append(delay)

    monkeypatch.setattr(psgrad._async_client.asyncio, "sleep", fake_sleep)  # type: ignore[attr-defined]
    handler, seen = scripted(error(429, "rate_limited", headers={"Retry-After": "2"}),
                             httpx.ConnectError("refused"))
    async with psgrad.AsyncClient(base_url="http://fake",
                                  transport=httpx.MockTransport(handler)) as client:
        result = await client.per_sample_grads("m", np.ones((1, 2), np.float32),
                                               outputs=["norms"])
        assert result.norms.tolist() == [1.0]
        assert len(seen) == 3 and waited[0] == 2.0
    handler, _ = scripted(error(404, "unknown_model", headers={"X-Request-ID": "r1"}))
    async with psgrad.AsyncClient(base_url="http://fake",
                                  transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(psgrad.UnknownModel) as info:
            await client.models.get("nope")
    assert info.value.request_id == "r1"


def test_url_and_key_fall_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSGRAD_URL", "http://gpu-host:9000/")
    monkeypatch.setenv("PSGRAD_API_KEY", "sekrit")
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"models": []})

    with psgrad.Client(transport=httpx.MockTransport(handler)) as client:
        assert client.models.list() == []
    assert str(seen[0].url) == "http://gpu-host:9000/models"
    assert seen[0].headers["authorization"] == "Bearer sekrit"
    with psgrad.Client(base_url="http://x", api_key="other") as client:
        assert client.base_url == "http://x" and client.api_key == "other"


def test_options_after_the_url_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        psgrad.Client("http://x", "key")  # type: ignore[misc]
    with pytest.raises(TypeError):
        psgrad.AsyncClient("http://x", "key")  # type: ignore[misc]
    with client_for(ok) as client, pytest.raises(TypeError):
        client.per_sample_grads("m", [[1.0]], None, "mse")  # type: ignore[misc]


def test_import_psgrad_pulls_in_no_torch_fastapi_or_redis() -> None:
    code = ("import sys, psgrad, psgrad._cli, psgrad._cli_client; "
            "bad = [m for m in ('torch', 'fastapi', 'redis', 'starlette', 'pydantic', 'service')"
            " if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("held_after", [[True, True], [True, False]])
def test_a_store_batch_sent_again_is_taken_as_committed_only_when_the_store_holds_it(
        held_after: list[bool], sleeps: list[float]) -> None:
    """``add`` after a lost answer: the store holds none of the batch, so it is sent again;
    that try is refused 409 (the lost one was committed meanwhile), and the store now holds
    every id: the batch is in, once. Had the store held some of the ids only, another writer
    was at work and the error stands."""
    doc = {"id": "s", "model": "m@1", "samples": 0, "dtype": "float32"}
    looks = iter([[False, False], [False, False], held_after])
    posts: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/lookup"):
            return httpx.Response(200, json={"present": next(looks), "samples": 0})
        if request.url.path.endswith("/samples"):
            posts.append(1)
            if len(posts) == 1:
                raise httpx.ReadTimeout("slow")
            return error(409, "conflict")
        return httpx.Response(200, json={**doc, "samples": 2})

    with client_for(handler, max_retries=2) as client:
        store = client.stores.get("s")
        if all(held_after):
            assert store.add(np.ones((2, 3), np.int64), [0, 1], ids=[7, 8])["samples"] == 2
        else:
            with pytest.raises(psgrad.Conflict):
                store.add(np.ones((2, 3), np.int64), [0, 1], ids=[7, 8])
    assert len(posts) == 2
