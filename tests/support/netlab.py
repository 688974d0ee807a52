"""Several "hosts" on one machine: Linux network namespaces joined by a bridge, for the
multi-host tests (``pytest -m multihost``).

Each :class:`Host` is a namespace with one interface, ``eth0``, at ``10.77.<n>.<i>/24``, its
other end a port of a bridge in a namespace of its own (the switch), so that a host is cut off
by taking its port down (packets then vanish silently, as on a real partition) and its
processes are every process in its namespace. The test process stays in the machine's own
namespace and reaches the hosts through one more veth pair at ``10.77.<n>.254``. Everything is
made with a per-run tag and deleted by :meth:`Lab.close` (deleting the switch's namespace also
deletes the machine-side end). Nothing here routes beyond the lab's /24.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def namespaces_or_skip() -> None:
    """Skip, saying why, where namespaces cannot be made (not root, no ``ip``, a sandbox)."""
    if shutil.which("ip") is None:
        pytest.skip("multi-host tests need iproute2's `ip` (apt-get install iproute2)")
    if os.geteuid() != 0:
        pytest.skip("multi-host tests make network namespaces: run them as root")
    probe = f"mhprobe-{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        pytest.skip(f"network namespaces are not allowed here: {made.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


class Host:
    """One namespace, its address, and the processes started in it."""

    def __init__(self, lab: Lab, name: str, index: int) -> None:
        self.lab = lab
        self.name = name
        self.ns = f"{lab.tag}-{name}"
        self.port = f"p{index}"  # its port on the switch
        self.addr = f"{lab.net}.{index}"
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: Sequence[str], env: Mapping[str, str], log: Path
              ) -> subprocess.Popen[bytes]:
        """``argv`` in this host's namespace, its output to ``log``."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], env=dict(env),
                                    stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        found = _ip("netns", "pids", self.ns, check=False).stdout.split()
        return [int(p) for p in found if p.isdigit()]

    def signal_all(self, sig: int) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill_all(self) -> None:
        """The host dies: SIGKILL to every process in its namespace, reaped."""
        self.signal_all(signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self.procs = [p for p in self.procs if p.poll() is None]

    def link(self, up: bool) -> None:
        """Connect or cut this host (its switch port), both ways."""
        _ip("-n", self.lab.switch, "link", "set", self.port, "up" if up else "down")

    def netem(self, spec: str) -> bool:
        """``tc netem`` on this host's interface (e.g. ``delay 40ms 10ms loss 2%``); False where
        the kernel has no netem."""
        done = subprocess.run(["tc", "-n", self.ns, "qdisc", "replace", "dev", "eth0", "root",
                               "netem", *spec.split()], capture_output=True, text=True,
                              check=False, timeout=30)
        return done.returncode == 0


class Lab:
    """The switch, the hosts, and the machine's own port; :meth:`close` removes all of it."""

    def __init__(self) -> None:
        self.tag = f"mh{uuid.uuid4().hex[:6]}"
        self.net = f"10.77.{self._free_octet()}"
        self.switch = f"{self.tag}-sw"
        self.hosts: list[Host] = []
        self.gateway = f"{self.net}.254"
        self._root_port = f"{self.tag}r"
        _ip("netns", "add", self.switch)
        try:
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            _ip("link", "add", self._root_port, "type", "veth", "peer", "name", "up0",
                "netns", self.switch)
            _ip("-n", self.switch, "link", "set", "up0", "master", "br0", "up")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self._root_port)
            _ip("link", "set", self._root_port, "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _free_octet() -> int:
        routes = _ip("-4", "route", "show", check=False).stdout + _ip(
            "-4", "addr", "show", check=False).stdout
        free = [n for n in range(100, 250) if f"10.77.{n}." not in routes]
        if not free:
            pytest.skip("no free 10.77.x.0/24 for the lab")
        return random.choice(free)

    def add(self, name: str) -> Host:
        host = Host(self, name, len(self.hosts) + 1)
        _ip("netns", "add", host.ns)
        self.hosts.append(host)
        _ip("-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "name", "eth0",
            "netns", host.ns)
        _ip("-n", self.switch, "link", "set", host.port, "master", "br0", "up")
        _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
        _ip("-n", host.ns, "link", "set", "eth0", "up")
        _ip("-n", host.ns, "link", "set", "lo", "up")
        return host

    def close(self) -> None:
        for host in self.hosts:
            host.kill_all()
            _ip("netns", "del", host.ns, check=False)
        _ip("netns", "del", self.switch, check=False)  # takes the machine-side port with it
        _ip("link", "del", self._root_port, check=False)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
