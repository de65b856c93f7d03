"""Who is using the console: login, server-side sessions, and the guard in front of every request.

A login posts the user's name and password to the control plane (``POST /api/v1/auth/login``) and keeps
the short-lived token it answers on the server, in a :class:`SessionStore`; the browser holds only a
signed Flask cookie naming the session (HttpOnly, SameSite=Strict). Every API call a page makes uses that
token, so the control plane itself refuses what the user's role may not do.

The guard (a Flask ``before_request`` hook) refuses requests for an unknown Host (DNS rebinding), refuses
every POST whose Origin (or, failing that, Referer) is not this console (cross-site requests: Dash's
``/_dash-update-component`` included), checks the login form's CSRF token, and sends anyone without a
live session to the login page.
"""

from __future__ import annotations

import contextlib
import contextvars
import html
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import dash
import flask

from controlplane.client import ApiError, ControlPlaneClient

log = logging.getLogger(__name__)

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
PUBLIC_PREFIXES = ("/login", "/_dash-component-suites/", "/assets/", "/_favicon.ico", "/favicon.ico")
OPERATOR_ROLES = frozenset({"operator", "admin"})


@dataclass(slots=True)
class Session:
    """One logged-in browser: the user, the role the control plane granted, and that role's token."""

    sid: str
    user: str
    role: str
    client: ControlPlaneClient
    expires_at: float
    created_at: float = field(default_factory=time.time)

    @property
    def can_operate(self) -> bool:
        return self.role in OPERATOR_ROLES


class SessionStore:
    """Sessions by id, in this process's memory: a restarted console asks everyone to log in again."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def create(self, *, user: str, role: str, client: ControlPlaneClient, ttl_s: float) -> Session:
        session = Session(secrets.token_urlsafe(32), user, role, client, self._clock() + ttl_s)
        with self._lock:
            self._sessions[session.sid] = session
        log.info("console login user=%s role=%s", user, role)
        return session

    def get(self, sid: str | None) -> Session | None:
        """The live session; an expired one is dropped (and its client closed)."""
        if not sid:
            return None
        with self._lock:
            session = self._sessions.get(sid)
            if session is None or session.expires_at > self._clock():
                return session
            del self._sessions[sid]
        session.client.close()
        log.info("console session expired user=%s", session.user)
        return None

    def drop(self, sid: str | None) -> Session | None:
        """Forget a session; the caller logs its token out and closes its client."""
        with self._lock:
            return self._sessions.pop(sid or "", None)


@dataclass(slots=True, frozen=True)
class AccessSettings:
    api_url: str
    session_ttl_s: float
    allowed_hosts: frozenset[str] = frozenset()  # Host header values accepted; empty: any


# ---- per-request helpers for pages --------------------------------------------------------------------
def current() -> Session | None:
    """The session of the request being served (pages and callbacks run inside one)."""
    sessions: SessionStore = flask.current_app.config["CONSOLE_SESSIONS"]
    return sessions.get(flask.session.get("sid"))


# ---- when the control plane is gone ------------------------------------------------------------
REFRESH = "refresh"  # the dcc.Interval every live panel listens to (``dashboards.shell``)
_REPORTING: contextvars.ContextVar[bool] = contextvars.ContextVar("reporting_outage", default=False)


class Outage:
    """Whether the control plane answers, as this console's calls find it (every session's client tells
    it). While it does not, a live refresh changes nothing on the page: every panel keeps the last data it
    showed, and only the banner (:meth:`reporting`) says since when the control plane is gone. A user's
    own action (a button) still gets the error, so nothing looks done that was not."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.since: float | None = None  # when calls started finding nobody
        self.last_answer: float | None = None
        self.error = ""

    def answered(self) -> None:
        self.since, self.last_answer = None, self.clock()

    def unreachable(self, error: ApiError) -> None:
        if self.since is None:
            self.since = self.clock()
        self.error = str(error)
        if not _REPORTING.get() and _is_live_refresh():
            raise dash.exceptions.PreventUpdate  # keep what the page shows

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """Calls made inside raise the error as it is (the banner reports the outage)."""
        token = _REPORTING.set(True)
        try:
            yield
        finally:
            _REPORTING.reset(token)


def _is_live_refresh() -> bool:
    try:
        return bool(dash.ctx.triggered_id == REFRESH)
    except (LookupError, AttributeError, dash.exceptions.MissingCallbackContextException):
        return False  # not in a callback (the login form)


OUTAGE = Outage()


def client() -> ControlPlaneClient:
    """The current user's API client; raises ApiError 401 when the session has ended."""
    session = current()
    if session is None:
        raise ApiError("your session has expired: log in again", status=401)
    return session.client


def can_operate() -> bool:
    session = current()
    return session is not None and session.can_operate


# ---- the guard -------------------------------------------------------------------------------------
def install(server: flask.Flask, settings: AccessSettings, sessions: SessionStore) -> None:
    """Login and logout routes, and the request guard, on the console's Flask server."""
    server.config.update(
        CONSOLE_SESSIONS=sessions,
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Strict",
        SESSION_COOKIE_NAME="console_session",
        PERMANENT_SESSION_LIFETIME=int(settings.session_ttl_s),
        # Only logins and logouts set the cookie: a late answer to a page's poll must not put back a
        # cookie that a logout (or another login) has just replaced.
        SESSION_REFRESH_EACH_REQUEST=False,
    )

    @server.before_request
    def guard() -> flask.typing.ResponseReturnValue | None:
        return _refusal(settings, sessions)

    @server.route("/login", methods=["GET", "POST"])
    def login() -> flask.typing.ResponseReturnValue:
        if flask.request.method == "GET":
            return _login_page()
        return _login(settings, sessions)

    @server.route("/logout", methods=["POST"])
    def logout() -> flask.typing.ResponseReturnValue:
        end_session(sessions)
        return flask.redirect("/login")


