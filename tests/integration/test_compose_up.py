"""`docker compose up` for real: docker-compose.yml and docker-compose.cpu.yml on an engine.

Compose builds the project's image on a local base (PSGRAD_TEST_BASE_IMAGE: Python 3.11 with
torch's CPU build) and runs Redis from a local image (PSGRAD_TEST_REDIS_IMAGE), both made by
``.ci/docker-images`` where no registry is reachable. The containers talk to one another on the
project's own network; the test reaches the api only through its port, published on 127.0.0.1.
Checked: every healthcheck passes, an answer through that port equals the per-sample loop, a
gradient store on the ``psgrad-data`` volume survives ``compose restart`` and new containers
(``down``, then ``up``), and ``compose down -v`` leaves no container, network or volume behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.support.client import free_port
from tests.support.compose import compose_command
from tests.support.reference import per_sample_loop

ROOT = Path(__file__).resolve().parents[2]
FILES = ("docker-compose.yml", "docker-compose.cpu.yml")
IMAGE = "psgrad-ci/psgrad:test"  # rebuilt by each run (the engine's cache keeps the layers)
ALICE = {"authorization": "Bearer alice-key"}
# every service of the CPU override has a healthcheck (a worker's: its /readyz, once warm)
HEALTHY = {"redis", "redis-answers", "api", "worker-cpu0", "worker-cpu1"}


@dataclass
class Stack:
    """One compose project: its name, the command that drives it and the api's address."""

    project: str
    compose: list[str]
    env: dict[str, str]
    url: str

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        files = [a for f in FILES for a in ("-f", str(ROOT / f))]
        return subprocess.run([*self.compose, "-p", self.project, *files, *args], cwd=ROOT,
                              env=self.env, capture_output=True, text=True, timeout=timeout,
                              check=False)

    def check(self, *args: str, timeout: float = 300) -> str:
        done = self.run(*args, timeout=timeout)
        assert done.returncode == 0, f"compose {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def states(self) -> dict[str, str]:
        """service -> its health where it has a check, else its state (``running``, ...)."""
        ids = self.check("ps", "-q").split()
        if not ids:
            return {}
        shown = json.loads(docker("inspect", *ids))
        return {c["Config"]["Labels"]["com.docker.compose.service"]:
                (c["State"].get("Health") or {}).get("Status", c["State"]["Status"])
                for c in shown}

    def logs(self) -> str:
        return self.run("logs", "--no-color", "--tail", "40").stdout

    def labelled(self, kind: str) -> list[str]:
        """This project's containers, networks or volumes the engine still has."""
        verb = ["ps", "-a"] if kind == "container" else [kind, "ls"]
        return docker(*verb, "-q", "--filter",
                      f"label=com.docker.compose.project={self.project}").split()


def docker(*args: str) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, f"docker {' '.join(args)}:\n{done.stderr}"
    return done.stdout


def wait_for(what: str, probe: Callable[[], bool], stack: Stack, limit_s: float = 300) -> None:
    """Poll until probe() holds; a hang guard, not a timing check."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            if probe():
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"{what} not reached in {limit_s} s\n{stack.states()}\n{stack.logs()}")


def all_up(stack: Stack) -> bool:
    states = stack.states()
    return all(states.get(s) == "healthy" for s in HEALTHY)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    base = os.environ.get("PSGRAD_TEST_BASE_IMAGE", "")
    redis_image = os.environ.get("PSGRAD_TEST_REDIS_IMAGE", "")
    if not (base and redis_image):
        pytest.skip("set PSGRAD_TEST_BASE_IMAGE and PSGRAD_TEST_REDIS_IMAGE to local images "
                    "(`bash .ci/docker-images` makes them, as .ci/run does)")
    compose = compose_command()
    assert compose is not None, "install Compose (`apt-get install docker-compose`)"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSGRAD_")}
    env.update({
        "PSGRAD_BASE_IMAGE": base, "PSGRAD_REDIS_IMAGE": redis_image, "PSGRAD_IMAGE": IMAGE,
        "PSGRAD_HOST_ADDRESS": "127.0.0.1", "PSGRAD_HOST_PORT": str(port),
        "PSGRAD_API_KEYS": "alice:alice-key", "PSGRAD_ADMIN_KEYS": "ops:ops-key",
    })
    made = Stack(f"psgradtest{uuid.uuid4().hex[:8]}", compose, env, f"http://127.0.0.1:{port}")
    try:
        made.check("up", "-d", "--build", timeout=1800)
        yield made
    finally:
        made.run("down", "-v", "--remove-orphans", "--timeout", "30")


LOOPS = """
from service.fast_stats import _kernels, warm_kernels
warm_kernels()
loops = (_kernels._moments, _kernels._norms_and_dots, _kernels._sums_and_dots)
print(*(sum(sum(getattr(f.stats, k).values()) for f in loops)
        for k in ("cache_hits", "cache_misses")))
