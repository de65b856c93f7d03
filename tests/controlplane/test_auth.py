"""Tokens verify only while live, only hashes reach the disk, roles order, passwords check, and a FastAPI
app answers 401/403/200 by role with an audit record for every mutation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from controlplane.api.guards import install, require
from controlplane.auth import (
    BOOTSTRAP_ADMIN_NAME,
    Auditor,
    Principal,
    Role,
    TokenAuthority,
    check_password,
    hash_password,
    unmatchable_hash,
)
from controlplane.store.database import Store

from .conftest import FakeClock


@pytest.fixture
def authority(store: Store, clock: FakeClock) -> TokenAuthority:
    return TokenAuthority(store, clock=clock)


# ---- tokens ------------------------------------------------------------------------------------
def test_issued_token_verifies_to_its_name_and_role(authority: TokenAuthority) -> None:
    secret = authority.issue("ci", Role.OPERATOR)
    assert len(secret) >= 43
    assert authority.verify(secret) == Principal("ci", Role.OPERATOR)
    assert authority.verify(secret + "x") is None
    assert authority.verify("") is None
    assert authority.verify(None) is None


def test_revoked_token_stops_verifying(authority: TokenAuthority) -> None:
    secret = authority.issue("ci", Role.OPERATOR)
    other = authority.issue("ops", Role.ADMIN)
    assert authority.revoke("ci") is True
    assert authority.verify(secret) is None
    assert authority.verify(other) == Principal("ops", Role.ADMIN)
    assert authority.revoke("ci") is False


def test_token_expires_after_its_ttl(authority: TokenAuthority, clock: FakeClock) -> None:
    secret = authority.issue("short", Role.VIEWER, ttl_s=60)
    clock.now += 59.9
    assert authority.verify(secret) == Principal("short", Role.VIEWER)
    clock.now += 0.1
    assert authority.verify(secret) is None
    with pytest.raises(ValueError, match="ttl_s"):
        authority.issue("bad", Role.VIEWER, ttl_s=0)


def test_only_hashes_reach_the_database_files(tmp_path: Path, authority: TokenAuthority,
                                               store: Store) -> None:
    secrets_issued = [authority.issue(f"t{n}", Role.ADMIN) for n in range(3)]
    password = "correct horse battery staple"
    store.add_user("alice", hash_password(password), Role.OPERATOR.value)
    files = sorted(tmp_path.glob("state.db*"))  # the main file and the WAL, where fresh commits live
    assert any(f.name.endswith("-wal") for f in files)
    content = b"".join(f.read_bytes() for f in files)
    assert b"t0" in content  # the data is really there to find
    for secret in [*secrets_issued, password]:
        assert secret.encode() not in content


def test_ensure_admin_creates_the_first_admin_once(authority: TokenAuthority) -> None:
    secret, created = authority.ensure_admin("from-the-environment-0123456789")
    assert (secret, created) == ("from-the-environment-0123456789", True)
    assert authority.verify(secret) == Principal(BOOTSTRAP_ADMIN_NAME, Role.ADMIN)
    assert authority.ensure_admin("another-secret") == ("another-secret", False)
    assert authority.verify("another-secret") is None


def test_ensure_admin_generates_a_secret_when_none_is_configured(authority: TokenAuthority) -> None:
    secret, created = authority.ensure_admin(None)
    assert created and len(secret) >= 43
    assert authority.verify(secret) == Principal(BOOTSTRAP_ADMIN_NAME, Role.ADMIN)
    assert authority.ensure_admin(None) == ("", False)


def test_ensure_admin_refuses_a_revoked_secret(authority: TokenAuthority) -> None:
    secret, _ = authority.ensure_admin("stale-env-token-0123456789")
    authority.revoke(BOOTSTRAP_ADMIN_NAME)
    with pytest.raises(ValueError, match="revoked"):
        authority.ensure_admin(secret)
    fresh, created = authority.ensure_admin("fresh-env-token-0123456789")
    assert created and authority.verify(fresh) == Principal(BOOTSTRAP_ADMIN_NAME, Role.ADMIN)


def test_roles_are_ordered_viewer_operator_admin() -> None:
    assert Role.VIEWER < Role.OPERATOR < Role.ADMIN
    assert Role.ADMIN >= Role.ADMIN and Role.OPERATOR <= Role.ADMIN and Role.ADMIN > Role.VIEWER
    assert sorted([Role.ADMIN, Role.VIEWER, Role.OPERATOR]) == [Role.VIEWER, Role.OPERATOR, Role.ADMIN]
    assert Principal("a", Role.OPERATOR).may(Role.VIEWER)
    assert not Principal("a", Role.OPERATOR).may(Role.ADMIN)
    assert Role("operator") is Role.OPERATOR


# ---- passwords ---------------------------------------------------------------------------------
def test_password_hash_checks_only_the_right_password() -> None:
    encoded = hash_password("hunter2")
    assert encoded.startswith("scrypt$131072$8$1$")  # OWASP's minimum: N = 2**17, r = 8, p = 1
    assert check_password("hunter2", encoded)
    assert not check_password("hunter3", encoded)
    assert hash_password("hunter2") != encoded  # a fresh salt each time
    with pytest.raises(ValueError):
        hash_password("")


def test_a_wrong_user_name_is_checked_at_a_passwords_full_cost() -> None:
    """The login checks an unknown name's password against an unmatchable hash of the same parameters."""
    dummy, real = unmatchable_hash(), hash_password("hunter2")
    assert dummy.split("$")[:4] == real.split("$")[:4]
    assert [len(part) for part in dummy.split("$")] == [len(part) for part in real.split("$")]
    assert not check_password("hunter2", dummy) and not check_password("", dummy)
    assert unmatchable_hash() != dummy


