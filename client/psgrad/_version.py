"""One version number for psgrad: this distribution's, which the server (``psgrad-server``,
released together) pins and reports in the ``psgrad-version`` header of every answer.

A client warns, once, when its server is older than the client's major.minor release: the
server may not know fields or answers this client sends or expects.
"""

from __future__ import annotations

import warnings

__version__ = "0.2.0"

VERSION_HEADER = "psgrad-version"


class ServerVersionWarning(UserWarning):
    """The server is an older release than this client (its ``psgrad-version`` header)."""


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version such as ``0.2.0`` or ``1.3.0rc1``; None if it has none."""
    parts = version.strip().split(".")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def warn_if_older(server: str | None, base_url: str) -> bool:
    """Warn (:class:`ServerVersionWarning`) when ``server``, an answer's ``psgrad-version``,
    is an older release than this client's; True once the header was read (warned or not)."""
    if server is None:
        return False
    theirs, ours = release(server), release(__version__)
    if theirs is not None and ours is not None and theirs < ours:
        warnings.warn(
            f"the psgrad server at {base_url} is version {server}, older than this client "
            f"({__version__}): fields it does not know are refused or ignored; upgrade the "
            f"server, or install the client of its release (pip install 'psgrad=={server}')",
            ServerVersionWarning, stacklevel=2)
    return True