"""


def test_compose_up_serves_the_loop_and_keeps_a_store(stack: Stack) -> None:
    wait_for("every healthcheck green", lambda: all_up(stack), stack)
    # The image carries the CPU's compiled loops (this host's CPU built it): a new container
    # reads all five back and compiles none.
    kept = docker("run", "--rm", "--network", "none", "--entrypoint", "python3", IMAGE, "-c",
                  LOOPS)
    assert kept.split() == ["5", "0"], kept
    published = stack.check("port", "api", "8000").strip()
    assert published == stack.url.removeprefix("http://"), published  # loopback only

    http = httpx.Client(base_url=stack.url, timeout=120, headers=ALICE)
    wait_for("/readyz", lambda: http.get("/readyz").status_code == 200, stack)

    # A request through the published port, answered by a CPU worker container, equals the loop.
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, 784)).astype(np.float32)
    y = np.array([1, 7, 3])
    r = http.post("/per-sample-grads", json={"model": "mlp", "inputs": x.tolist(),
                                             "targets": y.tolist(), "outputs": ["grads", "norms"]})
    assert r.status_code == 200, r.text[:500]
    got = r.json()
    from service.registry import ModelRegistry

    want = per_sample_loop(ModelRegistry().get("mlp").module,
                           {"inputs": torch.from_numpy(x), "targets": torch.from_numpy(y)},
                           "cross_entropy")
    assert list(got["grads"]) == list(want.grads)
    for name, g in want.grads.items():
        np.testing.assert_allclose(np.asarray(got["grads"][name]), g.numpy(), rtol=1e-4,
                                   atol=1e-6, err_msg=name)
    np.testing.assert_allclose(got["norms"], want.norms.numpy(), rtol=1e-4)

    # A gradient store, written by the workers to the psgrad-data volume.
    r = http.put("/stores/train", json={"model": "mlp", "projection_dim": 32})
    assert r.status_code == 201, r.text
    train = rng.normal(size=(6, 784)).astype(np.float32)
    r = http.post("/stores/train/samples", json={
        "inputs": train.tolist(), "targets": [0, 1, 2, 3, 4, 5], "ids": list(range(6))})
    assert r.status_code == 200 and r.json()["samples"] == 6, r.text
    query: dict[str, Any] = {"inputs": x.tolist(), "targets": y.tolist(), "k": 3,
                             "score": "cosine"}
    before = http.post("/stores/train/query", json=query)
    assert before.status_code == 200, before.text

    # After a restart, and after new containers on the same volumes (down without -v, up).
    for step in (["restart"], ["down"], ["up", "-d"]):
        stack.check(*step, timeout=600)
        if step == ["down"]:
            assert stack.labelled("container") == [] and stack.labelled("volume") != []
            continue
        wait_for(f"every healthcheck green after {step}", lambda: all_up(stack), stack)
        wait_for(f"/readyz after {step}", lambda: http.get("/readyz").status_code == 200, stack)
        doc = http.get("/stores/train")
        assert doc.status_code == 200 and doc.json()["samples"] == 6, doc.text
        after = http.post("/stores/train/query", json=query)
        assert after.status_code == 200 and after.json() == before.json(), after.text
    # the store's files are on the named volume (read by a container on no network)
    volume = f"{stack.project}_psgrad-data"
    listed = docker("run", "--rm", "--network", "none", "-v", f"{volume}:/data:ro",
                    stack.env["PSGRAD_REDIS_IMAGE"], "find", "/data", "-name", "*train*")
    assert listed.strip(), f"no store files on {volume}"
    http.close()

    # Down, volumes included: nothing of the project is left on the engine.
    stack.check("down", "-v", "--remove-orphans", "--timeout", "30")
    for kind in ("container", "network", "volume"):
        assert stack.labelled(kind) == [], kind
