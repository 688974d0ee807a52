"""Keys and tenants: ``name:secret`` entries, bare secrets, the keys file (TOML and JSON, secrets
or their SHA-256), its re-reading on change and on SIGHUP, and the tenant each request gets."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from service.api.deps import AdminDep, TenantDep
from service.keyring import Keyring, KeysError, install_sighup, parse_keys_file
from service.tenants import DEFAULT_TENANT, Quotas, Tenant
from tests.support.api import app_of, open_client

TOML = """
[[keys]]
tenant = "alice"
secret = "alice-secret"
quotas = { concurrent_jobs = 4, requests_per_s = 2.5, weight = 2 }

[[keys]]
tenant = "alice"
sha256 = "{bob_hash}"

[[keys]]
tenant = "ops"
secret = "ops-secret"
role = "admin"
"""


def sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def write(path: Path, text: str) -> None:
    """Write and move the modification time on, as an editor saving a second later would."""
    path.write_text(text)
    later = time.time_ns() + 2_000_000_000 * (1 + len(text) % 7)
    os.utime(path, ns=(later, later))


def test_name_secret_entries_and_bare_secrets() -> None:
    ring = Keyring("alice:s1, bob:s2,plain-secret", "ops:s3, a:b:c")
    assert ring.lookup("s1") == Tenant("alice")
    assert ring.lookup("s2") == Tenant("bob")
    bare = ring.lookup("plain-secret")
    assert bare is not None and bare.name == "key-" + sha("plain-secret")[:12] and not bare.admin
    assert ring.lookup("s3") == Tenant("ops", admin=True)
    assert ring.lookup("b:c") == Tenant("a", admin=True)  # split at the first ':'
    for wrong in ("alice:s1", "s", "", "S1", "alice"):
        assert ring.lookup(wrong) is None, wrong
    # a ':' whose left side is no tenant name is part of a bare secret
    odd = Keyring("!x:y")
    assert odd.lookup("!x:y") == Tenant("key-" + sha("!x:y")[:12])
    assert Keyring("k").configured and Keyring("", "k").has_admin
    assert not Keyring().configured and not Keyring("k").has_admin


def test_only_digests_are_kept() -> None:
    ring = Keyring("alice:very-secret-value", "ops:admin-secret-value")
    held = repr(vars(ring)) + repr(ring._entries)
    assert "very-secret-value" not in held and "admin-secret-value" not in held
    assert {e.sha256 for e in ring._entries} == {
        hashlib.sha256(b"very-secret-value").digest(),
        hashlib.sha256(b"admin-secret-value").digest(),
    }


def test_malformed_key_settings_are_refused() -> None:
    with pytest.raises(KeysError, match="no secret"):
        Keyring("alice:")
    with pytest.raises(KeysError, match="configured twice"):
        Keyring("alice:same", "ops:same")


def test_keys_file_toml_and_json(tmp_path: Path) -> None:
    toml = tmp_path / "keys.toml"
    toml.write_text(TOML.replace("{bob_hash}", sha("second-alice-key")))
    ring = Keyring("carol:c1", keys_file=str(toml))
    quotas = Quotas(concurrent_jobs=4, requests_per_s=2.5, weight=2)
    assert ring.lookup("alice-secret") == Tenant("alice", quotas=quotas)
    assert ring.lookup("second-alice-key") == Tenant("alice", quotas=quotas)  # by its hash
    assert ring.lookup(sha("second-alice-key")) is None  # the hash itself is no key
    assert ring.lookup("ops-secret") == Tenant("ops", admin=True)
    assert ring.lookup("c1") == Tenant("carol")
    assert ring.tenants() == {"alice": quotas, "ops": Quotas(), "carol": Quotas()}
    doc = {"keys": [{"tenant": "dave", "sha256": sha("d1").upper(), "role": "admin",
                     "quotas": {"queued_samples": 100}}]}
    js = tmp_path / "keys.json"
    js.write_text(json.dumps(doc))
    assert Keyring(keys_file=str(js)).lookup("d1") == Tenant(
        "dave", admin=True, quotas=Quotas(queued_samples=100))
    js.write_text(json.dumps(doc["keys"]))  # the bare list too
    assert parse_keys_file(js)[0].tenant == "dave"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"secret": "x"}, "tenant must be a name"),
        ({"tenant": "a b", "secret": "x"}, "tenant must be a name"),
        ({"tenant": "a"}, "exactly one of secret and sha256"),
        ({"tenant": "a", "secret": "x", "sha256": sha("x")}, "exactly one of secret and sha256"),
        ({"tenant": "a", "sha256": "abc"}, "64 hex digits"),
        ({"tenant": "a", "secret": ""}, "non-empty string"),
        ({"tenant": "a", "secret": "x", "role": "root"}, "role must be 'user' or 'admin'"),
        ({"tenant": "a", "secret": "x", "quotas": {"jobs": 1}}, "unknown quota jobs"),
        ({"tenant": "a", "secret": "x", "quotas": {"concurrent_jobs": 1.5}}, "an integer"),
        ({"tenant": "a", "secret": "x", "quotas": {"weight": -1}}, "positive finite"),
        ({"tenant": "a", "secret": "x", "quotas": {"requests_per_s": True}}, "positive finite"),
        ({"tenant": "a", "secret": "x", "quotas": 3}, "quotas must be a table"),
        ({"tenant": "a", "secret": "x", "admin": True}, "unknown field admin"),
        ("just-a-string", "each key is a table"),
    ],
)
def test_malformed_keys_files_name_the_problem(tmp_path: Path, entry: object,
                                               message: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [entry]}))
    with pytest.raises(KeysError, match=message) as info:
        Keyring(keys_file=str(path))
    assert "key 1" in str(info.value) and str(path) in str(info.value)


def test_keys_file_errors_beyond_entries(tmp_path: Path) -> None:
    with pytest.raises(KeysError, match="cannot read it"):
        Keyring(keys_file=str(tmp_path / "missing.toml"))
    bad = tmp_path / "keys.toml"
    bad.write_text("[[keys]\n")
    with pytest.raises(KeysError, match="not valid TOML"):
        Keyring(keys_file=str(bad))
    bad.write_text('users = []\n')
    with pytest.raises(KeysError, match="unknown top-level users"):
        Keyring(keys_file=str(bad))
    bad.write_text('[[keys]]\ntenant = "a"\nsecret = "x"\nquotas = {weight = 2}\n'
                   '[[keys]]\ntenant = "a"\nsecret = "y"\nquotas = {weight = 3}\n')
    with pytest.raises(KeysError, match="different quotas"):
        Keyring(keys_file=str(bad))


def test_keys_file_is_read_again_on_change(tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys.toml"
    write(path, '[[keys]]\ntenant = "a"\nsecret = "one"\n')
    ring = Keyring(keys_file=str(path))
    assert ring.lookup("one") == Tenant("a")
    write(path, '[[keys]]\ntenant = "b"\nsecret = "two"\nrole = "admin"\n')
    assert ring.lookup("one") is None
    assert ring.lookup("two") == Tenant("b", admin=True)
    write(path, "[[keys]\n")  # broken: the keys read before stay
    assert ring.lookup("two") == Tenant("b", admin=True)
    assert "keeping the keys read before" in caplog.text and "not valid TOML" in caplog.text
    path.unlink()  # gone: the keys read before stay too
    assert ring.lookup("two") == Tenant("b", admin=True)


def test_sighup_rereads_the_keys_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"tenant": "a", "secret": "one"}]))
    ring = Keyring(keys_file=str(path))
    assert ring.lookup("one") == Tenant("a")
    stat = path.stat()
    path.write_text(json.dumps([{"tenant": "a", "secret": "two"}]))  # same size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same time: unseen
    if stat.st_ino == path.stat().st_ino:
        assert ring.lookup("two") is None
    previous = signal.getsignal(signal.SIGHUP)
    try:
        assert install_sighup()
        os.kill(os.getpid(), signal.SIGHUP)
        assert ring.lookup("two") == Tenant("a") and ring.lookup("one") is None
    finally:
        signal.signal(signal.SIGHUP, previous)


async def test_each_request_gets_its_tenant(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text('[[keys]]\ntenant = "filed"\nsecret = "from-file"\n'
                    'quotas = {concurrent_jobs = 2}\n')
    async with open_client(api_keys="alice:a1,bare", admin_keys="ops:o1",
                           keys_file=str(path)) as c:
        app = app_of(c)

        async def whoami(tenant: TenantDep) -> dict[str, object]:
            return {"name": tenant.name, "admin": tenant.admin,
                    "jobs": tenant.quotas.concurrent_jobs}

        async def admin_only(tenant: AdminDep) -> dict[str, object]:
            return {"name": tenant.name}

        app.add_api_route("/whoami", whoami)
        app.add_api_route("/admin-only", admin_only)

        async def get(path: str, key: str | None) -> tuple[int, dict[str, object]]:
            headers = {"authorization": f"Bearer {key}"} if key else {}
            r = await c.get(path, headers=headers)
            return r.status_code, r.json()

        assert await get("/whoami", "a1") == (200, {"name": "alice", "admin": False,
                                                    "jobs": None})
        assert await get("/whoami", "o1") == (200, {"name": "ops", "admin": True, "jobs": None})
        assert await get("/whoami", "from-file") == (200, {"name": "filed", "admin": False,
                                                           "jobs": 2})
        code, body = await get("/whoami", "bare")
        assert code == 200 and body["name"] == "key-" + sha("bare")[:12]
        code, body = await get("/whoami", None)
        assert code == 401 and "Authorization: Bearer" in body["error"]["message"]
        code, body = await get("/whoami", "a2")
        assert code == 401 and body["error"]["message"] == "the API key is not valid"
        code, body = await get("/admin-only", "a1")
        assert code == 403 and "needs an admin key" in body["error"]["message"]
        assert await get("/admin-only", "o1") == (200, {"name": "ops"})
    async with open_client() as c:  # no keys: the default tenant, with every right
        app_of(c).add_api_route("/whoami", whoami)
        app_of(c).add_api_route("/admin-only", admin_only)
        assert (await c.get("/whoami")).json() == {"name": DEFAULT_TENANT, "admin": True,
                                                   "jobs": None}
        assert (await c.get("/admin-only")).status_code == 200


def test_a_server_with_a_broken_keys_file_does_not_start(tmp_path: Path) -> None:
    from service.cli import EXIT_REFUSED, serve
    from tests.support.api import settings

    path = tmp_path / "keys.toml"
    path.write_text('[[keys]]\ntenant = "a"\n')
    assert serve(settings=settings(keys_file=str(path))) == EXIT_REFUSED


async def test_a_running_server_takes_keys_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    write(path, '[[keys]]\ntenant = "a"\nsecret = "first"\n')
    async with open_client(keys_file=str(path)) as c:
        async def code(key: str) -> int:
            r = await c.get("/models", headers={"authorization": f"Bearer {key}"})
            return r.status_code

        assert (await code("first"), await code("second")) == (200, 401)
        write(path, f'[[keys]]\ntenant = "a"\nsha256 = "{sha("second")}"\n')
        assert (await code("first"), await code("second")) == (401, 200)
