"""The console's request guard and sessions, through Flask's test client against a real API server (the
auth routes in a uvicorn thread on loopback): no session, no page; cross-site POSTs refused; the login
form's CSRF token; a login becomes a session of the user's role; logout revokes its token; sessions end."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import dash
import pytest
import uvicorn
from fastapi import FastAPI
from flask.testing import FlaskClient

from controlplane.api.auth import auth_router
from controlplane.api.errors import install_error_handlers
from controlplane.api.guards import install
from controlplane.auth import Auditor, TokenAuthority, hash_password
from controlplane.client import ControlPlaneClient
from controlplane.store.database import Store
from dashboards.app import ConsoleConfig, create_console
from dashboards.session import Session, SessionStore
from inference.launcher import free_port
from tests.controlplane.conftest import FakeClock

HOST = "localhost"  # what Flask's test client sends
ORIGIN = {"Origin": "http://localhost"}


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Store, TokenAuthority]]:
    store = Store(tmp_path_factory.mktemp("console") / "state.db")
    store.add_user("olga", hash_password("olga-pw"), "operator")
    store.add_user("vic", hash_password("vic-pw"), "viewer")
    authority = TokenAuthority(store)
    app = FastAPI()
    install(app, authority, Auditor(store))
    install_error_handlers(app)  # the error tree as the control plane answers it (429: throttled login)
    app.include_router(auth_router(store, authority, Auditor(store)))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", store, authority
    finally:
        server.should_exit = True
        thread.join(10)
        store.close()


@pytest.fixture(scope="module")
def console(api: tuple[str, Store, TokenAuthority]) -> dash.Dash:
    config = ConsoleConfig(secret="s" * 32, port=8050, extra_hosts=(HOST,), session_ttl_s=600)
    return create_console(api[0], config)


@pytest.fixture
def browser(console: dash.Dash) -> FlaskClient:
    return console.server.test_client()


def login_form_token(browser: FlaskClient) -> str:
    page = browser.get("/login").get_data(as_text=True)
    match = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert match is not None
    return match.group(1)


def log_in(browser: FlaskClient, user: str, password: str):  # type: ignore[no-untyped-def]
    token = login_form_token(browser)
    form = {"csrf_token": token, "user": user, "password": password}
    return browser.post("/login", headers=ORIGIN, data=form)


def current_session(browser: FlaskClient, console: dash.Dash) -> Session:
    """The server-side session that the browser's signed cookie names."""
    with browser.session_transaction() as cookie:
        sid = cookie["sid"]
    sessions: SessionStore = console.server.config["CONSOLE_SESSIONS"]
    session = sessions.get(sid)
    assert session is not None
    return session


def test_without_a_session_pages_send_you_to_log_in(browser: FlaskClient) -> None:
    page = browser.get("/chaos")
    assert page.status_code == 302 and page.headers["Location"] == "/login"
    callback = browser.post("/_dash-update-component", headers=ORIGIN, json={})
    assert callback.status_code == 401
    assert callback.get_json()["error"]["code"] == "session_expired"


@pytest.mark.parametrize("headers", [{"Origin": "http://evil.example"}, {"Origin": "null"},
                                     {"Referer": "http://evil.example/x"}, {},
                                     {"Origin": "http://localhost:9999"}])
def test_posts_from_another_origin_are_refused(browser: FlaskClient, headers: dict[str, str]) -> None:
    token = login_form_token(browser)
    answer = browser.post("/login", headers=headers, data={"csrf_token": token, "user": "olga",
                                                           "password": "olga-pw"})
    assert answer.status_code == 403
    assert browser.post("/_dash-update-component", headers=headers, json={}).status_code == 403


def test_a_same_origin_referer_is_enough(browser: FlaskClient) -> None:
    token = login_form_token(browser)
    answer = browser.post("/login", headers={"Referer": "http://localhost/login"},
                          data={"csrf_token": token, "user": "olga", "password": "olga-pw"})
    assert answer.status_code == 302


def test_login_needs_the_forms_csrf_token(browser: FlaskClient) -> None:
    login_form_token(browser)
    answer = browser.post("/login", headers=ORIGIN, data={"csrf_token": "forged", "user": "olga",
                                                          "password": "olga-pw"})
    assert answer.status_code == 400 and "expired" in answer.get_data(as_text=True)


def test_an_unknown_host_is_refused(browser: FlaskClient) -> None:
    assert browser.get("/login", headers={"Host": "rebound.example"}).status_code == 400


def test_a_wrong_password_shows_one_line_and_no_session(browser: FlaskClient) -> None:
    answer = log_in(browser, "olga", "nope")
    assert answer.status_code == 401 and "wrong user name or password" in answer.get_data(as_text=True)
    assert browser.get("/").status_code == 302


def test_repeated_wrong_passwords_are_slowed_down_with_the_wait_shown(browser: FlaskClient) -> None:
    """The control plane backs off a user's failed logins (429 + Retry-After); the page says how long."""
    answers = [log_in(browser, "mallory", f"wrong-{i}") for i in range(8)]  # not a user the others need
    throttled = [a for a in answers if a.status_code == 429]
    assert throttled, [a.status_code for a in answers]
    text = throttled[0].get_data(as_text=True)
    assert "too many failed logins: try again in" in text and "cannot be reached" not in text


def test_a_login_opens_a_session_with_the_users_role_and_token(
        browser: FlaskClient, console: dash.Dash, api: tuple[str, Store, TokenAuthority]) -> None:
    answer = log_in(browser, "vic", "vic-pw")
    assert answer.status_code == 302 and answer.headers["Location"] == "/"
    cookie = answer.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "console_session=" in cookie
    assert "vic-pw" not in cookie
    assert browser.get("/").status_code == 200  # Dash's page
    live = current_session(browser, console)
    assert live.user == "vic"
    assert live.role == "viewer" and not live.can_operate
    principal = api[2].verify(live.client._http.headers["Authorization"].split()[1])
    assert principal is not None and principal.name.startswith("vic/")


def test_logout_ends_the_session_and_revokes_its_token(browser: FlaskClient, console: dash.Dash,
                                                       api: tuple[str, Store, TokenAuthority]) -> None:
    log_in(browser, "olga", "olga-pw")
    live = current_session(browser, console)
    assert live.user == "olga"
    token = live.client._http.headers["Authorization"].split()[1]
    assert api[2].verify(token) is not None
    answer = browser.post("/logout", headers=ORIGIN)
    assert answer.status_code == 302 and answer.headers["Location"] == "/login"
    assert api[2].verify(token) is None
    assert browser.get("/").status_code == 302


def test_sessions_expire(tmp_path: Path) -> None:
    clock = FakeClock()
    sessions = SessionStore(clock=clock)
    client = ControlPlaneClient("http://127.0.0.1:9", token="t")
    session = sessions.create(user="olga", role="operator", client=client, ttl_s=60)
    assert sessions.get(session.sid) is session and session.can_operate
    clock.now += 61
    assert sessions.get(session.sid) is None
    assert sessions.get(session.sid) is None  # and it stays gone


def test_a_second_login_in_the_same_browser_replaces_the_first(
        browser: FlaskClient, console: dash.Dash, api: tuple[str, Store, TokenAuthority]) -> None:
    log_in(browser, "olga", "olga-pw")
    first = current_session(browser, console)
    first_token = first.client._http.headers["Authorization"].split()[1]
    log_in(browser, "vic", "vic-pw")
    assert current_session(browser, console).user == "vic"
    sessions: SessionStore = console.server.config["CONSOLE_SESSIONS"]
    assert sessions.get(first.sid) is None and api[2].verify(first_token) is None
