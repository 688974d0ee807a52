"""``psgrad serve`` as a user starts it: a subprocess on a free loopback port, real HTTP."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file

import psgrad
from psgrad._wire import RESPONSE_KEY, fields_from_safetensors
from service.cli import is_loopback
from tests.support.api import TD0, safetensors_body
from tests.support.client import free_port, psgrad_serve

ROOT = Path(__file__).resolve().parents[2]
KEY = "e2e-key"
QUICK_START = re.search(
    r"^## Quick start\n(.*?)^## ", (ROOT / "README.md").read_text(), flags=re.S | re.M
)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with psgrad_serve({"PSGRAD_API_KEYS": KEY, "PSGRAD_BATCH_MAX_DELAY_MS": "5"}) as u:
        yield u


def test_grads_over_http_in_both_forms(url: str) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    doc = {**TD0, "outputs": ["grads", "updates", "td_errors"]}
    with httpx.Client(base_url=url, headers=auth, timeout=120) as c:
        r = c.post("/per-sample-grads", json=doc)
        assert r.status_code == 200, r.text
        st = c.post(
            "/per-sample-grads",
            content=safetensors_body(doc),
            headers={
                "content-type": "application/x-safetensors",
                "accept": "application/x-safetensors",
            },
        )
        assert st.status_code == 200, st.text
        metrics = c.get("/metrics").text
    body = r.json()
    np.testing.assert_allclose(body["updates"]["theta"], [[3.6, 1.8, -3.6]], rtol=1e-5)
    np.testing.assert_allclose(body["grads"]["theta"], [[-7.2, -3.6, 7.2]], rtol=1e-5)
    fields = fields_from_safetensors(st.content, RESPONSE_KEY)
    for name in ("updates", "grads"):
        np.testing.assert_array_equal(
            fields[name]["theta"], np.asarray(body[name]["theta"], np.float32)
        )
    np.testing.assert_array_equal(fields["td_errors"], np.asarray(body["td_errors"], np.float32))
    assert 'route="/per-sample-grads",status="200"} 2.0' in metrics


def test_keys_docs_and_health_over_http(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/per-sample-grads", json=TD0)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert c.get("/models", headers={"authorization": "Bearer wrong"}).status_code == 401
        health = c.get("/healthz")
        assert health.json() == {"status": "ok", "version": psgrad.__version__}
        assert health.headers["psgrad-version"] == psgrad.__version__
        assert c.get("/readyz").json()["ready"] is True
        page = c.get("/docs")
        assert page.status_code == 200 and "/docs-assets/swagger-ui.css" in page.text
        assert c.get("/docs-assets/swagger-ui.css").status_code == 200
        assert c.get("/openapi.json").json()["info"]["title"] == "psgrad"


def test_refuses_a_public_interface_without_keys() -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PSGRAD_API_KEYS", "PSGRAD_ADMIN_KEYS", "PSGRAD_REDIS_URL")
    }
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "service.cli",
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            str(free_port()),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "refusing" in out.stderr and "--insecure-no-auth" in out.stderr
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")


def test_readme_quick_start_runs(tmp_path: Path) -> None:
    """The curl blocks of README's Quick start, against a server without keys on loopback."""
    assert QUICK_START is not None
    blocks = re.findall(r"^```bash\n(.*?)^```", QUICK_START.group(1), flags=re.S | re.M)
    assert len(blocks) == 2
    outputs = []
    with psgrad_serve() as server:
        for block in blocks:
            script = block.replace("localhost:8000", server)
            out = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", script],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=240,
            )
            assert out.returncode == 0, out.stderr
            assert '"error"' not in out.stdout, out.stdout
            outputs.append(out.stdout)
    td = json.loads(outputs[0])
    np.testing.assert_allclose(td["updates"]["theta"], [[3.6, 1.8, -3.6]], rtol=1e-5)
    np.testing.assert_allclose(td["grads"]["theta"], [[-7.2, -3.6, 7.2]], rtol=1e-5)
    norms = json.loads(outputs[1])
    assert len(norms["norms"]) == 4 and len(norms["losses"]) == 4
    grads = load_file(str(tmp_path / "grads.safetensors"))
    assert grads["grads/conv1.weight"].shape[0] == 4
    assert sum(v[0].size for k, v in grads.items() if k.startswith("grads/")) == 1_199_882
