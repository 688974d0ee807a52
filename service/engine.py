"""The per-sample gradient engine: ``functional_call`` + ``vmap(grad_and_value(loss))``.

One call computes every requested output for a batch that may hold several jobs (``segments``):
per-sample outputs are split back per job, and statistics (``mean``, ``variance``,
``clipped_mean``, ``cosine_mean``) are computed per job, never over the merged batch. The batch
runs in chunks sized from a memory budget, and per-sample gradients are kept only when an output
needs them, so a large batch of summary outputs never holds B copies of the gradient.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.func import functional_call, grad_and_value, vmap

from service.losses import get_loss
from service.outputs import OUTPUTS
from service.registry import LoadedModel
from service.strategies.base import Options as Options
from service.strategies.base import clip_factors

if TYPE_CHECKING:
    from service.compile_cache import CompiledFunctions

Tensors = dict[str, torch.Tensor]
SAMPLE_FIELDS = ("inputs", "targets", "next_inputs", "rewards", "dones")
PER_SAMPLE_GRADS = frozenset({"grads", "updates"})  # outputs that keep every per-sample gradient


@dataclass
class Batch:
    """The tensors of a request, already validated, with the batch dimension first."""

    inputs: torch.Tensor
    targets: torch.Tensor | None = None
    next_inputs: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    dones: torch.Tensor | None = None
    weights: Tensors = field(default_factory=dict)
    reference: Tensors = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.inputs.shape[0])

    def samples(self) -> Tensors:
        return {k: v for k in SAMPLE_FIELDS if (v := getattr(self, k)) is not None}


PerSampleFn = Callable[[Tensors, Tensors, Tensors, Tensors], Any]
_FN_CACHE: OrderedDict[tuple[Any, ...], PerSampleFn] = OrderedDict()
_FN_CACHE_SIZE = 64
_FN_LOCK = threading.Lock()
FN_CACHE_STATS = {"hits": 0, "misses": 0}  # read by the api's /metrics
_STRUCTURE_LOCKS: dict[str, threading.Lock] = {}


def warm_up() -> None:
    """Pay torch.func's one-time set-up before the first job, not inside it.

    The first ``grad`` of a process imports ``torch._dynamo`` (``_autograd_grad`` enters
    ``torch._dynamo.compiled_autograd._disable()``): 1 to 3 s on our CPUs, which would
    otherwise land on the first request a worker serves. Workers call this when they start.
    """
    import torch._dynamo

    vmap(grad_and_value(lambda w, x: (w * x).sum()), in_dims=(None, 0))(
        torch.ones(2), torch.ones(2, 2))


def per_sample_fn(model: LoadedModel, loss_name: str, gamma: float) -> PerSampleFn:
    """``(selected, other_params, buffers, samples) -> (grads, (losses, aux))`` over a batch.

    Cached by model structure (architecture and config), device, dtype, loss, gamma and route;
    parameters and buffers are arguments, so per-call weights and new versions never rebuild it.
    """
    key = (model.structure or model.ref, str(next(iter(model.params.values())).device),
           model.dtype, loss_name, gamma, model.route)
    with _FN_LOCK:
        if key in _FN_CACHE:
            FN_CACHE_STATS["hits"] += 1
            _FN_CACHE.move_to_end(key)
            return _FN_CACHE[key]
        FN_CACHE_STATS["misses"] += 1
    loss = get_loss(loss_name)
    module = model.module

    def sample_loss(selected: Tensors, others: Tensors, buffers: Tensors,
                    sample: Tensors) -> Any:
        params = {**others, **selected}

        def forward(x: torch.Tensor) -> torch.Tensor:
            return functional_call(module, (params, buffers), (x.unsqueeze(0),)).squeeze(0)

        return loss.fn(forward, sample, gamma)

    one = grad_and_value(sample_loss, has_aux=True)
    fn: PerSampleFn
    fn = _looped(one) if model.route == "loop" else vmap(one, in_dims=(None, None, None, 0))
    with _FN_LOCK:
        _FN_CACHE[key] = fn
        while len(_FN_CACHE) > _FN_CACHE_SIZE:
            _FN_CACHE.popitem(last=False)
    return fn


def _looped(one: Callable[..., Any]) -> PerSampleFn:
    """The per-sample loop, for layers vmap cannot batch (``nn.GRU``/``nn.RNN`` in torch 2.13)."""

    def fn(selected: Tensors, others: Tensors, buffers: Tensors, samples: Tensors) -> Any:
        size = next(iter(samples.values())).shape[0]
        results = [one(selected, others, buffers, {k: v[i] for k, v in samples.items()})
                   for i in range(size)]
        grads = {k: torch.stack([r[0][k] for r in results]) for k in selected}
        losses = torch.stack([r[1][0] for r in results])
        aux = torch.stack([r[1][1] for r in results])
        return grads, (losses, aux)

    return fn


def chunk_size(model: LoadedModel, selected: Sequence[str], batch: int, budget_bytes: int,
               *, keep: bool = False) -> int:
    """Samples per vmap call so that the transient memory stays inside ``budget_bytes``.

    A chunk holds its per-sample gradients plus about one working copy, and its activations.
    With ``keep`` (``grads``/``updates`` asked for) the gradients are the answer itself, already
    bounded by the result-size limit, so only the working copy counts: splitting such a batch
    would add a copy of the whole answer and its page faults (3x slower for mlp at B=256).
    """
    itemsize = torch.finfo(model.dtype).bits // 8
    n_selected = sum(model.params[k].numel() for k in selected)
    copies = 1 if keep else 2
    per_sample = itemsize * (copies * n_selected + 4 * model.activation_numel) or 1
    return max(1, min(batch, budget_bytes // per_sample))


def compute(model: LoadedModel, batch: Batch, opts: Options,
            segments: Sequence[int] | None = None, *, budget_bytes: int = 1 << 30,
            compiled: CompiledFunctions | None = None, fast_stats: bool = True
            ) -> list[dict[str, Any]]:
    """Every requested output, for each segment of the batch (one segment per job).

    With ``compiled`` (``PSGRAD_COMPILE=1``) the per-sample function runs under torch.compile
    in padded pieces of preferred sizes (:mod:`service.compile_cache`); results are the same.
    With ``fast_stats`` (``PSGRAD_FAST_STATS``, default on) a call asking for no per-sample
    tensors takes :mod:`service.fast_stats` when the model allows it (same answer, no B copies
    of the gradient); ``meta["method"]`` says how each parameter was computed.
    """
    segments = list(segments or [batch.size])
    if sum(segments) != batch.size:
        raise ValueError(f"segments {segments} do not add up to the batch size {batch.size}")
    with _structure_lock(model):
        return _compute(model, batch, opts, segments, budget_bytes, compiled, fast_stats)


def _structure_lock(model: LoadedModel) -> threading.Lock:
    """One lock per model structure: ``functional_call`` swaps a module's parameters in place
    for the duration of a call, so two threads running the same module (or the cached per-sample
    function built on a module of the same structure) would read each other's parameters and
    get zero gradients. Different models still run in parallel."""
    key = model.structure or model.ref
    with _FN_LOCK:
        return _STRUCTURE_LOCKS.setdefault(key, threading.Lock())


def _compute(model: LoadedModel, batch: Batch, opts: Options, segments: list[int],
             budget_bytes: int, compiled: CompiledFunctions | None, fast_stats: bool
             ) -> list[dict[str, Any]]:
    if fast_stats:
        from service import fast_stats as fast

        if fast.supports(model, opts.outputs):
            answer = fast.compute(model, batch, opts, segments, budget_bytes=budget_bytes)
            if answer is not None:
                return answer
    device = next(iter(model.params.values())).device
    params = {**model.params, **{k: v.to(device, model.dtype) for k, v in batch.weights.items()}}
    selected = {k: params[k] for k in opts.params}
    others = {k: v for k, v in params.items() if k not in selected}
    samples = {k: v.to(device) for k, v in batch.samples().items()}
    reference = {k: v.to(device, model.dtype) for k, v in batch.reference.items()}
    fn = per_sample_fn(model, opts.loss, opts.gamma)
    if compiled is not None:
        fn = compiled.wrap(fn, model, opts.loss, opts.gamma)
    keep = bool(PER_SAMPLE_GRADS & set(opts.outputs))
    chunk = chunk_size(model, opts.params, batch.size, budget_bytes, keep=keep)

    def chunks() -> Any:
        for start in range(0, batch.size, chunk):
            stop = min(batch.size, start + chunk)
            grads, (losses, aux) = fn(selected, others, model.buffers,
                                      {k: v[start:stop] for k, v in samples.items()})
            yield start, stop, grads, losses, aux

    acc = _Accumulator(opts, selected, reference, segments, batch.size)
    last = None
    for last in chunks():
        acc.add(*last)
    if "cosine_mean" in opts.outputs:
        if chunk >= batch.size and last is not None:
            acc.cosine(last[0], last[2])
        elif keep:  # every per-sample gradient is at hand: no second pass
            acc.cosine(0, acc.kept)
        else:
            for start, _, grads, _, _ in chunks():
                acc.cosine(start, grads)
    meta = {"route": model.route, "chunk_size": chunk,
            "method": {k: model.route for k in opts.params}}
    return [{**out, "meta": {**meta, **extra}} for out, extra in acc.finish()]


def _bounds(segments: Sequence[int]) -> list[tuple[int, int]]:
    ends = [0]
    for n in segments:
        ends.append(ends[-1] + n)
    return list(itertools.pairwise(ends))


def _rows(g: torch.Tensor) -> torch.Tensor:
    """One row per sample (``flatten(1)`` fails on the [B] gradients of a scalar parameter)."""
    return g.reshape(g.shape[0], -1)


class _Accumulator:
    """Collects per-sample values and per-segment statistics chunk by chunk."""

    def __init__(self, opts: Options, selected: Tensors, reference: Tensors,
                 segments: Sequence[int], size: int) -> None:
        self.opts = opts
        self.want = set(opts.outputs)
        self.reference = reference
        self.bounds = _bounds(segments)
        self.size = size
        self.keep_grads = bool(self.want & PER_SAMPLE_GRADS)
        self.need_norms = bool(self.want & {"norms", "layer_norms", "clipped_mean", "cosine_mean"})
        self.need_stats = bool(self.want & {"mean", "variance", "cosine_mean"})
        self.per_sample: dict[str, list[torch.Tensor]] = {}
        self.layer_sq: dict[str, list[torch.Tensor]] = {k: [] for k in selected}
        self.kept: Tensors = {}  # {param: [B, *shape]}: the first chunk's, or one buffer
        # per segment: count, mean and M2 per parameter (Chan's parallel merge), clipped sums
        self.count = [0] * len(self.bounds)
        self.mean: list[Tensors] = [{} for _ in self.bounds]
        self.m2: list[Tensors] = [{} for _ in self.bounds]
        self.clipped: list[Tensors] = [{} for _ in self.bounds]

    def _append(self, name: str, value: torch.Tensor) -> None:
        self.per_sample.setdefault(name, []).append(value)

    def _overlaps(self, start: int, stop: int) -> Any:
        for s, (a, b) in enumerate(self.bounds):
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                yield s, lo - start, hi - start

    def add(self, start: int, stop: int, grads: Tensors, losses: torch.Tensor,
            aux: torch.Tensor) -> None:
        self._append("losses", losses)
        self._append("td_errors", aux)
        norms = None
        if self.need_norms:
            sq = {k: _rows(g).pow(2).sum(1) for k, g in grads.items()}
            for k, v in sq.items():
                self.layer_sq[k].append(v)
            norms = torch.stack(list(sq.values())).sum(0).sqrt()
            self._append("norms", norms)
        if "dot" in self.want:
            dots = [_rows(g) @ self.reference[k].flatten() for k, g in grads.items()]
            self._append("dot", torch.stack(dots).sum(0))
        if self.keep_grads:
            self._keep(start, stop, grads)
        for s, lo, hi in self._overlaps(start, stop):
            part = {k: g[lo:hi] for k, g in grads.items()}
            if self.need_stats:
                self._merge_stats(s, part)
            if "clipped_mean" in self.want and norms is not None:
                factor = clip_factors(self.opts.clip_norm, norms[lo:hi], self.opts.norm_offset)
                for k, g in part.items():
                    term = torch.tensordot(factor, g, dims=1)
                    self.clipped[s][k] = self.clipped[s].get(k, 0) + term

    def _keep(self, start: int, stop: int, grads: Tensors) -> None:
        """One batch of per-sample gradients: the single chunk's own, or chunks copied into
        one buffer as they come (never a list of chunks concatenated at the end: that holds
        the answer twice)."""
        if start == 0 and stop == self.size:
            self.kept = dict(grads)
            return
        for k, g in grads.items():
            if k not in self.kept:
                self.kept[k] = g.new_empty((self.size, *g.shape[1:]))
            self.kept[k][start:stop].copy_(g)

    def _merge_stats(self, s: int, part: Tensors) -> None:
        n_b = next(iter(part.values())).shape[0]
        n_a = self.count[s]
        for k, g in part.items():
            mean_b = g.mean(0)
            m2_b = (g - mean_b).pow(2).sum(0)
            if n_a == 0:
                self.mean[s][k], self.m2[s][k] = mean_b, m2_b
            else:
                delta = mean_b - self.mean[s][k]
                total = n_a + n_b
                self.mean[s][k] = self.mean[s][k] + delta * (n_b / total)
                self.m2[s][k] = self.m2[s][k] + m2_b + delta.pow(2) * (n_a * n_b / total)
        self.count[s] = n_a + n_b

    def cosine(self, start: int, grads: Tensors) -> None:
        stop = start + next(iter(grads.values())).shape[0]
        for s, lo, hi in self._overlaps(start, stop):
            dots = sum(_rows(g[lo:hi]) @ self.mean[s][k].flatten() for k, g in grads.items())
            self._append("_cos_dot", torch.as_tensor(dots))

    def finish(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        flat = {k: torch.cat(v) for k, v in self.per_sample.items()}
        layer_norms = ({k: torch.cat(v).sqrt() for k, v in self.layer_sq.items()}
                       if self.need_norms else {})
        kept = self.kept
        results = []
        for s, (a, b) in enumerate(self.bounds):
            out: dict[str, Any] = {}
            extra: dict[str, Any] = {}
            for name in self.opts.outputs:
                if name == "grads":
                    out[name] = {k: g[a:b] for k, g in kept.items()}
                elif name == "updates":
                    out[name] = {k: -0.5 * g[a:b] for k, g in kept.items()}
                elif name == "layer_norms":
                    out[name] = {k: v[a:b] for k, v in layer_norms.items()}
                elif name == "mean":
                    out[name] = dict(self.mean[s])
                elif name == "variance":
                    out[name] = {k: v / (b - a) for k, v in self.m2[s].items()}
                elif name == "clipped_mean":
                    out[name], extra["seed"] = self._noised(s, b - a)
                elif name == "cosine_mean":
                    norms = flat["norms"][a:b]
                    mean_norm = torch.stack(
                        [v.pow(2).sum() for v in self.mean[s].values()]).sum().sqrt()
                    cos = flat["_cos_dot"][a:b] / (norms * mean_norm)
                    out[name] = cos.nan_to_num(0.0, posinf=0.0, neginf=0.0)
                else:
                    out[name] = flat[name][a:b]
            results.append((out, extra))
        return results

    def _noised(self, s: int, n: int) -> tuple[Tensors, int | None]:
        return noised_mean(self.clipped[s], self.opts, n)


def noised_mean(sums: Tensors, opts: Options, n: int) -> tuple[Tensors, int | None]:
    """The DP-SGD aggregate from clipped sums: add seeded noise, divide by the sample count.

    A DP run's options divide by its expected batch size instead (``opts.divisor``) and draw the
    noise from the OS CSPRNG (``opts.secure_noise``): no seed exists, None is echoed.
    """
    sigma = opts.noise_multiplier * (opts.clip_norm or 0.0)
    divisor = opts.divisor or n
    if sigma == 0:
        return {k: v / divisor for k, v in sums.items()}, opts.seed
    if opts.secure_noise:
        from service.dp.noise import secure_normal

        return {k: (v + secure_normal(tuple(v.shape), sigma).to(v.device, v.dtype)) / divisor
                for k, v in sums.items()}, None
    seed = opts.seed if opts.seed is not None else secrets.randbits(63)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sums.items():  # noise drawn on the CPU so every device gives the same
        noise = torch.normal(0.0, sigma, size=tuple(v.shape), generator=gen)
        out[k] = (v + noise.to(v.device, v.dtype)) / divisor
    return out, seed


def output_bytes(model: LoadedModel, opts: Options, batch_size: int) -> int:
    """Bytes of the answer, to refuse an oversized result before computing it."""
    itemsize = torch.finfo(model.dtype).bits // 8
    n_selected = sum(model.params[k].numel() for k in opts.params)
    total = 0
    for name in opts.outputs:
        info = OUTPUTS[name]
        per = n_selected if info.per_param_tensor else (len(opts.params) if info.per_param else 1)
        total += per * (batch_size if info.per_sample else 1)
    return total * itemsize

