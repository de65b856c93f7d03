"""The parts of ``python -m controlplane.bench sim-vs-live`` that need no live fleet: the live config carries
the simulator's autoscaler exactly, the live figures are computed as the simulator computes its own, and the
run's profile drift and the diagnostic simulation at that drift."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from controlplane.autoscale.profile import ReplicaProfile, load_profile
from controlplane.bench.host_cpu import DataPathProbe, engine_cpu_s
from controlplane.bench.live_slice import Slice, write_config
from controlplane.bench.live_speed import host_speed, run_drift, run_share, speed_at
from controlplane.bench.sim_vs_live import engine_seconds, fitting_compress, profile_path
from controlplane.bench.sim_vs_live_report import (
    Side,
    fleet_capacity,
    format_report,
    integrate,
    live_side,
    outcome,
    replica_starts,
    verdicts,
)
from controlplane.client import Decision, DecisionInputs
from controlplane.config import load_config
from controlplane.sim.policies import autoscaler_config
from controlplane.sim.settings import PolicySpec, SimSettings, Slo
from controlplane.sim.simulator import p95, simulate
from controlplane.sim.trace import SimRequest, azure_trace
from controlplane.views import Event
from inference.bench.datasets import AZURE_TRACE
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
    # while the probe runs the autoscaler only observes; nothing else differs
    config, _, _ = write_config(tmp_path, wanted, observe_only=True)
    assert load_config(config).autoscaler == dataclasses.replace(wanted, observe_only=True)
    assert load_config(config).fleet.replica_cpu_limit is None
    # a profile measured under a CPU limit: the live replicas run under the same one
    config, _, _ = write_config(tmp_path, wanted, cpu_limit=0.75)
    assert load_config(config).fleet.replica_cpu_limit == 0.75


def test_the_probe_counts_what_runs_beside_the_replicas_per_request() -> None:
    probe = DataPathProbe(200, 12.0, {"control plane": 0.2, "replicas": 20.0, "gateway": 1.0,
                                      "load client": 2.4, "rest of the host": 0.5, "available": 24.0})
    assert probe.cpu_per_request_s == pytest.approx(3.6 / 200)  # not the replicas' nor the rest's
    assert "gateway 5.0, load client 12.0, control plane 1.0: 18.0 ms beside the replicas' engines" \
        in probe.describe()
    assert DataPathProbe(0, 1.0, {}).cpu_per_request_s == 0.0
    # with the engines' CPU read from the replicas' counters, their servers' share counts beside them
    served = dataclasses.replace(probe, engine_cpu_s=16.0)
    assert served.server_core_s == pytest.approx(4.0)
    assert served.cpu_per_request_s == pytest.approx((3.6 + 4.0) / 200)
    assert "control plane 1.0, replica servers 20.0: 38.0 ms" in served.describe()
    assert dataclasses.replace(probe, engine_cpu_s=25.0).server_core_s == 0.0  # never below nothing
    # replicas under a CPU limit pay for their servers within it (their profile was measured so): reported,
    # not taken from the host's cores
    limited = dataclasses.replace(served, servers_within_limit=True)
    assert limited.cpu_per_request_s == pytest.approx(3.6 / 200)
    assert "replica servers 20.0 (within the replicas' CPU limit: not counted): 18.0 ms" in limited.describe()


def test_the_engines_cpu_counts_their_turns_at_their_steps_share_on_a_core() -> None:
    """10 busy seconds, 2 of them turns between steps, 6 CPU seconds within the 8 of steps: the turns
    ran on a core at the same 75%, 7.5 CPU seconds in all."""
    assert engine_cpu_s((1.0, 5.0, 1.0), (7.0, 15.0, 3.0)) == pytest.approx(7.5)
    assert engine_cpu_s((0.0, 0.0, 0.0), (0.0, 0.0, 0.0)) == 0.0  # an idle engine


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


def test_a_workdir_holding_an_earlier_run_is_refused_before_anything_starts(tmp_path: Path) -> None:
    earlier = tmp_path / "run"
    (earlier / "state").mkdir(parents=True)
    (earlier / "load.jsonl").write_text("{}\n")
    run = subprocess.run([sys.executable, "-m", "controlplane.bench", "sim-vs-live", "--calibrate",
                          "--workdir", str(earlier)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"--workdir: {earlier} is not an empty folder" in run.stderr and len(run.stderr.splitlines()) == 1
    assert sorted(p.name for p in earlier.iterdir()) == ["load.jsonl", "state"]  # nothing calibrated there


def _decision(current: int, drift: dict[str, float] | None) -> Decision:
    inputs = DecisionInputs(current=current, ready=current, starting=0, metrics={}, profile_drift=drift)
    return Decision(at=0.0, mode="active", inputs=inputs, proposals=(), final=current, applied=False,
                    outcome="")


def test_the_runs_drift_weighs_each_decisions_window_by_its_engine_time() -> None:
    decisions = [_decision(1, None),  # too idle to judge
                 _decision(1, {"ratio": 1.5, "busy_s_per_s": 0.3, "predicted_s_per_s": 0.2}),
                 _decision(3, {"ratio": 2.5, "busy_s_per_s": 2.5, "predicted_s_per_s": 1.0})]
    assert run_drift(decisions) == pytest.approx(2.8 / 1.2)
    assert run_drift([d for d in decisions if d.inputs.current <= 2]) == pytest.approx(1.5)
    assert run_drift(decisions[:1]) is None


def test_the_runs_shares_of_step_time_weigh_each_decision_by_its_engine_time() -> None:
    decisions = [_decision(1, {"ratio": 1.5, "busy_s_per_s": 0.5, "predicted_s_per_s": 0.4, "on_cpu": 1.0}),
                 _decision(2, {"ratio": 2.0, "busy_s_per_s": 1.5, "predicted_s_per_s": 0.75, "on_cpu": 0.6,
                               "waiting_core": 0.3}),
                 _decision(2, {"ratio": 2.0, "busy_s_per_s": 1.5, "predicted_s_per_s": 0.75}),  # not counted
                 _decision(1, None)]
    assert run_share(decisions, "on_cpu") == pytest.approx((0.5 * 1.0 + 1.5 * 0.6) / 2.0)
    assert run_share(decisions, "waiting_core") == pytest.approx(0.3)  # the one decision that had it
    assert run_share(decisions[2:], "on_cpu") is None


def test_the_hosts_speed_takes_the_core_sharing_out_of_each_windows_drift() -> None:
    decisions = [_decision(1, {"ratio": 1.5, "busy_s_per_s": 0.6, "predicted_s_per_s": 0.4}),
                 _decision(3, {"ratio": 2.4, "busy_s_per_s": 3.0, "predicted_s_per_s": 1.25}),
                 _decision(1, None)]
    decisions = [dataclasses.replace(d, at=100.0 + 5 * i) for i, d in enumerate(decisions)]
    # three replicas busy 3.0 s/s on 2 cores run 1.5x slower by the sharing alone: the host ran at 1.6
    speed = host_speed(decisions, window_s=30.0, cores=2)
    assert speed == [(85.0, 1.5), (90.0, pytest.approx(1.6))]
    at = speed_at(speed, t0=80.0)
    assert [at(0.0), at(5.0), at(9.9), at(10.0), at(500.0)] == [1.5, 1.5, 1.5, pytest.approx(1.6),
                                                               pytest.approx(1.6)]


def test_the_diagnostic_steps_the_replicas_at_the_hosts_speed_and_sizes_on_the_profile() -> None:
    profile = load_profile()
    slower = dataclasses.replace(profile, **{name: getattr(profile, name) * 1.5 for name in (
        "step_base_s", "per_seq_s", "per_prefill_token_s", "per_context_token_s", "per_prefill_pair_s")})
    requests = [SimRequest(i, i * 0.5, 200, 40) for i in range(40)]
    settings = SimSettings(min_replicas=1, initial_replicas=1, max_replicas=1)
    # a fixed fleet sizes nothing: the replicas' speed alone moves the result
    fixed = PolicySpec.parse("static:1")
    at_speed = simulate(requests, fixed, profile=profile, settings=settings, speed=lambda now: 1.5)
    on_slower = simulate(requests, fixed, profile=slower, settings=settings)
    assert at_speed.to_json() | {"wall_s": 0} == on_slower.to_json() | {"wall_s": 0}
    at_profile = simulate(requests, fixed, profile=profile, settings=settings)
    assert at_speed.ttft_p95_s is not None and at_profile.ttft_p95_s is not None
    assert at_speed.ttft_p95_s > at_profile.ttft_p95_s


def test_a_slice_that_never_scales_does_not_pass_as_a_check_of_the_autoscaler() -> None:
    """Equal figures from one replica on both sides compare a static fleet: the verdict says to raise
    --compress, and the bench's exit status (all verdicts) follows it."""
    still = Side(100, 0.99, 0.2, 0.02, 300.0, 0)
    judged = verdicts(still, still)
    assert all(ok for name, (ok, _) in judged.items() if name != "scaled")
    assert judged["scaled"] == (False, "live 0, simulated 0 scale events (target: both scale; raise "
                                       "--compress where one replica serves the slice)")
    assert "scaled: NOT MET" in format_report(still, still, judged)
    scaled = dataclasses.replace(still, scale_events=1)
    assert verdicts(scaled, scaled)["scaled"][0]
    assert not verdicts(scaled, still)["scaled"][0]


