"""A child's environment: this process's, less every secret, plus what the child is meant to get."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from inference.environment import child_environment
from inference.launcher import replica_environment

SECRETS = {"CONTROLPLANE_ADMIN_TOKEN": "adm-1", "CONTROLPLANE_ADMIN_PASSWORD": "pw-2",
           "CONTROLPLANE_TOKEN": "op-3", "CONTROLPLANE_USERS": "ana:admin:scrypt$x",
           "INFERENCE_ADMIN_TOKEN": "inf-4", "HF_TOKEN": "hf-5", "AWS_SECRET_ACCESS_KEY": "aws-6",
           "OPENAI_API_KEY": "sk-7"}


def test_secrets_are_withheld_and_the_rest_kept() -> None:
    base = {**SECRETS, "PATH": "/usr/bin", "LLMSRE_STATE_DIR": "/var/lib/x", "OMP_NUM_THREADS": "2"}
    env = child_environment(base=base)
    assert env == {"PATH": "/usr/bin", "LLMSRE_STATE_DIR": "/var/lib/x", "OMP_NUM_THREADS": "2"}
    given = child_environment({"INFERENCE_ADMIN_TOKEN": "its-own"}, base=base)
    assert given["INFERENCE_ADMIN_TOKEN"] == "its-own"  # one secret, on purpose


def test_a_spawned_child_holds_no_secret_of_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    printed = subprocess.run([sys.executable, "-c", "import json, os; print(json.dumps(sorted(os.environ)))"],
                             env=replica_environment({"LLMSRE_STATE_DIR": "/tmp/x"}), capture_output=True,
                             text=True, check=True).stdout
    names = set(json.loads(printed))
    assert not set(SECRETS) & names
    assert {"LLMSRE_STATE_DIR", "OMP_WAIT_POLICY"} <= names
