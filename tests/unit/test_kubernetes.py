"""deploy/kubernetes/, checked without a cluster.

Every manifest parses; the base and the CPU overlay, rendered (tests/support/kustomize.py, the
same as ``kubectl kustomize`` where kubectl is installed), validate against the Kubernetes API
schemas (``kubernetes-validate``, strict: unknown fields refused) and the KEDA objects against
KEDA's CRD schemas kept in deploy/kubernetes/schemas/. Then the wiring: each process gets
exactly the settings it reads (service/config.py READ_BY), ports and probes are the app's, the
scaler reads the stream and group of service/broker/redis/keyspace.py, Redis runs as
docker-compose.yml runs it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from service.broker.redis import keyspace
from service.config import API, BOTH, READ_BY, WORKER, Settings, read_by
from tests.support.api import open_client
from tests.support.kustomize import containers, pod_spec, read_env, render, unhashed

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
BASE, CPU = DEPLOY / "base", DEPLOY / "overlays" / "cpu"
GENERATED = {"psgrad-shared", "psgrad-api", "psgrad-worker"}
K8S_VERSIONS = ["1.30.0", "1.37.0"]  # the oldest and newest we mean to support
KEDA_CRDS = {"ScaledObject": "keda.sh_scaledobjects.yaml",
             "TriggerAuthentication": "keda.sh_triggerauthentications.yaml"}


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return render(BASE)


@pytest.fixture(scope="module")
def cpu() -> list[dict[str, Any]]:
    return render(CPU)


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [obj] = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def container(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [c] = containers(find(objects, kind, name))
    return c


def test_every_manifest_parses() -> None:
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert len(files) >= 10, files
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, path
        for doc in docs:
            assert isinstance(doc, (dict, list)), path


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: the "
                    "Python rendering is checked against kubectl's where it is")
@pytest.mark.parametrize("folder", [BASE, CPU], ids=["base", "cpu"])
def test_the_python_rendering_is_kubectls(folder: Path) -> None:
    done = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    theirs = unhashed([d for d in yaml.safe_load_all(done.stdout) if d], GENERATED)

    def key(o: dict[str, Any]) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    assert sorted(theirs, key=key) == sorted(render(folder), key=key)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_the_kubernetes_api(
        version: str, base: list[dict[str, Any]], cpu: list[dict[str, Any]]) -> None:
    checked = 0
    for obj in (*base, *cpu):
        if obj["apiVersion"].startswith("keda.sh/"):
            continue
        kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked >= 2 * 9


def strict_unknown_fields(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields the structural schema does not declare (the API server would prune them)."""
    out = []
    if isinstance(obj, dict) and "properties" in schema:
        for k, v in obj.items():
            if k in schema["properties"]:
                out += strict_unknown_fields(v, schema["properties"][k], f"{path}.{k}")
            elif not schema.get("additionalProperties") and path:  # metadata is the server's
                out.append(f"{path}.{k}")
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        for k, v in obj.items():
            out += strict_unknown_fields(v, schema["additionalProperties"], f"{path}.{k}")
    elif isinstance(obj, list) and "items" in schema:
        for i, v in enumerate(obj):
            out += strict_unknown_fields(v, schema["items"], f"{path}[{i}]")
    return out


