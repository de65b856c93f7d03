"""Only the owner reads the control plane's secrets: the state folder is 0700, the store and its WAL/SHM
files 0600 (also when an earlier version left them wider), the replicas' admin-token secret 0600 from its
first byte. Run under the usual umask 022, which would otherwise make them 0755 and 0644."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.fleet.registry import load_or_create_secret
from controlplane.store.database import Store
from controlplane.store.files import create_private, private_dir


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(autouse=True)
def usual_umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_store_database_and_its_wal_and_shm_are_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "state" / "controlplane.db"
    with Store(path) as store:
        store.add_event("test", "s", {"detail": "x"})  # a write: the -wal and -shm files exist now
        files = [path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")]
        assert all(f.exists() for f in files)
        assert {f.name: oct(mode(f)) for f in files} == {f.name: "0o600" for f in files}


def test_store_files_an_earlier_version_left_readable_are_narrowed(tmp_path: Path) -> None:
    path = tmp_path / "controlplane.db"
    with Store(path) as store:
        store.add_event("test", "s", {"detail": "x"})
    for f in tmp_path.iterdir():
        f.chmod(0o644)
    with Store(path):
        assert {f.name: oct(mode(f)) for f in tmp_path.iterdir()} == \
            {f.name: "0o600" for f in tmp_path.iterdir()}


def test_state_folder_is_created_or_narrowed_to_0700(tmp_path: Path) -> None:
    fresh = private_dir(tmp_path / "new" / "state")
    assert mode(fresh) == 0o700
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    assert mode(private_dir(old)) == 0o700


def test_secret_files_are_0600_from_their_first_byte(tmp_path: Path) -> None:
    key = tmp_path / "replica-admin.key"
    secret = load_or_create_secret(key)
    assert mode(key) == 0o600 and len(secret) == 32
    assert load_or_create_secret(key) == secret  # read back, not made again
    with pytest.raises(FileExistsError):
        create_private(key, b"another")  # never written over
    assert key.read_bytes() == secret
