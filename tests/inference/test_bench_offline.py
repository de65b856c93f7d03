"""The offline benchmark runs all three paths on the default model and reports self-consistent figures.

One small run (4 short requests; the one-at-a-time baseline on the first 2) feeds every claim about the
result's structure, and one more of the same size on the bundled DeepSeek-V3 (``default-moe``) checks that
its roofline counts latent attention and routed experts. No claim is about speed: the figures depend on
the machine and its load.
"""

from __future__ import annotations

import json
import random
import sys

import pytest

from inference.bench.offline import (
    ENGINE,
    HF_ONE,
    HF_STATIC,
    TARGETS,
    VLLM,
    BenchmarkError,
    OfflineConfig,
    OfflineResult,
    WorkloadSpec,
    format_result,
    left_pad,
    make_workload,
    run_offline,
)
from inference.bench.offline_result import BOUND_TARGET_MIN_BATCH, Agreement
from inference.bench.roofline import ModelCost, RooflineConfig, mean_decode_context
from inference.config import EngineConfig
from inference.step_profile import (
    ATTEND,
    CACHE_WRITE,
    DECODE_LAYERS,
    GATHER,
    LOGITS,
    MODEL_REST,
    PHASES,
    POSTPROCESS,
    PREPARE,
    SAMPLING,
    SCHEDULE,
    StepProfile,
    current,
    lap,
    profiling,
)

pytest.importorskip("transformers")

TINY = WorkloadSpec(num_requests=4, min_prompt_len=8, max_prompt_len=40, min_output_len=4, max_output_len=12)
HF_SUBSET = 2


def tiny_run(model: str, *, repeats: int = 2, hf_subset: int = HF_SUBSET,
             engine: EngineConfig | None = None, skip_hf: bool = False) -> OfflineResult:
    config = OfflineConfig(model=model, workload=TINY, engine=engine or EngineConfig(device="cpu"),
                           repeats=repeats, skip_hf=skip_hf,
                           hf_one_at_a_time_requests=hf_subset,
                           roofline=RooflineConfig(copy_mib=32, gemm_size=256, repeats=2),
                           show_progress=False)
    return run_offline(config)


@pytest.fixture(scope="module")
def result() -> OfflineResult:
    return tiny_run("default")


@pytest.fixture(scope="module")
def torch_path_result() -> OfflineResult:
    """The engine with the CPU decode kernel turned off: attention on torch, in phases of its own."""
    return tiny_run("default", repeats=1, engine=EngineConfig(device="cpu", cpu_decode_kernel=False),
                    skip_hf=True)


@pytest.fixture(scope="module")
def moe_result() -> OfflineResult:
    return tiny_run("default-moe", repeats=1, hf_subset=1)


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
    r = result.roofline
    assert r is not None
    expected_bound = (None if r.observed.mean_batch < BOUND_TARGET_MIN_BATCH
                      else r.percent_of_bound >= 100 / 3)
    assert result.bound_target == expected_bound
    # the command exits 1 when a target is missed
    assert result.missed == (any(not t.passed for t in result.targets) or expected_bound is False)
    assert VLLM not in [t.baseline for t in result.targets]  # vLLM's target only when vLLM ran


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
    # the default Llama: multi-head attention over every cached key and value, no routed experts
    assert r.cost.attention_flops_per_context_token == 4 * 4 * 64 * 6
    assert r.cost.num_routed_experts == 0 and r.mean_experts_hit == 0
    assert r.weight_bytes_per_step == r.cost.streamed_weight_bytes
    assert r.cost.active_matmul_params == r.cost.matmul_params
    kv = result.kv_cache
    assert kv is not None
    assert kv.stored_bytes_per_token == kv.multi_head_bytes_per_token == r.cost.kv_bytes_per_token


def test_printed_report_and_json_carry_the_figures(result: OfflineResult) -> None:
    text = format_result(result)
    assert f"first {HF_SUBSET} of {TINY.num_requests} requests" in text
    assert "engine >= 5x HF static batches of 16:" in text and "engine >= 15x HF one at a time:" in text
    assert "decode step within 3x of the roofline bound, >= 33.3% (batch >= 16):" in text
    assert "% of the bound" in text
    data = json.loads(json.dumps(result.to_dict()))
    assert [p["name"] for p in data["paths"]] == [ENGINE, HF_ONE, HF_STATIC]
    assert data["paths"][0]["ratios"][HF_ONE] == pytest.approx(result.ratio(ENGINE, HF_ONE))
    assert data["roofline"]["derived"]["bound_seconds"] > 0