def test_a_slice_the_fleet_cannot_serve_is_called_overloaded_with_a_compression_that_fits() -> None:
    """2026-12-06's default run: 498 engine-seconds in 300 s for two unlimited replicas on two cores, 17.7 ms
    of other CPU per request over 7,869 requests; under a limit of 0.75 a core at 2.7x, 382 of 450."""
    over = fleet_capacity(498, span_s=300, compress=5, max_replicas=2, cpu_limit=None, host_cores=2,
                          beside_core_s=0.0177 * 7869)
    assert over.core_s == pytest.approx(600 - 139.3, abs=0.1) and over.load > 1
    warning = over.warning()
    assert warning is not None and "(108%): both sides overload" in warning
    assert "about --compress 3.7 loads it 80%" in warning
    fits = fleet_capacity(382, span_s=300, compress=2.7, max_replicas=2, cpu_limit=0.75, host_cores=2,
                          beside_core_s=0.026 * 3975)
    assert fits.core_s == pytest.approx(450) and fits.warning() is None  # the limits, not the host, bound it


def test_the_default_compression_asks_four_fifths_of_what_the_fleet_can_give() -> None:
    """Chosen after the probe: more of the trace in the same replay asks more engine time and more CPU
    beside the replicas; the choice loads the fleet at its bound 80%, under a CPU limit as without one."""
    profile = load_profile()
    cut = Slice(0.0, 300.0, 5.0, 0.25, profile.max_model_len * 3 // 4, profile.max_model_len // 4)

    def load(compress: float, limited: ReplicaProfile) -> float:
        requests = azure_trace(AZURE_TRACE, dataclasses.replace(cut, compress=compress).shape())
        return fleet_capacity(engine_seconds(limited, requests), span_s=300.0, compress=compress,
                              max_replicas=2, cpu_limit=limited.cpu_limit, host_cores=2,
                              beside_core_s=0.02 * len(requests)).load

    for limited in (profile, dataclasses.replace(profile, cpu_limit=0.75)):
        fitted = fitting_compress(limited, cut, max_replicas=2, host_cores=2, cpu_per_request_s=0.02)
        assert 0.5 < fitted < 20.0
        assert load(fitted - 0.1, limited) < 0.8 <= load(fitted + 0.1, limited) + 1e-9
    unlimited = fitting_compress(profile, cut, max_replicas=2, host_cores=2, cpu_per_request_s=0.02)
    assert fitting_compress(dataclasses.replace(profile, cpu_limit=0.75), cut, max_replicas=2, host_cores=2,
                            cpu_per_request_s=0.02) < unlimited  # less CPU to give: a lighter slice


def test_a_replica_start_counts_from_the_scale_up_to_that_replica_ready() -> None:
    def event(i: int, ts: float, kind: str, subject: str, **detail: int) -> Event:
        return Event(i, ts, kind, subject, detail)

    events = [
        # the first replica, before the load
        event(1, 90.0, "replica.spawned", "az-a-1"), event(2, 93.0, "replica.ready", "az-a-1"),
        event(3, 146.0, "fleet.scaled", "fleet", **{"from": 1, "to": 3}),
        event(4, 146.3, "replica.spawned", "az-b-1"), event(5, 146.4, "replica.spawned", "az-c-1"),
        event(6, 150.0, "replica.restarted", "az-a-1"), event(7, 150.1, "replica.ready", "az-a-1"),  # not new
        event(8, 151.9, "replica.ready", "az-c-1"), event(9, 152.1, "replica.ready", "az-b-1"),
        event(10, 200.0, "fleet.scaled", "fleet", **{"from": 3, "to": 2}),  # a scale-down adds none
        event(11, 260.0, "fleet.scaled", "fleet", **{"from": 2, "to": 3}),
        event(12, 260.2, "replica.spawned", "az-a-2"),  # never ready before the run ended: left out
    ]
    starts = replica_starts(list(reversed(events)), since=100.0)  # the API's order does not matter
    assert starts == pytest.approx([6.1, 5.9])  # az-b-1, then az-c-1, each from the decision at 146 s
    assert replica_starts(events, since=147.0) == []  # only scale-ups after the load's start
