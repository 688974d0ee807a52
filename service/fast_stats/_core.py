"""Shared pieces of the fast-statistics path: captured uses, the op registry, and sources.

A *use* is one call of a torch function that reads a selected parameter during the batched
forward pass, seen by :class:`Capture` (a ``TorchFunctionMode``). Layer families register a
handler per torch function (``@register_op(F.linear)``, Opacus-style) that runs the op and
describes the use: the batch-first layer input ``a`` and the output whose gradient ``g`` the
backward pass gives. A *source* turns the uses of one parameter (or a group of parameters) into
the per-sample statistics, by a closed form where the family has one, else by materialising
per-sample gradients a chunk of samples at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

Tensors = dict[str, torch.Tensor]


class Unsupported(Exception):
    """The fast path cannot serve this call; the engine falls back to ``vmap``."""


@dataclass
class Use:
    """One read of tracked parameters by one torch function call in the forward pass."""

    kind: str  # a family ("linear", "conv", "embedding"), "direct" or "opaque"
    func: Any
    roles: dict[str, str]  # parameter name -> its role in the call ("weight", "bias", "arg1")
    out: torch.Tensor | None = None  # the tensor whose gradient the backward pass gives
    a: Any = None  # family data: the batch-first layer input, or the call's arguments
    info: dict[str, Any] = field(default_factory=dict)  # hyperparameters, layout
    stack: tuple[str, ...] = ()  # module names being executed (probe only)
    g: torch.Tensor | None = None

    def signature(self) -> tuple[Any, ...]:
        return (self.kind, self.func, tuple(sorted(self.roles.items())), self.info.get("key"))

    def grad_bf(self) -> torch.Tensor:
        """The output gradient with the batch first (families may capture other layouts)."""
        assert self.g is not None
        to_bf = self.info.get("to_bf")
        return to_bf(self.g) if to_bf is not None else self.g


Handler = Callable[
    ["Capture", Any, tuple[Any, ...], dict[str, Any], dict[int, str]],
    "tuple[Any, list[Use]] | None",
]
OPS: dict[Any, Handler] = {}


def register_op(*funcs: Any) -> Callable[[Handler], Handler]:
    """Register a capture handler for torch functions; it may answer None to decline a call."""

    def decorate(handler: Handler) -> Handler:
        for f in funcs:
            OPS[f] = handler
        return handler

    return decorate


def leaves(args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[Any]:
    """Arguments, one level into lists and tuples (``torch.cat([w1, w2])``)."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, (list, tuple)):
            yield from v
        else:
            yield v


