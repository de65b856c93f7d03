"""The evaluation set: the kept files are their recipes, each trace has the shape its recipe promises, and
``python -m controlplane.sim bench --set eval`` prints its table. No test asserts a policy's verdict."""

from __future__ import annotations

import gzip
import statistics
from dataclasses import replace
from functools import cache
from importlib import resources

import pytest

from controlplane.sim.__main__ import main
from controlplane.sim.bench import Verdict, static_replicas
from controlplane.sim.evalset import (
    DATA_FOLDER,
    DATA_PACKAGE,
    NAMES,
    SUFFIX_RANGE,
    SYSTEM_PROMPTS,
    Row,
    decode_rows,
    encode_rows,
    evalset_rows,
    evalset_trace,
    load_evalset,
    minute_counts,
)
from controlplane.sim.settings import SimSettings
from controlplane.sim.simulator import PolicyReport, Timeline
from controlplane.sim.trace import BurstyConfig, TraceShape, synthetic_bursty


@cache
def rows(name: str) -> list[Row]:
    return evalset_rows(name)


def kept_file(name: str) -> bytes:
    return resources.files(DATA_PACKAGE).joinpath(DATA_FOLDER, f"{name}.csv.gz").read_bytes()


# ---- the kept files ----------------------------------------------------------------------------
def test_the_set_holds_the_seven_shapes() -> None:
    assert set(NAMES) == {
        "long-prompt", "code-completion", "long-output", "bursty", "diurnal", "flash-crowd", "shared-prefix"
    }


@pytest.mark.parametrize("name", NAMES)
def test_each_kept_file_equals_its_regenerated_recipe(name: str) -> None:
    kept = decode_rows(kept_file(name))
    assert len(kept) == len(rows(name))
    assert kept == rows(name)


@pytest.mark.parametrize("name", NAMES)
def test_each_trace_spans_the_hour_in_arrival_order_at_trace_scale(name: str) -> None:
    arrivals = [row[0] for row in rows(name)]
    assert arrivals == sorted(arrivals)
    assert 0 <= arrivals[0] < 60 and 3540 < arrivals[-1] < 3600
    assert all(row[1] >= 1 and row[2] >= 1 for row in rows(name))


def test_the_loader_shapes_the_kept_file_as_the_recipe_is_shaped() -> None:
    shape = TraceShape(compress=2.0, token_scale=0.25, duration_s=600, max_prompt_len=1536)
    assert load_evalset("long-prompt", shape) == evalset_trace("long-prompt", shape)
    loaded = load_evalset("long-prompt", shape)
    assert max(r.arrival for r in loaded) < 300 and max(r.prompt_len for r in loaded) == 1536


def test_an_unknown_trace_is_refused_with_the_known_names() -> None:
    with pytest.raises(ValueError, match="long-prompt"):
        load_evalset("nope")


def test_the_same_rows_always_encode_to_the_same_bytes() -> None:
    sample = rows("long-output")[:100]
    assert encode_rows(sample) == encode_rows(sample)
    header = gzip.decompress(encode_rows(sample)).decode().splitlines()[0]
    assert header == "arrival_s,prompt_tokens,output_tokens"
    assert decode_rows(encode_rows(sample)) == sample
    with_prefixes = rows("shared-prefix")[:100]
    header = gzip.decompress(encode_rows(with_prefixes)).decode().splitlines()[0]
    assert header == "arrival_s,prompt_tokens,output_tokens,prefix_id,prefix_tokens"
    assert decode_rows(encode_rows(with_prefixes)) == with_prefixes


def test_the_kept_set_stays_small() -> None:
    assert sum(len(kept_file(name)) for name in NAMES) < 2_000_000  # shared-prefix, 104k rows: 0.76 MB


# ---- each shape as its recipe promises -------------------------------------------------------------
def test_long_prompt_prompts_are_4000_to_8000_tokens_and_outputs_short() -> None:
    prompts = [p for _, p, _ in rows("long-prompt")]
    assert min(prompts) >= 4000 and max(prompts) <= 8000
    assert 100 <= statistics.median(o for _, _, o in rows("long-prompt")) <= 200


