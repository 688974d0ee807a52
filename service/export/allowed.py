"""The allow-list: the exact aten overloads an exported program may call, and how strings pass.

Only pure functions are here: no random, in-place, ``out=``, higher-order, custom or I/O ops
(``aten.from_file`` reads a server file; it is not listed, so it is refused by name like every
op not listed). A target string from the archive is only ever a key into :data:`OPS`, built
from psgrad's own names: it is never imported, evaluated or looked up on a module.

Some calls are rewritten rather than run: dropout is the identity (per-sample gradients are
taken in eval mode), ``detach_`` and ``lift_fresh_copy`` on lifted constants are the identity,
and torch's metadata assertions are dropped (they compare against the exporting machine).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

import torch

_ATEN = """
linear.default matmul.default mm.default bmm.default addmm.default baddbmm.default einsum.default
conv1d.default conv2d.default conv3d.default conv1d.padding conv2d.padding conv3d.padding
conv_transpose1d.default conv_transpose2d.input conv_transpose3d.input
batch_norm.default layer_norm.default group_norm.default rms_norm.default embedding.default
max_pool1d.default max_pool2d.default max_pool3d.default avg_pool1d.default avg_pool2d.default
avg_pool3d.default adaptive_avg_pool1d.default adaptive_avg_pool2d.default
adaptive_avg_pool3d.default upsample_nearest2d.vec upsample_bilinear2d.vec pixel_shuffle.default
scaled_dot_product_attention.default pad.default constant_pad_nd.default
relu.default relu6.default gelu.default silu.default sigmoid.default tanh.default
hardtanh.default hardswish.default hardsigmoid.default leaky_relu.default elu.default
selu.default celu.default softplus.default mish.default prelu.default glu.default
softmax.int log_softmax.int _softmax.default _log_softmax.default
exp.default log.default log1p.default expm1.default sqrt.default rsqrt.default abs.default
neg.default sin.default cos.default erf.default reciprocal.default square.default sign.default
pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar clamp.default clamp.Tensor clamp_min.default
clamp_max.default minimum.default maximum.default where.self where.ScalarOther
where.ScalarSelf masked_fill.Scalar masked_fill.Tensor
add.Tensor add.Scalar sub.Tensor sub.Scalar rsub.Scalar rsub.Tensor mul.Tensor mul.Scalar
div.Tensor div.Scalar div.Tensor_mode div.Scalar_mode floor_divide.default remainder.Scalar
remainder.Tensor eq.Tensor eq.Scalar ne.Tensor ne.Scalar lt.Tensor lt.Scalar le.Tensor
le.Scalar gt.Tensor gt.Scalar ge.Tensor ge.Scalar logical_and.default logical_or.default
logical_not.default bitwise_not.default bitwise_and.Tensor bitwise_or.Tensor
sum.default sum.dim_IntList mean.default mean.dim amax.default amin.default max.dim min.dim
max.default min.default var.correction std.correction logsumexp.default cumsum.default
argmax.default argmin.default any.dim all.dim norm.ScalarOpt_dim
view.default reshape.default permute.default transpose.int t.default contiguous.default
unsqueeze.default squeeze.dim squeeze.dims squeeze.default expand.default flatten.using_ints
unflatten.int slice.Tensor select.int narrow.default index.Tensor index_select.default
gather.default cat.default stack.default split.Tensor split_with_sizes.default chunk.default
unbind.int repeat.default flip.default clone.default to.dtype to.dtype_layout to.device
_to_copy.default type_as.default zeros.default ones.default full.default zeros_like.default
ones_like.default full_like.default new_zeros.default new_ones.default new_full.default
arange.default arange.start arange.start_step tril.default triu.default
scalar_tensor.default sym_size.int alias.default detach.default __and__.Tensor __or__.Tensor
"""
IDENTITY = {  # (op, the argument passed through)
    "torch.ops.aten.dropout.default": "input",
    "torch.ops.aten.feature_dropout.default": "input",
    "torch.ops.aten.alpha_dropout.default": "input",
    "torch.ops.aten.detach_.default": "self",
    "torch.ops.aten.lift_fresh_copy.default": "self",
}
DROPPED = {  # assertions about the exporting machine's tensors: no output, nothing to run
    "torch.ops.aten._assert_tensor_metadata.default",
    "torch.ops.aten._assert_scalar.default",
    "torch.ops.aten.sym_constrain_range_for_size.default",
}
SYM_OPS: dict[str, Callable[[Any, Any], Any]] = {  # integer arithmetic on sizes
    "_operator.add": operator.add,
    "_operator.sub": operator.sub,
    "_operator.mul": operator.mul,
    "_operator.floordiv": operator.floordiv,
}
_EINSUM = re.compile(r"[a-zA-Z ,.]{1,120}(->[a-zA-Z .]{0,60})?")
STRINGS: dict[tuple[str, str], Callable[[str], bool]] = {
    ("gelu.default", "approximate"): {"none", "tanh"}.__contains__,
    ("einsum.default", "equation"): lambda s: bool(_EINSUM.fullmatch(s)),
    ("div.Tensor_mode", "rounding_mode"): {"trunc", "floor"}.__contains__,
    ("div.Scalar_mode", "rounding_mode"): {"trunc", "floor"}.__contains__,
    ("pad.default", "mode"): {"constant", "reflect", "replicate", "circular"}.__contains__,
    ("conv1d.padding", "padding"): {"same", "valid"}.__contains__,
    ("conv2d.padding", "padding"): {"same", "valid"}.__contains__,
    ("conv3d.padding", "padding"): {"same", "valid"}.__contains__,
}


PINNED: dict[tuple[str, str], Any] = {  # arguments that must hold this value when given
    ("batch_norm.default", "training"): False,  # batch statistics couple the samples
    ("scaled_dot_product_attention.default", "dropout_p"): 0.0,  # random otherwise
}


def _resolve(name: str) -> torch._ops.OpOverload:
    packet, overload = name.split(".")
    op: torch._ops.OpOverload = getattr(getattr(torch.ops.aten, packet), overload)
    schema = op._schema
    if schema.is_mutable or any(a.alias_info is not None and a.alias_info.is_write
                                for a in schema.arguments):
        raise AssertionError(f"{name} mutates its arguments")
    if torch.Tag.nondeterministic_seeded in op.tags and not any(k[0] == name for k in PINNED):
        raise AssertionError(f"{name} is random")
    # a tensor made from nothing takes the serving device from the graph (graph.py); made on
    # the CPU's default, the size pass on ``meta`` would allocate what it is meant to refuse
    types = [str(a.real_type) for a in schema.arguments]
    if not any("Tensor" in t or "Device" in t for t in types):
        raise AssertionError(f"{name} makes a tensor and takes no device")
    return op


OPS: dict[str, torch._ops.OpOverload] = {
    f"torch.ops.aten.{name}": _resolve(name) for name in _ATEN.split()
}


def known_string(op_name: str, arg: str, value: str) -> bool:
    """Whether ``value`` is in the fixed set of strings that argument of that op accepts."""
    check = STRINGS.get((op_name.removeprefix("torch.ops.aten."), arg))
    return check is not None and check(value)