def keda_schema(kind: str) -> dict[str, Any]:
    crd = yaml.safe_load((DEPLOY / "schemas" / KEDA_CRDS[kind]).read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return dict(version["schema"]["openAPIV3Schema"])


def test_keda_objects_validate_against_kedas_crds(base: list[dict[str, Any]]) -> None:
    keda = [o for o in base if o["apiVersion"].startswith("keda.sh/")]
    assert sorted(o["kind"] for o in keda) == ["ScaledObject", "TriggerAuthentication"]
    for obj in keda:
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        schema = keda_schema(obj["kind"])
        jsonschema.Draft7Validator(schema).validate(obj)
        assert not strict_unknown_fields(obj, schema), strict_unknown_fields(obj, schema)
    # the check refuses what it should: a misspelt field, a wrong type
    scaled = find(base, "ScaledObject", "psgrad-worker")
    schema = keda_schema("ScaledObject")
    assert strict_unknown_fields({**scaled, "spec": {**scaled["spec"], "minReplicas": 0}},
                                 schema) == [".spec.minReplicas"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(
            {**scaled, "spec": {**scaled["spec"], "minReplicaCount": "zero"}})


# --- wiring ------------------------------------------------------------------------------------


def settings_given(objects: list[dict[str, Any]], name: str) -> dict[str, str | None]:
    """PSGRAD_* variables of a Deployment's container: its ConfigMaps' and its own (None: from
    a Secret), each name once."""
    c = container(objects, "Deployment", name)
    given: dict[str, str | None] = {}
    for source in c.get("envFrom", []):
        data = find(objects, "ConfigMap", source["configMapRef"]["name"])["data"]
        for k, v in data.items():
            assert k not in given, (name, k)
            given[k] = v
    for env in c.get("env", []):
        if env["name"].startswith("PSGRAD_"):
            assert env["name"] not in given, (name, env["name"])
            given[env["name"]] = env.get("value")
    return given


@pytest.mark.parametrize("objects", ["base", "cpu"])
def test_each_process_gets_every_setting_it_reads_and_no_other(
        objects: str, request: pytest.FixtureRequest) -> None:
    rendered = request.getfixturevalue(objects)
    for name, process in (("psgrad-api", API), ("psgrad-worker", WORKER)):
        given = settings_given(rendered, name)
        fields = {k.removeprefix("PSGRAD_").lower() for k in given}
        wanted = set(read_by(process))
        assert fields == wanted, (name, f"missing {sorted(wanted - fields)}",
                                  f"not read {sorted(fields - wanted)}")
        for key, value in given.items():
            if value is not None and "$(" not in value:
                Settings(**{key.removeprefix("PSGRAD_").lower(): value})  # a valid value


# Settings whose value here differs from the code's default on purpose.
DELIBERATE = {
    "device": "the api computes nothing on a GPU (its pods have none)",
    "memory_budget_mb": "a GPU has more memory than the laptop default assumes (as compose)",
    "listen_host": "the api listens on its pod's interface",
    "worker_metrics_host": "the workers' metrics are scraped from other pods",
    "worker_metrics_port": "each worker serves its metrics (as compose)",
    "torch_threads": "the CPU overlay: the cores its pods are given",
}


def test_settings_are_the_codes_defaults_unless_deliberate() -> None:
    fields = Settings.model_fields
    files = [*(BASE / "settings" / f"{f}.env" for f in ("shared", "api", "worker")),
             CPU / "worker.env"]
    for file in files:
        for key, value in read_env(file).items():
            field = key.removeprefix("PSGRAD_").lower()
            parsed = getattr(Settings(**{field: value}), field)
            if fields[field].default is None and value == "":
                parsed = None  # an empty value: unset
            if field not in DELIBERATE:
                assert parsed == fields[field].default, (file, key, value)


def test_settings_files_hold_what_their_readers_read() -> None:
    """shared.env: settings both read (one value for both); api.env, worker.env: one reader's."""
    for file, readers in ((BASE / "settings" / "shared.env", BOTH),
                          (BASE / "settings" / "api.env", frozenset({API})),
                          (BASE / "settings" / "worker.env", frozenset({WORKER})),
                          (CPU / "worker.env", frozenset({WORKER}))):
        for key in read_env(file):
            assert READ_BY[key.removeprefix("PSGRAD_").lower()] == readers, (file, key)


def test_secrets_and_urls_resolve(base: list[dict[str, Any]]) -> None:
    """$(VAR) in a value names a variable defined before it; secrets come from psgrad-keys."""
    for obj in base:
        for c in containers(obj):
            defined: set[str] = set()
            for env in c.get("env", []):
                for ref in re.findall(r"\$\((\w+)\)", env.get("value", "")):
                    assert ref in defined, (obj["metadata"]["name"], env["name"], ref)
                secret = env.get("valueFrom", {}).get("secretKeyRef")
                if secret:
                    assert secret["name"] == "psgrad-keys", env
                defined.add(env["name"])
            for arg in c.get("args", []):
                for ref in re.findall(r"\$\((\w+)\)", arg):
                    assert ref in defined, (obj["metadata"]["name"], arg)
    env = {e["name"]: e for e in container(base, "Deployment", "psgrad-api")["env"]}
    assert env["PSGRAD_API_KEYS"]["valueFrom"]["secretKeyRef"]["key"] == "api-keys"
    for name in ("psgrad-api", "psgrad-worker"):
        urls = settings_given(base, name)
        assert urls["PSGRAD_REDIS_URL"] == "redis://:$(REDIS_PASSWORD)@psgrad-redis:6379/0"
        assert (urls["PSGRAD_ANSWER_REDIS_URL"]
                == "redis://:$(REDIS_PASSWORD)@psgrad-redis-answers:6379/0")


def test_no_pod_gets_service_link_variables(base: list[dict[str, Any]]) -> None:
    """A Service named psgrad-api would set PSGRAD_API_PORT=tcp://... in every pod: a PSGRAD_*
    variable the settings would read."""
    for obj in base:
        spec = pod_spec(obj)
        if spec is not None:
            assert spec.get("enableServiceLinks") is False, obj["metadata"]["name"]


def service_ports(objects: list[dict[str, Any]], service: str, workload: dict[str, Any]
                  ) -> dict[int, int]:
    """{service port: container port} of ``service``, whose selector picks ``workload``."""
    svc = find(objects, "Service", service)
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items(), service
    [c] = containers(workload)
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    return {p["port"]: named[p["targetPort"]] if isinstance(p["targetPort"], str)
            else p["targetPort"] for p in svc["spec"]["ports"]}


async def test_api_ports_and_probes_are_the_apps(base: list[dict[str, Any]]) -> None:
    api = find(base, "Deployment", "psgrad-api")
    given = settings_given(base, "psgrad-api")
    assert given["PSGRAD_LISTEN_HOST"] == "0.0.0.0"
    port = int(given["PSGRAD_LISTEN_PORT"] or 0)
    assert service_ports(base, "psgrad-api", api) == {8000: port}
    [c] = containers(api)
    assert c["args"] == ["serve"]
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    probes = {kind: c[kind]["httpGet"] for kind in ("readinessProbe", "livenessProbe")}
    for probe in probes.values():
        assert named[probe["port"]] == port
    assert probes["livenessProbe"]["path"] == "/healthz"
    assert probes["readinessProbe"]["path"] == "/readyz?need_worker=false"
    async with open_client(workers=0) as client:  # no worker: ready only without need_worker
        for kind, probe in probes.items():
            answer = await client.get(probe["path"])
            assert answer.status_code == 200, (kind, answer.text)
        assert (await client.get("/readyz")).status_code == 503
    # long enough for a synchronous request to get its answer after SIGTERM, a worker's
    # planning time included (the deadline does not count it, up to the planning grace)
    grace = api["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(given["PSGRAD_REQUEST_TIMEOUT_S"] or 0) + float(
        given["PSGRAD_PLANNING_GRACE_S"] or 0)


def test_workers_get_a_gpu_each_metrics_and_time_to_drain(
        base: list[dict[str, Any]], cpu: list[dict[str, Any]]) -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    compose_grace = int(compose["services"]["worker-gpu0"]["stop_grace_period"].rstrip("s"))
    for objects, device in ((base, "cuda"), (cpu, "cpu")):
        worker = find(objects, "Deployment", "psgrad-worker")
        spec = worker["spec"]["template"]["spec"]
        [c] = containers(worker)
        assert c["args"] == ["worker", "--device", device]
        assert "replicas" not in worker["spec"], "KEDA owns the replica count"
        given = settings_given(objects, "psgrad-worker")
        assert given["PSGRAD_WORKER_METRICS_HOST"] == "0.0.0.0"
        metrics = int(given["PSGRAD_WORKER_METRICS_PORT"] or 0)
        assert service_ports(objects, "psgrad-worker-metrics", worker) == {metrics: metrics}
        assert c["livenessProbe"]["httpGet"]["path"] == "/metrics"
        # ready once warm (service/worker_process.py's port): a rollout waits for warm workers
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        # SIGTERM: the batch in hand is finished and acknowledged, jobs read but not started
        # are handed back (service/worker_process.py); as long as compose allows, and longer
        # than the visibility timeout after which a cut-off job is claimed anyway
        grace = spec["terminationGracePeriodSeconds"]
        assert grace >= compose_grace
        assert grace > float(given["PSGRAD_VISIBILITY_TIMEOUT_S"] or 0)
        gpus = c["resources"]["limits"].get("nvidia.com/gpu")
        if device == "cuda":
            assert gpus == 1
            assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
                spec["tolerations"])
        else:
            assert gpus is None and "nodeSelector" not in spec and "tolerations" not in spec
            cores = c["resources"]["limits"]["cpu"]
            assert given["PSGRAD_TORCH_THREADS"] == str(cores)  # torch's threads: its cores


def test_the_scaler_reads_the_job_streams_lag(base: list[dict[str, Any]]) -> None:
    scaled = find(base, "ScaledObject", "psgrad-worker")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "psgrad-worker"
    find(base, "Deployment", "psgrad-worker")
    assert scaled["spec"]["minReplicaCount"] == 0  # scale to zero
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "redis-streams"
    meta = trigger["metadata"]
    prefix = read_env(BASE / "settings" / "shared.env")["PSGRAD_REDIS_PREFIX"]
    assert meta["stream"] == keyspace.job_stream(prefix)
    assert meta["consumerGroup"] == keyspace.STREAM_GROUP
    assert int(meta["lagCount"]) >= 1 and int(meta["activationLagCount"]) == 0
    assert "pendingEntriesCount" not in meta and "streamLength" not in meta
    # the queue's Redis, by the name KEDA's operator resolves from its own namespace
    redis = find(base, "StatefulSet", "psgrad-redis")
    namespace = redis["metadata"]["namespace"]
    assert service_ports(base, "psgrad-redis", redis) == {6379: 6379}
    assert meta["address"] == f"psgrad-redis.{namespace}.svc.cluster.local:6379"
    auth = find(base, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    [secret] = auth["spec"]["secretTargetRef"]
    assert secret["parameter"] == "password"
    [redis_c] = containers(redis)
    password = {e["name"]: e for e in redis_c["env"]}["REDIS_PASSWORD"]
    assert password["valueFrom"]["secretKeyRef"] == {"name": secret["name"], "key": secret["key"]}


def flags(args: list[str]) -> dict[str, str]:
    """redis-server's ``--flag value`` pairs."""
    assert args[0] == "redis-server" and len(args) % 2 == 1, args
    return dict(zip(args[1::2], args[2::2], strict=True))


def test_redis_runs_as_compose_runs_it(base: list[dict[str, Any]]) -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name, kind, service in (("psgrad-redis", "StatefulSet", "redis"),
                                ("psgrad-redis-answers", "Deployment", "redis-answers")):
        ours = flags(container(base, kind, name)["args"])
        theirs = flags([str(a) for a in compose[service]["command"]])
        for flag, value in theirs.items():
            # the socket: one host only; protected mode: for a Redis without a password, which
            # compose's is and these are not (--requirepass already admits other pods)
            if flag not in ("--unixsocket", "--unixsocketperm", "--protected-mode"):
                assert ours.get(flag) == value, (name, flag)
        assert ours["--requirepass"] == "$(REDIS_PASSWORD)"
    queue = find(base, "StatefulSet", "psgrad-redis")
    [c] = containers(queue)
    [claim] = queue["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == flags(c["args"])["--dir"]
    assert flags(c["args"])["--appendonly"] == "yes"


def test_disruption_budgets_and_images_are_parameters(base: list[dict[str, Any]]) -> None:
    for name in ("psgrad-api", "psgrad-worker"):
        budget = find(base, "PodDisruptionBudget", name)
        labels = find(base, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    spec = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    named = {i["name"] for i in spec["images"]}
    raw = [c["image"] for path in BASE.glob("*.yaml") if path.name != "kustomization.yaml"
           for doc in yaml.safe_load_all(path.read_text()) if doc for c in containers(doc)]
    assert raw and set(raw) <= named, raw  # every image is set in kustomization.yaml
    for obj in base:
        for c in containers(obj):
            assert ":" in c["image"], c["image"]
