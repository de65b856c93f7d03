"""Who may do what: bearer tokens with roles, console passwords, and the audit trail of every mutation.

Where it sits: the REST API guards each route with these tokens (:mod:`controlplane.api.guards`, which holds
all of it that knows HTTP), and a route that changes something records it through :class:`Auditor`; the
CLI and the loops use the same classes without loading the web framework (an eighth of a second or more of
every CLI command's start). Tokens and
passwords live in the store only as hashes: a token's secret exists once, in the answer to ``issue``, and
is never logged.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from controlplane.store.database import AuditRecord, Outcome, Store, StoreConflictError, redact

log = logging.getLogger(__name__)

TOKEN_BYTES = 32  # secrets.token_urlsafe(32): 256 random bits
MAX_TOKEN_CHARS = 512  # longer bearer values are refused before hashing
BOOTSTRAP_ADMIN_NAME = "bootstrap-admin"
BREAK_GLASS_REVOKES = ("bootstrap", "all", "none")  # which admin tokens `admin reset-token` revokes
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

# scrypt cost as OWASP's Password Storage Cheat Sheet asks (N >= 2**17, r=8, p=1): 128 MiB and a few
# hundred milliseconds per hash. The encoded hash records N, r and p, so hashes made with other costs (the
# 2**14 of earlier versions) still verify; they are not rehashed.
SCRYPT_N = 2**17
SCRYPT_R = 8
SCRYPT_P = 1
SCRYPT_SALT_BYTES = 16
SCRYPT_KEY_BYTES = 32
SCRYPT_MAX_MEMORY = 256 * 1024 * 1024  # encoded hashes asking for more are refused, not computed


class Role(enum.Enum):
    """Roles in increasing power: a viewer reads, an operator acts on the fleet, an admin manages access."""

    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"

    @property
    def rank(self) -> int:
        return list(Role).index(self)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Role):
            return NotImplemented
        return self.rank < other.rank

    def __le__(self, other: object) -> bool:
        if not isinstance(other, Role):
            return NotImplemented
        return self.rank <= other.rank

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, Role):
            return NotImplemented
        return self.rank > other.rank

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, Role):
            return NotImplemented
        return self.rank >= other.rank


@dataclass(slots=True, frozen=True)
class Principal:
    """Who is calling: a token's (or user's) name and role."""

    name: str
    role: Role

    def may(self, needed: Role) -> bool:
        return self.role >= needed


def hash_token(secret: str) -> str:
    """Hex SHA-256 of a token secret: what the store keeps. Tokens are 256 random bits, so a fast hash
    suffices (no dictionary to attack, unlike passwords)."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


# ---- tokens ----------------------------------------------------------------------------------
class TokenAuthority:
    """Issues, verifies and revokes bearer tokens; the clock is injectable for expiry tests."""

    def __init__(self, store: Store, *, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._clock = clock

    def issue(self, name: str, role: Role, ttl_s: float | None = None) -> str:
        """A new token's secret, returned this once; only its hash is stored."""
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        secret = secrets.token_urlsafe(TOKEN_BYTES)
        expires_at = None if ttl_s is None else self._clock() + ttl_s
        self._store.add_token(name, role.value, hash_token(secret), expires_at)
        log.info("token issued name=%s role=%s expires_at=%s", name, role.value, expires_at)
        return secret

    def verify(self, secret: str | None) -> Principal | None:
        """The token's principal; None when the secret is unknown, revoked or expired."""
        if not secret or len(secret) > MAX_TOKEN_CHARS:
            return None
        digest = hash_token(secret)
        row = self._store.token_by_hash(digest)
        # The lookup is by hash, so its timing tells an attacker nothing about any stored secret; the
        # constant-time compare keeps it that way should the lookup ever become a prefix or scan.
        if row is None or not hmac.compare_digest(row.token_hash, digest):
            return None
        if not row.is_active(self._clock()):
            return None
        try:
            role = Role(row.role)
        except ValueError:
            log.warning("token name=%s has an unknown role %r; refused", row.name, row.role)
            return None
        return Principal(name=row.name, role=role)

    def live_names(self, role: Role, *, permanent: bool = False) -> list[str]:
        """The names of the tokens of ``role`` that work now (neither revoked nor expired); with
        ``permanent``, only those that never expire (not a console session's)."""
        now = self._clock()
        return [row.name for row in self._store.tokens() if row.role == role.value and row.is_active(now)
                and not (permanent and row.expires_at is not None)]

    def revoke(self, name: str) -> bool:
        """Revoke the live token called ``name``; False when there is none."""
        revoked = self._store.revoke_token(name)
        log.info("token revoked name=%s found=%s", name, revoked)
        return revoked

    def break_glass(self, *, revoke: str) -> tuple[str, str, list[str]]:
        """A new admin token for an admin who lost theirs, named ``break-glass-<UTC time>``: returns its
        name, its secret (shown once) and the names of the tokens revoked with it: the first admin's
        (``revoke="bootstrap"``), every other live admin token (``"all"``) or none (``"none"``)."""
        if revoke not in BREAK_GLASS_REVOKES:
            raise ValueError(f"revoke must be one of {', '.join(BREAK_GLASS_REVOKES)}, got {revoke!r}")
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self._clock()))
        live = set(self.live_names(Role.ADMIN))
        name = next(n for n in (f"break-glass-{stamp}", *(f"break-glass-{stamp}-{i}" for i in range(2, 100)))
                    if n not in live)
        doomed = {"bootstrap": [n for n in live if n == BOOTSTRAP_ADMIN_NAME], "all": sorted(live),
                  "none": []}[revoke]
        secret = self.issue(name, Role.ADMIN)
        revoked = [n for n in doomed if self.revoke(n)]
        return name, secret, revoked

    def ensure_admin(self, secret: str | None) -> tuple[str, bool]:
        """Create the first admin token when no live admin token exists.

        Uses ``secret`` (from the config or the environment) or generates one; returns (secret, created).
        When an admin already exists nothing changes and the secret returned is the one given, or ""
        (a stored token cannot be recovered). A given secret that the store already knows (revoked,
        expired or issued with another role) is refused: a stale environment variable must not undo a
        revocation.
        """
        now = self._clock()
        if any(row.role == Role.ADMIN.value and row.is_active(now) for row in self._store.tokens()):
            return secret or "", False
        secret = secret or secrets.token_urlsafe(TOKEN_BYTES)
        digest = hash_token(secret)
        if self._store.token_by_hash(digest) is not None:
            raise ValueError("the configured admin token was revoked, has expired or belongs to another "
                             "role; configure a new one")
        self._store.revoke_token(BOOTSTRAP_ADMIN_NAME)  # an expired bootstrap token would block the name
        try:
            self._store.add_token(BOOTSTRAP_ADMIN_NAME, Role.ADMIN.value, digest, None)
        except StoreConflictError:  # another control plane created it at the same moment
            return secret if self.verify(secret) else "", False
        log.info("token issued name=%s role=admin (first admin)", BOOTSTRAP_ADMIN_NAME)
        return secret, True


