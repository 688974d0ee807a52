"""The client warns, once per client, when the server's ``psgrad-version`` is an older release
(httpx.MockTransport for the versions no real server here has; the real app for its own)."""

from __future__ import annotations

import warnings

import httpx
import pytest

import psgrad
from psgrad._version import release
from service.api import create_app
from service.config import Settings
from tests.support.client import running_app

MODELS = {"models": [{"id": "m", "version": "1", "architecture": "mlp"}]}


def answering(version: str | None, status: int = 200) -> httpx.MockTransport:
    headers = {} if version is None else {"psgrad-version": version}
    body = MODELS if status == 200 else {"error": {"code": "unknown_model", "message": "no"}}
    return httpx.MockTransport(lambda _r: httpx.Response(status, json=body, headers=headers))


def older() -> str:
    major, minor = release(psgrad.__version__) or (0, 0)
    return f"{major}.{minor - 1}.9" if minor else f"{major - 1}.99.0"


def test_release_reads_major_and_minor() -> None:
    assert release("0.2.0") == (0, 2) and release("1.13.0rc1") == (1, 13)
    assert release("2") is None and release("x.y") is None and release("") is None


def test_an_older_server_is_warned_about_once_per_client() -> None:
    with pytest.warns(psgrad.ServerVersionWarning) as caught, \
            psgrad.Client("http://old", transport=answering(older())) as client:
        for _ in range(3):
            assert client.models.list()[0].id == "m"
    assert len(caught) == 1
    message = str(caught[0].message)
    assert older() in message and psgrad.__version__ in message and "http://old" in message
    with pytest.warns(psgrad.ServerVersionWarning), \
            psgrad.Client("http://old", transport=answering(older(), 404)) as client, \
            pytest.raises(psgrad.UnknownModel):  # an error answer names the version too
        client.models.get("nope")


async def test_the_async_client_warns_the_same_way() -> None:
    with pytest.warns(psgrad.ServerVersionWarning) as caught:
        transport = httpx.MockTransport(
            lambda _r: httpx.Response(200, json=MODELS, headers={"psgrad-version": older()}))
        async with psgrad.AsyncClient("http://old", transport=transport) as client:
            for _ in range(3):
                await client.models.list()
    assert len(caught) == 1 and older() in str(caught[0].message)


@pytest.mark.parametrize("version", [psgrad.__version__, "99.0.0", "not-a-version", None])
def test_no_warning_from_a_server_as_new_or_newer_or_unnamed(version: str | None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", psgrad.ServerVersionWarning)
        with psgrad.Client("http://new", transport=answering(version)) as client:
            client.models.list()


def test_no_warning_from_the_real_server() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", psgrad.ServerVersionWarning)
        with running_app(create_app(Settings(workers=1))) as transport, \
                psgrad.Client("http://app", transport=transport) as client:
            assert {m.id for m in client.models.list()} >= {"mlp"}
            assert client._version_read  # the header was there, and read
