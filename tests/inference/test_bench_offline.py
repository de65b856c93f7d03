"""The offline benchmark runs all three paths on the default model and reports self-consistent figures.

One small run (4 short requests; the one-at-a-time baseline on the first 2) feeds every claim about the
result's structure. No claim is about speed: the figures depend on the machine and its load.
"""

from __future__ import annotations

import json
import random

import pytest

from inference.bench.offline import (
    ENGINE,
    HF_ONE,
    HF_STATIC,
    TARGETS,
    OfflineConfig,
    OfflineResult,
    WorkloadSpec,
    format_result,
    left_pad,
    make_workload,
    run_offline,
)
from inference.bench.roofline import RooflineConfig, mean_decode_context
from inference.config import EngineConfig

pytest.importorskip("transformers")

TINY = WorkloadSpec(num_requests=4, min_prompt_len=8, max_prompt_len=40, min_output_len=4, max_output_len=12)
HF_SUBSET = 2


@pytest.fixture(scope="module")
def result() -> OfflineResult:
    config = OfflineConfig(workload=TINY, engine=EngineConfig(device="cpu"), repeats=2,
                           hf_one_at_a_time_requests=HF_SUBSET,
                           roofline=RooflineConfig(copy_mib=32, gemm_size=256, repeats=2),
                           show_progress=False)
    return run_offline(config)


def test_every_path_counts_exactly_the_requested_output_tokens(result: OfflineResult) -> None:
    assert len(result.output_lens) == TINY.num_requests
    assert [p.name for p in result.paths] == [ENGINE, HF_ONE, HF_STATIC]
    engine, one, static = result.paths
    assert (engine.num_requests, engine.num_output_tokens) == (4, sum(result.output_lens))
    assert (one.num_requests, one.num_output_tokens) == (HF_SUBSET, sum(result.output_lens[:HF_SUBSET]))
    assert (static.num_requests, static.num_output_tokens) == (4, sum(result.output_lens))
    # one batch of 4 runs every row to the longest output; only the requested tokens are useful
    assert static.num_generated_tokens == 4 * max(result.output_lens)


def test_tokens_per_second_are_positive_and_ratios_divide_them(result: OfflineResult) -> None:
    for path in result.paths:
        assert path.seconds > 0 and path.tokens_per_s > 0
        assert path.tokens_per_s == pytest.approx(path.num_output_tokens / path.seconds)
        for base in result.baselines:
            ratio = result.ratio(path.name, base.name)
            assert ratio == pytest.approx(path.tokens_per_s / base.tokens_per_s)
    assert result.ratio(HF_ONE, HF_ONE) == pytest.approx(1.0)
    chained = result.ratio(ENGINE, HF_STATIC) * result.ratio(HF_STATIC, HF_ONE)  # type: ignore[operator]
    assert result.ratio(ENGINE, HF_ONE) == pytest.approx(chained)


def test_targets_judge_the_engine_ratio_against_each_baseline(result: OfflineResult) -> None:
    assert [(t.baseline, t.required_ratio) for t in result.targets] == list(TARGETS)
    for target in result.targets:
        assert target.ratio == result.ratio(ENGINE, target.baseline)
        assert target.passed == (target.ratio >= target.required_ratio)  # type: ignore[operator]


def test_roofline_numbers_are_positive_and_add_up(result: OfflineResult) -> None:
    r = result.roofline
    assert r is not None
    assert r.rates.bandwidth_bytes_per_s > 0
    assert r.rates.square_gemm.gflops > 0 and r.rates.decode_gemm.gflops > 0
    assert r.cost.num_params > 0 and 0 < r.cost.streamed_weight_bytes <= r.cost.weight_bytes
    assert r.cost.kv_bytes_per_token > 0
    assert r.observed.num_steps > 0 and r.observed.mean_seconds > 0
    assert 1 <= r.observed.mean_batch <= TINY.num_requests
    assert r.mean_context >= TINY.min_prompt_len
    assert r.memory_seconds == pytest.approx(r.weights_seconds + r.kv_seconds)
    assert r.bound_seconds == max(r.memory_seconds, r.compute_seconds) > 0
    assert r.percent_of_bound == pytest.approx(100 * r.bound_seconds / r.observed.mean_seconds)


def test_printed_report_and_json_carry_the_figures(result: OfflineResult) -> None:
    text = format_result(result)
    assert f"first {HF_SUBSET} of {TINY.num_requests} requests" in text
    assert "engine >= 2x HF static batches of 16:" in text and "engine >= 8x HF one at a time:" in text
    assert "% of the bound" in text
    data = json.loads(json.dumps(result.to_dict()))
    assert [p["name"] for p in data["paths"]] == [ENGINE, HF_ONE, HF_STATIC]
    assert data["paths"][0]["ratios"][HF_ONE] == pytest.approx(result.ratio(ENGINE, HF_ONE))
    assert data["roofline"]["derived"]["bound_seconds"] > 0


def test_workload_is_seeded_in_range_and_free_of_special_tokens() -> None:
    spec = WorkloadSpec(num_requests=50, seed=7)
    special = {0, 1, 2, 3}
    requests = make_workload(spec, vocab_size=40, special_ids=special)
    assert requests == make_workload(spec, vocab_size=40, special_ids=special)
    other_seed = WorkloadSpec(num_requests=50, seed=8)
    assert requests != make_workload(other_seed, vocab_size=40, special_ids=special)
    for r in requests:
        assert spec.min_prompt_len <= len(r.prompt_token_ids) <= spec.max_prompt_len
        assert spec.min_output_len <= r.output_len <= spec.max_output_len
        assert all(4 <= t < 40 for t in r.prompt_token_ids)


def test_mean_decode_context_averages_over_decoded_tokens() -> None:
    # prompt 10, 3 outputs: decode steps attend to 11 and 12; a 1-token request has no decode step
    assert mean_decode_context([(10, 3), (5, 1)]) == pytest.approx(11.5)
    lengths = [(random.Random(i).randint(1, 50), random.Random(-i).randint(1, 20)) for i in range(20)]
    contexts = [p + i for p, n in lengths for i in range(1, n)]
    assert mean_decode_context(lengths) == pytest.approx(sum(contexts) / len(contexts))
    assert mean_decode_context([]) == 0.0


def test_left_pad_puts_prompts_flush_right_under_the_mask() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
