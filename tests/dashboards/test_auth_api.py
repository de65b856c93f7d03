"""Console users and ``/api/v1/auth``: a password becomes a short-lived token of the user's role, wrong
ones are refused in the OpenAI error shape and audited, logout revokes; the first admin is created once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from controlplane.api.auth import (
    FIRST_ADMIN_NAME,
    MAX_SESSION_TTL_S,
    USERS_ENV,
    UserEntry,
    auth_router,
    ensure_users,
    parse_users,
)
from controlplane.api.guards import install
from controlplane.auth import Auditor, Role, TokenAuthority, check_password, hash_password
from controlplane.store.database import Store
from tests.controlplane.conftest import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock) -> Iterator[Store]:
    with Store(tmp_path / "state.db", clock=clock) as opened:
        yield opened


@pytest.fixture
def authority(store: Store, clock: FakeClock) -> TokenAuthority:
    return TokenAuthority(store, clock=clock)


@pytest.fixture
def api(store: Store, authority: TokenAuthority) -> Iterator[TestClient]:
    app = FastAPI()
    install(app, authority, Auditor(store))
    app.include_router(auth_router(store, authority, Auditor(store)))
    store.add_user("olga", hash_password("olga-pw"), "operator")
    store.add_user("vic", hash_password("vic-pw"), "viewer")
    with TestClient(app) as client:
        yield client


def test_login_answers_a_token_of_the_users_role(api: TestClient, authority: TokenAuthority) -> None:
    answer = api.post("/api/v1/auth/login", json={"user": "vic", "password": "vic-pw", "ttl_s": 600})
    assert answer.status_code == 200
    body = answer.json()
    assert body["user"] == "vic" and body["role"] == "viewer" and body["ttl_s"] == 600
    principal = authority.verify(body["token"])
    assert principal is not None and principal.role is Role.VIEWER and principal.name.startswith("vic/")
    me = api.get("/api/v1/auth/whoami", headers={"Authorization": f"Bearer {body['token']}"})
    assert me.json() == {"name": principal.name, "role": "viewer"}


def test_the_token_expires_with_the_session(api: TestClient, authority: TokenAuthority,
                                            clock: FakeClock) -> None:
    token = api.post("/api/v1/auth/login", json={"user": "olga", "password": "olga-pw", "ttl_s": 60}).json()
    assert authority.verify(token["token"]) is not None
    clock.now += 61
    assert authority.verify(token["token"]) is None


@pytest.mark.parametrize("user,password", [("olga", "guess-123"), ("nobody", "olga-pw")])
def test_wrong_credentials_are_refused_alike_and_audited(api: TestClient, store: Store, user: str,
                                                         password: str) -> None:
    answer = api.post("/api/v1/auth/login", json={"user": user, "password": password})
    assert answer.status_code == 401
    assert answer.json() == {"error": {"message": "wrong user name or password",
                                       "type": "authentication_error", "param": None,
                                       "code": "invalid_credentials"}}
    [record] = store.audit(limit=5)  # a failed login: nobody we know acted; the name typed is its target
    assert (record.actor, record.action, record.outcome, record.target) == ("anonymous", "auth.login",
                                                                             "denied", user)
    assert password not in str(record)


def test_a_session_longer_than_the_limit_is_refused(api: TestClient) -> None:
    answer = api.post("/api/v1/auth/login", json={"user": "olga", "password": "olga-pw",
                                                  "ttl_s": MAX_SESSION_TTL_S + 1})
    assert answer.status_code in (400, 422)


def test_logout_revokes_the_callers_token(api: TestClient, authority: TokenAuthority, store: Store) -> None:
    token = api.post("/api/v1/auth/login", json={"user": "olga", "password": "olga-pw"}).json()["token"]
    answer = api.post("/api/v1/auth/logout", headers={"Authorization": f"Bearer {token}"})
    assert answer.json() == {"revoked": True}
    assert authority.verify(token) is None
    assert [a.action for a in store.audit(limit=3)][:2] == ["auth.logout", "auth.login"]


def test_first_admin_gets_a_generated_password_once(store: Store) -> None:
    password = ensure_users(store, [], None)
    assert password
    admin = store.user(FIRST_ADMIN_NAME)
    assert admin is not None and admin.role == "admin" and check_password(password, admin.password_hash)
    assert ensure_users(store, [], None) is None  # an admin exists: nothing printed, nothing created
    assert [u.name for u in store.users()] == [FIRST_ADMIN_NAME]


def test_a_given_admin_password_is_used_and_not_printed(store: Store) -> None:
    assert ensure_users(store, [], "given-pw") is None
    admin = store.user(FIRST_ADMIN_NAME)
    assert admin is not None and check_password("given-pw", admin.password_hash)


def test_configured_users_are_added_once(store: Store) -> None:
    entry = f"ana:operator:{hash_password('ana-pw')}"
    users = parse_users([entry], {USERS_ENV: f"bo:viewer:{hash_password('bo-pw')}"})
    assert [(u.name, u.role) for u in users] == [("ana", Role.OPERATOR), ("bo", Role.VIEWER)]
    ensure_users(store, users, "admin-pw")
    ensure_users(store, users, "admin-pw")
    assert sorted((u.name, u.role) for u in store.users()) == [("admin", "admin"), ("ana", "operator"),
                                                                 ("bo", "viewer")]


@pytest.mark.parametrize("text,reason", [("ana:root:scrypt$1", "role must be"),
                                         ("ana:viewer:plain-password", "hash"),
                                         ("a b:viewer:scrypt$1", "bad name")])
def test_bad_user_entries_say_why(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        UserEntry.parse(text)
