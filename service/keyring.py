"""Which tenant a key belongs to: the keys of ``PSGRAD_API_KEYS``, ``PSGRAD_ADMIN_KEYS`` and the
keys file (``PSGRAD_KEYS_FILE``), held as SHA-256 digests only.

An entry of the two variables is ``name:secret`` (the tenant ``name``) or a bare ``secret`` (a
tenant of its own, named ``key-`` and the first 12 hex digits of the secret's SHA-256, so its
name never reveals the secret). The keys file, TOML, or JSON when its name ends in ``.json``,
lists entries for operators with many users::

    [[keys]]
    tenant = "alice"
    secret = "a-long-random-string"     # or: sha256 = "<hex digest of the secret>"
    role = "user"                       # or "admin"
    quotas = { concurrent_jobs = 4, queued_samples = 4096, requests_per_s = 20, weight = 2 }

It is read again when its modification time (or size) changes, checked on each lookup, and on
``SIGHUP``; a file that no longer parses keeps the keys read before (and logs why), so a typo
never locks every user out. A lookup hashes the key given and compares its digest with every
digest held (constant time in the key's content).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import signal
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from service.tenants import DEFAULT_TENANT, TENANT_NAME, Quotas, Tenant

__all__ = ["KeyEntry", "Keyring", "KeysError", "digest", "install_sighup", "parse_keys_file"]

log = logging.getLogger("psgrad.keys")

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_QUOTA_FIELDS = {f.name for f in fields(Quotas)}
_hup = [0]  # SIGHUPs received by this process: each keyring re-reads its file once per signal


class KeysError(ValueError):
    """A key setting or the keys file is malformed: the message says where and how to fix it."""


def digest(secret: str) -> bytes:
    """The SHA-256 of a secret: all the keyring keeps of it."""
    return hashlib.sha256(secret.encode()).digest()


@dataclass(frozen=True)
class KeyEntry:
    """One key: its digest and the tenant (with role and quotas) it opens."""

    sha256: bytes
    tenant: str
    admin: bool = False
    quotas: Quotas | None = None  # None: this entry says nothing of the tenant's quotas


def _bare_name(secret: str) -> str:
    return "key-" + digest(secret).hex()[:12]


def parse_key_list(text: str, *, admin: bool, where: str) -> list[KeyEntry]:
    """Entries of ``PSGRAD_API_KEYS`` / ``PSGRAD_ADMIN_KEYS``: comma-separated ``name:secret``
    or bare secrets (a ``:`` whose left side is not a valid tenant name is part of the secret).
    """
    out = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, secret = item.partition(":")
        if not (sep and TENANT_NAME.fullmatch(name)):
            name, secret = _bare_name(item), item
        if not secret:
            raise KeysError(f"{where}: the entry '{name}:' has no secret after the ':'")
        out.append(KeyEntry(digest(secret), name, admin))
    return out


def _quotas(raw: Any, where: str) -> Quotas | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise KeysError(f"{where}: quotas must be a table of {', '.join(sorted(_QUOTA_FIELDS))}")
    unknown = set(raw) - _QUOTA_FIELDS
    if unknown:
        raise KeysError(f"{where}: unknown quota {', '.join(sorted(unknown))}; known: "
                        f"{', '.join(sorted(_QUOTA_FIELDS))}")
    for name, value in raw.items():
        ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        if name in ("queued_samples", "concurrent_jobs"):
            ok = ok and isinstance(value, int)
        if not ok or value != value or value == float("inf"):
            raise KeysError(f"{where}: quota {name} must be a positive finite number"
                            + (" (an integer)" if name != "requests_per_s" and name != "weight"
                               else "") + f", not {value!r}")
    return Quotas(**raw)


def _file_entry(raw: Any, where: str) -> KeyEntry:
    if not isinstance(raw, dict):
        raise KeysError(f"{where}: each key is a table with tenant, secret or sha256, role, quotas")
    unknown = set(raw) - {"tenant", "secret", "sha256", "role", "quotas"}
    if unknown:
        raise KeysError(f"{where}: unknown field {', '.join(sorted(unknown))}; known: tenant, "
                        "secret, sha256, role, quotas")
    tenant = raw.get("tenant")
    if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
        raise KeysError(f"{where}: tenant must be a name of letters, digits, '_', '.' or '-' "
                        f"(1-64, starting with a letter or digit), not {tenant!r}")
    secret, hashed = raw.get("secret"), raw.get("sha256")
    if (secret is None) == (hashed is None):
        raise KeysError(f"{where}: give exactly one of secret and sha256 (the hex SHA-256 of the "
                        "secret: `printf %s SECRET | sha256sum`)")
    if secret is not None and (not isinstance(secret, str) or not secret):
        raise KeysError(f"{where}: secret must be a non-empty string")
    if hashed is not None and (not isinstance(hashed, str) or not _HEX64.fullmatch(hashed)):
        raise KeysError(f"{where}: sha256 must be 64 hex digits (`printf %s SECRET | sha256sum`)")
    role = raw.get("role", "user")
    if role not in ("user", "admin"):
        raise KeysError(f"{where}: role must be 'user' or 'admin', not {role!r}")
    sha = digest(secret) if isinstance(secret, str) else bytes.fromhex(str(hashed))
    return KeyEntry(sha, tenant, role == "admin", _quotas(raw.get("quotas"), where))


def parse_keys_file(path: str | Path) -> list[KeyEntry]:
    """The entries of a keys file: TOML, or JSON for a name ending in ``.json`` (an object with
    a ``keys`` list, or the list itself)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeysError(f"PSGRAD_KEYS_FILE {path}: cannot read it ({exc})") from None
    try:
        doc: Any = json.loads(text) if path.suffix == ".json" else _toml(text, path)
    except (ValueError, RecursionError) as exc:
        kind = "JSON" if path.suffix == ".json" else "TOML (name it *.json for JSON)"
        raise KeysError(f"PSGRAD_KEYS_FILE {path}: not valid {kind}: {exc}") from None
    if isinstance(doc, dict):
        if set(doc) - {"keys"}:
            raise KeysError(f"PSGRAD_KEYS_FILE {path}: unknown top-level "
                            f"{', '.join(sorted(set(doc) - {'keys'}))}; put entries under 'keys'")
        doc = doc.get("keys", [])
    if not isinstance(doc, list):
        raise KeysError(f"PSGRAD_KEYS_FILE {path}: 'keys' must be a list of entries")
    return [_file_entry(raw, f"PSGRAD_KEYS_FILE {path}, key {i + 1}") for i, raw in enumerate(doc)]


