"""What a layer family is, and the registry the capture looks families up in.

A family is one class, registered once by the torch functions it handles, Opacus-style::

    @register_family(F.linear)
    class Linear(Family[LinearInput]):
        method = "linear"

        def capture(self, cap, func, args, kwargs, found): ...  # run the op, describe its uses
        def source(self, name, role, uses, ctx): ...  # their per-sample statistics

``capture`` runs during the batched forward pass (under :class:`~._capture.Capture`) and answers
the op's output and one :class:`~._records.Use` per call, carrying the family's own frozen
payload, or None to decline (the op then runs as any other). ``source`` turns the uses of one
parameter in one role (same payload key) into a :class:`~._source.Source`. Adding a family is
one module in ``families/`` plus its import in ``families/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, cast

import torch

from psgrad._errors import PsgradError
from service.fast_stats._records import Output, Payload, Use
from service.plugins import Registry

if TYPE_CHECKING:
    from service.fast_stats._capture import Capture
    from service.fast_stats._source import Source, SourceContext

P = TypeVar("P", bound=Payload)
C = TypeVar("C", bound="type[Family[Any]]")
Captured = tuple[Any, list[Use]]  # what the op answers, and the uses it recorded


class Family(Generic[P]):
    """One layer family: how its calls are captured and how their statistics are computed."""

    method: ClassVar[str]  # how ``meta["method"]`` names a parameter this family computes
    reduces: ClassVar[bool] = False  # whether :meth:`reduce` keeps less than the gradient

    def capture(
        self, cap: Capture, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
        found: dict[int, str],
    ) -> Captured | None:
        """Run ``func`` and describe its uses of the tracked parameters ``found`` (by id)."""
        raise NotImplementedError

    def source(self, name: str, role: str, uses: Sequence[Use], ctx: SourceContext) -> Source:
        """The statistics of parameter ``name``, read in ``role`` by each of ``uses``."""
        raise NotImplementedError

    def reduce(self, use: Use, g: torch.Tensor) -> torch.Tensor:
        """What ``source`` reads of ``use``'s output gradient ``g`` (with ``reduces``): taken
        as the backward pass reaches the output, so that ``g`` itself is not held to the end.
        The use's ``grad`` is then this."""
        raise NotImplementedError

    def spent(self, payload: P) -> P:
        """``payload`` without what only :meth:`reduce` reads (the source reads the rest)."""
        return payload

    def use(self, func: Any, roles: dict[str, str], payload: P, out: torch.Tensor) -> Use:
        return Use(self, func, roles, payload, out=Output.of(out))

    def payload(self, use: Use) -> P:
        """``use``'s payload, as the type this family's capture gave it."""
        return cast(P, use.payload)


FAMILIES: Registry[Any, Family[Any]] = Registry("layer family", PsgradError, sort=False)


def register_family(*funcs: Any) -> Callable[[C], C]:
    """Class decorator: one instance of the family handles every call of ``funcs``."""

    def decorate(cls: C) -> C:
        family = cls()
        for func in funcs:
            FAMILIES.add(func, family)
        return cls

    return decorate
