"""The Dockerfile and compose files, checked without a Docker engine (test_compose_up.py runs one).

Compose itself parses the files (the plugin's ``docker compose config`` where it exists, else
Debian's ``docker-compose config``, which .ci/run installs), and the tests read what it parsed:
a GPU reserved per worker, the healthchecks and start order, settings that the code knows. The
last test starts the processes compose would start, with the parsed commands and environment,
on loopback, and checks an answer computed by hand.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
import numpy as np
import pytest
import tomllib
import yaml
from packaging.requirements import Requirement

from psgrad._wire import array_from_json
from service.config import API, WORKER, Settings, read_by
from tests.support.client import free_port
from tests.support.compose import compose_command
from tests.support.redis import metric

ROOT = Path(__file__).resolve().parents[2]
GPU_FILES = (ROOT / "docker-compose.yml",)
CPU_FILES = (*GPU_FILES, ROOT / "docker-compose.cpu.yml")
SECRET_WORDS = ("KEY", "SECRET", "PASSWORD", "TOKEN")
API_KEY = "compose-test-key"
# Settings whose compose value differs from the code's default on purpose.
DELIBERATE = {
    "redis_url": "compose runs Redis; the code defaults to the embedded broker",
    "answer_redis_url": "compose runs a Redis without persistence for large answers",
    "memory_budget_mb": "a GPU has more memory than the laptop default assumes",
    "api_keys": "required: the api refuses a non-loopback host without keys",
    "worker_metrics_port": "each worker container serves its metrics; off for bare processes",
    "listen_host": "the api listens on its container's interface; bare processes on loopback",
    "worker_metrics_host": "the same for a worker's metrics (the port is not published)",
    "data_dir": "the gradient stores live in a named volume every process mounts",
}


# ---------------------------------------------------------------------------------------------
# Compose


def run_compose_config(
    files: tuple[Path, ...], tmp_path: Path, env: dict[str, str], env_file: str = ""
) -> subprocess.CompletedProcess[str]:
    """``compose config`` of ``files``, given exactly ``env`` (no PSGRAD_*) and an env file."""
    command = compose_command()
    if command is None:
        pytest.skip(
            "neither the compose plugin (`docker compose`) nor `docker-compose` is installed; "
            "`apt-get install docker-compose` (as .ci/run does) to run this test"
        )
    dotenv = tmp_path / "compose.env"
    dotenv.write_text(env_file)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PSGRAD_", "COMPOSE_"))}
    args = [*command, "--project-directory", str(ROOT), "--env-file", str(dotenv)]
    for file in files:
        args += ["-f", str(file)]
    done = subprocess.run(
        [*args, "config"],
        capture_output=True,
        text=True,
        env={**clean, **env},
        timeout=120,
        check=False,
    )
    return done


def compose_config(
    files: tuple[Path, ...],
    tmp_path: Path,
    env: dict[str, str] | None = None,
    env_file: str = "",
) -> dict[str, Any]:
    """What Compose makes of ``files``; ``env`` defaults to the one key the api needs."""
    done = run_compose_config(files, tmp_path, env or {"PSGRAD_API_KEYS": API_KEY}, env_file)
    assert done.returncode == 0, f"compose config failed:\n{done.stderr}"
    parsed: dict[str, Any] = yaml.safe_load(done.stdout)
    return parsed


@pytest.fixture(scope="module")
def gpu_config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return compose_config(GPU_FILES, tmp_path_factory.mktemp("gpu"))


@pytest.fixture(scope="module")
def cpu_config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return compose_config(CPU_FILES, tmp_path_factory.mktemp("cpu"))


def started(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services `compose up` starts: those in no profile (compose v1 lists the others too)."""
    return {name: s for name, s in config["services"].items() if not s.get("profiles")}


def workers(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in started(config).items() if list(s["command"])[:1] == ["worker"]}


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    return list(reservations.get("devices", []))


