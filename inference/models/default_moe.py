"""The bundled mixture-of-experts model: a small random DeepSeek-V3, built on first use (``default-moe``).

The same recipe as :mod:`inference.models.default` (fixed seeds, the same byte-level tokenizer and chat
template, an ordinary Hugging Face folder under the state directory), with DeepSeek-V3's architecture:
multi-head latent attention with low-rank queries and YaRN, a dense first layer, then mixture-of-experts
layers with a shared expert and grouped top-k routing. It exists so that drills and the autoscaler can
rehearse with the KV-cache footprint and the expert routing of the models the fleet serves, at a size
where three replicas and the control plane share a 2-core machine (its active parameters per token are
about those of the default Llama).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from inference.models.bundled import DEFAULT_MOE_MODEL_NAME, ensure_bundled_model
from inference.models.default import (
    BEGIN_OF_TEXT,
    COMPLETE_MARKER,
    ENDOFTEXT,
    EOS_TOKENS,
    HIDDEN_SIZE,
    INIT_STD,
    MAX_POSITION_EMBEDDINGS,
    RMS_NORM_EPS,
    ROPE_THETA,
    VOCAB_SIZE,
    generation_config,
    write_json,
    write_tokenizer_files,
)

# Shape (decided for the 2-core budget; cited by the README).
NUM_HIDDEN_LAYERS = 6
FIRST_K_DENSE_REPLACE = 1
INTERMEDIATE_SIZE = 768  # the dense first layer, as the default Llama's MLP
NUM_ATTENTION_HEADS = 4
Q_LORA_RANK = 128
KV_LORA_RANK = 64
QK_NOPE_HEAD_DIM = 32
QK_ROPE_HEAD_DIM = 16
V_HEAD_DIM = 32
N_ROUTED_EXPERTS = 16
N_GROUP = 4
TOPK_GROUP = 2
NUM_EXPERTS_PER_TOK = 4
N_SHARED_EXPERTS = 1
MOE_INTERMEDIATE_SIZE = 128
ROUTED_SCALING_FACTOR = 2.5
# YaRN as V3 ships it (factor 40 over 4k there): here 4 over 512, with equal mscales.
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
WEIGHTS_SEED = 2345


def ensure_default_moe_model(state_dir: Path | None = None) -> Path:
    """The bundled DeepSeek-V3 model's folder, built on first use."""
    return ensure_bundled_model(DEFAULT_MOE_MODEL_NAME, build_default_moe_model, state_dir)


def build_default_moe_model(folder: Path) -> None:
    ids = write_tokenizer_files(folder)
    write_json(folder / "config.json", model_config(ids))
    write_json(folder / "generation_config.json", generation_config(ids))
    save_file(build_weights(), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / COMPLETE_MARKER).write_text(f"{DEFAULT_MOE_MODEL_NAME}\n", encoding="utf-8")


def build_weights() -> dict[str, torch.Tensor]:
    """Hugging Face-named float32 tensors: normal(0, INIT_STD) matrices, norms of 1, routing bias 0."""
    generator = torch.Generator().manual_seed(WEIGHTS_SEED)

    def normal(*shape: int) -> torch.Tensor:
        return torch.normal(0.0, INIT_STD, size=shape, generator=generator)

    def mlp(prefix: str, inter: int) -> dict[str, torch.Tensor]:
        return {prefix + "gate_proj.weight": normal(inter, HIDDEN_SIZE),
                prefix + "up_proj.weight": normal(inter, HIDDEN_SIZE),
                prefix + "down_proj.weight": normal(HIDDEN_SIZE, inter)}

    qk_head_dim = QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM
    tensors = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN_SIZE)}
    for i in range(NUM_HIDDEN_LAYERS):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        tensors.update({
            a + "q_a_proj.weight": normal(Q_LORA_RANK, HIDDEN_SIZE),
            a + "q_a_layernorm.weight": torch.ones(Q_LORA_RANK),
            a + "q_b_proj.weight": normal(NUM_ATTENTION_HEADS * qk_head_dim, Q_LORA_RANK),
            a + "kv_a_proj_with_mqa.weight": normal(KV_LORA_RANK + QK_ROPE_HEAD_DIM, HIDDEN_SIZE),
            a + "kv_a_layernorm.weight": torch.ones(KV_LORA_RANK),
            a + "kv_b_proj.weight": normal(NUM_ATTENTION_HEADS * (QK_NOPE_HEAD_DIM + V_HEAD_DIM),
                                           KV_LORA_RANK),
            a + "o_proj.weight": normal(HIDDEN_SIZE, NUM_ATTENTION_HEADS * V_HEAD_DIM),
            p + "input_layernorm.weight": torch.ones(HIDDEN_SIZE),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN_SIZE),
        })
        if i < FIRST_K_DENSE_REPLACE:
            tensors.update(mlp(p + "mlp.", INTERMEDIATE_SIZE))
            continue
        tensors[p + "mlp.gate.weight"] = normal(N_ROUTED_EXPERTS, HIDDEN_SIZE)
        tensors[p + "mlp.gate.e_score_correction_bias"] = torch.zeros(N_ROUTED_EXPERTS)
        for e in range(N_ROUTED_EXPERTS):
            tensors.update(mlp(f"{p}mlp.experts.{e}.", MOE_INTERMEDIATE_SIZE))
        tensors.update(mlp(p + "mlp.shared_experts.", MOE_INTERMEDIATE_SIZE * N_SHARED_EXPERTS))
    tensors["model.norm.weight"] = torch.ones(HIDDEN_SIZE)
    return tensors


def model_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN_SIZE, "intermediate_size": INTERMEDIATE_SIZE,
        "moe_intermediate_size": MOE_INTERMEDIATE_SIZE, "num_hidden_layers": NUM_HIDDEN_LAYERS,
        "first_k_dense_replace": FIRST_K_DENSE_REPLACE, "num_attention_heads": NUM_ATTENTION_HEADS,
        "num_key_value_heads": NUM_ATTENTION_HEADS, "q_lora_rank": Q_LORA_RANK, "kv_lora_rank": KV_LORA_RANK,
        "qk_nope_head_dim": QK_NOPE_HEAD_DIM, "qk_rope_head_dim": QK_ROPE_HEAD_DIM, "v_head_dim": V_HEAD_DIM,
        "n_routed_experts": N_ROUTED_EXPERTS, "n_shared_experts": N_SHARED_EXPERTS, "n_group": N_GROUP,
        "topk_group": TOPK_GROUP, "num_experts_per_tok": NUM_EXPERTS_PER_TOK, "norm_topk_prob": True,
        "routed_scaling_factor": ROUTED_SCALING_FACTOR, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "num_nextn_predict_layers": 0, "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS, "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA, "rope_scaling": YARN, "rope_interleave": True, "attention_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": True, "initializer_range": INIT_STD,
        "bos_token_id": ids[BEGIN_OF_TEXT], "eos_token_id": [ids[t] for t in EOS_TOKENS],
        "pad_token_id": ids[ENDOFTEXT], "torch_dtype": "float32", "use_cache": True,
    }
