"""Linear layers: ``F.linear`` (``aten.linear`` in exported graphs), ``aten.addmm`` (Hugging
Face's ``Conv1D``, exported), and the two projections inside ``F.multi_head_attention_forward``.

The per-sample gradient of a linear weight is ``sum_t g_it a_it^T`` over the positions t of
sample i (:class:`~.._outer.OuterSource`); several calls of one weight add positions (an RNN's
steps). A bias's is ``sum_t g_it``, held whole. ``addmm(bias, x, w)`` reads its weight as
``[in, out]``, the transpose of a linear weight: its role is ``weight_t``, whose gradient
``sum_t a_it g_it^T`` is the same outer-product source with the two sides swapped. Inputs may be
batch first or their flattening ``[B * T, d]`` (``x.view(-1, d)``), rows in sample order.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from service.fast_stats._capture import Capture, bind, roles_of
from service.fast_stats._dense import dense_sum
from service.fast_stats._family import Captured, Family, register_family
from service.fast_stats._outer import Block, OuterSource
from service.fast_stats._records import Use
from service.fast_stats._source import Source, SourceContext, cat


@dataclass(frozen=True)
class LinearInput:
    """The layer input ``a``, batch first, and how to bring the output gradient to that layout
    (attention runs its projections time-major)."""

    a: torch.Tensor
    to_bf: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def key(self) -> Hashable:
        return None

    def grad_bf(self, g: torch.Tensor) -> torch.Tensor:
        return self.to_bf(g) if self.to_bf is not None else g


class LinearSource(OuterSource):
    """The weight of ``F.linear`` calls, from their inputs and output gradients
    ``[B, T, d]``/``[B, T, p]`` (positions of all calls concatenated)."""

    pieces_cos = True

    def __init__(self, name: str, a: torch.Tensor, g: torch.Tensor, ctx: SourceContext) -> None:
        self.a = a.unsqueeze(1)
        self.g = g.unsqueeze(1)
        self.grams = ctx.grams
        super().__init__(name, ctx.shapes[name], ctx.batch, ctx.budget, groups=1,
                         d=a.shape[-1], p=g.shape[-1], positions=a.shape[1], method="linear")

    @property
    def dtype(self) -> torch.dtype:
        return self.a.dtype

    def blocks(self, lo: int, hi: int) -> Iterator[Block]:
        yield lo, hi, self.a[lo:hi], self.g[lo:hi]

    def gram(self, a: torch.Tensor) -> torch.Tensor:
        return self.grams(a)  # the query, key and value of one input build it once


_MHA = inspect.signature(F.multi_head_attention_forward)
_ADDMM = torch.ops.aten.addmm.default


@register_family(F.linear, F.multi_head_attention_forward, torch.ops.aten.linear.default, _ADDMM)
class Linear(Family[LinearInput]):
    method = "linear"

    def source(self, name: str, role: str, uses: Sequence[Use], ctx: SourceContext) -> Source:
        batch = ctx.batch
        g = [self.payload(u).grad_bf(u.grad) for u in uses]
        rows = [x.reshape(batch, -1, x.shape[-1]) for x in g]
        if role == "bias":
            parts = [r[:, 0] if r.shape[1] == 1 else r.sum(1) for r in rows]
            return dense_sum(name, parts, ctx, self.method)
        a = [p.a.reshape(batch, -1, p.a.shape[-1]) for p in map(self.payload, uses)]
        if role == "weight_t":  # [in, out]: sum_t a_t g_t^T, the outer product swapped
            return LinearSource(name, cat(rows, 1), cat(a, 1), ctx)
        return LinearSource(name, cat(a, 1), cat(rows, 1), ctx)

    def capture(
        self, cap: Capture, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
        found: dict[int, str],
    ) -> Captured | None:
        if func is F.multi_head_attention_forward:
            return self._attention(cap, args, kwargs, found)
        if func is _ADDMM:
            return self._addmm(cap, func, args, kwargs, found)
        x, w, b = bind(args, kwargs, ("input", "weight", "bias"))
        if id(x) in found or not cap.batch_rows(x) or x.dim() < 2:
            return None
        out = func(*args, **kwargs)
        return out, [self.use(func, roles_of(found, weight=w, bias=b), LinearInput(x), out)]

    def _addmm(
        self, cap: Capture, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
        found: dict[int, str],
    ) -> Captured | None:
        """``bias + x @ w`` on rows ``x`` [B * T, in] of the batch, ``w`` [in, out]."""
        b, x, w, beta, alpha = bind(args, kwargs, ("self", "mat1", "mat2", "beta", "alpha"))
        if (
            beta not in (None, 1)
            or alpha not in (None, 1)
            or id(x) in found
            or not cap.batch_rows(x)
            or (id(b) in found and b.dim() != 1)
        ):
            return None
        out = func(*args, **kwargs)
        return out, [self.use(func, roles_of(found, weight_t=w, bias=b), LinearInput(x), out)]

    def _attention(
        self, cap: Capture, args: tuple[Any, ...], kwargs: dict[str, Any], found: dict[int, str]
    ) -> Captured | None:
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
        if not _simple_self_attention(v, cap, found):
            return None
        q = v["query"]
        tgt_len, bsz, embed_dim = q.shape
        heads = v["num_heads"]
        head_dim = embed_dim // heads
        uses = []
        proj = F.linear(q, v["in_proj_weight"], v["in_proj_bias"])
        roles = roles_of(found, weight=v["in_proj_weight"], bias=v["in_proj_bias"])
        if roles:
            payload = LinearInput(q.transpose(0, 1), lambda g: g.transpose(0, 1))
            uses.append(self.use(F.linear, roles, payload, proj))
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
            payload = LinearInput(attn.view(tgt_len, bsz, embed_dim).transpose(0, 1),
                                  lambda g: g.view(tgt_len, bsz, -1).transpose(0, 1))
            uses.append(self.use(F.linear, roles, payload, out))
        return (out.view(tgt_len, bsz, out.size(1)), None), uses


def _simple_self_attention(v: dict[str, Any], cap: Capture, found: dict[int, str]) -> bool:
    q = v["query"]
    return bool(
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