def seconds(duration: str | int | float) -> float:
    """Compose durations: v1 keeps '120s', v2 prints Go's '2m0s'."""
    if isinstance(duration, int | float):
        return float(duration)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of each volume, from v1's 'src:dst:mode' or v2's long form."""
    out = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume["source"], volume["target"]
        out.append((source, target))
    return out


def readonly(service: dict[str, Any], target: str) -> bool:
    """Whether the volume mounted at ``target`` is mounted read-only."""
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            if volume.split(":")[1] == target:
                return volume.split(":")[2:] == ["ro"]
        elif volume["target"] == target:
            return bool(volume.get("read_only"))
    raise AssertionError(f"nothing mounted at {target}")


def healthcheck_text(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    return " ".join(test) if isinstance(test, list) else str(test)


def test_each_gpu_worker_reserves_its_own_gpu(gpu_config: dict[str, Any]) -> None:
    gpu_workers = workers(gpu_config)
    assert len(gpu_workers) >= 2, sorted(gpu_config["services"])
    ids: list[str] = []
    for name, service in gpu_workers.items():
        devices = gpu_devices(service)
        assert len(devices) == 1, (name, devices)
        (device,) = devices
        assert device["driver"] == "nvidia"
        assert "gpu" in device["capabilities"]
        assert "count" not in device, "device_ids pins a GPU; count would pick any"
        assert len(device["device_ids"]) == 1, (name, device)
        ids += [str(i) for i in device["device_ids"]]
        assert service["command"] == ["worker", "--device", "cuda"]
        assert "replicas" not in service.get("deploy", {}), "replicas would share one GPU"
    assert len(set(ids)) == len(ids), f"two workers share a GPU: {ids}"


def test_services_restart_and_workers_get_time_to_drain(gpu_config: dict[str, Any]) -> None:
    for name, service in gpu_config["services"].items():
        assert service.get("restart") == "unless-stopped", name
    for name, service in workers(gpu_config).items():
        # A worker finishes its batch after SIGTERM; compose kills it after the grace period.
        assert seconds(service["stop_grace_period"]) >= 60, name
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert service["depends_on"]["redis-answers"]["condition"] == "service_healthy", name
    # The api lets the synchronous requests in flight end after SIGTERM: their deadline and the
    # planning grace, before compose kills it (it once did at 30 s, cutting them off).
    api = gpu_config["services"]["api"]
    env = {k: float(v) for k, v in api["environment"].items()
           if k in ("PSGRAD_REQUEST_TIMEOUT_S", "PSGRAD_PLANNING_GRACE_S")}
    assert seconds(api["stop_grace_period"]) >= sum(env.values()) and len(env) == 2


def test_redis_keeps_the_queue(gpu_config: dict[str, Any]) -> None:
    redis = gpu_config["services"]["redis"]
    assert str(redis["image"]).split(":")[1].split(".")[0] == "7"
    command = [str(a) for a in redis["command"]]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    # forks only for rewrites of the append-only file (what a restart loads), and those sized
    # to the traffic: about 4 kB per job (benchmarks/soak.py), 256 MiB is half an hour at 37/s
    assert command[command.index("--save") + 1] == ""
    min_size = command[command.index("--auto-aof-rewrite-min-size") + 1]
    assert min_size.endswith("mb") and int(min_size.removesuffix("mb")) >= 256, min_size
    assert "redis-cli ping" in healthcheck_text(redis)
    volumes = dict(mounts(redis))
    assert volumes.get("redis-data") == "/data", redis.get("volumes")
    assert "redis-data" in gpu_config["volumes"]


def test_answers_go_to_a_redis_without_persistence(
    gpu_config: dict[str, Any], cpu_config: dict[str, Any]
) -> None:
    answers = gpu_config["services"]["redis-answers"]
    assert str(answers["image"]) == str(gpu_config["services"]["redis"]["image"])
    command = [str(a) for a in answers["command"]]
    assert command[command.index("--appendonly") + 1] == "no"
    assert command[command.index("--save") + 1] == ""
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    # Reached over a Unix socket in a volume of its own, in /data: the image's entrypoint gives
    # that folder (its working directory) to the redis user, which creates the socket there.
    sock = PurePosixPath(command[command.index("--unixsocket") + 1])
    assert sock.parent == PurePosixPath("/data")
    assert int(command[command.index("--unixsocketperm") + 1], 8) & 0o006 == 0o006  # uid 10001
    [(volume, target)] = mounts(answers)
    assert target == "/data" and volume in gpu_config["volumes"], answers["volumes"]
    assert f"redis-cli -s {sock} ping" in healthcheck_text(answers)
    for config in (gpu_config, cpu_config):
        for name in ("api", *workers(config)):
            service = config["services"][name]
            [there] = [t for v, t in mounts(service) if v == volume]
            assert readonly(service, there), name
            assert (service["environment"]["PSGRAD_ANSWER_REDIS_URL"]
                    == f"unix://{there}/{sock.name}?db=0"), name


def test_api_waits_for_redis_and_reports_health(gpu_config: dict[str, Any]) -> None:
    api = gpu_config["services"]["api"]
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"
    assert api["depends_on"]["redis-answers"]["condition"] == "service_healthy"
    assert "/healthz" in healthcheck_text(api)
    assert "8000" in healthcheck_text(api)
    ports = api["ports"]
    assert len(ports) == 1
    port = ports[0]
    if isinstance(port, str):  # v1: 'address:published:target/tcp'
        address, published, target = port.removesuffix("/tcp").split(":")
    else:
        address, published, target = port["host_ip"], port["published"], port["target"]
    # on every interface unless PSGRAD_HOST_ADDRESS names one (the test of `up` uses loopback)
    assert (address, int(published), int(target)) == ("0.0.0.0", 8000, 8000)
    assert api["command"] == ["serve"]  # where it listens: its settings
    assert api["environment"]["PSGRAD_LISTEN_PORT"] == "8000"
    assert api["environment"]["PSGRAD_LISTEN_HOST"] == "0.0.0.0"
    assert api["environment"]["PSGRAD_REDIS_URL"] == "redis://redis:6379/0"
    for service in workers(gpu_config).values():
        assert service["environment"]["PSGRAD_REDIS_URL"] == "redis://redis:6379/0"


def test_api_keys_come_from_the_environment_or_an_env_file(tmp_path: Path) -> None:
    # The api refuses a non-loopback host without keys, so compose refuses to start without.
    refused = run_compose_config(GPU_FILES, tmp_path, env={})
    assert refused.returncode != 0
    assert "PSGRAD_API_KEYS" in refused.stderr
    from_env = compose_config(GPU_FILES, tmp_path, env={"PSGRAD_API_KEYS": "k1,k2"})
    assert from_env["services"]["api"]["environment"]["PSGRAD_API_KEYS"] == "k1,k2"
    assert from_env["services"]["api"]["environment"]["PSGRAD_ADMIN_KEYS"] == ""
    from_file = compose_config(
        GPU_FILES, tmp_path, env={"X": "1"}, env_file="PSGRAD_API_KEYS=k3\nPSGRAD_ADMIN_KEYS=adm\n"
    )
    assert from_file["services"]["api"]["environment"]["PSGRAD_API_KEYS"] == "k3"
    assert from_file["services"]["api"]["environment"]["PSGRAD_ADMIN_KEYS"] == "adm"
    # Workers serve no HTTP: they get no keys.
    for service in workers(from_file).values():
        assert not [k for k in service["environment"] if "KEYS" in k]


def test_compose_settings_are_settings_with_the_code_defaults(
    gpu_config: dict[str, Any], cpu_config: dict[str, Any]
) -> None:
    fields = Settings.model_fields
    for config in (gpu_config, cpu_config):
        for name, service in started(config).items():
            for key, value in service.get("environment", {}).items():
                if not key.startswith("PSGRAD_"):
                    continue
                field = key.removeprefix("PSGRAD_").lower()
                assert field in fields, f"{name}: {key} is no setting of service/config.py"
                parsed = getattr(Settings(**{field: value}), field)
                if fields[field].default is None and value == "":
                    parsed = None  # `${PSGRAD_X:-}`: unset, as the code takes an empty value
                if field not in DELIBERATE:
                    assert parsed == fields[field].default, (name, key, value)


def process_of(service: dict[str, Any]) -> str:
    """Which psgrad process a service runs: `serve` is the api (it has a Redis URL)."""
    command = list(service["command"])
    assert command[0] in ("serve", "worker"), command
    assert service["environment"]["PSGRAD_REDIS_URL"], "serve without Redis is no api"
    return API if command[0] == "serve" else WORKER


def test_each_process_gets_every_setting_it_reads_and_no_other(
    gpu_config: dict[str, Any], cpu_config: dict[str, Any]
) -> None:
    """service/config.py READ_BY: a setting a process reads can be set for it (from .env or
    the shell), and none is given to a process that ignores it; PSGRAD_RESULT_TTL_S reaches the
    workers, which store the results, with the api's value."""
    for config in (gpu_config, cpu_config):
        for name, service in started(config).items():
            if name in ("redis", "redis-answers"):
                continue
            process = process_of(service)
            given = {k.removeprefix("PSGRAD_").lower() for k in service["environment"]}
            wanted = set(read_by(process))
            assert given == wanted, (name, f"missing {sorted(wanted - given)}",
                                     f"not read {sorted(given - wanted)}")
        api = config["services"]["api"]["environment"]
        for name, service in workers(config).items():
            for key, value in service["environment"].items():
                if key in api and key != "PSGRAD_ANSWER_REDIS_URL":
                    assert api[key] == value, (name, key)