def end_session(sessions: SessionStore) -> None:
    """Forget the browser's session and revoke its API token."""
    session = sessions.drop(flask.session.get("sid"))
    if session is not None:
        try:
            session.client.logout()
        except ApiError:
            pass  # the token expires by itself
        finally:
            session.client.close()
    flask.session.clear()


def _refusal(settings: AccessSettings, sessions: SessionStore) -> flask.typing.ResponseReturnValue | None:
    request = flask.request
    if settings.allowed_hosts and request.host not in settings.allowed_hosts:
        return _plain(400, f"unknown host {request.host!r}")
    if request.method not in SAFE_METHODS and not _is_same_origin(request):
        log.warning(
            "cross-site %s %s refused (origin=%r referer=%r)",
            request.method,
            request.path,
            request.headers.get("Origin"),
            request.headers.get("Referer"),
        )
        return _plain(403, "cross-site request refused: the Origin or Referer is not this console")
    if request.path.startswith(PUBLIC_PREFIXES):
        return None
    if sessions.get(flask.session.get("sid")) is not None:
        return None
    if request.method in SAFE_METHODS and not request.path.startswith("/_dash"):
        return flask.redirect("/login")
    return flask.make_response(
        (
            {
                "error": {
                    "message": "not logged in, or the session has expired",
                    "type": "authentication_error",
                    "param": None,
                    "code": "session_expired",
                }
            },
            401,
        )
    )


def _is_same_origin(request: flask.Request) -> bool:
    own = _origin(request.host_url)
    origin = request.headers.get("Origin")
    if origin and origin != "null":
        return _origin(origin) == own
    referer = request.headers.get("Referer")
    return bool(referer) and _origin(referer or "") == own


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def _login(settings: AccessSettings, sessions: SessionStore) -> flask.typing.ResponseReturnValue:
    form = flask.request.form
    expected = flask.session.get("login_csrf")
    if not expected or not secrets.compare_digest(str(expected), form.get("csrf_token", "")):
        return _login_page("the login form expired: try again", status=400)
    user, password = form.get("user", "").strip(), form.get("password", "")
    if not user or not password:
        return _login_page("enter a user name and a password", status=400)
    api = ControlPlaneClient(settings.api_url, token=None)
    try:
        granted = api.login(user, password, settings.session_ttl_s)
    except ApiError as exc:
        if exc.status in (400, 401):
            return _login_page("wrong user name or password", status=401)
        if exc.status == 429:
            wait = f" in {exc.retry_after_s:.0f} s" if exc.retry_after_s else " later"
            return _login_page(f"too many failed logins: try again{wait}", status=429)
        log.warning("login: the control plane did not answer: %s", exc)
        return _login_page("the control plane cannot be reached; try again shortly", status=503)
    finally:
        api.close()
    client = ControlPlaneClient(settings.api_url, token=granted.token, availability=OUTAGE)
    session = sessions.create(
        user=granted.user, role=granted.role, client=client, ttl_s=settings.session_ttl_s
    )
    end_session(sessions)  # a new login replaces the browser's earlier session, if any
    flask.session.permanent = True
    flask.session["sid"] = session.sid
    return flask.redirect("/")


def _login_page(message: str = "", *, status: int = 200) -> flask.typing.ResponseReturnValue:
    token = secrets.token_urlsafe(24)
    flask.session["login_csrf"] = token
    notice = f'<p class="error" id="login-error">{html.escape(message)}</p>' if message else ""
    page = _LOGIN_HTML.format(notice=notice, csrf=html.escape(token))
    return flask.make_response(
        (page, status, {"Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-store"})
    )


def _plain(status: int, message: str) -> flask.Response:
    return flask.make_response((message + "\n", status, {"Content-Type": "text/plain; charset=utf-8"}))


def allowed_hosts(host: str, port: int, extra: Iterable[str] = ()) -> frozenset[str]:
    """Host header values a browser sends for this console."""
    names = {host, "127.0.0.1", "localhost"} if host in ("127.0.0.1", "localhost") else {host}
    return frozenset({f"{n}:{port}" for n in names} | set(extra))


_LOGIN_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Log in · LLM SRE console</title>
<link rel="icon" href="data:,">
<style>
body {{ font-family: system-ui, sans-serif; background: #0f172a; color: #e2e8f0; display: flex;
       justify-content: center; align-items: center; height: 100vh; margin: 0; }}
form {{ background: #1e293b; padding: 2rem 2.5rem; border-radius: 8px; width: 20rem; }}
h1 {{ font-size: 1.2rem; margin-top: 0; }}
label {{ display: block; margin: .8rem 0 .2rem; }}
input[type=text], input[type=password] {{ width: 100%; padding: .45rem; border-radius: 4px; border: 0;
                                         box-sizing: border-box; }}
button {{ margin-top: 1.2rem; width: 100%; padding: .55rem; background: #2563eb; color: white; border: 0;
         border-radius: 4px; font-weight: 600; cursor: pointer; }}
.error {{ color: #fca5a5; }}
</style></head>
<body><form method="post" action="/login" id="login-form">
<h1>LLM SRE control plane</h1>{notice}
<input type="hidden" name="csrf_token" value="{csrf}">
<label for="user">User</label><input type="text" id="user" name="user" autocomplete="username" autofocus>
<label for="password">Password</label>
<input type="password" id="password" name="password" autocomplete="current-password">
<button type="submit" id="login-submit">Log in</button>
</form></body></html>
"""
