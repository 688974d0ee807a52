"""Compose as this machine has it: the plugin (`docker compose`) or `docker-compose`."""

from __future__ import annotations

import shutil
import subprocess


def compose_command() -> list[str] | None:
    """The command that runs Compose here, or None when neither is installed."""
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy is not None else None