def test_a_setting_in_env_reaches_every_process_that_reads_it(tmp_path: Path) -> None:
    config = compose_config(GPU_FILES, tmp_path, env={"PSGRAD_API_KEYS": API_KEY,
                                                      "PSGRAD_RESULT_TTL_S": "77"})
    for name, service in started(config).items():
        if name not in ("redis", "redis-answers"):
            assert service["environment"]["PSGRAD_RESULT_TTL_S"] == "77", name


def test_cpu_override_runs_cpu_workers_and_no_gpu(
    gpu_config: dict[str, Any], cpu_config: dict[str, Any]
) -> None:
    running = started(cpu_config)
    assert {"redis", "api"} <= set(running)
    cpu_workers = workers(cpu_config)
    assert len(cpu_workers) >= 2
    for name, service in running.items():
        assert not gpu_devices(service), f"{name} still reserves a GPU"
    gpu_worker = next(iter(workers(gpu_config).values()))
    for name, service in cpu_workers.items():
        assert service["command"] == ["worker", "--device", "cpu"], name
        for key in ("environment", "restart", "stop_grace_period", "depends_on", "image",
                    "build", "healthcheck"):
            assert service[key] == gpu_worker[key], (name, key)
    # The GPU workers are still defined, in a profile that is off unless asked for.
    for name in workers(gpu_config):
        if name in cpu_config["services"]:
            assert cpu_config["services"][name]["profiles"] == ["gpu"]
    assert cpu_config["services"]["api"] == gpu_config["services"]["api"]


