"""Plans kept beyond one process: made once per model structure and shared.

A plan's verdict (which parameters are captured op by op and which modules replay the rest) is
what the probe and its check work out; a worker that has never seen the model loads it instead
(:func:`service.fast_stats._plan.plan_for`). What is stored is plain JSON, never anything that
runs: per model structure, dtype, loss, selection, sample fields (dtype and number of
dimensions: no batch size, no sequence length), device, torch version and this package's own
code, the module replays of each *class* of calls (the digest of the sequence of ops the
plan's forward sees) and the reason when the model has no plan at all. In Redis mode the
entries live in Redis (:func:`service.redis_keys.plan`); in embedded mode under the data directory
(``plans/``).

An entry is trusted only as far as it is proven:

- one that does not parse, names another key, or fails its digest is ignored with a log line;
- one whose parameters or modules the model lacks is ignored the same way;
- one signed with HMAC-SHA256 under the store's secret is taken as it is: in Redis mode
  ``PSGRAD_COMPILE_SECRET`` (the secret workers share); under a data directory that setting,
  else the folder's own key (``plans/.secret``, made on first use, owner-only);
- any other (unsigned, or signed under another secret) is checked like a new plan before its
  first use (:func:`._plan._check`, not the probe): an entry written by a party without the
  secret can never change an answer, only cost that check.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch

from psgrad import __version__
from service import redis_keys

log = logging.getLogger("psgrad.plans")

FORMAT = 1
MAX_ENTRY_BYTES = 4 << 20  # a plan names each parameter a few times: GPT-2's is ~20 KiB
_CODE = Path(__file__).parent


def _code_digest() -> str:
    """This package's own source: a stored verdict holds for the code that checked it."""
    h = hashlib.sha256()
    for path in sorted(_CODE.rglob("*.py")):
        h.update(path.relative_to(_CODE).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


CODE = _code_digest()


def signature_digest(signature: Sequence[Any]) -> str | None:
    """A digest of a plan's sequence of uses that another process computes alike (None when a
    use names something only this process can: an object known by its address)."""
    parts = []
    for sig in signature:
        kind = f"{sig.kind.__module__}.{sig.kind.__qualname__}"
        part = json.dumps([kind, _func_name(sig.func), sig.roles, repr(sig.key)])
        if " at 0x" in part:
            return None
        parts.append(part)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _func_name(func: Any) -> str:
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(func)
    owner = getattr(func, "__module__", None) or getattr(
        getattr(func, "__objclass__", None), "__qualname__", None)
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    return f"{owner}.{name}" if owner and name else repr(func)


@dataclass(frozen=True)
class Stored:
    """A loaded entry: the module replays of each class of calls, or why there is no plan."""

    classes: Mapping[str, tuple[tuple[str, tuple[str, ...]], ...]]  # digest -> replays
    unsupported: str | None
    trusted: bool  # signed with the workers' secret: no check before use


@dataclass
class PlanStats:
    """What the store did in this process (tests count probes by it, never by time)."""

    probes: int = 0  # plans worked out by a probe and its check
    checks: int = 0  # checks run (a probe's, or an unsigned entry's before its first use)
    check_s: float = 0.0  # seconds they took
    loaded: int = 0  # plans taken from the store
    stored: int = 0
    ignored: int = 0  # entries refused (corrupt, foreign, tampered, failed their check)
    reasons: list[str] = field(default_factory=list)


class Backend(Protocol):
    def read(self, name: str) -> bytes | None: ...
    def write(self, name: str, data: bytes) -> None: ...
    def close(self) -> None: ...


class RedisBackend:
    """Entries as Redis strings (``redis_keys.plan``), kept :data:`redis_keys.PLAN_TTL_S`
    after last use."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.r, self.prefix = client, prefix

    def read(self, name: str) -> bytes | None:
        key = redis_keys.plan(self.prefix, name)
        data: bytes | None = self.r.getex(key, ex=redis_keys.PLAN_TTL_S)
        return data

    def write(self, name: str, data: bytes) -> None:
        self.r.set(redis_keys.plan(self.prefix, name), data, ex=redis_keys.PLAN_TTL_S)

    def close(self) -> None:
        self.r.close()


class FileBackend:
    """Entries as files ``<root>/<name>.json``, written whole (a temporary file, renamed)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def read(self, name: str) -> bytes | None:
        """The entry's bytes (at most one past :data:`MAX_ENTRY_BYTES`: refused as too large
        below), or None; a link or anything but a plain file is refused (a FIFO would block
        its reader)."""
        path = self.root / f"{name}.json"
        try:
            with _opened(path) as (f, st):
                if not stat.S_ISREG(st.st_mode):
                    raise OSError(f"{path} is not a plain file")
                return f.read(MAX_ENTRY_BYTES + 1)
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{name}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        tmp.replace(self.root / f"{name}.json")

    def close(self) -> None:
        pass

    def own_secret(self) -> str:
        """This folder's own signing key (``.secret``, readable by its owner only), made on
        first use: an embedded server trusts what it signed itself before a restart."""
        path = self.root / ".secret"
        try:
            return _owned_secret(path)
        except FileNotFoundError:
            pass
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first
            return _owned_secret(path)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        return path.read_text().strip()


def _owned_secret(path: Path) -> str:
    """The signing key in ``path`` where only this user could have written it (a plain file,
    this user's, readable by no one else); else none, said in the log: the plans are then
    checked before their first use, as a worker's without PSGRAD_COMPILE_SECRET are."""
    with _opened(path) as (f, st):
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            log.warning("plans' signing key %s is not a file of this user's that no one else "
                        "may read (mode %o): not trusted; stored plans are checked before "
                        "their first use", path, stat.S_IMODE(st.st_mode))
            return ""
        return f.read(256).decode().strip()


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[tuple[BinaryIO, os.stat_result]]:
    """``path`` open for reading, never through a link nor blocking on a FIFO, and what it is
    (its ``fstat``, for the caller to refuse anything but a plain file)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        yield f, os.fstat(fd)


class SharedPlans:
    """The plans of every model this process serves, kept in a backend all its peers read."""

    def __init__(self, backend: Backend, secret: str = "") -> None:
        self.backend = backend
        self.secret = secret.encode()
        self.stats = PlanStats()

    def load(self, key: Mapping[str, Any], module: torch.nn.Module) -> Stored | None:
        """The stored entry for ``key``, or None (none, or refused with a log line)."""
        name = _name(key)
        try:
            data = self.backend.read(name)
        except Exception as exc:  # a store that cannot be read is a cold start, not an error
            log.warning("plan store unreadable (%s): planning afresh", exc)
            return None
        if data is None:
            return None
        try:
            return _parse(data, key, module, self.secret)
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            self.refused(f"stored plan {name} ignored: {str(exc)[:300]}")
            return None

    def save(self, key: Mapping[str, Any], signature: str | None,
             replays: Mapping[str, Sequence[str]] | None, unsupported: str | None = None) -> None:
        """Adds a class of calls (``signature`` -> ``replays``) or the reason there is no plan."""
        name = _name(key)
        body: dict[str, Any] = {"format": FORMAT, "key": dict(key), "classes": {},
                                "unsupported": unsupported}
        try:
            body["classes"] = self._vouched_classes(name, body["key"])
            if signature is not None and replays is not None:
                body["classes"][signature] = [[m, list(p)] for m, p in replays.items()]
            self.backend.write(name, _sign(body, self.secret))
            self.stats.stored += 1
        except Exception as exc:  # the next process plans again: slower, never wrong
            log.warning("plan %s not stored: %s", name, exc)

    def _vouched_classes(self, name: str, key: Mapping[str, Any]) -> dict[str, Any]:
        """The classes already stored that this process would vouch for (signed under its
        secret, or intact where it holds none); a damaged entry is written over."""
        try:
            old = self.backend.read(name)
            previous = json.loads(old) if old else {}
        except (OSError, ValueError, RecursionError):
            return {}
        if not isinstance(previous, dict) or previous.get("key") != key:
            return {}
        sealed = _signed_ok(previous, self.secret)
        if sealed is True or (sealed is False and not self.secret):
            return dict(previous.get("classes") or {})
        return {}

    def close(self) -> None:
        self.backend.close()

    def refused(self, reason: str) -> None:
        log.warning("%s", reason)
        self.stats.ignored += 1
        self.stats.reasons.append(reason)


def plan_key(structure: str, dtype: torch.dtype, loss: str, selected: Sequence[str],
             fields: Iterator[tuple[str, torch.dtype, int]], device: torch.device,
             form: str) -> dict[str, Any]:
    """What a stored verdict depends on (no batch size, no sequence length)."""
    kind = device.type
    if kind == "cuda":
        kind = f"cuda:{torch.cuda.get_device_name(device)}"
    return {"structure": structure, "dtype": str(dtype), "loss": loss,
            "selected": list(selected), "fields": [[k, str(d), n] for k, d, n in fields],
            "device": kind, "form": form, "torch": torch.__version__, "psgrad": __version__,
            "code": CODE}


def _name(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _sign(body: dict[str, Any], secret: bytes) -> bytes:
    raw = _canonical(body)
    if secret:
        seal = "hmac:" + hmac.new(secret, raw, hashlib.sha256).hexdigest()
    else:
        seal = "sha256:" + hashlib.sha256(raw).hexdigest()
    return _canonical({**body, "seal": seal})


def _signed_ok(entry: Mapping[str, Any], secret: bytes) -> bool | None:
    """True: signed under ``secret``; False: intact but unsigned; None: the seal is wrong."""
    seal = entry.get("seal")
    if not isinstance(seal, str):
        return None
    raw = _canonical({k: v for k, v in entry.items() if k != "seal"})
    if seal.startswith("hmac:") and secret:
        good = hmac.new(secret, raw, hashlib.sha256).hexdigest()
        return True if hmac.compare_digest(seal[5:], good) else None
    if seal.startswith("sha256:"):
        return False if hmac.compare_digest(seal[7:], hashlib.sha256(raw).hexdigest()) else None
    return None  # signed under a secret this process does not hold


def _parse(data: bytes, key: Mapping[str, Any], module: torch.nn.Module,
           secret: bytes) -> Stored:
    if len(data) > MAX_ENTRY_BYTES:
        raise ValueError(f"{len(data)} bytes, over {MAX_ENTRY_BYTES}")
    entry = json.loads(data)
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        raise ValueError("not a plan of this format")
    sealed = _signed_ok(entry, secret)
    if sealed is None:
        if str(entry.get("seal", "")).startswith("hmac:"):
            raise ValueError("it is signed under a PSGRAD_COMPILE_SECRET this worker does not "
                             "hold (set the same one on every worker), or was changed since")
        raise ValueError("its seal does not match its content")
    if entry.get("key") != dict(key):
        raise ValueError("it is another model's or another setting's (foreign)")
    unsupported = entry.get("unsupported")
    if unsupported is not None and not isinstance(unsupported, str):
        raise TypeError("'unsupported' is not a string")
    selected = set(key["selected"])
    modules = {name for name, _ in module.named_modules()}
    classes = {}
    for digest, replays in dict(entry["classes"]).items():
        seen: set[str] = set()
        out = []
        for owner, names in replays:
            if not isinstance(owner, str) or owner not in modules:
                raise ValueError(f"module {owner!r} is not the model's")
            if not all(isinstance(n, str) for n in names) or not set(names) <= selected - seen:
                raise ValueError(f"replay of {owner!r} names parameters outside the selection")
            seen |= set(names)
            out.append((owner, tuple(names)))
        classes[str(digest)] = tuple(out)
    return Stored(classes, unsupported, trusted=bool(sealed))
