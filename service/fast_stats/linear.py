"""Linear layers: ``F.linear`` and the projections inside ``F.multi_head_attention_forward``.

The per-sample gradient of a linear layer's weight is ``sum_t g_it a_it^T`` over the positions t
of sample i (one position without a sequence). Its squared norm is ``|g_i|^2 |a_i|^2`` for one
position, the Gram form ``<A_i A_i^T, G_i G_i^T>`` for T positions when ``2 T^2 < d p``, and is
otherwise read off the materialised ``G_i^T A_i`` (one batched matmul a chunk at a time); a dot
product with a reference R is ``sum_t g_it^T R a_it`` and a weighted sum over samples is one
matmul ``G^T diag(c) A``. Convolutions reuse :class:`OuterSource` through their unfolded input.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.linalg import vector_norm

from service.fast_stats._core import (
    Budget,
    Capture,
    Dense,
    Materialised,
    Need,
    Pass1,
    Pass2,
    Tensors,
    Use,
    cat,
    register_op,
    total,
)
from service.fast_stats._sources import SourceContext, register_source

Block = tuple[int, int, torch.Tensor, torch.Tensor]  # lo, hi, A [n, Gr, T, d], G [n, Gr, T, p]


def bind(args: Sequence[Any], kwargs: dict[str, Any], names: Sequence[str]) -> list[Any]:
    """Positional-or-keyword arguments by name (None when absent)."""
    return [args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names)]


class OuterSource(Materialised):
    """A weight whose per-sample gradient is ``sum_t g_t a_t^T`` per group (Linear, Conv)."""

    cache = False  # one batched matmul rebuilds a chunk: cheaper than holding B copies

    def __init__(
        self,
        name: str,
        shape: torch.Size,
        batch: int,
        budget: Budget,
        groups: int,
        d: int,
        p: int,
        positions: int,
        method: str,
    ) -> None:
        super().__init__([name], {name: shape}, batch, budget)
        self.method = method
        self.groups, self.d, self.p, self.t = groups, d, p, positions
        if positions == 1:
            self._form = "outer"
        elif 2 * positions * positions < d * p:
            self._form = "gram"
        else:
            self._form = "materialise"

    def form(self, name: str) -> str:
        return self._form

    def blocks(self, lo: int, hi: int) -> Iterator[Block]:
        raise NotImplementedError

    def grads(self, lo: int, hi: int) -> Tensors:
        parts = [
            (g.transpose(-1, -2) @ a).reshape(y - x, *self.shapes[self.names[0]])
            for x, y, a, g in self.blocks(lo, hi)
        ]
        return {self.names[0]: cat(parts)}

    def _sq(self, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        if self._form == "outer":
            sq = vector_norm(a, dim=-1).square() * vector_norm(g, dim=-1).square()
            return sq.sum((1, 2))
        return (a @ a.transpose(-1, -2)).mul_(g @ g.transpose(-1, -2)).sum((1, 2, 3))

    def _ref(self, ref: torch.Tensor) -> torch.Tensor:
        return ref.reshape(self.groups, self.p, self.d)

    def wsum(self, c: torch.Tensor | None, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """``sum_i c_i grad_i`` over rows [lo, hi) (``c`` of length hi - lo, or all ones)."""
        total: torch.Tensor | None = None
        for x, y, a, g in self.blocks(lo, hi):
            if c is not None:  # scale the smaller side
                scale = c[x - lo : y - lo].to(g.dtype).reshape(-1, 1, 1, 1)
                if self.p <= self.d:
                    g = g * scale
                else:
                    a = a * scale
            g, a = g.to(dtype), a.to(dtype)
            if self.groups == 1:  # one GEMM, as a batch gradient would be
                g, a = _rows(g[:, 0], a[:, 0])
                term = (g.reshape(-1, self.p).t() @ a.reshape(-1, self.d)).unsqueeze(0)
            else:
                term = torch.einsum("ngtp,ngtd->gpd", g, a)
            total = term if total is None else total + term
        assert total is not None
        return total.reshape(self.shapes[self.names[0]])

    def pass1(self, need: Need, keep: bool = True) -> dict[str, Pass1]:
        if self._form == "materialise" or (need.sqsums and self._form == "gram"):
            return super().pass1(need, keep)
        name = self.names[0]
        out = Pass1()
        sq, dot = [], []
        ref = self._ref(need.reference[name]) if need.reference is not None else None
        for _, _, a, g in self.blocks(0, self.batch):
            if need.sq:
                sq.append(self._sq(a, g))
            if ref is not None:
                dot.append(((g @ ref.to(g.dtype)) * a).sum((1, 2, 3)))
        out.sq = cat(sq) if need.sq else None
        out.dot = cat(dot) if ref is not None else None
        if need.sums:
            out.sums = [self.wsum(None, x, y, need.sums_dtype) for x, y in need.bounds]
        if need.sqsums:  # one position: (g^2)^T (a^2), in float64
            out.sqsums = []
            for x, y in need.bounds:
                total = torch.zeros((self.groups, self.p, self.d), dtype=torch.float64)
                for _, _, a, g in self.blocks(x, y):
                    a64, g64 = a.to(torch.float64), g.to(torch.float64)
                    total = total.to(a.device) + torch.einsum(
                        "ngtp,ngtd->gpd", g64 * g64, a64 * a64
                    )
                out.sqsums.append(total.reshape(self.shapes[name]))
        return {name: out}

    def pass2(
        self, clip: torch.Tensor | None, means: list[Tensors] | None, bounds: list[tuple[int, int]]
    ) -> dict[str, Pass2]:
        if self._form == "materialise" or self._cache is not None:
            return super().pass2(clip, means, bounds)
        name = self.names[0]
        out = Pass2()
        if clip is not None:
            out.clipped = [self.wsum(clip[x:y], x, y, clip.dtype) for x, y in bounds]
        if means is not None:
            cos = []
            for s, (x, y) in enumerate(bounds):
                ref = self._ref(means[s][name])
                for _, _, a, g in self.blocks(x, y):
                    cos.append(((g @ ref.to(g.dtype)) * a).sum((1, 2, 3)))
            out.cos = cat(cos)
        return {name: out}


def _rows(g: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``g``, ``a`` [n, T, k], or both time-major when both are laid out that way (attention's
    projections): a sum over every (sample, position) row does not care about the order of
    the rows as long as both sides share it, and this order needs no copy."""
    gt, at = g.transpose(0, 1), a.transpose(0, 1)
    if not (g.is_contiguous() and a.is_contiguous()) and gt.is_contiguous() and at.is_contiguous():
        return gt, at
    return g, a


