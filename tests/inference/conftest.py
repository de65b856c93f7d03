"""Model folders shared by the inference tests: the bundled default model and tiny random checkpoints.

The tiny checkpoints are written by Hugging Face transformers itself (``save_pretrained``), so they are
exactly what a user downloads, and carry the default model's tokenizer files to be complete folders.
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from inference.models.default import ensure_default_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TINY_SHAPE: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "initializer_range": 0.2,  # well-separated logits, so greedy argmaxes do not flip on rounding
}


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("state"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """Llama 3.1-style rope scaling, untied head, saved in several shards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY_SHAPE, rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    return _save(LlamaForCausalLM, config, tmp_path_factory.mktemp("tiny-llama"), default_model_dir,
                 max_shard_size="100KB")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """q/k/v biases and tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**TINY_SHAPE, rope_theta=1000000.0, tie_word_embeddings=True)
    return _save(Qwen2ForCausalLM, config, tmp_path_factory.mktemp("tiny-qwen2"), default_model_dir)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A sliding window longer than any test prompt, one safetensors file."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**TINY_SHAPE, sliding_window=128, tie_word_embeddings=False)
    return _save(MistralForCausalLM, config, tmp_path_factory.mktemp("tiny-mistral"), default_model_dir)


# DeepSeek-V3 at the tiny shape: latent attention (kv_lora_rank 32 + a 16-wide rotary key cached per token,
# against 4 heads x (48 + 24) expanded) and 8 routed experts in 4 groups.
TINY_DEEPSEEK: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
    "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 24, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "max_position_embeddings": 256, "num_nextn_predict_layers": 0,
    "initializer_range": 0.2, "tie_word_embeddings": False,
}


@pytest.fixture(scope="session")
def tiny_deepseek_v3_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """V3 as released: low-rank queries, YaRN (mscale 0.8 / mscale_all_dim 1.0, so both of its scales
    apply), interleaved rope, grouped routing with normalised weights, a dense first layer, shards."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
            "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 1.0}
    config = DeepseekV3Config(**TINY_DEEPSEEK, q_lora_rank=48, n_group=4, topk_group=2, n_shared_experts=1,
                              first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                              rope_interleave=True, rope_scaling=yarn)
    return _save(DeepseekV3ForCausalLM, config, tmp_path_factory.mktemp("tiny-deepseek-v3"),
                 default_model_dir, max_shard_size="100KB")


@pytest.fixture(scope="session")
def tiny_deepseek_v3_plain_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """The other branches: q_proj without a low rank, no rope scaling, rope in halves, one expert group,
    unnormalised weights, two shared experts, attention biases, every layer a mixture of experts."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**TINY_DEEPSEEK, q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2,
                              first_k_dense_replace=0, norm_topk_prob=False, routed_scaling_factor=1.0,
                              rope_interleave=False, attention_bias=True)
    return _save(DeepseekV3ForCausalLM, config, tmp_path_factory.mktemp("tiny-deepseek-v3-plain"),
                 default_model_dir)


@pytest.fixture(scope="session")
def tiny_deepseek_v2_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """V2: softmax routing limited to the best groups, no correction bias, complex (interleaved) rope."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    shape = {k: v for k, v in TINY_DEEPSEEK.items() if k != "num_nextn_predict_layers"}
    config = DeepseekV2Config(**shape, q_lora_rank=48, n_group=4, topk_group=2, n_shared_experts=1,
                              first_k_dense_replace=1, topk_method="group_limited_greedy",
                              routed_scaling_factor=2.0)
    return _save(DeepseekV2ForCausalLM, config, tmp_path_factory.mktemp("tiny-deepseek-v2"),
                 default_model_dir)


def _save(model_class: Any, config: Any, folder: Path, default_model_dir: Path, **save_kwargs: Any) -> Path:
    torch.manual_seed(0)
    model = model_class(config).eval()
    _randomize_zero_initialized(model)
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        save_kwargs["safe_serialization"] = True  # transformers 4; 5 always writes safetensors
    model.save_pretrained(folder, **save_kwargs)
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_dir / name, folder / name)
    return folder


def _randomize_zero_initialized(model: torch.nn.Module) -> None:
    """transformers starts biases at 0 and norms at 1; random values prove the loader reads them."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
            elif "norm" in name:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: steers the choice
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
