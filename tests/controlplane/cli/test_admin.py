"""Break-glass: ``controlplane admin reset-token`` on the host issues a new admin token from the state folder
(no token needed), revokes the first admin's token (or every admin token, or none), audits it, and prints
the new token once; it refuses when the state folder or the store is not the caller's alone."""

from __future__ import annotations

import getpass
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.auth import BOOTSTRAP_ADMIN_NAME, Role, TokenAuthority
from controlplane.cli.main import main
from controlplane.store.database import Store
from controlplane.store.files import private_dir

Capture = pytest.CaptureFixture[str]


@pytest.fixture
def state(tmp_path: Path) -> Iterator[tuple[Path, str, str]]:
    """A state folder as ``controlplane up`` leaves it: the first admin's token and another admin's; yields
    (the config file naming the folder, the first admin's token, the other admin's)."""
    folder = private_dir(tmp_path / "state")
    with Store(folder / "controlplane.db") as store:
        tokens = TokenAuthority(store)
        first, _ = tokens.ensure_admin(None)
        other = tokens.issue("ops-admin", Role.ADMIN)
    config = tmp_path / "controlplane.toml"
    config.write_text(f'state_dir = "{folder}"\n')
    yield config, first, other


def reset(config: Path, *options: str) -> int:
    return main(["admin", "reset-token", "--config", str(config), *options])


def verify(config: Path, secret: str) -> Role | None:
    folder = Path(config.read_text().split('"')[1])
    with Store(folder / "controlplane.db") as store:
        principal = TokenAuthority(store).verify(secret)
    return principal.role if principal else None


def test_reset_token_issues_a_new_admin_and_revokes_the_first_admins(state: tuple[Path, str, str],
                                                                     capsys: Capture) -> None:
    config, first, other = state
    assert reset(config) == 0
    out = capsys.readouterr()
    new = out.out.strip()
    assert verify(config, new) is Role.ADMIN
    assert verify(config, first) is None and verify(config, other) is Role.ADMIN
    assert "shown once" in out.err and f"revoked: {BOOTSTRAP_ADMIN_NAME}" in out.err
    folder = Path(config.read_text().split('"')[1])
    with Store(folder / "controlplane.db") as store:
        [record] = store.audit(action_prefix="token.reset")
    assert record.actor == f"local:{getpass.getuser()}" and record.role == "admin"
    assert record.params == {"revoke": "bootstrap", "revoked": [BOOTSTRAP_ADMIN_NAME]}
    assert new not in str(record)


def test_reset_token_can_revoke_every_admin_token_or_none(state: tuple[Path, str, str],
                                                          capsys: Capture) -> None:
    config, first, other = state
    assert reset(config, "--revoke", "none") == 0
    kept = capsys.readouterr().out.strip()
    assert verify(config, first) is Role.ADMIN
    assert reset(config, "--revoke", "all") == 0
    last = capsys.readouterr().out.strip()
    assert [verify(config, t) for t in (first, other, kept, last)] == [None, None, None, Role.ADMIN]


def test_reset_token_refuses_a_state_folder_others_may_write(state: tuple[Path, str, str],
                                                             capsys: Capture) -> None:
    config, first, _ = state
    folder = Path(config.read_text().split('"')[1])
    folder.chmod(0o777)
    assert reset(config) == 1
    assert "others may write" in capsys.readouterr().err
    assert verify(config, first) is Role.ADMIN  # nothing changed


@pytest.mark.skipif(os.getuid() != 0, reason="giving the folder to another user needs root")
def test_reset_token_refuses_a_state_folder_of_another_user(state: tuple[Path, str, str],
                                                            capsys: Capture) -> None:
    config, first, _ = state
    folder = Path(config.read_text().split('"')[1])
    os.chown(folder, 65534, 65534)
    assert reset(config) == 1
    assert "belongs to uid 65534, not to you" in capsys.readouterr().err
    os.chown(folder, 0, 0)
    assert verify(config, first) is Role.ADMIN


def test_reset_token_refuses_where_no_control_plane_ran(tmp_path: Path, capsys: Capture) -> None:
    config = tmp_path / "controlplane.toml"
    config.write_text(f'state_dir = "{private_dir(tmp_path / "empty")}"\n')
    assert reset(config) == 1
    assert "controlplane.db does not exist" in capsys.readouterr().err