def _toml(text: str, path: Path) -> Any:
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        raise KeysError(f"PSGRAD_KEYS_FILE {path}: TOML needs Python 3.11 or later; write the "
                        "keys as JSON in a file named *.json") from None
    return tomllib.loads(text)


def _tenants(entries: list[KeyEntry]) -> dict[str, Quotas]:
    """Each tenant's quotas; refuses a secret given twice and quotas that disagree."""
    seen: dict[bytes, str] = {}
    quotas: dict[str, Quotas | None] = {}
    for e in entries:
        if e.sha256 in seen:
            raise KeysError(f"one secret is configured twice (tenants '{seen[e.sha256]}' and "
                            f"'{e.tenant}'): give each key its own secret")
        seen[e.sha256] = e.tenant
        had = quotas.get(e.tenant)
        if e.quotas is not None and had is not None and had != e.quotas:
            raise KeysError(f"tenant '{e.tenant}' has keys with different quotas: give them on "
                            "one of its keys, or the same on each")
        quotas[e.tenant] = had or e.quotas
    return {name: q or Quotas() for name, q in quotas.items()}


class Keyring:
    """The keys a server accepts, by digest, and the tenant each opens.

    Args:
        api_keys: ``PSGRAD_API_KEYS``.
        admin_keys: ``PSGRAD_ADMIN_KEYS``.
        keys_file: ``PSGRAD_KEYS_FILE`` (None: none). Raises :class:`KeysError` when a setting
            is malformed, so a server never starts on keys it misread.
    """

    def __init__(self, api_keys: str = "", admin_keys: str = "",
                 keys_file: str | None = None) -> None:
        self._fixed = (parse_key_list(api_keys, admin=False, where="PSGRAD_API_KEYS")
                       + parse_key_list(admin_keys, admin=True, where="PSGRAD_ADMIN_KEYS"))
        self._file = Path(keys_file) if keys_file else None
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._hup = _hup[0]
        self._entries: list[KeyEntry] = []
        self._quotas: dict[str, Quotas] = {}
        self._load(self._read_file())

    @property
    def configured(self) -> bool:
        """Keys are configured (each request then needs one); False: loopback dev mode."""
        return bool(self._entries) or self._file is not None

    @property
    def has_admin(self) -> bool:
        return any(e.admin for e in self._entries)

    def tenants(self) -> dict[str, Quotas]:
        """Every tenant a key opens, with its quotas."""
        self._refresh()
        return dict(self._quotas)

    def lookup(self, secret: str) -> Tenant | None:
        """The tenant ``secret`` opens, or None. Every digest is compared (constant time)."""
        self._refresh()
        given = digest(secret)
        found: KeyEntry | None = None
        for e in self._entries:
            if hmac.compare_digest(given, e.sha256):
                found = e
        if found is None:
            return None
        return Tenant(found.tenant, found.admin, self._quotas.get(found.tenant, Quotas()))

    def dev_tenant(self) -> Tenant:
        """The caller when no key is configured: the default tenant, with every right."""
        return Tenant(DEFAULT_TENANT, admin=True)

    def _signature(self) -> tuple[int, int, int] | None:
        assert self._file is not None
        try:
            st = self._file.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _read_file(self) -> list[KeyEntry]:
        if self._file is None:
            return []
        self._seen = self._signature()
        return parse_keys_file(self._file)

    def _load(self, from_file: list[KeyEntry]) -> None:
        entries = self._fixed + from_file
        quotas = _tenants(entries)
        self._entries, self._quotas = entries, quotas

    def _refresh(self) -> None:
        """Re-read the file once it changed or a SIGHUP came; a bad file keeps the old keys."""
        if self._file is None or (self._hup == _hup[0] and self._signature() == self._seen):
            return
        with self._lock:
            if self._hup == _hup[0] and self._signature() == self._seen:
                return
            self._hup = _hup[0]
            try:
                self._load(self._read_file())
            except KeysError as exc:
                log.error("keeping the keys read before: %s", exc)
                return
            log.info("keys file %s read: %d keys, %d tenants", self._file,
                     len(self._entries), len(self._quotas))


def _on_hup(_signum: int, _frame: Any) -> None:
    _hup[0] += 1


def install_sighup() -> bool:
    """Count SIGHUPs so every keyring re-reads its file (the main thread only; elsewhere, as
    under a test's server thread, the modification time alone triggers the re-read)."""
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGHUP) is not _on_hup:
        signal.signal(signal.SIGHUP, _on_hup)
    return True

