"""Logins back off and are audited as what they are; logout cannot lock the admins out; ids beyond what the
store can hold are refusals, not 500s.

- After the free failures for one user name, the next attempt (even with the right password) is a 429 in
  the OpenAI shape with Retry-After, while other users still log in; after the free failures from one
  client, any name from it is a 429.
- A failed login is audited as ``anonymous`` trying the name typed (not as that user acting); a throttled
  attempt adds no audit row, so a flood does not grow the trail.
- ``POST /api/v1/auth/logout`` with the last admin token that does not expire is refused (409) and the
  token keeps working; with another one live, it is revoked.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.auth import BOOTSTRAP_ADMIN_NAME, Role, hash_password
from controlplane.config import ApiConfig, LoginLimits
from controlplane.store.database import Store

from .conftest import Served, serve

LOGIN = "/api/v1/auth/login"


@pytest.fixture
def strict(tmp_path: Path) -> Iterator[Served]:
    """The API with 2 free failures per user and 4 per client, and two users."""
    limits = LoginLimits(user_free_failures=2, client_free_failures=4, backoff_s=30.0, max_backoff_s=60.0)
    with Store(tmp_path / "state.db") as store:
        store.add_user("alice", hash_password("alice-pw"), "operator")
        store.add_user("bob", hash_password("bob-pw"), "viewer")
        yield from serve(tmp_path, store, ApiConfig(login=limits))


def login(served: Served, user: str, password: str) -> tuple[int, dict[str, object], dict[str, str]]:
    answer = served.client.post(LOGIN, json={"user": user, "password": password})
    return answer.status_code, answer.json(), dict(answer.headers)


def test_failed_logins_for_one_user_back_off_with_429_and_retry_after(strict: Served) -> None:
    assert login(strict, "alice", "guess")[0] == 401
    before_last_failure = time.monotonic()
    assert login(strict, "alice", "guess")[0] == 401
    status, body, headers = login(strict, "alice", "alice-pw")  # the right password waits too
    since_last_failure = time.monotonic() - before_last_failure  # a hash or two: seconds on a busy machine
    assert status == 429
    wait = int(headers["retry-after"])  # 30 s from the last failure, less what has passed since
    assert 30 - since_last_failure - 1 <= wait <= 30
    assert body["error"] == {"message": f"too many failed logins; try again in {wait} s",
                             "type": "rate_limit_error", "param": None, "code": None}
    assert login(strict, "bob", "bob-pw")[0] == 200  # another user is not held back


def test_failed_logins_from_one_client_back_off_whatever_the_name(strict: Served) -> None:
    assert [login(strict, f"made-up-{i}", "guess")[0] for i in range(4)] == [401] * 4
    assert login(strict, "made-up-5", "guess")[0] == 429
    assert login(strict, "bob", "bob-pw")[0] == 429  # the client waits, whoever it claims to be


def test_a_failed_login_is_audited_as_anonymous_trying_the_typed_name(strict: Served) -> None:
    login(strict, "alice", "guess")
    assert strict.store.audit(actor="alice") == []  # alice did nothing
    [record] = strict.store.audit(actor="anonymous")
    assert (record.action, record.outcome, record.target) == ("auth.login", "denied", "alice")
    assert record.params == {"client": "testclient"} and "guess" not in str(record)


def test_throttled_attempts_add_no_audit_rows(strict: Served) -> None:
    for _ in range(2):
        login(strict, "alice", "guess")
    rows = len(strict.store.audit(limit=1000))
    assert [login(strict, "alice", "guess")[0] for _ in range(20)] == [429] * 20
    assert len(strict.store.audit(limit=1000)) == rows


def test_a_success_clears_the_users_failures(strict: Served) -> None:
    login(strict, "alice", "guess")
    assert login(strict, "alice", "alice-pw")[0] == 200
    assert login(strict, "alice", "guess")[0] == 401  # counted afresh: one failure, not the third
    assert login(strict, "alice", "alice-pw")[0] == 200


# ---- logout --------------------------------------------------------------------------------------------
def test_logout_of_the_last_admin_token_is_refused_and_it_keeps_working(served: Served) -> None:
    admin = served.tokens.issue(BOOTSTRAP_ADMIN_NAME, Role.ADMIN)
    bearer = {"authorization": f"Bearer {admin}"}
    answer = served.client.post("/api/v1/auth/logout", headers=bearer)
    assert answer.status_code == 409
    assert "last admin token" in answer.json()["error"]["message"]
    assert served.client.get("/api/v1/auth/whoami", headers=bearer).status_code == 200
    assert served.store.audit(limit=1)[0].outcome == "denied"


def test_logout_revokes_an_admin_token_when_another_is_live(served: Served) -> None:
    first, second = (served.tokens.issue(f"admin-{i}", Role.ADMIN) for i in range(2))
    assert served.client.post("/api/v1/auth/logout", headers={"authorization": f"Bearer {first}"}).json() == {
        "revoked": True}
    assert served.client.get("/api/v1/auth/whoami", headers={"authorization": f"Bearer {first}"}
                             ).status_code == 401
    assert served.client.get("/api/v1/auth/whoami", headers={"authorization": f"Bearer {second}"}
                             ).status_code == 200


def test_a_console_admins_logout_always_revokes_its_session(served: Served) -> None:
    served.tokens.issue(BOOTSTRAP_ADMIN_NAME, Role.ADMIN)
    session = served.tokens.issue("admin/console-abc123", Role.ADMIN, ttl_s=600)
    bearer = {"authorization": f"Bearer {session}"}
    assert served.client.post("/api/v1/auth/logout", headers=bearer).json() == {"revoked": True}


# ---- ids the store cannot hold ------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "status"), [
    ("/api/v1/events?since_id=5808807660256036388864", 400),
    ("/api/v1/drills/5808807660256036388864", 404),
    ("/api/v1/chaos/experiments/5808807660256036388864", 404),
    ("/api/v1/simulations/5808807660256036388864", 404),
    ("/api/v1/drills/compare?ids=1,5808807660256036388864", 404),
])
def test_an_id_too_large_for_sqlite_is_refused_not_a_500(served: Served, path: str, status: int) -> None:
    answer = served.client.get(path, headers={"authorization": f"Bearer {served.token('viewer')}"})
    assert answer.status_code == status and "error" in answer.json()
