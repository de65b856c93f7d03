"""DeepSeek-V3 in the engine beyond the token-for-token equivalence: what a V3 folder may hold and what it
may not, the router's precision, the expert-load counts, the INT8 latent cache, the bundled ``default-moe``
model, and the replica's metrics page for a mixture-of-experts model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.config import EngineConfig
from inference.engine import LLM, LLMEngine
from inference.metrics import (
    EXPERT_IMBALANCE,
    EXPERT_TOKENS,
    KV_BYTES_PER_TOKEN,
    CacheConfigInfo,
    EngineGauges,
    ReplicaMetrics,
    expert_imbalance,
)
from inference.models.config import ModelConfig, ModelLoadError
from inference.models.deepseek import DeepseekMoE, DeepseekV3ForCausalLM
from inference.models.default_moe import ensure_default_moe_model
from inference.models.loader import load_model
from inference.sampling_params import SamplingParams
from tests.inference.test_engine_equivalence import (
    MAX_TOKENS,
    _common_prefix,
    base_config,
    make_prompts,
    run_engine,
)

CPU = torch.device("cpu")


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "model"))


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(("changes", "message"), [
    ({"quantization_config": {"quant_method": "fp8"}}, "quantized (FP8) checkpoints are not supported"),
    ({"scoring_func": "softmax"}, "'scoring_func' must be 'sigmoid'"),
    ({"topk_method": "greedy"}, "'topk_method' must be 'noaux_tc'"),
    ({"n_routed_experts": 10}, "must be a multiple of n_group"),
    ({"topk_group": 5}, "topk_group (5) must be <= n_group (4)"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
    ({"kv_lora_rank": None}, "field 'kv_lora_rank' is missing"),
])
def test_a_v3_folder_the_engine_cannot_compute_exactly_is_refused_by_name(
        tiny_deepseek_v3_dir: Path, tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    folder = _copy(tiny_deepseek_v3_dir, tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    raw = {k: v for k, v in raw.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"config\.json: ") as caught:
        ModelConfig.from_folder(folder)
    assert message in str(caught.value)


@pytest.mark.parametrize(("changes", "message"), [
    ({"topk_method": "noaux_tc"}, "'topk_method' must be 'greedy' or 'group_limited_greedy' for DeepSeek-V2"),
    ({"scoring_func": "sigmoid"}, "'scoring_func' must be 'softmax' for DeepSeek-V2"),
    ({"norm_topk_prob": True}, "'norm_topk_prob' must be false for DeepSeek-V2"),
])
def test_a_v2_folder_with_v3_routing_is_refused_by_name(tiny_deepseek_v2_dir: Path, tmp_path: Path,
                                                        changes: dict[str, Any], message: str) -> None:
    folder = _copy(tiny_deepseek_v2_dir, tmp_path)
    _edit_config(folder, **changes)
    with pytest.raises(ModelLoadError, match=r"config\.json: ") as caught:
        ModelConfig.from_folder(folder)
    assert message in str(caught.value)


def test_multi_token_prediction_layers_are_skipped_and_stray_tensors_are_not(
        tiny_deepseek_v3_dir: Path, tmp_path: Path) -> None:
    """V3 releases append an MTP layer after the stack (``model.layers.61`` there); decoding skips it."""
    folder = _copy(tiny_deepseek_v3_dir, tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.3.eh_proj.weight"] = shard.name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    load_model(folder, device=CPU, dtype=torch.float32)

    tensors["model.layers.0.mlp.experts.0.stray.weight"] = torch.zeros(2)
    index["weight_map"]["model.layers.0.mlp.experts.0.stray.weight"] = shard.name
    save_file(tensors, shard, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.experts\.0\.stray"):
        load_model(folder, device=CPU, dtype=torch.float32)


def test_router_stays_float32_when_the_model_is_bfloat16(tiny_deepseek_v3_dir: Path) -> None:
    model, _ = load_model(tiny_deepseek_v3_dir, device=CPU, dtype=torch.bfloat16)
    assert isinstance(model, DeepseekV3ForCausalLM)
    moe = model.moe_layers[0]
    assert moe.gate_weight.dtype == torch.float32
    assert moe.e_score_correction_bias.dtype == torch.float32
    assert moe.experts_gate_up.dtype == torch.bfloat16
    assert float(moe.e_score_correction_bias.abs().sum()) > 0, "the routing bias is read from the folder"


def test_every_routed_token_is_counted_once_per_chosen_expert(tiny_deepseek_v3_dir: Path) -> None:
    engine = LLMEngine(str(tiny_deepseek_v3_dir), base_config())
    prompts = make_prompts(512, seed=5)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    computed = sum(len(p) for p in prompts) + len(prompts) * (MAX_TOKENS - 1)  # the last token is not run
    per_layer = engine.model.expert_tokens()
    moe = engine.model_config.moe
    assert moe is not None
    assert len(per_layer) == engine.model_config.num_hidden_layers - moe.first_k_dense_replace
    assert all(sum(layer) == computed * moe.num_experts_per_tok for layer in per_layer)
    assert all(len(layer) == moe.n_routed_experts for layer in per_layer)
    assert expert_imbalance(per_layer) >= 1.0


def test_int8_latent_cache_fits_more_blocks_and_mostly_agrees_with_fp32(tiny_deepseek_v3_dir: Path) -> None:
    """INT8 rows with a scale per token. The bound is below the Llama cache's 75%: a latent feeds every
    head's keys and values through kv_b_proj, so its rounding reaches all heads (measured: 72% of tokens
    before the first divergence here, 81% for the INT8 Llama cache on the same prompts)."""
    budget = 1024 * 1024
    prompts = make_prompts(512, seed=6)
    fp32 = run_engine(tiny_deepseek_v3_dir, prompts,
                      base_config(num_kv_blocks=0, kv_cache_memory_bytes=budget))
    int8 = run_engine(tiny_deepseek_v3_dir, prompts,
                      base_config(num_kv_blocks=0, kv_cache_memory_bytes=budget, kv_cache_dtype="int8"))
    assert int8.engine.block_manager.num_blocks >= 3 * fp32.engine.block_manager.num_blocks
    matched = [_common_prefix(fp32.outputs[r], int8.outputs[r]) for r in fp32.outputs]
    prefix = sum(matched) / (MAX_TOKENS * len(matched))
    print(f"int8 latent cache: {prefix:.0%} of greedy tokens before the first divergence from fp32; "
          f"blocks {int8.engine.block_manager.num_blocks} vs {fp32.engine.block_manager.num_blocks}")
    assert all(m >= 1 for m in matched)  # the first token attends to fresh rows, never quantized ones
    assert prefix >= 0.65


def test_default_moe_model_is_a_deepseek_v3_that_serves(tmp_path: Path) -> None:
    folder = ensure_default_moe_model(tmp_path)
    config = ModelConfig.from_folder(folder)
    assert config.architecture == "DeepseekV3ForCausalLM"
    assert config.mla is not None and config.moe is not None
    assert ensure_default_moe_model(tmp_path) == folder  # built once
    llm = LLM(str(folder), EngineConfig(device="cpu", dtype="float32", num_threads=1))
    outputs = llm.generate(["Hello", "The replica answers"], SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(o.output_token_ids) for o in outputs] == [8, 8]
    assert any(sum(layer) > 0 for layer in llm.engine.model.expert_tokens())


def test_default_moe_logits_match_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = ensure_default_moe_model(tmp_path)
    ours, _ = load_model(folder, device=CPU, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.arange(5, 205) % 500 + 4
    with torch.inference_mode():
        expected = theirs(ids.unsqueeze(0)).logits[0]
        actual = ours.compute_logits(ours(ids, torch.arange(len(ids))))
    assert ((actual - expected).abs().max() / expected.abs().max()).item() < 1e-4


def test_metrics_page_shows_expert_load_and_cache_bytes() -> None:
    per_layer = [[3, 1, 0, 0], [2, 2, 0, 0]]
    gauges = EngineGauges(num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_queries=0,
                          prefix_cache_hits=0, num_preemptions=0, device_memory_used=0, device_memory_total=1,
                          device_utilization=None, expert_tokens=per_layer)
    metrics = ReplicaMetrics(model_name="default-moe", replica="r0", zone="az-a", max_model_len=256,
                             read_engine=lambda: gauges,
                             cache_info=CacheConfigInfo(16, 10, "auto", True, bytes_per_token=1920))
    page = _render(metrics)
    labels = 'engine="0",model_name="default-moe",replica="r0",zone="az-a"'
    rest = 'model_name="default-moe",replica="r0",zone="az-a"'
    assert f'{EXPERT_TOKENS}_total{{engine="0",expert="0",{rest}}} 5.0' in page
    assert f'{EXPERT_TOKENS}_total{{engine="0",expert="3",{rest}}} 0.0' in page
    assert f"{EXPERT_IMBALANCE}{{{labels}}} 3.0" in page  # layer one: 3 over a mean of 1
    assert f"{KV_BYTES_PER_TOKEN}{{{labels}}} 1920.0" in page
    assert expert_imbalance([[0, 0]]) == 0.0


def _render(metrics: ReplicaMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()


def test_moe_layer_runs_each_expert_once_per_step(tiny_deepseek_v3_dir: Path) -> None:
    """Tokens are batched per expert: one pair of matmuls per expert hit, not one per token."""
    model, _ = load_model(tiny_deepseek_v3_dir, device=CPU, dtype=torch.float32)
    moe: DeepseekMoE = model.moe_layers[0]
    calls = 0
    original = torch.nn.functional.linear

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    x = torch.randn(64, 64)
    torch.nn.functional.linear = counting  # type: ignore[assignment]
    try:
        with torch.inference_mode():
            moe(x)
    finally:
        torch.nn.functional.linear = original
    _, ids = moe.route(x)
    hit = len(torch.unique(ids))
    # the router, two per expert hit (gate/up, down), two for the shared expert
    assert calls == 1 + 2 * hit + 2, f"{calls} linear calls for {hit} experts hit by 64 tokens"
