"""The parts of ``python -m controlplane.bench sim-vs-live`` that need no live fleet: the live config carries
the simulator's autoscaler exactly, and the live figures are computed as the simulator computes its own."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from controlplane.autoscale.profile import load_profile
from controlplane.bench.sim_vs_live import profile_path, write_config
from controlplane.bench.sim_vs_live_report import integrate, live_side, outcome
from controlplane.config import load_config
from controlplane.sim.simulator import SimSettings, Slo, autoscaler_config, p95
from inference.bench.report import RequestRecord


def test_the_live_config_runs_the_simulators_autoscaler_on_the_same_profile(tmp_path: Path) -> None:
    path = profile_path("", tmp_path)  # nothing calibrated there: the shipped profile, by its file
    assert Path(path).is_file() and load_profile(path) == load_profile()
    settings = SimSettings(min_replicas=1, initial_replicas=1, max_replicas=4, host_cores=2)
    wanted = dataclasses.replace(autoscaler_config(load_profile(path), settings), replica_profile=path)
    config, api, gateway = write_config(tmp_path, wanted)
    assert load_config(config).autoscaler == wanted
    raw = tomllib.loads(config.read_text())
    assert raw["fleet"]["replicas"] == 1 and raw["autoscaler"]["enabled"] is True
    assert raw["autoscaler"]["replica_profile"] == path and raw["autoscaler"]["anomaly_enabled"] is False
    assert "tick_s" not in raw["autoscaler"]  # the default: only what differs is written
    assert api.startswith("http://127.0.0.1:") and gateway.startswith("http://127.0.0.1:")


def test_a_calibrated_profile_in_the_state_folder_is_chosen(tmp_path: Path) -> None:
    (tmp_path / "replica_profile.json").write_text("{}")
    assert profile_path("", tmp_path) == str(tmp_path / "replica_profile.json")
    assert profile_path(str(tmp_path / "other.json"), tmp_path) == str(tmp_path / "other.json")


def record(index: int, *, ttft: float | None, tpot: float = 0.01, tokens: int = 11,
           status: int = 200) -> RequestRecord:
    send = float(index)
    r = RequestRecord(index=index, request_id=str(index), prompt_len=100, output_len=tokens,
                      send_time=send, send_wall=1000.0 + send, status=status)
    if ttft is not None:
        r.first_token_time = send + ttft
        r.token_times = [send + ttft + i * tpot for i in range(tokens)]
        r.end_time = r.token_times[-1]
    else:
        r.error_kind, r.end_time = "http_503", send + 1.0
    return r


def test_live_figures_count_failures_as_misses_and_integrate_the_fleet() -> None:
    records = [record(0, ttft=0.5), record(1, ttft=2.0), record(2, ttft=0.2, tpot=0.2), record(3, ttft=None)]
    assert [Slo().is_met(outcome(r)) for r in records] == [True, False, False, False]
    fleet = [(999.5, 1), (1010.0, 2), (1020.0, 1)]  # POSIX seconds; the load started at 1000
    decisions = [(995.0, True, "scaled"), (1009.0, True, "scaled 1 -> 2"), (1012.0, False, "no change")]
    side = live_side(records, fleet, decisions, 30.0, Slo())
    assert side.slo_attainment == 0.25 and side.failed == 1 and side.scale_events == 1
    assert side.replica_seconds == pytest.approx(10 * 1 + 10 * 2 + 10 * 1)
    assert side.ttft_p95_s is None  # a request with no first token is the P95 here
    assert integrate([(0.0, 3)], 5.0) == 15.0 and p95([1.0, 2.0]) == 2.0


def test_calibrate_and_a_named_profile_together_are_refused_before_anything_starts(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "controlplane.bench", "sim-vs-live", "--calibrate",
                          "--profile", str(tmp_path / "p.json"), "--workdir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "give --profile or --calibrate, not both" in run.stderr and len(run.stderr.splitlines()) == 1
    assert not (tmp_path / "run").exists()  # refused before the workdir (or a replica) was made