def test_the_decode_profile_splits_a_step_into_phases_that_add_up_to_it(
        torch_path_result: OfflineResult) -> None:
    result = torch_path_result
    profile = result.decode_profile
    assert profile is not None and profile.num_steps > 0
    assert 1 <= profile.mean_batch <= TINY.num_requests
    assert set(profile.seconds) == set(PHASES)
    assert all(seconds >= 0 for seconds in profile.seconds.values())
    # a decode step of the default Llama on torch runs every phase but the C++ layer call
    for phase in (SCHEDULE, PREPARE, CACHE_WRITE, GATHER, ATTEND, MODEL_REST, LOGITS, SAMPLING, POSTPROCESS):
        assert profile.seconds[phase] > 0, phase
    assert profile.seconds[DECODE_LAYERS] == 0
    assert profile.step_seconds == pytest.approx(sum(profile.seconds.values()))
    text = format_result(result)
    assert "Where a decode step goes" in text and "attention: gather K/V" in text
    assert f"not a phase of its own on this path: {DECODE_LAYERS}" in text
    assert "CPU decode kernel: off" in text
    data = json.loads(json.dumps(result.to_dict()))
    assert data["decode_profile"]["step_ms"] == pytest.approx(profile.step_seconds * 1e3)
    # the profiled run is not a timed one: the roofline still reads the timed run's steps
    assert result.roofline is not None and result.roofline.observed.num_steps > 0


def test_with_the_default_cpu_decode_kernel_a_decode_step_is_one_layer_call_and_the_rest(
        result: OfflineResult) -> None:
    """On a CPU the kernel is on by default: its layer call holds attention whole, so the attention phases
    are named as not measured on their own rather than printed as 0."""
    profile = result.decode_profile
    assert profile is not None and result.cpu_decode_kernel == "on"
    for phase in (SCHEDULE, PREPARE, DECODE_LAYERS, LOGITS, SAMPLING, POSTPROCESS):
        assert profile.seconds[phase] > 0, phase
    assert profile.seconds[CACHE_WRITE] == profile.seconds[GATHER] == profile.seconds[ATTEND] == 0
    text = format_result(result)
    assert "CPU decode kernel: on" in text and DECODE_LAYERS in text
    assert f"not a phase of its own on this path: {CACHE_WRITE}, {GATHER}, {ATTEND}" in text
    assert " 0.000 ms" not in text


def test_a_step_profile_charges_each_interval_to_the_phase_that_ends_it() -> None:
    profile = StepProfile(clock=iter([0.0, 1.0, 3.0, 6.0]).__next__)
    with profiling(profile):
        assert current() is profile
        profile.begin()
        for phase in (SCHEDULE, MODEL_REST, SCHEDULE):
            lap(phase)
        profile.end(0, 3)
    assert current() is None
    lap(SCHEDULE)  # no profile: nothing recorded, nothing raised
    (step,) = profile.steps
    assert step.seconds[SCHEDULE] == 4.0 and step.seconds[MODEL_REST] == 2.0 and step.total == 6.0
    breakdown = profile.decode_breakdown()
    assert breakdown is not None and breakdown.mean_batch == 3 and breakdown.step_seconds == 6.0
    assert profile.decode_breakdown(min_batch=4) is None


def test_a_bfloat16_run_reports_its_agreement_with_a_float32_engine() -> None:
    config = OfflineConfig(model="default", workload=TINY, repeats=1, skip_hf=True, show_progress=False,
                           engine=EngineConfig(device="cpu", dtype="bfloat16"),
                           roofline=RooflineConfig(copy_mib=32, gemm_size=256, repeats=2))
    result = run_offline(config)
    assert result.dtype == "bfloat16"
    agreement = result.float32_agreement
    assert agreement is not None and agreement.num_requests == TINY.num_requests
    assert agreement.num_tokens == sum(result.output_lens)
    assert 0 <= agreement.tokens_before_divergence <= agreement.num_tokens
    assert "Agreement with a float32 engine" in format_result(result)
    assert result.path(ENGINE) is not None and result.path(ENGINE).tokens_per_s > 0  # type: ignore[union-attr]