def test_code_completion_has_short_outputs_after_long_contexts_and_a_working_day_ramp() -> None:
    assert statistics.median(o for _, _, o in rows("code-completion")) <= 40
    assert max(o for _, _, o in rows("code-completion")) <= 100
    assert all(1500 <= p <= 2500 for _, p, _ in rows("code-completion"))
    per_minute = minute_counts(rows("code-completion"))
    assert statistics.mean(per_minute[30:45]) >= 3 * statistics.mean(per_minute[:8])


def test_long_output_generates_far_more_than_it_reads() -> None:
    assert statistics.median(o for _, _, o in rows("long-output")) >= 800
    assert statistics.median(p for _, p, _ in rows("long-output")) <= 400


def test_bursty_is_the_synthetic_bursty_trace_seed_0() -> None:
    bursty = synthetic_bursty(BurstyConfig(seed=0))
    assert rows("bursty") == [(round(r.arrival, 3), r.prompt_len, r.output_len) for r in bursty]


def test_diurnal_peak_minute_is_at_least_three_times_the_trough() -> None:
    per_minute = minute_counts(rows("diurnal"))
    assert max(per_minute) >= 3 * min(per_minute)
    assert per_minute.index(max(per_minute)) in range(20, 40)  # the peak is mid-hour


def test_flash_crowd_has_a_minute_at_five_times_the_median_rate_for_a_few_minutes() -> None:
    per_minute = minute_counts(rows("flash-crowd"))
    typical = statistics.median(per_minute)
    assert max(per_minute) >= 5 * typical
    crowded = [i for i, n in enumerate(per_minute) if n >= 4 * typical]
    assert 1 <= len(crowded) <= 6 and crowded[-1] - crowded[0] == len(crowded) - 1  # one crowd


def test_shared_prefix_prompts_are_one_of_a_few_system_prompts_plus_a_short_suffix() -> None:
    prefixes = []
    for row in rows("shared-prefix"):
        assert len(row) == 5  # each row names its system prompt
        _, prompt, _, prefix_id, prefix = row
        assert prefix == SYSTEM_PROMPTS[prefix_id - 1]
        assert SUFFIX_RANGE[0] <= prompt - prefix <= SUFFIX_RANGE[1]
        prefixes.append(prefix)
    assert all(prefixes.count(p) >= 0.05 * len(prefixes) for p in SYSTEM_PROMPTS)
    total = sum(row[1] for row in rows("shared-prefix"))
    assert sum(prefixes) >= 0.8 * total  # most prompt tokens are a shared prefix
    assert all(len(row) == 3 for name in NAMES if name != "shared-prefix" for row in rows(name))


