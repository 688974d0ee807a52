"""A real tmpfs as a test's disk: as small as an unlucky volume, remounted read-only as one is
after a disk error. Needs root (mount); the test skips elsewhere, saying why."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """``folder`` (made here) as a tmpfs of ``size`` (``2m``, ...), unmounted after."""
    folder.mkdir()
    mounted = _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder))
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here (root needed): {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def remount(folder: Path, mode: str) -> None:
    """Remount ``folder`` ``ro`` or ``rw``; read-only refuses a write even to root."""
    done = _mount("-o", f"remount,{mode}", str(folder))
    assert done.returncode == 0, done.stderr
    if mode == "ro":
        with pytest.raises(OSError):
            (folder / "probe").write_bytes(b"x")


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