class LinearSource(OuterSource):
    """The weight of ``F.linear`` calls; several calls add positions (an RNN's steps)."""

    def __init__(self, name: str, uses: list[Use], ctx: SourceContext) -> None:
        a = [u.a.reshape(ctx.batch, -1, u.a.shape[-1]) for u in uses]
        g = [x.reshape(ctx.batch, -1, x.shape[-1]) for x in (u.grad_bf() for u in uses)]
        self.a = cat(a, 1).unsqueeze(1)
        self.g = cat(g, 1).unsqueeze(1)
        shape = ctx.shapes[name]
        super().__init__(
            name,
            shape,
            ctx.batch,
            ctx.budget,
            1,
            self.a.shape[-1],
            self.g.shape[-1],
            self.a.shape[2],
            "linear",
        )

    def blocks(self, lo: int, hi: int) -> Iterator[Block]:
        yield lo, hi, self.a[lo:hi], self.g[lo:hi]


@register_source("linear")
def linear_source(name: str, role: str, uses: list[Use], ctx: SourceContext) -> Materialised:
    if role == "bias":
        g = [u.grad_bf() for u in uses]
        rows = [x.reshape(ctx.batch, -1, x.shape[-1]) for x in g]
        per = total([r[:, 0] if r.shape[1] == 1 else r.sum(1) for r in rows])
        return Dense(name, per.reshape(ctx.batch, *ctx.shapes[name]), ctx.budget, "linear")
    return LinearSource(name, uses, ctx)