# ---- passwords -------------------------------------------------------------------------------
def hash_password(password: str) -> str:
    """``scrypt$n$r$p$salt$key`` (salt and key in unpadded urlsafe base64), with a random salt."""
    if not password:
        raise ValueError("password must not be empty")
    salt = secrets.token_bytes(SCRYPT_SALT_BYTES)
    key = _scrypt(password, salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, length=SCRYPT_KEY_BYTES)
    return f"scrypt${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${_b64encode(salt)}${_b64encode(key)}"


def unmatchable_hash() -> str:
    """A hash of the same parameters that no password is known to match (a random key, not a derived
    one): checking a password against it costs one scrypt like any other, and computing it costs none."""
    return (f"scrypt${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${_b64encode(secrets.token_bytes(SCRYPT_SALT_BYTES))}"
            f"${_b64encode(secrets.token_bytes(SCRYPT_KEY_BYTES))}")


def check_password(password: str, encoded: str) -> bool:
    """True when ``password`` matches ``encoded``; False for a wrong password or a malformed hash."""
    try:
        scheme, n_text, r_text, p_text, salt_text, key_text = encoded.split("$")
        n, r, p = int(n_text), int(r_text), int(p_text)
        salt, expected = _b64decode(salt_text), _b64decode(key_text)
    except (ValueError, binascii.Error):
        return False
    if scheme != "scrypt" or not _is_sane_cost(n, r, p) or not expected:
        return False
    key = _scrypt(password, salt, n=n, r=r, p=p, length=len(expected))
    return hmac.compare_digest(key, expected)


def _is_sane_cost(n: int, r: int, p: int) -> bool:
    is_power_of_two = n > 1 and n & (n - 1) == 0
    return is_power_of_two and 1 <= r <= 64 and 1 <= p <= 16 and 128 * r * (n + p) <= SCRYPT_MAX_MEMORY


def _scrypt(password: str, salt: bytes, *, n: int, r: int, p: int, length: int) -> bytes:
    memory = 128 * r * (n + p) + 1024 * 1024
    return hashlib.scrypt(password.encode("utf-8"), salt=salt, n=n, r=r, p=p, maxmem=memory, dklen=length)


def _b64encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def _b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# ---- audit -----------------------------------------------------------------------------------
class Auditor:
    """Writes one audit record per mutation, with secrets redacted from its parameters."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def record(self, principal: Principal, action: str, target: str, params: Mapping[str, Any],
               outcome: Outcome, detail: str = "") -> AuditRecord:
        stored = self._store.add_audit(AuditRecord(actor=principal.name, role=principal.role.value,
                                                   action=action, target=target, params=redact(params),
                                                   outcome=outcome, detail=detail))
        log.info("audit id=%s actor=%s action=%s target=%s outcome=%s", stored.id, principal.name, action,
                 target, outcome)
        return stored
