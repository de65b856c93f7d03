"""A replica's secrets stay out of ``ps``: ``--api-key-file`` (and ``--admin-token-file``) are read from their
files and never appear in the process's command line, and a secret given as an argument works but the
replica warns on stderr that every user can read it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from .harness import start_replica

pytestmark = pytest.mark.slow

KEY = "replica-key-from-a-file"
ADMIN = "admin-token-on-argv"


def test_a_key_file_is_used_and_an_argument_secret_is_warned_about(state_dir: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    replica = start_replica(state_dir=state_dir, log_dir=tmp_path, replica_id="secrets", api_key=None,
                            admin_token=None, flags=("--api-key-file", str(key_file), "--admin-token", ADMIN))
    try:
        cmdline = Path(f"/proc/{replica.proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert KEY not in cmdline and str(key_file) in cmdline
        models = f"{replica.base_url}/v1/models"
        assert httpx.get(models, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(models).status_code == 401
        admin = httpx.get(f"{replica.base_url}/admin/faults", headers={"Authorization": f"Bearer {ADMIN}"})
        assert admin.status_code == 200
    finally:
        replica.stop()
    log = replica.log_path.read_text()
    assert "--admin-token on the command line can be read by every user" in log
    assert "--api-key on the command line" not in log and KEY not in log