def test_vs_vllm_without_vllm_in_that_environment_fails_with_its_log() -> None:
    # This environment has no vLLM (it lives in its own, `make bench-vllm`): the child's ImportError is what
    # the user must see, not a traceback of the benchmark.
    config = OfflineConfig(model="default", workload=TINY, repeats=1, skip_hf=True, show_progress=False,
                           engine=EngineConfig(device="cpu"), vllm_python=sys.executable,
                           roofline=RooflineConfig(copy_mib=32, gemm_size=256, repeats=2))
    with pytest.raises(BenchmarkError, match=r"(?s)exited with status 1.*No module named 'vllm'"):
        run_offline(config)


def test_agreement_counts_tokens_up_to_each_outputs_first_difference() -> None:
    agreement = Agreement.of([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 9, 6], [0, 8]])
    assert (agreement.num_identical, agreement.tokens_before_divergence, agreement.num_tokens) == (1, 4, 8)
    assert agreement.share_before_divergence == 0.5


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


def test_default_moe_runs_every_path_and_its_roofline_counts_latent_rows_and_routed_experts(
        moe_result: OfflineResult) -> None:
    assert [p.name for p in moe_result.paths] == [ENGINE, HF_ONE, HF_STATIC]  # transformers loads the folder
    assert all(p.num_output_tokens > 0 and p.seconds > 0 for p in moe_result.paths)
    assert moe_result.paths[0].num_output_tokens == sum(moe_result.output_lens)
    r = moe_result.roofline
    assert r is not None
    cost = r.cost
    # 4 heads; scores over [latent 64 | rope 16], values in the 64-wide latent; 6 layers
    assert cost.attention_flops_per_context_token == 2 * 4 * (2 * 64 + 16) * 6
    assert cost.kv_bytes_per_token == 80 * 4 * 6  # one float32 latent row per token and layer
    assert (cost.num_routed_experts, cost.experts_per_token, cost.num_moe_layers) == (16, 4, 5)
    assert cost.routed_expert_params == 3 * 128 * 256 * 5  # gate, up and down of 128 x 256, in 5 layers
    assert cost.routed_expert_bytes == 4 * cost.routed_expert_params
    # a step streams the dense weights and the experts its batch hits: at least k, at most all E
    assert 4 <= r.mean_experts_hit <= 16
    assert r.weight_bytes_per_step == pytest.approx(cost.streamed_weight_bytes
                                                    + r.mean_experts_hit * cost.routed_expert_bytes)
    assert r.weight_bytes_per_step < cost.weight_bytes
    assert cost.active_matmul_params == cost.matmul_params + 4 * cost.routed_expert_params
    assert sum(n for _, n in r.observed.batch_steps) == r.observed.num_steps
    kv = moe_result.kv_cache
    assert kv is not None and (kv.stored_bytes_per_token, kv.multi_head_bytes_per_token) == (1_920, 7_680)
    text = format_result(moe_result)
    assert "KV cache" in text and "4.0x the stored" in text
    assert "latent rows, weight-absorbed" in text and "16 routed, 4 per token" in text
    assert json.loads(json.dumps(moe_result.to_dict()))["kv_cache"]["derived"]["ratio"] == pytest.approx(4.0)


def test_expected_experts_hit_is_the_mean_of_uniform_routing() -> None:
    cost = ModelCost(0, 0, 0, 0, 0, 0, num_routed_experts=16, experts_per_token=4)
    assert cost.expected_experts_hit(0) == 0 and cost.expected_experts_hit(1) == pytest.approx(4)
    rng = random.Random(0)
    for batch in (2, 5, 12):
        trials = [len({e for _ in range(batch) for e in rng.sample(range(16), 4)}) for _ in range(4000)]
        assert cost.expected_experts_hit(batch) == pytest.approx(sum(trials) / len(trials), rel=0.02)
    assert ModelCost(0, 0, 0, 0, 0, 0).expected_experts_hit(8) == 0
