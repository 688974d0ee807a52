"""All settings, read from ``PSGRAD_*`` environment variables through one cached object."""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from psgrad._contract import MAX_VERIFY
from psgrad._errors import TooLarge


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PSGRAD_", env_file=None, extra="ignore")

    redis_url: str | None = None
    redis_prefix: str = "psgrad"
    # where large answers' bytes go (a Redis without persistence: they are written once, read
    # once and expire); unset: the same Redis as the queue
    answer_redis_url: str | None = None
    device: str = "auto"
    memory_budget_mb: int = 1024
    fast_stats: bool = True
    # how fast statistics form the per-sample norms of a weight read at several positions:
    # "auto" picks the cheaper of the Gram form and the materialised gradient from its shapes;
    # the others force one (tests hold both to the same answers)
    fast_stats_form: Literal["auto", "gram", "materialise"] = "auto"
    compile: bool = False
    compile_secret: str = ""  # workers only: enables sharing compiled artifacts via Redis
    model_dir: str | None = None
    # gradient stores' files (service.stores): a path or an fsspec URL (s3://bucket/dir, ...);
    # unset: $XDG_DATA_HOME/psgrad. With Redis, every api replica must see the same one.
    data_dir: str | None = None
    store_shard_bytes: Annotated[int, Field(ge=1)] = 64 * 1024 * 1024  # rows per shard file
    # a store's factors file: its linear layers' Kronecker factors, two values per parameter
    max_factors_bytes: Annotated[int, Field(ge=1)] = 2 * 1024 * 1024 * 1024
    # stores' approximate indexes an api process keeps in memory (at 10 million rows of
    # IVF4096,SQ4 at 1024 one is about 7 GiB); past it the least recently queried store's goes
    index_memory_bytes: Annotated[int, Field(ge=1)] = 16 * 1024 * 1024 * 1024

    max_body_bytes: int = 512 * 1024 * 1024
    max_batch_size: int = 4096
    max_result_bytes: int = 2 * 1024 * 1024 * 1024  # simple-cnn B=256 grads: 1.2 GB
    max_reference_set_bytes: int = 256 * 1024 * 1024  # one stored reference set's tensors
    max_elements: int = 256 * 1024 * 1024
    request_timeout_s: float = 120.0
    # a job queued with POST /jobs: its deadline from when it is queued, long enough for the
    # first worker to start where workers scale to zero (docs/kubernetes.md)
    job_timeout_s: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 3600.0
    # the most a request waits past request_timeout_s while its worker plans its model: time
    # the server chose to spend, not the request's (docs/operations.md, cold starts)
    planning_grace_s: float = 900.0
    # a registration's warm-up jobs wait this long in the queue; a worker starting up warms the
    # models that asked for one for at most this long before it reports ready (service/warmup.py)
    warmup_timeout_s: float = 300.0
    max_queue_depth: int = 1000

    batch_max_delay_ms: float = 5.0
    batch_max_samples: int = 512
    # a lone job larger than this runs a chunk at a time, other tenants' jobs between (0: whole)
    fair_chunk_samples: Annotated[int, Field(ge=0)] = 64
    workers: int = 1
    torch_threads: int = 0  # intra-op threads of a worker process (0: torch's own choice)
    # CUDA's TF32 convolutions and matrix products: faster on Ampere and later, but with a 10-bit
    # mantissa (simple-cnn's per-sample gradients moved by ~1e-2 on an H100); off: float32
    allow_tf32: bool = False

    api_keys: str = ""  # comma-separated: `name:secret` (tenant name) or a bare secret
    admin_keys: str = ""
    keys_file: str | None = None  # TOML, or JSON (*.json): tenants' keys, roles, quotas

    # each tenant's quotas unless its keys file entry gives its own (service.broker.quotas); 0: none
    tenant_max_queued_samples: Annotated[int, Field(ge=0)] = 0  # samples queued or running
    tenant_max_jobs: Annotated[int, Field(ge=0)] = 0  # jobs queued or running
    tenant_requests_per_s: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.0

    result_ttl_s: int = 3600
    visibility_timeout_s: float = 60.0
    max_attempts: int = 3
    heartbeat_s: float = 2.0
    redis_timeout_s: float = 2.0  # socket timeouts: a dead Redis answers 503 fast, never hangs
    redis_transfer_timeout_s: float = 60.0  # commands that move payloads and results (MBs-GBs)
    worker_redis_grace_s: float = 30.0  # a worker that cannot reach Redis this long exits 1
    # psgrad worker serves Prometheus /metrics here (0: off)
    worker_metrics_port: Annotated[int, Field(ge=0, le=65535)] = 0
    # where processes listen: loopback unless set (compose and deploy/kubernetes/ set them)
    listen_host: str = "127.0.0.1"  # psgrad serve's interface when --host is not given
    # psgrad serve's port when --port is not given
    listen_port: Annotated[int, Field(ge=1, le=65535)] = 8000
    worker_metrics_host: str = "127.0.0.1"  # the interface of a worker's metrics
    # the fraction of jobs that did not ask for `verify` verified anyway, on this many samples
    verify_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    verify_samples: Annotated[int, Field(ge=1, le=MAX_VERIFY)] = 1

    max_layers: int = 64
    # the defaults take GPT-2 small (124M parameters, 475 MiB) and BERT-base (109M) exported
    # with a length up to 512, on a host of 24 GiB (docs/operations.md, "Limits")
    max_parameters: int = 150_000_000
    max_weight_bytes: int = 500 * 1024 * 1024  # under Redis's 512 MiB for one value
    # activation elements of one sample, at the sizes a request sends: 3 GiB of float32
    max_model_activations: int = 768 * 1024 * 1024
    max_graph_nodes: int = 20_000  # nodes of an exported program
    export_memory_mb: int = 8192  # address space of the process that checks a .pt2 archive
    export_cpu_s: int = 60  # CPU seconds of that process
    export_timeout_s: float = 120.0  # wall-clock seconds of that process
    # workers on CUDA: replay a captured graph of each class of calls seen before (graphs.py)
    cuda_graphs: bool = False
    # server processes keep the memory torch frees (glibc's malloc), reused by the next call
    # rather than faulted in afresh; their resident memory then stays at their largest peak
    keep_freed_memory: bool = True
    # an api that may register models starts that process ahead, so that a registration
    # finds torch imported
    export_spare: bool = True
    # CPU seconds of one DP run's privacy accounting (a child process, killed past them)
    dp_accounting_cpu_s: Annotated[int, Field(ge=1)] = 5

    @property
    def keys_configured(self) -> bool:
        """Any key is configured (else the server is open: loopback dev mode)."""
        return bool(self.api_key_set or self.admin_key_set or self.keys_file)

    @property
    def may_register(self) -> bool:
        """Whether a registration can come: admin keys (or a keys file, which may hold some),
        or no keys at all (the open dev mode, where anyone on the loopback registers)."""
        return bool(self.admin_key_set or self.keys_file or not self.keys_configured)

    @property
    def api_key_set(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.api_keys.split(",") if k.strip())

    @property
    def admin_key_set(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.admin_keys.split(",") if k.strip())


