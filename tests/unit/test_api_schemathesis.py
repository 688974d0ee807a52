"""Schemathesis against the app's own OpenAPI document, every check on, keys configured.

Beyond "no 5xx": answers conform to the document, schema-invalid requests are refused and
schema-valid ones are not refused as malformed (400): the document states what validation
enforces (a binary body is a file format the document can only name, so any bytes are
"schema-valid" there: those are held to every check but that one; likewise a tensor's content,
rectangular nested lists or base64 data of ``prod(shape) * itemsize`` bytes, is beyond JSON Schema:
a 400 naming a tensor field is the one refusal of schema-valid JSON allowed). A schema-valid
request may still be 422 (its tensors do not fit the model: shapes are the model's, not the
document's), 404 (an unknown model or job) or 413 (a limit an operator set).
Each operation is called with the key it needs: the admin key for the routes that change models,
an API key for the rest.

The app runs under uvicorn on a free loopback port in a thread (its lifespan and worker thread
running). The run is deterministic: 25 examples per operation, derandomized (a fixed seed), and
no example database (a failure saved by one run is not replayed by the next), so five runs in a
row give one result; it takes 1-2 minutes here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig
from schemathesis.core.failures import FailureGroup
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.specs.openapi.checks import positive_data_acceptance

from psgrad._contract import TENSOR_DICT_FIELDS, TENSOR_FIELDS
from service.api import create_app
from tests.support.api import serving, settings

SETTINGS = settings(
    request_timeout_s=60,
    max_body_bytes=1 << 20,
    max_batch_size=64,
    max_elements=1 << 16,
    max_result_bytes=1 << 24,
    batch_max_delay_ms=0,
    api_keys="user-key",
    admin_keys="admin-key",
)
ACCEPTED = ["2xx", "401", "403", "404", "409", "413", "422", "429"]
# A schema-invalid body is refused like any other; one past the body limit is refused for its
# size before it is parsed (413), which schemathesis's default list for this check lacks.
REFUSED = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429",
           "5xx"]
CONFIG = SchemathesisConfig.from_dict({"checks": {
    "positive_data_acceptance": {"expected-statuses": ACCEPTED},
    "negative_data_rejection": {"expected-statuses": REFUSED},
}})
schema = schemathesis.openapi.from_dict(create_app(SETTINGS).openapi(), config=CONFIG)


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
    with serving(create_app(SETTINGS)) as url:
        # the worker's start-up warm-ups (torch.func's first jvp compiles TorchScript, which
        # parses source) end before hypothesis runs: it sets the recursion limit as it
        # generates, and CPython 3.11 fails an AST parse running meanwhile in another thread
        # ("SystemError: AST constructor recursion depth mismatch")
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/readyz", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the app never said ready"
            time.sleep(0.05)
        yield url


@schema.parametrize()
@hypothesis.settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)
def test_no_server_error_for_any_generated_request(case: schemathesis.Case, base_url: str) -> None:
    admin = case.method.upper() in ("PUT", "DELETE") and case.path.startswith("/models")
    key = "admin-key" if admin else "user-key"
    binary = case.media_type in ("application/x-safetensors", "application/x-torch-export",
                                 "application/octet-stream")  # the last: OIP's binary form
    headers = {"Authorization": f"Bearer {key}"}
    response = case.call(base_url=base_url, headers=headers)
    try:
        case.validate_response(
            response,
            headers=headers,
            transport_kwargs={"base_url": base_url, "headers": headers},
            excluded_checks=[positive_data_acceptance] if binary else [],
        )
    except FailureGroup as group:
        left = [f for f in group.exceptions if not _tensor_content(f, response)]
        if left:
            raise FailureGroup(left, f"{group.message}\n{case.as_curl_command(headers)}") from None


def _tensor_content(failure: Exception, response: Any) -> bool:
    """A 400 about one tensor's content (see the module's docstring)."""
    if not isinstance(failure, RejectedPositiveData) or response.status_code != 400:
        return False
    error = response.json()["error"]
    if not isinstance(error, dict):  # the Open Inference Protocol's shape: a message alone
        return False
    field = str(error["details"].get("field", "")).split(".")[0]
    return field in TENSOR_FIELDS + TENSOR_DICT_FIELDS
