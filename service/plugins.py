"""One registry of plug-ins by key, filled by a decorator: zoo families, losses, outputs, layer
families.

Every registry answers an unknown key the same way: the registry's own error class (a
:class:`psgrad.PsgradError`, so it reaches the client as its code) with a message that names
what was asked for and every key that would have worked. Torch-free, and below every layer that
uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from psgrad._errors import PsgradError

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")


def key_name(key: Any) -> str:
    """How a key reads in a message (a torch function by its name, anything else by ``str``)."""
    return getattr(key, "__name__", None) or str(key)


class Registry(Generic[K, V]):
    """Plug-ins by key, in registration order.

    Args:
        what: what a key names, for messages ("loss", "output", "architecture").
        error: the error class an unknown key raises; it gets ``known=[...]`` as details.
        sort: list the known keys sorted (True) or in registration order.
    """

    def __init__(self, what: str, error: type[PsgradError], *, sort: bool = True) -> None:
        self.what = what
        self.error = error
        self.sort = sort
        self._items: dict[K, V] = {}

    def add(self, key: K, value: V) -> V:
        if key in self._items:
            raise ValueError(f"{self.what} {key_name(key)!r} is registered twice")
        self._items[key] = value
        return value

    def register(self, *keys: K) -> Callable[[T], T]:
        """Decorator: register the decorated object under each of ``keys`` (unchanged)."""

        def decorate(obj: T) -> T:
            for key in keys:
                self.add(key, obj)  # type: ignore[arg-type]
            return obj

        return decorate

    def remove(self, key: K) -> V | None:
        """Take ``key`` out (test-only plug-ins leave no trace); None when it was not there."""
        return self._items.pop(key, None)

    def get(self, key: K) -> V:
        try:
            return self._items[key]
        except (KeyError, TypeError):
            known = self.names()
            raise self.error(
                f"unknown {self.what} '{key_name(key)}'; known: {', '.join(known) or '(none)'}",
                known=known,
            ) from None

    def find(self, key: K) -> V | None:
        """The plug-in for ``key``, or None (for lookups that fall back instead of failing)."""
        return self._items.get(key)

    def names(self) -> list[str]:
        names = [key_name(k) for k in self._items]
        return sorted(names) if self.sort else names

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[K]:
        return list(self._items)

    def values(self) -> list[V]:
        return list(self._items.values())

    def items(self) -> list[tuple[K, V]]:
        return list(self._items.items())
