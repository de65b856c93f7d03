"""Who may call the control plane: API tokens (kept by their hash) and console users.

Where it sits: the tables behind :mod:`controlplane.auth` (issue, check and revoke tokens; users and their
password hashes), mixed into :class:`controlplane.store.database.Store`.
"""

from __future__ import annotations

from controlplane.store.rows import TokenRow, UserRow, require_text, token_row, user_row
from controlplane.store.sqlite import SqliteDatabase

_TOKEN_SELECT = "SELECT name, role, token_hash, created_at, expires_at, revoked_at FROM tokens"


class AccessTables(SqliteDatabase):
    """The ``tokens`` and ``users`` tables."""

    # -- tokens --------------------------------------------------------------------------------
    def add_token(self, name: str, role: str, token_hash: str, expires_at: float | None) -> TokenRow:
        """Store a token by its hash. A live (unrevoked) token of the same name is a conflict."""
        require_text(name=name, role=role, token_hash=token_hash)
        row = TokenRow(name=name, role=role, token_hash=token_hash, created_at=self._clock(),
                       expires_at=expires_at)
        with self._write(f"add token {name}") as conn:
            conn.execute("INSERT INTO tokens (name, role, token_hash, created_at, expires_at) "
                         "VALUES (?, ?, ?, ?, ?)", (name, role, token_hash, row.created_at, expires_at))
        return row

    def token_by_hash(self, token_hash: str) -> TokenRow | None:
        rows = self._read("read token", f"{_TOKEN_SELECT} WHERE token_hash = ?", (token_hash,))
        return token_row(rows[0]) if rows else None

    def revoke_token(self, name: str) -> bool:
        """Revoke the live token called ``name``; False when there is none."""
        with self._write(f"revoke token {name}") as conn:
            cur = conn.execute("UPDATE tokens SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL",
                               (self._clock(), name))
            return cur.rowcount > 0

    def purge_tokens(self, *, name_like: str, ended_before: float, batch: int) -> int:
        """Delete up to ``batch`` tokens named like ``name_like`` (SQL ``LIKE``) that were revoked or
        expired before ``ended_before``; how many went."""
        with self._write("purge tokens") as conn:
            cur = conn.execute("DELETE FROM tokens WHERE id IN (SELECT id FROM tokens WHERE name LIKE ? AND "
                               "(revoked_at < ? OR expires_at < ?) ORDER BY id LIMIT ?)",
                               (name_like, ended_before, ended_before, batch))
            return int(cur.rowcount)

    def tokens(self) -> list[TokenRow]:
        """Every token, revoked and expired ones included, oldest first."""
        return [token_row(r) for r in self._read("read tokens", f"{_TOKEN_SELECT} ORDER BY id")]

    # -- users ---------------------------------------------------------------------------------
    def add_user(self, name: str, password_hash: str, role: str) -> UserRow:
        require_text(name=name, password_hash=password_hash, role=role)
        row = UserRow(name=name, password_hash=password_hash, role=role, created_at=self._clock())
        with self._write(f"add user {name}") as conn:
            conn.execute("INSERT INTO users (name, password_hash, role, created_at) VALUES (?, ?, ?, ?)",
                         (name, password_hash, role, row.created_at))
        return row

    def user(self, name: str) -> UserRow | None:
        rows = self._read("read user", "SELECT * FROM users WHERE name = ?", (name,))
        return user_row(rows[0]) if rows else None

    def users(self) -> list[UserRow]:
        return [user_row(r) for r in self._read("read users", "SELECT * FROM users ORDER BY name")]