def test_counting_prefix_cache_hits_keeps_the_shared_prefix_fleet_to_what_it_computes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ten minutes around the peak (48 requests/s): ours, fed the simulated replicas' prefix hit share,
    against ours priced on whole prompts, as it was before the share was read."""
    from controlplane.autoscale import decide
    from controlplane.autoscale.profile import load_reference_profile
    from controlplane.sim.bench import shape_for
    from controlplane.sim.settings import PolicySpec
    from controlplane.sim.simulator import simulate
    from controlplane.vocabulary import OURS

    profile = load_reference_profile()  # the replica the set's traffic is sized for
    shape = replace(shape_for(1.0, 0.25, profile.max_model_len), start_s=1500.0, duration_s=600.0)
    requests = load_evalset("shared-prefix", shape)
    counted = simulate(requests, PolicySpec(OURS), profile=profile, settings=SimSettings())
    offered_work = decide.offered_work
    monkeypatch.setattr(decide, "offered_work",
                        lambda *a, **k: offered_work(*a, **{**k, "prefix_hit_share": None}))
    whole = simulate(requests, PolicySpec(OURS), profile=profile, settings=SimSettings())
    assert counted.slo_attainment >= 0.99 and whole.slo_attainment >= 0.99
    assert counted.replica_seconds < 0.6 * whole.replica_seconds


# ---- the benchmark over the set ---------------------------------------------------------------
def report(policy: str, attainment: float, replica_seconds: float, duration_s: float = 100.0) -> PolicyReport:
    return PolicyReport(
        policy=policy, num_requests=100, slo_attainment=attainment, replica_seconds=replica_seconds,
        scale_events=0, reversals=0, ttft_p95_s=0.1, tpot_p95_s=0.01, unfinished=0, missed_ttft=0,
        missed_tpot=round(100 * (1 - attainment)), duration_s=duration_s,
        wall_s=0.0, timeline=Timeline([], [], [], [], []),
    )


def test_the_eval_verdict_allows_one_point_below_hpa_and_the_azure_verdict_does_not() -> None:
    ours, hpa = report("ours", 0.985, 80.0), report("hpa", 0.99, 100.0)
    assert Verdict("t", ours, hpa, attainment_slack=0.01).is_met
    assert not Verdict("t", ours, hpa).is_met
    assert not Verdict("t", replace(ours, slo_attainment=0.975), hpa, attainment_slack=0.01).is_met


def test_the_static_baseline_is_the_ceiling_of_hpas_mean_replicas() -> None:
    settings = SimSettings()
    assert static_replicas(report("hpa", 1.0, 250.0), settings) == 3  # 2.5 replicas on average
    assert static_replicas(report("hpa", 1.0, 300.0), settings) == 3
    assert static_replicas(report("hpa", 1.0, 5000.0), settings) == settings.max_replicas


def test_bench_on_the_eval_set_prints_every_policy_for_each_trace(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--set", "eval", "--duration-s", "600", "--only", "long-output", "--only", "flash-crowd"]
    code = main(argv)
    out = capsys.readouterr().out
    assert code in (0, 1)  # the verdict is the policy's business, not this test's
    assert "ours" in out and "hpa" in out and "static:N, N = ceil(HPA mean replicas)" in out
    names = ("long-output", "flash-crowd")
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith(names)}
    assert set(lines) == {"long-output", "flash-crowd"}
    for line in lines.values():
        cells = line.split("|")
        assert len(cells) == 5  # trace and requests, ours, hpa, static, verdict
        assert all(cell.count("%") == 2 for cell in cells[1:4])  # the hour's attainment and its worst 5 min
        for cell in cells[1:4]:
            hour, worst = (float(v.rstrip("%")) for v in cell.split() if v.endswith("%"))
            assert 0 <= worst <= hour <= 100
        assert cells[4].split()[-1] == "MET" or cells[4].strip().endswith("NOT MET")
    assert "target met on" in out


@pytest.mark.parametrize("name", NAMES)
def test_another_draw_is_the_same_shape_with_other_traffic(name: str) -> None:
    """Draw 0 is the kept file; draws 1 and up give other arrivals and lengths of the same recipe, each the
    same every time (``bench --set eval --draw N``: traffic no policy was run on)."""
    drawn = evalset_rows(name, 1)
    assert drawn == evalset_rows(name, 1) and drawn != rows(name) and evalset_rows(name, 0) == rows(name)
    # the same rates: a similar count of requests (bursty's states dwell for random times: within 2x)
    assert 0.5 < len(drawn) / len(rows(name)) < 2.0


def test_bench_on_a_draw_says_so_and_a_negative_draw_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--set", "eval", "--duration-s", "300", "--only", "long-output", "--draw", "2"]
    assert main(argv) in (0, 1)
    assert "evaluation set, draw 2 of the recipes" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--draw: must be >= 0, got -1"):
        main([*argv[:-1], "-1"])


def test_evalset_command_finds_the_kept_files_equal_to_their_recipes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["evalset"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in NAMES) and "differs" not in out