def cat(parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat`` that does not copy a single part (fresh memory costs page faults)."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim)


def total(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of same-shaped tensors, without stacking them first."""
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


class Capture(TorchFunctionMode):
    """Records every use of a tracked parameter during one forward pass.

    ``tracked`` maps ``id(tensor)`` to the parameter name; ``consts`` holds the ids of every other
    parameter and buffer (never batched). With ``stack`` set (the probe), each use also records
    which modules were running, so a parameter read in a way no family understands can fall
    back to the smallest enclosing module.
    """

    def __init__(
        self, tracked: dict[int, str], consts: set[int], batch: int, stack: list[str] | None = None
    ) -> None:
        super().__init__()
        self.tracked = tracked
        self.consts = consts
        self.batch = batch
        self.stack = stack
        self.uses: list[Use] = []
        self.thread = threading.get_ident()

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        found = {
            id(v): self.tracked[id(v)]
            for v in leaves(args, kwargs)
            if isinstance(v, torch.Tensor) and id(v) in self.tracked
        }
        if not found:
            return func(*args, **kwargs)
        handler = OPS.get(func)
        if handler is not None:
            answer = handler(self, func, tuple(args), kwargs, found)
            if answer is not None:
                out, uses = answer
                for use in uses:
                    self.record(use)
                return out
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            self.record(self.direct_use(func, tuple(args), kwargs, found, out))
        return out

    def record(self, use: Use) -> None:
        if self.stack is not None:
            use.stack = tuple(self.stack)
        self.uses.append(use)

    def is_batched(self, t: Any) -> bool:
        return (
            isinstance(t, torch.Tensor)
            and id(t) not in self.consts
            and id(t) not in self.tracked
            and t.dim() > 0
            and t.shape[0] == self.batch
        )

    def direct_use(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        found: dict[int, str],
        out: torch.Tensor,
    ) -> Use:
        """An op reading parameters that runs sample by sample: batch-first in and out.

        Its per-sample parameter gradient is the op's own vjp, replayed per sample (``direct``).
        Anything else (``w.t()``, a constant with another first dimension) is ``opaque``.
        """
        pattern: list[str] = []
        ok = out.dim() > 0 and out.shape[0] == self.batch
        for v in (*args, *kwargs.values()):
            if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
                pattern.append("?")
                ok = False
            elif not isinstance(v, torch.Tensor):
                pattern.append("-")
            elif id(v) in self.tracked:
                pattern.append("p")
            elif id(v) in self.consts:
                pattern.append("c")
            elif self.is_batched(v):
                pattern.append("b")
            else:
                pattern.append("?")
                ok = False
        ok = ok and "b" in pattern
        roles = {
            name: f"arg{i}"
            for i, v in enumerate((*args, *kwargs.values()))
            if isinstance(v, torch.Tensor) and (name := found.get(id(v))) is not None
        }
        roles |= {name: "nested" for name in found.values() if name not in roles}
        if not ok:
            return Use("opaque", func, roles, info={"key": "".join(pattern)})
        at = [
            found.get(id(v)) if isinstance(v, torch.Tensor) else None
            for v in (*args, *kwargs.values())
        ]
        return Use(
            "direct",
            func,
            roles,
            out=out,
            a=(args, kwargs),
            info={"key": "".join(pattern), "names": at},
        )


@dataclass
class Need:
    """What the first pass over the per-sample gradients must produce."""

    sq: bool
    reference: Tensors | None
    sums: bool
    sqsums: bool
    bounds: list[tuple[int, int]]
    sums_dtype: torch.dtype


@dataclass
class Pass1:
    sq: torch.Tensor | None = None  # [B] squared norm of each sample's gradient
    dot: torch.Tensor | None = None  # [B] dot product with the reference
    sums: list[torch.Tensor] | None = None  # per segment: sum of the per-sample gradients
    sqsums: list[torch.Tensor] | None = None  # per segment: sum of squares, float64


@dataclass
class Pass2:
    clipped: list[torch.Tensor] | None = None  # per segment: sum_i c_i grad_i
    cos: torch.Tensor | None = None  # [B] dot of each sample's gradient with its segment mean


class Budget:
    """Memory for transient per-sample tensors and for caching them between the two passes."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = max(1 << 20, budget_bytes)
        self.cache_left = self.budget // 4

    def chunk(self, bytes_per_sample: int, batch: int, work: int = 32 << 20) -> int:
        """Samples per chunk so that one chunk's transient tensors take about ``work`` bytes:
        big enough for efficient kernels, small next to the activations a backward holds."""
        limit = min(self.budget // 4, work)
        return max(1, min(batch, limit // max(1, bytes_per_sample)))

    def reserve(self, nbytes: int) -> bool:
        if nbytes <= self.cache_left:
            self.cache_left -= nbytes
            return True
        return False


def overlaps(bounds: Sequence[tuple[int, int]], lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
    """(segment, start, stop) of each segment's part of rows [lo, hi), relative to lo."""
    for s, (a, b) in enumerate(bounds):
        x, y = max(a, lo), min(b, hi)
        if x < y:
            yield s, x - lo, y - lo


class Source:
    """Per-sample statistics of some parameters, from the uses captured for them."""

    method = "direct"

    def __init__(
        self, names: Sequence[str], shapes: dict[str, torch.Size], batch: int, budget: Budget
    ) -> None:
        self.names = tuple(names)
        self.shapes = shapes
        self.batch = batch
        self.budget = budget

    def form(self, name: str) -> str:
        return self.method

    def method_of(self, name: str) -> str:
        return self.method

    def pass1(self, need: Need) -> dict[str, Pass1]:
        raise NotImplementedError

    def pass2(
        self, clip: torch.Tensor | None, means: list[Tensors] | None, bounds: list[tuple[int, int]]
    ) -> dict[str, Pass2]:
        raise NotImplementedError

    def grads(self, lo: int, hi: int) -> Tensors:
        """Materialised per-sample gradients of rows [lo, hi), ``{name: [n, *shape]}``."""
        raise NotImplementedError


class Materialised(Source):
    """Statistics from per-sample gradients built a chunk at a time (kept if the budget allows).

    Sums of squares accumulate in float64 so that ``variance`` does not lose its digits to
    cancellation when the mean is large next to the spread.
    """

    cache = True  # keep the per-sample gradients for the second pass (when the budget allows)

    def __init__(
        self,
        names: Sequence[str],
        shapes: dict[str, torch.Size],
        batch: int,
        budget: Budget,
        itemsize: int = 4,
    ) -> None:
        super().__init__(names, shapes, batch, budget)
        self.numel = sum(shapes[k].numel() for k in self.names)
        self.itemsize = itemsize
        self._cache: list[tuple[int, int, Tensors]] | None = None

    def chunk_size(self) -> int:
        return self.budget.chunk(self.numel * self.itemsize * 3, self.batch)

    def chunks(self, keep: bool = False) -> Iterator[tuple[int, int, Tensors]]:
        if self._cache is not None:
            yield from self._cache
            return
        step = self.chunk_size()
        kept: list[tuple[int, int, Tensors]] = []
        keep = keep and self.cache and self.budget.reserve(self.batch * self.numel * self.itemsize)
        for lo in range(0, self.batch, step):
            hi = min(self.batch, lo + step)
            item = (lo, hi, self.grads(lo, hi))
            if keep:
                kept.append(item)
            yield item
        if keep:
            self._cache = kept

    def pass1(self, need: Need, keep: bool = True) -> dict[str, Pass1]:
        out = {k: Pass1() for k in self.names}
        parts: dict[str, dict[str, list[torch.Tensor]]] = {
            k: {"sq": [], "dot": []} for k in self.names
        }
        for k in self.names:
            if need.sums:
                out[k].sums = [
                    torch.zeros(self.shapes[k], dtype=need.sums_dtype) for _ in need.bounds
                ]
            if need.sqsums:
                out[k].sqsums = [
                    torch.zeros(self.shapes[k], dtype=torch.float64) for _ in need.bounds
                ]
        for lo, hi, grads in self.chunks(keep):
            for k, g in grads.items():
                flat = g.reshape(hi - lo, -1)
                if need.sq:
                    parts[k]["sq"].append(torch.linalg.vector_norm(flat, dim=1).square())
                if need.reference is not None:
                    parts[k]["dot"].append(flat @ need.reference[k].reshape(-1).to(flat.dtype))
                for s, x, y in overlaps(need.bounds, lo, hi):
                    sums, sqsums = out[k].sums, out[k].sqsums
                    if sums is not None:
                        sums[s] = sums[s].to(g.device) + g[x:y].sum(0, dtype=need.sums_dtype)
                    if sqsums is not None:
                        g64 = g[x:y].to(torch.float64)
                        sqsums[s] = sqsums[s].to(g.device) + (g64 * g64).sum(0)
        for k in self.names:
            if need.sq:
                out[k].sq = cat(parts[k]["sq"])
            if need.reference is not None:
                out[k].dot = cat(parts[k]["dot"])
        return out

    def pass2(
        self, clip: torch.Tensor | None, means: list[Tensors] | None, bounds: list[tuple[int, int]]
    ) -> dict[str, Pass2]:
        out = {k: Pass2() for k in self.names}
        cos: dict[str, list[torch.Tensor]] = {k: [] for k in self.names}
        for k in self.names:
            if clip is not None:
                out[k].clipped = [torch.zeros(self.shapes[k]) for _ in bounds]
        for lo, hi, grads in self.chunks():
            for k, g in grads.items():
                for s, x, y in overlaps(bounds, lo, hi):
                    clipped = out[k].clipped
                    if clip is not None and clipped is not None:
                        c = clip[lo + x : lo + y].to(g.dtype)
                        clipped[s] = clipped[s].to(g) + torch.tensordot(c, g[x:y], dims=1)
                    if means is not None:
                        cos[k].append(g[x:y].reshape(y - x, -1) @ means[s][k].reshape(-1))
        for k in self.names:
            if means is not None:
                out[k].cos = cat(cos[k])
        return out


class Dense(Materialised):
    """Per-sample gradients small enough to hold whole (biases, norms' affine parameters)."""

    def __init__(self, name: str, grads: torch.Tensor, budget: Budget, method: str) -> None:
        super().__init__(
            [name], {name: grads.shape[1:]}, grads.shape[0], budget, grads.element_size()
        )
        self.method = method
        self.full = grads

    def chunk_size(self) -> int:
        return self.batch

    def grads(self, lo: int, hi: int) -> Tensors:
        return {self.names[0]: self.full[lo:hi]}


class DenseGroup(Source):
    """Small per-sample gradients (biases, norms' affine parameters) as one source: one plain
    op per statistic and parameter, none of :class:`Materialised`'s chunking around it (on a
    small model that overhead was a fifth of a ``clipped_mean`` call). Nothing is copied."""

    SMALL = 1 << 14  # elements per sample of a member

    def __init__(self, parts: Sequence[Dense]) -> None:
        names = [p.names[0] for p in parts]
        super().__init__(names, {k: p.shapes[k] for k, p in zip(names, parts, strict=True)},
                         parts[0].batch, parts[0].budget)
        self.methods = {k: p.method for k, p in zip(names, parts, strict=True)}
        self.flat = {k: p.full.reshape(self.batch, -1) for k, p in zip(names, parts, strict=True)}

    def method_of(self, name: str) -> str:
        return self.methods[name]

    def form(self, name: str) -> str:
        return self.methods[name]

    def grads(self, lo: int, hi: int) -> Tensors:
        return {k: f[lo:hi].reshape(hi - lo, *self.shapes[k]) for k, f in self.flat.items()}

    def pass1(self, need: Need) -> dict[str, Pass1]:
        out = {}
        for k, f in self.flat.items():
            shape, p1 = self.shapes[k], Pass1()
            if need.sq:
                p1.sq = torch.linalg.vector_norm(f, dim=1).square()
            if need.reference is not None:
                p1.dot = f @ need.reference[k].reshape(-1).to(f.dtype)
            if need.sums:
                p1.sums = [f[x:y].sum(0, dtype=need.sums_dtype).reshape(shape)
                           for x, y in need.bounds]
            if need.sqsums:
                p1.sqsums = [f[x:y].to(torch.float64).square().sum(0).reshape(shape)
                             for x, y in need.bounds]
            out[k] = p1
        return out

    def pass2(
        self, clip: torch.Tensor | None, means: list[Tensors] | None, bounds: list[tuple[int, int]]
    ) -> dict[str, Pass2]:
        out = {}
        for k, f in self.flat.items():
            p2 = Pass2()
            if clip is not None:
                p2.clipped = [(clip[x:y].to(f.dtype) @ f[x:y]).reshape(self.shapes[k])
                              for x, y in bounds]
            if means is not None:
                p2.cos = cat([f[x:y] @ means[s][k].reshape(-1).to(f.dtype)
                              for s, (x, y) in enumerate(bounds)])
            out[k] = p2
        return out


def grouped(sources: list[Source]) -> list[Source]:
    """The sources, with small :class:`Dense` ones of one dtype merged into a
    :class:`DenseGroup`."""
    small: dict[tuple[torch.dtype, torch.device], list[Dense]] = {}
    rest: list[Source] = []
    for s in sources:
        if type(s) is Dense and s.numel <= DenseGroup.SMALL:
            small.setdefault((s.full.dtype, s.full.device), []).append(s)
        else:
            rest.append(s)
    for members in small.values():
        rest.extend([DenseGroup(members)] if len(members) > 1 else members)
    return rest


class Zero(Dense):
    """A selected parameter the forward pass never reads: every per-sample gradient is zero."""

    def __init__(
        self,
        name: str,
        shape: torch.Size,
        batch: int,
        dtype: torch.dtype,
        device: torch.device,
        budget: Budget,
    ) -> None:
        zeros = torch.zeros((1, *shape), dtype=dtype, device=device).expand(batch, *shape)
        super().__init__(name, zeros, budget, "unused")


class Summed(Materialised):
    """A parameter read by several uses of different kinds (tied weights): the per-sample
    gradient is the sum of the parts, so norms need it materialised."""

    method = "tied"

    def __init__(
        self,
        name: str,
        parts: list[tuple[Source, str]],
        shape: torch.Size,
        batch: int,
        budget: Budget,
    ) -> None:
        super().__init__([name], {name: shape}, batch, budget)
        self.parts = parts

    def grads(self, lo: int, hi: int) -> Tensors:
        total: torch.Tensor | None = None
        for source, key in self.parts:
            g = source.grads(lo, hi)[key]
            total = g if total is None else total + g
        assert total is not None
        return {self.names[0]: total}
