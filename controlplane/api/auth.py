"""Console users: who they are (hashed passwords in the store) and how they turn a password into a token.

Where it sits: ``controlplane up`` calls :func:`ensure_users` at start (users from the ``[console]`` config
and ``$CONTROLPLANE_USERS``, and a first admin whose password is ``$CONTROLPLANE_ADMIN_PASSWORD``, the
config's ``console.admin_password``, or generated and printed once). The console posts a user's name and
password to ``POST /api/v1/auth/login`` and gets back a short-lived bearer token of that user's role; every
later call of that browser session carries it, so the API itself refuses what the role may not do.
``POST /api/v1/auth/logout`` revokes the caller's token (any token, not only a session's), except the last
admin token that does not expire (the first admin's, typically): that would leave no admin token, so it is
refused with 409 (issue another admin token first, or recover with ``controlplane admin reset-token`` on
the host). A console session's token always goes: it expires anyway, and the admin user can log in again.

Every login is audited: a success as the user acting, a failure as ``anonymous`` trying (action
``auth.login``, outcome ``denied``, the name typed as its target, the client's address in its
parameters): a typed name is not who acted. Failed logins back off per user name and per client address
(:mod:`controlplane.api.throttle`): a throttled attempt is answered 429 with Retry-After before its
password is hashed, and is not audited, so a flood neither burns CPU on scrypt nor grows the audit trail.
"""

from __future__ import annotations

import logging
import math
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from controlplane.api.guards import openai_error, public, require
from controlplane.api.throttle import LoginThrottle
from controlplane.auth import (
    Auditor,
    Principal,
    Role,
    TokenAuthority,
    check_password,
    hash_password,
    unmatchable_hash,
)
from controlplane.config import LoginLimits
from controlplane.errors import Conflict, RateLimited
from controlplane.store.database import AuditRecord, Store, StoreConflictError

log = logging.getLogger(__name__)

ADMIN_PASSWORD_ENV = "CONTROLPLANE_ADMIN_PASSWORD"
USERS_ENV = "CONTROLPLANE_USERS"  # comma-separated NAME:ROLE:PASSWORD_HASH entries, as in console.users
FIRST_ADMIN_NAME = "admin"
DEFAULT_SESSION_TTL_S = 3600.0
MAX_SESSION_TTL_S = 12 * 3600.0
USER_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
# A wrong user name costs as much as a wrong password: the timing does not tell which names exist.
_DUMMY_HASH = unmatchable_hash()


@dataclass(slots=True, frozen=True)
class UserEntry:
    """A configured user: ``NAME:ROLE:PASSWORD_HASH`` (the hash from ``controlplane hash-password``)."""

    name: str
    role: Role
    password_hash: str

    @classmethod
    def parse(cls, text: str) -> UserEntry:
        name, _, rest = text.strip().partition(":")
        role_text, _, password_hash = rest.partition(":")
        if not USER_NAME.match(name):
            raise ValueError(f"user entry: bad name {name!r} (expected NAME:ROLE:PASSWORD_HASH)")
        try:
            role = Role(role_text)
        except ValueError as exc:
            raise ValueError(f"user {name}: role must be viewer, operator or admin: {role_text!r}") from exc
        if not password_hash.startswith("scrypt$"):
            raise ValueError(f"user {name}: the password must be a hash from `controlplane hash-password`")
        return cls(name, role, password_hash)


def parse_users(config_entries: Sequence[str], env: Mapping[str, str]) -> list[UserEntry]:
    """Users from the config, then from ``$CONTROLPLANE_USERS``; a bad entry raises ValueError."""
    texts = [*config_entries, *(e for e in env.get(USERS_ENV, "").split(",") if e.strip())]
    return [UserEntry.parse(t) for t in texts]


def ensure_users(store: Store, entries: Sequence[UserEntry], admin_password: str | None) -> str | None:
    """Add configured users missing from the store, and a first admin when no admin user exists.

    The first admin's password is ``admin_password`` or a generated one; returns the password when this
    call created the first admin with a generated one (to print once), else None. Existing users are left
    as they are: the store is the authority once a user exists.
    """
    known = {u.name for u in store.users()}
    for entry in entries:
        if entry.name not in known:
            _add_user(store, entry.name, entry.password_hash, entry.role)
            known.add(entry.name)
    if any(u.role == Role.ADMIN.value for u in store.users()):
        return None
    password = admin_password or secrets.token_urlsafe(12)
    _add_user(store, FIRST_ADMIN_NAME, hash_password(password), Role.ADMIN)
    return None if admin_password else password