# Made by an earlier version at N = 2**14 (stored in users' rows); the new cost must not lock them out.
OLD_HASH = "scrypt$16384$8$1$bGxtLXNyZS1vbGQtc2FsdA$TtvHUOCv-EgV_vPcuj86x4fqlpFIygtTBFZ-_dNsUr4"


def test_a_hash_made_at_the_old_cost_still_verifies() -> None:
    assert check_password("correct horse battery staple", OLD_HASH)
    assert not check_password("correct horse battery stapler", OLD_HASH)


@pytest.mark.parametrize("encoded", ["", "garbage", "bcrypt$16384$8$1$c2FsdA$a2V5",
                                     "scrypt$1000$8$1$c2FsdA$a2V5", "scrypt$16384$8$1$!!$a2V5",
                                     "scrypt$1073741824$8$1$c2FsdA$a2V5"])
def test_malformed_or_abusive_hashes_never_match(encoded: str) -> None:
    assert check_password("anything", encoded) is False


# ---- FastAPI -----------------------------------------------------------------------------------
def make_app(store: Store, authority: TokenAuthority) -> FastAPI:
    app = FastAPI()
    auditor = Auditor(store)
    install(app, authority, auditor)

    @app.get("/status")
    def status(who: Annotated[Principal, Depends(require(Role.VIEWER))]) -> dict[str, str]:
        return {"name": who.name}

    @app.post("/fleet/scale")
    def scale(body: dict[str, Any],
              who: Annotated[Principal, Depends(require(Role.OPERATOR))]) -> dict[str, Any]:
        auditor.record(who, "fleet.scale", "fleet", body, "ok")
        return {"replicas": body["replicas"]}

    @app.delete("/tokens/{name}")
    def revoke(name: str, who: Annotated[Principal, Depends(require(Role.ADMIN))]) -> dict[str, bool]:
        revoked = authority.revoke(name)
        auditor.record(who, "token.revoke", name, {}, "ok")
        return {"revoked": revoked}

    return app


@pytest.fixture
def client(store: Store, authority: TokenAuthority) -> Iterator[TestClient]:
    with TestClient(make_app(store, authority)) as test_client:
        yield test_client


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer not-a-token"},
                                     {"Authorization": "Basic dXNlcjpwdw=="}, {"Authorization": "Bearer"}])
def test_no_valid_token_gets_401_in_openai_shape(client: TestClient, headers: dict[str, str]) -> None:
    response = client.get("/status", headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Bearer")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_token"


def test_each_route_admits_its_role_and_above(client: TestClient, authority: TokenAuthority) -> None:
    tokens = {role: authority.issue(role.value, role) for role in Role}
    routes = {Role.VIEWER: ("GET", "/status", None), Role.OPERATOR: ("POST", "/fleet/scale", {"replicas": 2}),
              Role.ADMIN: ("DELETE", "/tokens/nobody", None)}
    for needed, (method, path, body) in routes.items():
        for role, secret in tokens.items():
            response = client.request(method, path, json=body, headers=bearer(secret))
            expected = 200 if role >= needed else 403
            assert response.status_code == expected, (role, needed, response.text)
            if expected == 403:
                assert response.json()["error"]["type"] == "permission_error"


def test_expired_token_gets_401(client: TestClient, authority: TokenAuthority, clock: FakeClock) -> None:
    secret = authority.issue("temp", Role.ADMIN, ttl_s=10)
    assert client.get("/status", headers=bearer(secret)).status_code == 200
    clock.now += 10
    assert client.get("/status", headers=bearer(secret)).status_code == 401


def test_mutation_is_audited_with_redacted_params(client: TestClient, authority: TokenAuthority,
                                                  store: Store) -> None:
    secret = authority.issue("alice", Role.OPERATOR)
    body = {"replicas": 4, "api_key": "sk-live-123", "max_tokens": 64}
    assert client.post("/fleet/scale", json=body, headers=bearer(secret)).status_code == 200
    (record,) = store.audit()
    assert (record.actor, record.role, record.action, record.target, record.outcome) == \
        ("alice", "operator", "fleet.scale", "fleet", "ok")
    assert record.params == {"replicas": 4, "api_key": "***", "max_tokens": 64}


def test_refused_mutation_is_audited_as_denied(client: TestClient, authority: TokenAuthority,
                                               store: Store) -> None:
    secret = authority.issue("bob", Role.VIEWER)
    assert client.post("/fleet/scale", json={"replicas": 9}, headers=bearer(secret)).status_code == 403
    assert client.get("/status", headers=bearer(secret)).status_code == 200
    (record,) = store.audit()
    assert (record.actor, record.action, record.outcome) == ("bob", "POST /fleet/scale", "denied")


def test_require_without_install_fails_loudly() -> None:
    app = FastAPI()

    @app.get("/status")
    def status(who: Annotated[Principal, Depends(require(Role.VIEWER))]) -> dict[str, str]:
        return {"name": who.name}

    with TestClient(app) as test_client, pytest.raises(RuntimeError, match="install"):
        test_client.get("/status", headers=bearer("x"))