@register_op(F.linear)
def capture_linear(
    cap: Capture, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], found: dict[int, str]
) -> tuple[Any, list[Use]] | None:
    x, w, b = bind(args, kwargs, ("input", "weight", "bias"))
    if id(x) in found or not cap.is_batched(x) or x.dim() < 2:
        return None
    out = func(*args, **kwargs)
    return out, [Use("linear", func, roles_of(found, weight=w, bias=b), out=out, a=x)]


def roles_of(found: dict[int, str], **tensors: Any) -> dict[str, str]:
    return {
        found[id(t)]: role
        for role, t in tensors.items()
        if isinstance(t, torch.Tensor) and id(t) in found
    }


_MHA = inspect.signature(F.multi_head_attention_forward)


@register_op(F.multi_head_attention_forward)
def capture_attention(
    cap: Capture, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], found: dict[int, str]
) -> tuple[Any, list[Use]] | None:
    """Self-attention without masks, replayed with its two projections as captured linears.

    The steps are those of ``F.multi_head_attention_forward`` for this case (same ops, same
    order, so the same numbers); any other configuration declines and its parameters fall
    back to the enclosing module.
    """
    try:
        bound = _MHA.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    v = bound.arguments
    q = v["query"]
    simple = (
        q is v["key"]
        and q is v["value"]
        and isinstance(q, torch.Tensor)
        and q.dim() == 3
        and q.shape[1] == cap.batch
        and id(q) not in found
        and not v["use_separate_proj_weight"]
        and v["in_proj_weight"] is not None
        and v["bias_k"] is None
        and v["bias_v"] is None
        and not v["add_zero_attn"]
        and v["key_padding_mask"] is None
        and v["attn_mask"] is None
        and not v["need_weights"]
        and not v["is_causal"]
        and v["static_k"] is None
        and v["static_v"] is None
        and (not v["training"] or v["dropout_p"] == 0.0)
        and v["embed_dim_to_check"] == q.shape[2]
        and set(found.values())
        <= {
            found.get(id(v[k]))
            for k in ("in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias")
        }
    )
    if not simple:
        return None
    tgt_len, bsz, embed_dim = q.shape
    heads = v["num_heads"]
    head_dim = embed_dim // heads
    uses = []
    proj = F.linear(q, v["in_proj_weight"], v["in_proj_bias"])
    roles = roles_of(found, weight=v["in_proj_weight"], bias=v["in_proj_bias"])
    if roles:
        uses.append(
            Use(
                "linear",
                F.linear,
                roles,
                out=proj,
                a=q.transpose(0, 1),
                info={"to_bf": lambda g: g.transpose(0, 1)},
            )
        )
    proj = proj.unflatten(-1, (3, embed_dim)).unsqueeze(0).transpose(0, -2).squeeze(-2)
    proj = proj.contiguous()
    qh, kh, vh = (
        proj[i]
        .view(tgt_len, bsz * heads, head_dim)
        .transpose(0, 1)
        .view(bsz, heads, tgt_len, head_dim)
        for i in range(3)
    )
    attn = F.scaled_dot_product_attention(qh, kh, vh, None, 0.0, False)
    attn = attn.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
    out = F.linear(attn, v["out_proj_weight"], v["out_proj_bias"])
    roles = roles_of(found, weight=v["out_proj_weight"], bias=v["out_proj_bias"])
    if roles:
        uses.append(
            Use(
                "linear",
                F.linear,
                roles,
                out=out,
                a=attn.view(tgt_len, bsz, embed_dim).transpose(0, 1),
                info={"to_bf": lambda g: g.view(tgt_len, bsz, -1).transpose(0, 1)},
            )
        )
    return (out.view(tgt_len, bsz, out.size(1)), None), uses