def _add_user(store: Store, name: str, password_hash: str, role: Role) -> None:
    try:
        store.add_user(name, password_hash, role.value)
        log.info("user added name=%s role=%s", name, role.value)
    except StoreConflictError:  # another control plane added it at the same moment
        log.info("user name=%s exists already", name)


class LoginRequest(BaseModel):
    user: str = Field(min_length=1, max_length=64)
    password: str = Field(min_length=1, max_length=1024)
    ttl_s: float = Field(DEFAULT_SESSION_TTL_S, gt=0, le=MAX_SESSION_TTL_S)


ANONYMOUS = "anonymous"  # the actor of a failed login: nobody we know


def auth_router(store: Store, tokens: TokenAuthority, auditor: Auditor,
                throttle: LoginThrottle | None = None) -> APIRouter:
    """The auth routes; ``throttle`` defaults to the ``[api.login]`` defaults."""
    router = APIRouter(prefix="/api/v1/auth", tags=["security"])
    throttle = throttle or LoginThrottle(LoginLimits())
    viewer = require(Role.VIEWER)

    @router.post("/login", response_model=None, dependencies=[Depends(public)],
                 responses={401: {"description": "wrong user name or password"},
                            429: {"description": "too many failed logins for this user or from this "
                                                 "client; Retry-After says when to try again"}})
    def login(body: LoginRequest, request: Request) -> dict[str, object] | JSONResponse:
        # A plain def: scrypt takes tens of milliseconds, so FastAPI runs it in a worker thread.
        client = request.client.host if request.client else "unknown"
        wait = throttle.admit(body.user, client)
        if wait > 0:
            log.info("login throttled user=%s client=%s retry_after=%.1fs", body.user, client, wait)
            raise RateLimited(f"too many failed logins; try again in {math.ceil(wait)} s", retry_after_s=wait)
        user = store.user(body.user)
        matches = check_password(body.password, user.password_hash if user else _DUMMY_HASH)
        role = _role(user.role) if user is not None else None
        if user is None or not matches or role is None:
            store.add_audit(AuditRecord(actor=ANONYMOUS, role="-", action="auth.login",
                                        target=body.user, params={"client": client}, outcome="denied",
                                        detail="wrong user name or password"))
            return JSONResponse(openai_error("wrong user name or password", type_="authentication_error",
                                             code="invalid_credentials"), status_code=401)
        throttle.succeeded(body.user, client)
        # "alice/console-1a2b3c": the audit names the user; "/" is in no user or API token name.
        token_name = f"{user.name}/console-{secrets.token_hex(3)}"
        secret = tokens.issue(token_name, role, body.ttl_s)
        auditor.record(Principal(user.name, role), "auth.login", user.name, {"ttl_s": body.ttl_s}, "ok",
                       detail=f"session token {token_name}")
        return {"user": user.name, "role": role.value, "token": secret, "ttl_s": body.ttl_s}

    @router.post("/logout", responses={409: {"description": "the caller's token is the last live admin "
                                                            "token; it is not revoked"}})
    def logout(who: Principal = Depends(viewer)) -> dict[str, object]:
        permanent = tokens.live_names(Role.ADMIN, permanent=True)
        if who.name in permanent and len(permanent) == 1:
            detail = ("the last admin token that does not expire is not revoked: that would leave no admin "
                      "token. Issue another admin token first, or run `controlplane admin reset-token` on "
                      "the host")
            auditor.record(who, "auth.logout", who.name, {}, "denied", detail)
            raise Conflict(detail)
        revoked = tokens.revoke(who.name)
        auditor.record(who, "auth.logout", who.name, {}, "ok" if revoked else "error")
        return {"revoked": revoked}

    @router.get("/whoami")
    def whoami(who: Principal = Depends(viewer)) -> dict[str, str]:
        return {"name": who.name, "role": who.role.value}

    return router


def _role(text: str) -> Role | None:
    try:
        return Role(text)
    except ValueError:
        log.warning("a user has an unknown role %r; login refused", text)
        return None