# The processes of a Redis deployment: ``psgrad serve`` with PSGRAD_REDIS_URL (the api) and
# ``psgrad worker``. ``psgrad serve`` without Redis runs both in one process, reading them all.
API = "api"
WORKER = "worker"
BOTH = frozenset({API, WORKER})
EMBEDDED_ONLY: frozenset[str] = frozenset()  # read only by ``psgrad serve`` without Redis

# Which process reads each setting: docker-compose*.yml and deploy/kubernetes/ give each process
# exactly the settings it reads (tests/unit/test_settings_readers.py checks them, and checks this
# table against the modules each process imports). A setting both read must have one value for
# both: PSGRAD_RESULT_TTL_S set for the api alone changed nothing, as workers store the results.
READ_BY: dict[str, frozenset[str]] = {
    "redis_url": BOTH,
    "redis_prefix": BOTH,
    "answer_redis_url": BOTH,
    "device": frozenset({API}),  # the api's model checks; a worker's device is its --device
    "memory_budget_mb": frozenset({WORKER}),
    "fast_stats": frozenset({WORKER}),
    "fast_stats_form": frozenset({WORKER}),
    "compile": frozenset({WORKER}),
    "compile_secret": frozenset({WORKER}),
    "model_dir": EMBEDDED_ONLY,  # with Redis, models live in Redis
    "data_dir": BOTH,  # the api writes and queries stores; workers read reference sets
    "store_shard_bytes": frozenset({API}),
    "max_factors_bytes": frozenset({API}),
    "index_memory_bytes": frozenset({API}),
    "max_body_bytes": frozenset({API}),
    "max_batch_size": BOTH,  # checked at the api and again where the worker decodes
    "max_result_bytes": frozenset({WORKER}),
    "max_reference_set_bytes": BOTH,  # a set made (api); a store read by influence (worker)
    "max_elements": frozenset({API}),
    "request_timeout_s": frozenset({API}),
    "job_timeout_s": frozenset({API}),
    "planning_grace_s": frozenset({API}),
    "warmup_timeout_s": BOTH,  # the warm-up jobs' deadline (api); the start-up bound (worker)
    "max_queue_depth": frozenset({API}),
    "batch_max_delay_ms": frozenset({WORKER}),
    "batch_max_samples": frozenset({WORKER}),
    "fair_chunk_samples": frozenset({WORKER}),
    "workers": EMBEDDED_ONLY,  # worker threads of the embedded broker
    "torch_threads": frozenset({WORKER}),
    "allow_tf32": frozenset({WORKER}),
    "api_keys": frozenset({API}),
    "admin_keys": frozenset({API}),
    "keys_file": frozenset({API}),
    "tenant_max_queued_samples": frozenset({API}),  # quotas are checked at admission
    "tenant_max_jobs": frozenset({API}),
    "tenant_requests_per_s": frozenset({API}),
    "result_ttl_s": BOTH,  # workers store results with it; the api its jobs' first TTL
    "visibility_timeout_s": frozenset({WORKER}),
    "max_attempts": BOTH,
    "heartbeat_s": frozenset({WORKER}),
    "redis_timeout_s": BOTH,
    "redis_transfer_timeout_s": BOTH,
    "worker_redis_grace_s": frozenset({WORKER}),
    "worker_metrics_port": frozenset({WORKER}),
    "listen_host": frozenset({API}),
    "listen_port": frozenset({API}),
    "worker_metrics_host": frozenset({WORKER}),
    "verify_fraction": frozenset({WORKER}),
    "verify_samples": frozenset({WORKER}),
    "max_layers": frozenset({API}),  # registration runs in the api
    "max_parameters": frozenset({API}),
    "max_weight_bytes": frozenset({API}),
    "max_model_activations": BOTH,  # registration, and a worker at the sizes a request sends
    "max_graph_nodes": frozenset({API}),
    "export_memory_mb": frozenset({API}),
    "export_cpu_s": frozenset({API}),
    "export_timeout_s": frozenset({API}),
    "export_spare": frozenset({API}),
    "cuda_graphs": frozenset({WORKER}),
    "keep_freed_memory": BOTH,  # each process's own allocator
    "dp_accounting_cpu_s": BOTH,  # runs made and described (api); each step's epsilon (worker)
}


def read_by(process: str) -> list[str]:
    """The settings ``process`` (:data:`API` or :data:`WORKER`) reads, in declaration order."""
    return [name for name in Settings.model_fields if process in READ_BY.get(name, BOTH)]


def raise_setting(field: str, value: object) -> str:
    """What a 413 says of the limit it hit: the setting to raise, and its value now."""
    return f"raise PSGRAD_{field.upper()} (now {value})"


def naming_setting(exc: TooLarge, field: str, value: object) -> TooLarge:
    """``exc``, a 413 from a check shared with the client (which has no settings to name), as
    the server says it: naming the setting behind its limit."""
    return TooLarge(f"{exc.message}: {raise_setting(field, value)}", **exc.details)


@lru_cache
def get_settings() -> Settings:
    return Settings()
