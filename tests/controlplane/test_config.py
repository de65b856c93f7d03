"""The configuration's [chaos] section: the extra hosts experiments may reach are checked at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.config import ConfigError, load_config


def test_experiment_hosts_are_read_and_a_malformed_one_fails_at_start(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[chaos]\nexperiment_hosts = ["status.example.com", "10.0.0.5:9100", "[::1]:9090"]\n')
    assert load_config(good).chaos.experiment_hosts == ["status.example.com", "10.0.0.5:9100", "[::1]:9090"]
    assert load_config().chaos.experiment_hosts == []  # by default: the control plane's own hosts only
    bad = tmp_path / "bad.toml"
    bad.write_text('[chaos]\nexperiment_hosts = ["http://evil.example/path"]\n')
    with pytest.raises(ConfigError, match=r"chaos\.experiment_hosts\[0\]: not a host or host:port"):
        load_config(bad)
