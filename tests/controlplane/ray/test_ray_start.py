"""``[fleet] backend = "ray"`` fails at start, in one line, when it cannot run: Ray not installed, or no
cluster at the address. Bad values of the Ray keys fail as every config error does. No lab needed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from controlplane.config import ConfigError, load_config
from inference.launcher import free_port

pytestmark = [pytest.mark.exclusive, pytest.mark.timeout(120)]


def up(tmp_path: Path, fleet: str,
       env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    config = tmp_path / "ray.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\n[api]\nport = {free_port()}\n[gateway]\nport = '
                      f'{free_port()}\n[console]\nenabled = false\n[fleet]\nbackend = "ray"\n{fleet}\n')
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "controlplane", "up", "--config", str(config)],
                          capture_output=True, text=True, timeout=90, env={**os.environ, **(env or {})})
    return done, time.monotonic() - started


def test_an_unreachable_cluster_fails_up_at_once_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="unavailable: Ray is not installed")
    address = f"ray://127.0.0.1:{free_port()}"  # nothing listens there: refused at once, on loopback only
    done, seconds = up(tmp_path, f'ray_address = "{address}"')
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"controlplane: unavailable: the Ray cluster at {address} does not answer:")
    assert "Traceback" not in done.stderr
    assert seconds < 30


def test_a_missing_ray_package_fails_up_in_one_line(tmp_path: Path) -> None:
    shadow = tmp_path / "no-ray"  # a `ray` that cannot be imported, ahead of the installed one
    (shadow / "ray").mkdir(parents=True)
    (shadow / "ray" / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    done, _ = up(tmp_path, 'ray_address = "auto"', env={"PYTHONPATH": f"{shadow}:{os.getcwd()}"})
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "controlplane: unavailable: fleet.backend = \"ray\" needs the ray package (pip install '.[ray]')")


@pytest.mark.parametrize(("line", "error"), [
    ('backend = "kubernetes"', "fleet.backend: must be one of local, ray"),
    ('ray_address = "10.0.0.1:6379"', "fleet.ray_address: must be auto, local or ray://host:port"),
    ('on_node_loss = "move"', "fleet.on_node_loss: must be one of stay, spill"),
    ("ray_num_gpus = -1", "fleet.ray_num_gpus: must be >= 0"),
])
def test_a_bad_ray_setting_names_its_key(tmp_path: Path, line: str, error: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(f"[fleet]\n{line}\n")
    with pytest.raises(ConfigError, match=error):
        load_config(config)


def test_the_ray_settings_are_read(tmp_path: Path) -> None:
    config = tmp_path / "good.toml"
    config.write_text('[fleet]\nbackend = "ray"\nray_address = "ray://10.199.0.2:10001"\n'
                      'on_node_loss = "spill"\nray_num_npus = 1\n')
    fleet = load_config(config).fleet
    assert (fleet.backend, fleet.ray_address, fleet.on_node_loss, fleet.ray_num_npus) == \
        ("ray", "ray://10.199.0.2:10001", "spill", 1.0)
    assert load_config().fleet.backend == "local" and load_config().fleet.on_node_loss == "stay"
