"""Seeing every use of a tracked parameter in one batched forward pass, and the helpers families
capture with.

:class:`Capture` is a ``TorchFunctionMode``: each torch function call that reads a tracked
parameter goes to the family registered for that function (:data:`~._family.FAMILIES`), which
runs it and describes its uses; a call no family claims runs as is and is recorded as a
:class:`~._records.DirectCall` when it runs sample by sample, else as an
:class:`~._records.OpaqueCall`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from service.fast_stats import _family
from service.fast_stats._records import DirectCall, OpaqueCall, Output, Use


def bind(args: Sequence[Any], kwargs: dict[str, Any], names: Sequence[str]) -> list[Any]:
    """Positional-or-keyword arguments by name (None when absent)."""
    return [args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names)]


def roles_of(found: dict[int, str], **tensors: Any) -> dict[str, str]:
    """``{parameter name: role}`` of the tracked parameters among ``role=tensor`` arguments."""
    return {
        found[id(t)]: role
        for role, t in tensors.items()
        if isinstance(t, torch.Tensor) and id(t) in found
    }


def leaves(args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[Any]:
    """Arguments, one level into lists and tuples (``torch.cat([w1, w2])``)."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, (list, tuple)):
            yield from v
        else:
            yield v


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
        family = _family.FAMILIES.get(func)
        if family is not None:
            answer = family.capture(self, func, tuple(args), kwargs, found)
            if answer is not None:
                out, uses = answer
                for use in uses:
                    self.record(use)
                return out
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            self.record(self.unclaimed(func, tuple(args), kwargs, found, out))
        return out

    def record(self, use: Use) -> None:
        self.uses.append(use if self.stack is None else replace(use, stack=tuple(self.stack)))

    def is_batched(self, t: Any) -> bool:
        """Whether ``t`` is an activation of the batch (not a parameter, buffer or constant)."""
        return (
            isinstance(t, torch.Tensor)
            and id(t) not in self.consts
            and id(t) not in self.tracked
            and t.dim() > 0
            and t.shape[0] == self.batch
        )

    def batch_rows(self, t: Any) -> bool:
        """Batch first, or a flattening of a batch-first tensor that keeps its memory
        (``x.view(-1, d)`` of a contiguous ``[B, T, d]``): sample i owns rows ``i*T`` to
        ``(i+1)*T - 1``, in order."""
        if self.is_batched(t):
            return True
        base = t._base if isinstance(t, torch.Tensor) else None
        return (
            base is not None
            and self.is_batched(base)
            and id(t) not in self.consts
            and t.dim() > 0
            and t.shape[0] % self.batch == 0
            and t.numel() == base.numel()
            and t.data_ptr() == base.data_ptr()
            and t.is_contiguous()
            and base.is_contiguous()
        )

    def unclaimed(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        found: dict[int, str],
        out: torch.Tensor,
    ) -> Use:
        """A call no family claimed: a :class:`DirectCall` when it is batch-first in and out
        with its parameters as plain arguments, else an :class:`OpaqueCall`."""
        flat = (*args, *kwargs.values())
        pattern = "".join(self._letter(v) for v in flat)
        ok = out.dim() > 0 and out.shape[0] == self.batch and "?" not in pattern and "b" in pattern
        roles = {
            name: f"arg{i}"
            for i, v in enumerate(flat)
            if isinstance(v, torch.Tensor) and (name := found.get(id(v))) is not None
        }
        roles |= {name: "nested" for name in found.values() if name not in roles}
        if not ok:
            return Use(None, func, roles, OpaqueCall(pattern))
        names = tuple(found.get(id(v)) if isinstance(v, torch.Tensor) else None for v in flat)
        return Use(None, func, roles, DirectCall(args, kwargs, pattern, names),
                   out=Output.of(out))

    def _letter(self, v: Any) -> str:
        if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            return "?"
        if not isinstance(v, torch.Tensor):
            return "-"
        if id(v) in self.tracked:
            return "p"
        if id(v) in self.consts:
            return "c"
        return "b" if self.is_batched(v) else "?"
