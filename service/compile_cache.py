"""Opt-in compiled per-sample functions (``PSGRAD_COMPILE=1``), shared between workers via Redis.

The engine's transformed function (``vmap(grad_and_value(loss))`` from
:func:`service.strategies.per_sample.per_sample_fn`) is compiled as a whole with
``torch.compile``: outside the torch.func transforms, never inside them. Compiled code is
specialised to a batch size (every new size recompiled even with ``dynamic=True``, and
``mark_dynamic`` on the batch dimension raised ``ConstraintViolationError`` with torch 2.13), so
a chunk of ``n`` samples runs as pieces of a few preferred sizes, powers of two: ``n`` is padded
up to the next power of two when that wastes at most a quarter, else split (48 runs as 32 + 16).
Padding repeats the piece's first sample and the padded rows are dropped before the engine sees
the output, so statistics never include them.

Sharing: a worker that compiled a signature cold stores ``torch.compiler.save_cache_artifacts``
in Redis under a key of the torch version, device name, model structure, loss, gamma, route,
dtype, selected parameters and padded sample shapes; another worker loads them with
``load_cache_artifacts`` before its first call and skips most of the compile. Those artifacts
are torch's own serialised compiler state, which torch loads with pickle: they are shared only
when ``PSGRAD_COMPILE_SECRET`` is set (workers only; the api never needs it), and each is signed
with HMAC-SHA256 under it, so a party that can write to Redis but lacks the secret cannot make a
worker load its bytes. Only workers write them; clients never reach them.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from service import redis_keys
from service.config import Settings

log = logging.getLogger("psgrad.compile")

Tensors = dict[str, torch.Tensor]
PerSampleFn = Callable[[Tensors, Tensors, Tensors, Tensors], Any]
MAX_WASTE = 0.25  # pad up to the next power of two only when it adds at most this share
RECOMPILE_LIMIT = 256  # every model and padded size is one more entry on vmap's code object


def pieces(n: int) -> list[tuple[int, int]]:
    """``(real, padded)`` sizes covering ``n`` samples, each padded size a power of two."""
    out: list[tuple[int, int]] = []
    while n > 0:
        up = 1 << (n - 1).bit_length()
        if up - n <= MAX_WASTE * n:
            out.append((n, up))
            break
        down = up >> 1
        out.append((down, down))
        n -= down
    return out


def _pad(samples: Tensors, size: int) -> Tensors:
    """Repeat the first sample so that every field has ``size`` rows (always valid input)."""
    out = {}
    for k, v in samples.items():
        extra = size - v.shape[0]
        out[k] = v if extra == 0 else torch.cat([v, v[:1].expand(extra, *v.shape[1:])])
    return out


@dataclass
class CompileStats:
    """What the cache did; tests and the benchmark read it."""

    compiled: int = 0  # signatures compiled in this process
    loaded: int = 0  # of those, warm-started from artifacts in Redis
    stored: int = 0  # artifacts this process wrote to Redis
    compile_s: list[float] = field(default_factory=list)  # first call of each signature


class CompiledFunctions:
    """Compiled versions of per-sample functions, one per signature, built on first use.

    Args:
        settings: ``compile_secret`` enables sharing through ``redis_client``.
        redis_client: a synchronous redis client (workers); None compiles locally only.
        writer: whether this process may store artifacts (workers yes, the api never).
    """

    def __init__(self, settings: Settings, redis_client: Any = None, *,
                 writer: bool = True) -> None:
        self.prefix = settings.redis_prefix
        self.secret = settings.compile_secret.encode() if settings.compile_secret else b""
        self.redis = redis_client if self.secret else None
        self.writer = writer
        self.stats = CompileStats()
        self._fns: dict[str, Callable[..., Any]] = {}
        self._lock = threading.Lock()
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit,
                                                 4 * RECOMPILE_LIMIT)

    def wrap(self, fn: PerSampleFn, model: Any, loss: str, gamma: float) -> PerSampleFn:
        """``fn`` with the same signature and results, run compiled in padded pieces."""
        if model.route == "loop":  # a Python loop over samples: nothing to gain
            return fn

        def run(selected: Tensors, others: Tensors, buffers: Tensors, samples: Tensors) -> Any:
            n = next(iter(samples.values())).shape[0]
            parts: list[Any] = []
            start = 0
            for real, padded in pieces(n):
                piece = _pad({k: v[start : start + real] for k, v in samples.items()}, padded)
                compiled = self._get(fn, model, loss, gamma, selected, piece)
                grads, (losses, aux) = compiled(selected, others, buffers, piece)
                parts.append(({k: g[:real] for k, g in grads.items()}, losses[:real],
                              aux[:real]))
                start += real
            if len(parts) == 1:
                grads, losses, aux = parts[0]
                return grads, (losses, aux)
            return ({k: torch.cat([p[0][k] for p in parts]) for k in parts[0][0]},
                    (torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])))

        return run

    def signature(self, model: Any, loss: str, gamma: float, selected: Tensors,
                  piece: Tensors) -> str:
        """Everything the compiled code depends on; weights are arguments, so not them."""
        device = model.device
        device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                       else device.type)
        parts = [torch.__version__, device_name, model.structure or model.ref, loss,
                 repr(gamma), model.route, str(model.dtype), ",".join(selected),
                 ";".join(f"{k}:{v.dtype}:{tuple(v.shape)}" for k, v in piece.items())]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]

    def _get(self, fn: PerSampleFn, model: Any, loss: str, gamma: float, selected: Tensors,
             piece: Tensors) -> Callable[..., Any]:
        sig = self.signature(model, loss, gamma, selected, piece)
        found = self._fns.get(sig)
        if found is not None:
            return found
        with self._lock:
            if sig in self._fns:
                return self._fns[sig]
            loaded = self._load(sig)
            compiled = torch.compile(fn, dynamic=False)
            first = _FirstCall(compiled, self, sig, stored=loaded)
            self._fns[sig] = first
            return first

    def _load(self, sig: str) -> bool:
        if self.redis is None:
            return False
        try:
            blob = self.redis.get(redis_keys.compile_artifact(self.prefix, sig))
        except Exception as exc:  # the cache is an optimisation: never fail a job for it
            log.warning("compile cache: cannot read artifacts: %s", exc)
            return False
        if not blob:
            return False
        mac, data = bytes(blob[:32]), bytes(blob[32:])
        if not hmac.compare_digest(mac, hmac.new(self.secret, data, hashlib.sha256).digest()):
            log.warning("compile cache: artifacts for %s have a bad signature; ignored", sig)
            return False
        torch.compiler.load_cache_artifacts(data)
        self.stats.loaded += 1
        return True

    def _store(self, sig: str) -> None:
        if self.redis is None or not self.writer:
            return
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        data = saved[0]
        mac = hmac.new(self.secret, data, hashlib.sha256).digest()
        try:
            if self.redis.set(redis_keys.compile_artifact(self.prefix, sig), mac + data, nx=True,
                              ex=redis_keys.COMPILE_TTL_S):
                self.stats.stored += 1
        except Exception as exc:
            log.warning("compile cache: cannot store artifacts: %s", exc)


class _FirstCall:
    """The compiled function; its first call compiles, is timed, and may store artifacts."""

    def __init__(self, compiled: Callable[..., Any], owner: CompiledFunctions, sig: str, *,
                 stored: bool) -> None:
        self.compiled = compiled
        self.owner = owner
        self.sig = sig
        self.pending = True
        self.stored = stored

    def __call__(self, *args: Any) -> Any:
        if not self.pending:
            return self.compiled(*args)
        with self.owner._lock:
            if not self.pending:
                return self.compiled(*args)
            started = time.perf_counter()
            out = self.compiled(*args)
            self.owner.stats.compiled += 1
            self.owner.stats.compile_s.append(time.perf_counter() - started)
            if not self.stored:
                self.owner._store(self.sig)
            self.pending = False
            return out
