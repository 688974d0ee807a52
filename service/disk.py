"""A server's own folders (the data directory, the model directory) that take no write: the
``OSError`` of a full, read-only or unwritable volume as the 507 a client can act on, so a
disk's state is never a 500."""

from __future__ import annotations

import errno

from psgrad._errors import InsufficientStorage

__all__ = ["unwritable"]


def unwritable(exc: OSError, folder: str, setting: str) -> InsufficientStorage | None:
    """The 507 for ``folder`` (``"the data directory"``), set by ``setting``, that cannot take
    a write: full (ENOSPC, EDQUOT), mounted read-only (EROFS: a volume remounted read-only
    after a disk error, a read-only bind mount), or not writable by the server's user (EACCES,
    EPERM). None for any other error."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientStorage(
            f"{folder} is full ({exc.strerror}); nothing was written: retry once the operator "
            f"has freed space ({setting})", reason="full")
    if exc.errno == errno.EROFS:
        return InsufficientStorage(
            f"{folder} is read-only (the volume under {setting} was mounted or remounted "
            "read-only); nothing was written and what it holds is still readable: retry once "
            "the operator has remounted it read-write (after a disk error, check the disk "
            "first)", reason="read_only")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return InsufficientStorage(
            f"{folder} is not writable by the server ({exc.strerror}); nothing was written: "
            f"the operator must give the server's user write access to {setting}",
            reason="not_writable")
    return None
