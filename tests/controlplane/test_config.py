"""The configuration: the [chaos] section's extra hosts and the [simulator] section are checked at start."""

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


def test_the_what_if_priority_is_idle_by_default_low_on_request_and_nothing_else(tmp_path: Path) -> None:
    assert load_config().simulator.cpu_priority == "idle"
    low = tmp_path / "low.toml"
    low.write_text('[simulator]\ncpu_priority = "low"\n')
    assert load_config(low).simulator.cpu_priority == "low"
    bad = tmp_path / "bad.toml"
    bad.write_text('[simulator]\ncpu_priority = "realtime"\n')
    with pytest.raises(ConfigError, match=r"bad\.toml: simulator\.cpu_priority: must be one of idle, low, "
                                          r"got 'realtime'"):
        load_config(bad)
