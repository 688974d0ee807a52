"""One registry of plug-ins by key, filled by a decorator: zoo families, losses, outputs, layer
families.

Every registry answers an unknown key the same way: the registry's own error class (a
:class:`psgrad.PsgradError`, so it reaches the client as its code) with a message that names
what was asked for and every key that would have worked. Torch-free, and below every layer that
uses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from psgrad._errors import PsgradError

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")


def key_name(key: Any) -> str:
    """How a key reads in a message (a torch function by its name, anything else by ``str``)."""
    return getattr(key, "__name__", None) or str(key)


class Registry(dict[K, V]):
    """Plug-ins by key, in registration order: a dict whose lookup ``registry[key]`` of an
    unknown key raises the registry's error (``get`` answers None, as a dict's does).

    A known key is found by the dict itself, with no call into this module: a request looks up
    its loss and outputs several times.

    Args:
        what: what a key names, for messages ("loss", "output", "architecture").
        error: the error class an unknown key raises; it gets ``known=[...]`` as details.
        sort: list the known keys sorted (True) or in registration order.
    """

    def __init__(self, what: str, error: type[PsgradError], *, sort: bool = True) -> None:
        super().__init__()
        self.what = what
        self.error = error
        self.sort = sort

    def __missing__(self, key: K) -> V:
        known = self.names()
        raise self.error(
            f"unknown {self.what} '{key_name(key)}'; known: {', '.join(known) or '(none)'}",
            known=known,
        )

    def add(self, key: K, value: V) -> V:
        if key in self:
            raise ValueError(f"{self.what} {key_name(key)!r} is registered twice")
        self[key] = value
        return value

    def register(self, *keys: K) -> Callable[[T], T]:
        """Decorator: register the decorated object under each of ``keys`` (unchanged)."""

        def decorate(obj: T) -> T:
            for key in keys:
                self.add(key, obj)  # type: ignore[arg-type]
            return obj

        return decorate

    def names(self) -> list[str]:
        names = [key_name(k) for k in self]
        return sorted(names) if self.sort else names
