"""Latent attention's cache footprint: bytes per token as the engine stores them against the per-head keys
and values the same model would cache, for DeepSeek-V3's published shape and for the bundled default-moe
engine, whose pool holds as many more blocks as the bytes per token are fewer."""

from __future__ import annotations

import pytest
import torch

from inference.bench.kv_cache import format_kv_cache, kv_cache_footprint
from inference.config import EngineConfig
from inference.engine import LLMEngine
from inference.model_runner import cache_bytes_per_block, multi_head_bytes_per_token, plan_cache
from inference.models.config import ModelConfig

# DeepSeek-V3's config.json (the FP8 quantization_config aside: a bfloat16 conversion).
V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
    "num_nextn_predict_layers": 1, "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}
# Llama 3 8B: grouped-query attention, 8 key/value heads of 128.
LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "torch_dtype": "bfloat16",
}
BLOCK = 16


def test_deepseek_v3_stores_576_values_per_token_and_layer_against_40960_multi_head() -> None:
    v3 = ModelConfig.from_dict(V3_CONFIG, source="v3")
    assert v3.mla is not None and v3.mla.latent_width == 512 + 64
    stored = cache_bytes_per_block(v3, block_size=BLOCK, dtype=torch.bfloat16, int8=False) // BLOCK
    assert stored == 576 * 2 * 61 == 70_272
    multi_head = multi_head_bytes_per_token(v3, torch.bfloat16)
    assert multi_head == 128 * (128 + 64 + 128) * 2 * 61 == 40_960 * 2 * 61 == 4_997_120
    assert multi_head / stored == pytest.approx(71.1, abs=0.05)
    # the same 64 GiB pool: about 71 times the blocks
    budget = 64 * 2**30
    layout = plan_cache(memory_bytes=budget, num_blocks=0, block_size=BLOCK, config=v3, dtype=torch.bfloat16,
                        int8=False)
    assert layout.bytes_per_token == stored and layout.latent_width == 576
    assert layout.num_blocks == budget // (stored * BLOCK)
    assert layout.num_blocks >= 71 * (budget // (multi_head * BLOCK))


def test_a_llama_model_caches_its_multi_head_keys_and_values_as_they_are() -> None:
    llama = ModelConfig.from_dict(LLAMA3_8B_CONFIG, source="llama3")
    stored = cache_bytes_per_block(llama, block_size=BLOCK, dtype=torch.bfloat16, int8=False) // BLOCK
    assert multi_head_bytes_per_token(llama, torch.bfloat16) == stored == 2 * 8 * 128 * 2 * 32
    assert multi_head_bytes_per_token(llama, torch.float32) == 2 * stored


def test_the_default_moe_pool_holds_four_times_the_blocks_of_its_multi_head_equivalent() -> None:
    budget = 8 * 2**20
    engine = LLMEngine("default-moe", EngineConfig(device="cpu", dtype="float32", num_kv_blocks=0,
                                                   kv_cache_memory_bytes=budget))
    config, layout = engine.model_config, engine.runner.layout
    assert config.mla is not None
    # 4 heads x (32 + 16 + 32) values per layer expand from one row of 64 + 16
    assert layout.bytes_per_token == 80 * 4 * 6 == 1_920
    multi_head = multi_head_bytes_per_token(config, torch.float32)
    assert multi_head == 4 * 80 * 4 * 6 == 7_680
    multi_head_blocks = budget // (multi_head * layout.block_size)
    assert layout.num_blocks == budget // (layout.bytes_per_token * layout.block_size) == 273
    assert multi_head_blocks == 68 and layout.num_blocks >= 4 * multi_head_blocks

    footprint = kv_cache_footprint(engine)
    assert (footprint.stored_bytes_per_token, footprint.multi_head_bytes_per_token) == (1_920, 7_680)
    assert (footprint.num_blocks, footprint.multi_head_blocks) == (273, 68)
    assert footprint.ratio == pytest.approx(4.0)
    text = format_kv_cache(footprint)
    assert "1,920 B" in text and "7,680 B" in text and "4.0x the stored" in text and "68 blocks" in text