# ---------------------------------------------------------------------------------------------
# Dockerfile


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines = [ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if not ln.startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_image_uses_the_base_images_torch(gpu_config: dict[str, Any]) -> None:
    instructions = dockerfile()
    assert next(rest for word, rest in instructions if word == "FROM") == "${PSGRAD_BASE_IMAGE}"
    base = next(rest for word, rest in instructions if word == "ARG").split("=", 1)[1]
    # compose builds on the same base unless PSGRAD_BASE_IMAGE names another
    for name, service in started(gpu_config).items():
        if "build" in service:
            assert service["build"]["args"] == {"PSGRAD_BASE_IMAGE": base}, name
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime", base)
    assert match, base
    with (ROOT / "pyproject.toml").open("rb") as f:  # the server's requirements
        server = tomllib.load(f)["project"]["dependencies"]
    torch_req = next(req for req in map(Requirement, server) if req.name == "torch")
    assert match.group(1) in torch_req.specifier, (match.group(1), str(torch_req))
    # The image runs the torch that CI tests (the lock's CPU build of the same release).
    lock = (ROOT / ".ci" / "lock" / "test.txt").read_text()
    assert f"\ntorch=={match.group(1)}+cpu " in lock
    # Every pip install takes nothing but what it names: the lock leaves torch out, so the
    # base image's is kept.
    for word, rest in instructions:
        if word == "RUN" and "pip install" in rest:
            for part in rest.split("&&"):
                if "pip install" in part:
                    assert "--no-deps" in part, part
    server_lock = (ROOT / ".ci" / "lock" / "server.txt").read_text()
    assert "\ntorch==" not in server_lock


def test_image_installs_dependencies_before_the_code() -> None:
    """The locked dependencies first, so a code change does not reinstall them."""
    instructions = dockerfile()
    copies = [(i, rest) for i, (word, rest) in enumerate(instructions) if word == "COPY"]
    first_code = min(i for i, rest in copies if rest.split()[0] in ("client", "service", "models"))
    lock = min(i for i, rest in copies if rest.split()[0] == ".ci/lock/server.txt")
    deps = min(
        i for i, (word, rest) in enumerate(instructions)
        if word == "RUN" and "--require-hashes -r /tmp/server.txt" in rest
    )
    assert lock < deps < first_code
    assert copies[0][0] == lock


def test_image_runs_as_non_root_with_health_and_no_secrets() -> None:
    instructions = dockerfile()
    user = [rest for word, rest in instructions if word == "USER"]
    assert user and user[-1].split(":")[0] not in ("root", "0")
    health = [rest for word, rest in instructions if word == "HEALTHCHECK"]
    assert len(health) == 1 and "/healthz" in health[0] and "python3" in health[0]
    envs = " ".join(rest for word, rest in instructions if word in ("ENV", "ARG"))
    assert "THP_MEM_ALLOC_ENABLE=1" in envs.split()
    for word, rest in instructions:
        if word in ("ENV", "ARG"):
            names = re.findall(r"([A-Z_][A-Z0-9_]*)=", rest)
            assert not [n for n in names if any(s in n for s in SECRET_WORDS)], rest


def dockerignored(path: str) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""
    ignored = False
    parents = [str(Path(*Path(path).parts[: i + 1])) for i in range(len(Path(path).parts))]
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        if any(fnmatch(p, pattern) for p in parents):
            ignored = not negate
    return ignored


def test_dockerignore_sends_only_the_packages() -> None:
    for path in (
        ".env",
        ".git/config",
        "tests/conftest.py",
        "benchmarks/x.py",
        ".ci/run",
        ".ci/lock/test.txt",
        "service/__pycache__/config.cpython-311.pyc",
        "docker-compose.yml",
    ):
        assert dockerignored(path), path
    copied = [rest.split()[0] for word, rest in dockerfile() if word == "COPY"]
    for path in (*copied, "service/config.py", "models/value.py", "client/psgrad/_wire.py"):
        assert not dockerignored(path), path


def psgrad_executable() -> str:
    beside = Path(sys.executable).parent / "psgrad"
    found = str(beside) if beside.exists() else shutil.which("psgrad")
    assert found, "the psgrad console script is not installed (pip install -e ./client)"
    return found


def test_compose_commands_are_psgrad_subcommands(
    gpu_config: dict[str, Any], cpu_config: dict[str, Any]
) -> None:
    instructions = dockerfile()
    entrypoint = json.loads(next(rest for word, rest in instructions if word == "ENTRYPOINT"))
    default_cmd = json.loads(next(rest for word, rest in instructions if word == "CMD"))
    assert entrypoint == ["psgrad"]
    commands = {tuple(default_cmd)}
    for config in (gpu_config, cpu_config):
        for name, service in started(config).items():
            if name not in ("redis", "redis-answers"):
                commands.add(tuple(service["command"]))
    assert {c[0] for c in commands} == {"serve", "worker"}
    for command in sorted(commands):
        done = subprocess.run(
            [psgrad_executable(), command[0], "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        for flag in (a for a in command[1:] if a.startswith("--")):
            assert flag in done.stdout, (command, done.stdout)


# ---------------------------------------------------------------------------------------------
# The processes compose starts, on loopback


def image_env() -> dict[str, str]:
    """The ENV of the Dockerfile, as the containers get it."""
    env: dict[str, str] = {}
    for word, rest in dockerfile():
        if word == "ENV":
            env.update(pair.split("=", 1) for pair in rest.split())
    return env


def with_option(command: list[str], flag: str, value: str) -> list[str]:
    out = list(command)
    out[out.index(flag) + 1] = value
    return out


class Processes:
    """Started processes with their logs in files; all stopped with SIGTERM at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: dict[str, subprocess.Popen[bytes]] = {}
        self.stopped: set[str] = set()

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        with (self.logs / f"{name}.log").open("wb") as log:  # the child keeps its own copy
            self.started[name] = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.logs
            )

    def tails(self) -> str:
        return "\n".join(
            f"--- {name}:\n{(self.logs / f'{name}.log').read_text(errors='replace')[-3000:]}"
            for name in self.started
        )

    def check_running(self) -> None:
        dead = {
            n: p.returncode
            for n, p in self.started.items()
            if n not in self.stopped and p.poll() is not None
        }
        assert not dead, f"exited early: {dead}\n{self.tails()}"

    def stop(self, name: str, timeout: float = 60) -> int:
        proc = self.started[name]
        self.stopped.add(name)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise

    def stop_all(self) -> None:
        for name in reversed(list(self.started)):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.stop(name)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


def wait_for(what: str, probe: Callable[[], bool], procs: Processes, limit_s: float = 180) -> None:
    """Poll until probe() holds; a hang guard, not a timing check."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        procs.check_running()
        try:
            if probe():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"{what} not reached in {limit_s} s\n{procs.tails()}")


def test_compose_processes_serve_a_request_on_loopback(
    tmp_path: Path, processes: Processes
) -> None:
    config = compose_config(CPU_FILES, tmp_path)
    services = started(config)
    psgrad = psgrad_executable()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("PSGRAD_")}
    base_env.update(image_env())

    # Both Redis servers with the compose file's arguments, each on its own port and directory;
    # the answers' one with its Unix socket in its folder, where the api and workers reach it.
    import redis

    urls = {}
    for service in ("redis", "redis-answers"):
        port, folder = free_port(), tmp_path / service
        folder.mkdir()
        cmd = [str(a) for a in services[service]["command"]]
        assert shutil.which(cmd[0]), f"{cmd[0]} is not installed"
        urls[service] = f"redis://127.0.0.1:{port}/0"
        if "--unixsocket" in cmd:
            sock = folder / PurePosixPath(cmd[cmd.index("--unixsocket") + 1]).name
            cmd = with_option(cmd, "--unixsocket", str(sock))
            urls[service] = f"unix://{sock}?db=0"
        processes.start(
            service,
            [*cmd, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder)],
            base_env,
        )
    assert urls["redis-answers"].startswith("unix://")

    def service_env(name: str) -> dict[str, str]:
        env = {k: str(v) for k, v in services[name]["environment"].items()}
        assert env["PSGRAD_REDIS_URL"] == "redis://redis:6379/0"
        assert env["PSGRAD_ANSWER_REDIS_URL"].startswith("unix:///run/redis-answers/")
        return {**base_env, **env, "PSGRAD_REDIS_URL": urls["redis"],
                "PSGRAD_ANSWER_REDIS_URL": urls["redis-answers"]}

    def redis_up(url: str) -> bool:
        try:
            return bool(redis.Redis.from_url(url).ping())
        except redis.ConnectionError:  # not an OSError: redis-server is still starting
            return False

    for service, url in urls.items():
        wait_for(service, lambda url=url: redis_up(url), processes)

    metrics_ports: dict[str, int] = {}

    def worker_env(name: str) -> dict[str, str]:
        """Compose gives each worker container its own port 9400; here each gets a free one."""
        env = service_env(name)
        assert env["PSGRAD_WORKER_METRICS_PORT"] == "9400"
        assert env["PSGRAD_WORKER_METRICS_HOST"] == "0.0.0.0"
        metrics_ports[name] = free_port()
        return {**env, "PSGRAD_WORKER_METRICS_PORT": str(metrics_ports[name]),
                "PSGRAD_WORKER_METRICS_HOST": "127.0.0.1"}

    api_port = free_port()
    api_cmd = list(services["api"]["command"])

    def api_env(port: int) -> dict[str, str]:
        env = service_env("api")
        assert env["PSGRAD_LISTEN_HOST"] == "0.0.0.0"  # in its container; here loopback
        return {**env, "PSGRAD_LISTEN_HOST": "127.0.0.1", "PSGRAD_LISTEN_PORT": str(port)}

    processes.start("api", [psgrad, *api_cmd], api_env(api_port))
    cpu_workers = sorted(workers(config))
    assert len(cpu_workers) == 2
    for name in cpu_workers:
        processes.start(name, [psgrad, *services[name]["command"]], worker_env(name))

    base = f"http://127.0.0.1:{api_port}"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=base, timeout=60) as http:
        wait_for("/healthz", lambda: http.get("/healthz").status_code == 200, processes)
        wait_for("/readyz", lambda: http.get("/readyz").status_code == 200, processes)

        # TD(0) on the linear value function, checked by hand (docs of the TD(0) semantics):
        # sample 0: V(s)=0, V(s')=-0.2, delta=1.8; sample 1 is terminal: delta=0-0.2=-0.2.
        body = {
            "model": "linear-value",
            "loss": "td0",
            "inputs": [[2.0, 1.0, -2.0], [1.0, 0.0, 0.0]],
            "next_inputs": [[1.0, 2.0, 0.0], [5.0, 5.0, 5.0]],
            "rewards": [2.0, 0.0],
            "dones": [0.0, 1.0],
            "gamma": 1.0,
            "weights": {"theta": [0.2, -0.2, 0.1]},
            "outputs": ["grads", "updates", "td_errors"],
        }
        refused = http.post("/per-sample-grads", json=body)
        assert refused.status_code == 401, refused.text
        answer = http.post("/per-sample-grads", json=body, headers=auth)
        assert answer.status_code == 200, f"{answer.text}\n{processes.tails()}"
        result = answer.json()
        assert result["batch_size"] == 2
        expected = {
            "td_errors": [1.8, -0.2],
            "updates": [[3.6, 1.8, -3.6], [-0.2, 0.0, 0.0]],
            "grads": [[-7.2, -3.6, 7.2], [0.4, 0.0, 0.0]],
        }
        for output, want in expected.items():
            got = result[output]["theta"] if output != "td_errors" else result[output]
            array = array_from_json(got, name=output, max_elements=1000)
            np.testing.assert_allclose(array, want, atol=1e-5, err_msg=output)

        # A large answer (mlp's grads of one sample: fc1's alone are 1.6 MB): its bytes go
        # through the answers' Redis, not the queue's, whose append-only file would get them too.
        rng = np.random.default_rng(0)
        large = {"model": "mlp", "inputs": rng.standard_normal((1, 784)).tolist(),
                 "targets": [3], "outputs": ["grads"]}
        grads = http.post("/per-sample-grads", json=large, headers=auth)
        assert grads.status_code == 200, f"{grads.text[:500]}\n{processes.tails()}"
        assert np.asarray(grads.json()["grads"]["fc1.weight"]).shape == (1, 512, 784)

        received = {service: int(redis.Redis.from_url(url).info("stats")["total_net_input_bytes"])
                    for service, url in urls.items()}
        assert received["redis-answers"] > 1_600_000 > 1_000_000 > received["redis"], received

        # /metrics needs no key and has every metric docs/operations.md names.
        scraped = http.get("/metrics")
        assert scraped.status_code == 200
        guide = (ROOT / "docs" / "operations.md").read_text()
        named = set(re.findall(r"`(psgrad_[a-z_]+)", guide))
        assert "psgrad_queue_depth" in named
        exposed = {
            line.split()[2].removesuffix("_total")
            for line in scraped.text.splitlines()
            if line.startswith("# TYPE ")
        }
        assert not [m for m in named if m.removesuffix("_total") not in exposed], exposed
        # the workers' own pages: together they counted the two jobs
        pages = [httpx.get(f"http://127.0.0.1:{metrics_ports[name]}/metrics").text
                 for name in cpu_workers]
        assert all("psgrad_compute_seconds_bucket" in page for page in pages)
        assert sum(metric(page, 'psgrad_jobs_total{status="succeeded"}') for page in pages) == 2

        # each worker's healthcheck, run as its container runs it: passes on the port of a
        # worker that answered jobs (its /readyz), fails where no worker listens
        def healthcheck(name: str, port: int) -> int:
            kind, python, *args = services[name]["healthcheck"]["test"]
            assert (kind, python) == ("CMD", "python3"), services[name]["healthcheck"]
            return subprocess.run([sys.executable, *args], capture_output=True, timeout=30,
                                  env={**os.environ, "PSGRAD_WORKER_METRICS_PORT": str(port)},
                                  ).returncode
        assert all(healthcheck(name, metrics_ports[name]) == 0 for name in cpu_workers)
        assert healthcheck(cpu_workers[0], free_port()) != 0

        # An upgrade as docs/operations.md does it: the workers get SIGTERM and drain (exit 0);
        # a job queued meanwhile waits in Redis, through an api restart, for the new worker.
        for name in cpu_workers:
            assert processes.stop(name) == 0, processes.tails()
        queued = http.post("/jobs", json=body, headers=auth)
        assert queued.status_code == 202, queued.text
        job = queued.json()["job_id"]
        # uvicorn shuts down, then re-raises the signal it caught (exit code 143 in Docker).
        assert processes.stop("api") in (0, -signal.SIGTERM), processes.tails()

    new_port = free_port()
    processes.start("api-new", [psgrad, *api_cmd], api_env(new_port))
    name = cpu_workers[0]
    processes.start(f"{name}-new", [psgrad, *services[name]["command"]], worker_env(name))
    with httpx.Client(base_url=f"http://127.0.0.1:{new_port}", timeout=60) as http:

        def job_done() -> bool:
            status = http.get(f"/jobs/{job}", headers=auth).json()["status"]
            assert status in ("queued", "running", "succeeded"), status
            return bool(status == "succeeded")

        wait_for(f"job {job}", job_done, processes)
        done = http.get(f"/jobs/{job}", headers=auth).json()["result"]
        array = array_from_json(done["td_errors"], name="td_errors", max_elements=1000)
        np.testing.assert_allclose(array, expected["td_errors"], atol=1e-5)


def test_operations_guide_lists_every_setting() -> None:
    guide = (ROOT / "docs" / "operations.md").read_text()
    missing = [
        f"PSGRAD_{f.upper()}" for f in Settings.model_fields if f"PSGRAD_{f.upper()}`" not in guide
    ]
    assert not missing, f"add these settings to the table in docs/operations.md: {missing}"
