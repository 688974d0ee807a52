"""A version is 16 hex digits; any other text after ``@`` is no version, answered as an unknown
one, and is never joined into a file path (models kept in ``PSGRAD_MODEL_DIR``): a file outside
the model directory that exists and one that does not get the same answer, and a 300-character
version is a 404, not a 500."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.api import open_client

ADMIN = {"Authorization": "Bearer admin-key"}
SPEC = {"architecture": "sequential", "input": {"shape": [4]},
        "layers": [{"type": "Linear", "args": [4, 3]}]}
VERSIONS = ("0123456789abcdef", "../../secret", "../../nothing", "a" * 300, "..")


async def refusal(c: httpx.AsyncClient, route: str, ref: str) -> str:
    """The error code ``route`` answers for ``ref`` (a job's, where the job is queued)."""
    if route == "/models":
        r = await c.get(f"/models/{ref}", headers=ADMIN)
    else:
        body: dict[str, Any] = {"model": ref, "inputs": [[1.0, 2.0, 3.0, 4.0]],
                                "targets": [0], "outputs": ["norms"]}
        if route == "/dp-runs":
            body = {"model": ref, "clip_norm": 1.0, "noise_multiplier": 2.0,
                    "expected_batch_size": 8, "dataset_size": 200, "delta": 1e-5,
                    "max_epsilon": 2.0}
        r = await c.post(route, json=body, headers=ADMIN)
        if r.status_code == 202:  # POST /jobs: refused when the job runs
            job = r.json()["job_id"]
            for _ in range(1200):
                r = await c.get(f"/jobs/{job}", headers=ADMIN)
                if r.json()["status"] not in ("queued", "running"):
                    break
                await asyncio.sleep(0.05)
            assert r.json()["status"] == "failed", r.text
            return str(r.json()["error"]["code"])
    assert r.status_code == 404, (ref[:60], r.status_code, r.text)
    return str(r.json()["error"]["code"])


@pytest.mark.parametrize("route", ["/per-sample-grads", "/jobs", "/dp-runs", "/models"])
async def test_a_version_of_another_form_is_an_unknown_version(tmp_path: Path, route: str
                                                                ) -> None:
    (tmp_path / "secret.json").write_text('{"created": 1, "id": "x"}')  # models/tiny/../../
    async with open_client(model_dir=str(tmp_path / "models"), admin_keys="admin-key") as c:
        assert (await c.put("/models/tiny", json=SPEC, headers=ADMIN)).status_code == 200
        codes = {await refusal(c, route, f"tiny@{v}") for v in VERSIONS
                 if route != "/models" or "/" not in v}  # a path segment holds no '/'
    assert codes == {"unknown_model"}


@pytest.mark.parametrize("route", ["/per-sample-grads", "/jobs", "/dp-runs", "/stores"])
@pytest.mark.parametrize("model", ["tiny", "mlp"])
async def test_an_empty_version_is_an_unknown_version(tmp_path: Path, route: str, model: str
                                                      ) -> None:
    """Issue 53's rerun: ``tiny@`` (an ``@`` and no version) was served as the newest version
    by three routes, kept as ``tiny@`` on a DP run, and refused 422 by ``POST /jobs``; it is no
    version, so every route answers it as an unknown one (and a zoo model alike)."""
    async with open_client(model_dir=str(tmp_path / "models"), admin_keys="admin-key") as c:
        assert (await c.put("/models/tiny", json=SPEC, headers=ADMIN)).status_code == 200
        if route == "/stores":
            r = await c.put("/stores/s", json={"model": f"{model}@", "projection_dim": 8},
                            headers=ADMIN)
            assert r.status_code == 404, r.text
            code = r.json()["error"]["code"]
        else:
            code = await refusal(c, route, f"{model}@")
    assert code == "unknown_model"


async def test_a_long_version_of_a_zoo_model_is_not_echoed_whole() -> None:
    async with open_client() as c:
        r = await c.post("/per-sample-grads", json={"model": "mlp@" + "a" * 100_000,
                                                    "inputs": [[0.0] * 784], "targets": [0]})
    assert r.status_code == 404 and len(r.text) < 1000, r.text[:200]


async def test_the_path_routes_answer_a_version_of_another_form_as_unknown(tmp_path: Path
                                                                          ) -> None:
    """Issue 53's second rerun: ``DELETE /models/tiny@bad`` and ``GET
    /models/tiny@bad/weights`` answered 400 where ``GET /models/tiny@bad`` answered 404; and
    ``DELETE /models/tiny@`` read the empty version as "every version". Each is an unknown
    version (404, the versions named), and nothing is deleted; so is an id of another form
    (the third rerun), as on ``GET /models/{id}``."""
    async with open_client(model_dir=str(tmp_path / "models"), admin_keys="admin-key") as c:
        made = await c.put("/models/tiny", json=SPEC, headers=ADMIN)
        assert made.status_code == 200
        for ref in ("tiny@bad", "tiny@", "tiny@0123456789abcdef", "tiny@" + "a" * 300):
            for r in (await c.delete(f"/models/{ref}", headers=ADMIN),
                      await c.get(f"/models/{ref}/weights", headers=ADMIN)):
                assert r.status_code == 404, (ref[:40], r.status_code, r.text)
                assert r.json()["error"]["code"] == "unknown_model"
                assert made.json()["version"] in r.json()["error"]["message"]
        assert (await c.get("/models/tiny", headers=ADMIN)).json()["versions"] == [
            made.json()["version"]]
        # the third rerun: an id of another form was 404 on GET /models/{id} but 400 here
        for ref in ("A3", "a~b", "x" * 300, "\u00e9", "-x", "A3@0123456789abcdef"):
            answers = [await c.get(f"/models/{ref}", headers=ADMIN),
                       await c.get(f"/models/{ref}/weights", headers=ADMIN),
                       await c.delete(f"/models/{ref}", headers=ADMIN)]
            assert [(r.status_code, r.json()["error"]["code"]) for r in answers] == [
                (404, "unknown_model")] * 3, (ref[:20], [r.text for r in answers])
        r = await c.delete(f"/models/tiny@{made.json()['version']}", headers=ADMIN)
        assert r.status_code == 200 and r.json()["deleted"] == [made.json()["version"]]
