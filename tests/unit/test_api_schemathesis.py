"""Schemathesis against the app's own OpenAPI document: no generated request gets a 5xx.

The app runs under uvicorn on a free loopback port in a thread (its lifespan and worker thread
running); examples per operation are bounded so the whole file takes well under a minute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import hypothesis
import pytest
import schemathesis
import uvicorn
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from service.api import create_app
from tests.support.api import settings
from tests.support.client import free_port

SETTINGS = settings(
    request_timeout_s=60,
    max_body_bytes=1 << 20,
    max_batch_size=64,
    max_elements=1 << 16,
    max_result_bytes=1 << 24,
    batch_max_delay_ms=0,
)
schema = schemathesis.openapi.from_dict(create_app(SETTINGS).openapi())


@schemathesis.serializer("application/x-safetensors")
def _raw_bytes(_ctx: object, value: object) -> bytes:
    """Generated binary bodies go out as they are: the server must refuse garbage cleanly."""
    if isinstance(value, bytes):
        return value
    return str(value).encode()


@schemathesis.serializer("application/x-torch-export")
def _raw_archive(_ctx: object, value: object) -> bytes:
    """Generated .pt2 bodies, as they are, like the safetensors ones."""
    return value if isinstance(value, bytes) else str(value).encode()


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(SETTINGS), host="127.0.0.1", port=port, log_level="warning", lifespan="on"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(600):
        if server.started:
            break
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)


@schema.parametrize()
@hypothesis.settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(hypothesis.HealthCheck),
)
def test_no_server_error_for_any_generated_request(case: schemathesis.Case, base_url: str) -> None:
    case.call_and_validate(
        base_url=base_url,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )
