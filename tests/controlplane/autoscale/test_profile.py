"""The replica profile: its step-time model, its fit, and the profile the control plane picks.

The shipped profile was written by ``controlplane calibrate`` on the development machine: its calibration
and held-out points are real timings of a replica, so fitting them again must give the shipped
coefficients, and the fit must predict every held-out point within the bound the calibration keeps.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from controlplane.autoscale.calibrate import CalibrationPlan
from controlplane.autoscale.profile import (
    HELD_OUT_BOUND,
    ProfilePoint,
    ReplicaProfile,
    attention_pairs,
    fit,
    load_profile,
    load_reference_profile,
    refit,
    resolve_profile_path,
)

COEFFICIENTS = ("step_base_s", "per_seq_s", "per_prefill_token_s", "per_context_token_s",
                "per_prefill_pair_s")
TRUE = ReplicaProfile(step_base_s=0.004, per_seq_s=0.0004, per_prefill_token_s=0.00015,
                      per_context_token_s=2e-7, per_prefill_pair_s=6e-8, start_s=3.0)


def synthetic_points(profile: ReplicaProfile) -> list[ProfilePoint]:
    prefills = [ProfilePoint(0, n, 0, profile.step_time(num_decode=0, num_prefill_tokens=n, context_tokens=0))
                for n in (64, 256, 512, 1024)]
    decodes = [ProfilePoint(b, 0, b * c, profile.step_time(num_decode=b, num_prefill_tokens=0,
                                                           context_tokens=b * c))
               for b in (1, 4, 16, 48) for c in (128, 1024)]
    return prefills + decodes


def test_attention_pairs_count_what_a_chunk_attends() -> None:
    assert attention_pairs(1) == 1 and attention_pairs(3) == 6  # 1 + 2 + 3
    # a prompt prefilled in two chunks attends the same pairs as in one
    assert attention_pairs(600) + attention_pairs(400, before=600) == attention_pairs(1000)


def test_prefill_is_super_linear_and_decode_grows_with_context() -> None:
    per_token = [TRUE.step_time(num_decode=0, num_prefill_tokens=n, context_tokens=0) / n
                 for n in (256, 1024)]
    assert per_token[1] > per_token[0] > TRUE.per_prefill_token_s
    short, long = (TRUE.step_time(num_decode=16, num_prefill_tokens=0, context_tokens=16 * c)
                   for c in (128, 1024))
    assert long > short


def test_fit_recovers_the_coefficients_of_exact_points() -> None:
    fitted = fit(synthetic_points(TRUE), start_s=3.0)
    for name in COEFFICIENTS:
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=1e-3), name
    assert fitted.fit_error().calibration_max < 1e-3


def test_fit_error_is_reported_on_points_it_never_saw() -> None:
    held = [ProfilePoint(8, 0, 8 * 512, TRUE.step_time(num_decode=8, num_prefill_tokens=0,
                                                       context_tokens=8 * 512) * 1.3)]  # 30% slower
    error = fit(synthetic_points(TRUE), held, start_s=3.0).fit_error()
    assert error.held_out_max == pytest.approx(0.3 / 1.3, rel=1e-2)  # predicted 1.0 of a measured 1.3
    assert "held out" in error.describe()


@pytest.mark.parametrize("load", [load_profile, load_reference_profile], ids=["fallback", "reference"])
def test_the_shipped_profile_is_a_calibration_within_its_bound_on_held_out_points(
        load: Callable[[], ReplicaProfile]) -> None:
    """Both shipped profiles: the fallback the control plane runs on before `controlplane calibrate`, and
    the reference replica the policy benchmarks' traffic is sized for."""
    shipped = load()
    assert shipped.held_out, "no held-out point in the shipped profile: `controlplane calibrate` writes them"
    assert len(shipped.points) >= 5 and shipped.start_s > 0 and shipped.kv_capacity_tokens > 0
    again = refit(shipped)
    for name in COEFFICIENTS:
        assert getattr(again, name) == pytest.approx(getattr(shipped, name), rel=1e-6, abs=1e-12), name
    error = shipped.fit_error()
    assert error.held_out_max is not None and error.held_out_max <= HELD_OUT_BOUND, error.describe()
    # the form follows the engine: decode attention reads the context, so the fit gives it a cost
    assert shipped.per_context_token_s > 0


def test_the_fallback_was_measured_on_the_replica_the_fleet_runs_by_default() -> None:
    """CPU replicas decode with the C++ kernel and pack their linear weights unless told not to, so the
    profile a control plane runs on before `controlplane calibrate` must be such a replica's: the torch
    path's is 1.3-2x slower, and an uncalibrated fleet sized on it over-provisions by that much."""
    assert load_profile().source.endswith(", CPU decode kernel, packed weights"), load_profile().source
    assert load_profile() != load_reference_profile()


def test_a_profile_written_before_the_attention_term_still_loads(tmp_path: Path) -> None:
    old = {"step_base_s": 0.003, "per_seq_s": 0.0004, "per_prefill_token_s": 0.0002,
           "per_context_token_s": 1e-7, "start_s": 3.5,
           "points": [{"num_decode": 0, "num_prefill_tokens": 64, "context_tokens": 0, "seconds": 0.016}]}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    profile = load_profile(path)
    assert profile.per_prefill_pair_s == 0 and profile.points[0].prefill_pairs == attention_pairs(64)
    assert profile.fit_error().held_out_max is None


def test_the_control_plane_runs_on_the_configured_then_the_calibrated_then_the_shipped_profile(
        tmp_path: Path) -> None:
    assert resolve_profile_path("", tmp_path) == ""  # nothing calibrated: the shipped one
    calibrated = tmp_path / "replica_profile.json"
    calibrated.write_text(json.dumps(replace(TRUE, points=()).to_json()))
    assert resolve_profile_path("", tmp_path) == str(calibrated)
    assert resolve_profile_path("/etc/elsewhere.json", tmp_path) == "/etc/elsewhere.json"
    assert load_profile(resolve_profile_path("", tmp_path)).per_prefill_pair_s == TRUE.per_prefill_pair_s


def test_a_fleet_without_the_kernel_falls_back_on_the_torch_paths_profile(tmp_path: Path) -> None:
    """Uncalibrated, a fleet told to run without the CPU decode kernel is sized on the shipped reference
    (the torch path's calibration), not on the kernel's faster fallback, which would under-provision it."""
    torch_path = resolve_profile_path("", tmp_path, cpu_decode_kernel=False)
    assert load_profile(torch_path) == load_reference_profile()
    assert "CPU decode kernel" not in load_profile(torch_path).source
    assert resolve_profile_path("", tmp_path, cpu_decode_kernel=True) == ""  # the kernel's: the fallback
    assert resolve_profile_path("", tmp_path, cpu_decode_kernel=None) == ""
    # nor a fleet whose replicas run torch's linear: the shipped profile's replicas pack their weights
    assert "packed weights" in load_profile().source
    assert resolve_profile_path("", tmp_path, packed_weights=False) == torch_path
    assert resolve_profile_path("", tmp_path, packed_weights=True) == ""
    calibrated = tmp_path / "replica_profile.json"
    calibrated.write_text(json.dumps(replace(TRUE, points=()).to_json()))
    assert resolve_profile_path("", tmp_path, cpu_decode_kernel=False) == str(calibrated)  # the host's wins


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> list[CalibrationPlan]:
    """The plans ``controlplane calibrate`` would measure, each stopped before it starts a replica."""
    from controlplane.autoscale import calibrate as calibration

    seen: list[CalibrationPlan] = []

    def stop_at_the_plan(plan: CalibrationPlan) -> None:
        seen.append(plan)
        raise SystemExit(9)

    monkeypatch.setattr(calibration, "calibrate_with_bar", stop_at_the_plan)
    return seen


def test_calibrate_measures_the_replica_the_config_runs(tmp_path: Path, plans: list[CalibrationPlan]) -> None:
    """``controlplane calibrate --config FILE`` starts its replica as that file's fleet would: with
    ``[fleet] cpu_decode_kernel = true``, the C++ decode kernel (or with ``--cpu-decode-kernel``); with
    ``false`` (or ``--no-cpu-decode-kernel``), the torch path; unset, the replica's default."""
    from controlplane.autoscale import calibrate as calibration
    from controlplane.cli.main import main
    config = tmp_path / "c.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\n[fleet]\ncpu_decode_kernel = true\n')
    plain = tmp_path / "plain.toml"
    plain.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    off = tmp_path / "off.toml"
    off.write_text(f'state_dir = "{tmp_path / "state"}"\n[fleet]\ncpu_decode_kernel = false\n')
    for args in (["--config", str(config)], ["--config", str(plain), "--cpu-decode-kernel"],
                 ["--config", str(plain)], ["--config", str(off)],
                 ["--config", str(config), "--no-cpu-decode-kernel"]):
        with pytest.raises(SystemExit):
            main(["calibrate", "--quick", *args])
    assert [p.cpu_decode_kernel for p in plans] == [True, True, None, False, False]
    with_kernel = ["--num-threads", "1", "--cpu-decode-kernel"]
    without = ["--num-threads", "1", "--no-cpu-decode-kernel"]
    assert [calibration.replica_args(p) for p in plans] == [with_kernel, with_kernel, ["--num-threads", "1"],
                                                            without, without]
    # the kernel is built (or found built) before the replica's start is timed, unless it is not run
    build = [sys.executable, "-m", "inference", "kernel"]
    assert [calibration.kernel_build_command(p) for p in plans] == [build, build, build, None, None]


def test_calibrate_packs_the_replica_s_weights_as_the_config_says(tmp_path: Path,
                                                                  plans: list[CalibrationPlan]) -> None:
    """``[fleet] packed_weights`` (or ``--[no-]packed-weights``) reaches the calibrated replica's flags;
    unset, the replica's default (packed where it applies)."""
    from controlplane.autoscale import calibrate as calibration
    from controlplane.cli.main import main
    off = tmp_path / "off.toml"
    off.write_text(f'state_dir = "{tmp_path / "state"}"\n[fleet]\npacked_weights = false\n')
    plain = tmp_path / "plain.toml"
    plain.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    for args in (["--config", str(off)], ["--config", str(plain)],
                 ["--config", str(off), "--packed-weights"]):
        with pytest.raises(SystemExit):
            main(["calibrate", "--quick", *args])
    assert [p.packed_weights for p in plans] == [False, None, True]
    assert [calibration.replica_args(p)[2:] for p in plans] == [["--no-packed-weights"], [],
                                                                ["--packed-weights"]]


def test_calibrate_measures_under_the_fleets_cpu_limit_and_the_profile_keeps_it(
        tmp_path: Path, plans: list[CalibrationPlan]) -> None:
    """``[fleet] replica_cpu_limit`` (or ``--cpu-limit``) reaches the calibrated replica's flags, and the
    profile says what it was measured under, through its JSON; a limit under 0.1 is a one-line refusal."""
    from controlplane.autoscale import calibrate as calibration
    from controlplane.cli.main import main
    limited = tmp_path / "limited.toml"
    limited.write_text(f'state_dir = "{tmp_path / "state"}"\n[fleet]\nreplica_cpu_limit = 0.75\n')
    plain = tmp_path / "plain.toml"
    plain.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    for args in (["--config", str(limited)], ["--config", str(plain), "--cpu-limit", "0.5"],
                 ["--config", str(plain)]):
        with pytest.raises(SystemExit):
            main(["calibrate", "--quick", *args])
    assert [p.cpu_limit for p in plans] == [0.75, 0.5, None]
    assert calibration.replica_args(plans[0])[-2:] == ["--cpu-limit", "0.75"]
    assert "--cpu-limit" not in calibration.replica_args(plans[2])
    assert main(["calibrate", "--config", str(plain), "--cpu-limit", "0.05"]) == 2
    assert len(plans) == 3  # refused before measuring
    measured = replace(TRUE, cpu_limit=0.75)
    assert ReplicaProfile.from_json(json.loads(json.dumps(measured.to_json()))).cpu_limit == 0.75
    older = {k: v for k, v in TRUE.to_json().items() if k != "cpu_limit"}  # profiles from before the field
    assert ReplicaProfile.from_json(older).cpu_limit is None
