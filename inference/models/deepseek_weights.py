"""DeepSeek-V3 (and V2) checkpoint tensors: the shapes a folder must hold, and their mapping onto our module.

A Hugging Face DeepSeek-V3 folder stores each routed expert's matrices separately
(``mlp.experts.{e}.gate_proj.weight``, ...); the model stacks them into one [experts, ...] tensor per
layer, fuses ``q_a_proj`` (or ``q_proj``) with ``kv_a_proj_with_mqa`` (they read the same input), and
gate with up. The multi-token-prediction layers some releases append after the last decoder layer
(``model.layers.{num_hidden_layers}.*``) are not used for plain decoding; the loader skips them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

from inference.models.config import ModelConfig
from inference.models.deepseek_shapes import MlaShape, MoeShape

Shapes = dict[str, tuple[int, ...]]
Getter = Callable[[str], torch.Tensor]  # checkpoint tensor by name
Named = Iterator[tuple[str, torch.Tensor]]  # our parameter names with their tensors
# The router stays float32 whatever the model's dtype, as in transformers (routing decisions flip otherwise).
FLOAT32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "mlp.gate_weight",
                    "mlp.e_score_correction_bias")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def is_extra_layer(name: str, config: ModelConfig) -> bool:
    """A tensor of a layer past the decoder stack (multi-token prediction)."""
    match = _LAYER.match(name)
    return match is not None and int(match.group(1)) >= config.num_hidden_layers


def expected_shapes(config: ModelConfig) -> Shapes:
    assert config.mla is not None and config.moe is not None
    hidden = config.hidden_size
    shapes: Shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden),
                      "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        shapes.update(_attention_shapes(config, config.mla, prefix + "self_attn."))
        if config.moe.is_moe_layer(i):
            shapes.update(_moe_shapes(hidden, config.moe, prefix + "mlp."))
        else:
            shapes.update(_mlp_shapes(hidden, config.intermediate_size, prefix + "mlp."))
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
    return shapes


def _attention_shapes(config: ModelConfig, mla: MlaShape, attn: str) -> Shapes:
    hidden, heads = config.hidden_size, config.num_attention_heads
    shapes: Shapes = {
        attn + "kv_a_proj_with_mqa.weight": (mla.latent_width, hidden),
        attn + "kv_a_layernorm.weight": (mla.kv_lora_rank,),
        attn + "kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        attn + "o_proj.weight": (hidden, heads * mla.v_head_dim),
    }
    if mla.q_lora_rank is None:
        shapes[attn + "q_proj.weight"] = (heads * mla.qk_head_dim, hidden)
    else:
        shapes.update({attn + "q_a_proj.weight": (mla.q_lora_rank, hidden),
                       attn + "q_a_layernorm.weight": (mla.q_lora_rank,),
                       attn + "q_b_proj.weight": (heads * mla.qk_head_dim, mla.q_lora_rank)})
    if config.attention_bias:
        shapes[attn + "kv_a_proj_with_mqa.bias"] = (mla.latent_width,)
        shapes[attn + "o_proj.bias"] = (hidden,)
        if mla.q_lora_rank is not None:
            shapes[attn + "q_a_proj.bias"] = (mla.q_lora_rank,)
    return shapes


def _mlp_shapes(hidden: int, inter: int, mlp: str) -> Shapes:
    return {mlp + "gate_proj.weight": (inter, hidden), mlp + "up_proj.weight": (inter, hidden),
            mlp + "down_proj.weight": (hidden, inter)}


def _moe_shapes(hidden: int, moe: MoeShape, mlp: str) -> Shapes:
    shapes: Shapes = {mlp + "gate.weight": (moe.n_routed_experts, hidden)}
    if moe.has_correction_bias:
        shapes[mlp + "gate.e_score_correction_bias"] = (moe.n_routed_experts,)
    for e in range(moe.n_routed_experts):
        shapes.update(_mlp_shapes(hidden, moe.moe_intermediate_size, f"{mlp}experts.{e}."))
    if moe.n_shared_experts:
        shapes.update(_mlp_shapes(hidden, moe.moe_intermediate_size * moe.n_shared_experts,
                                  mlp + "shared_experts."))
    return shapes


def fused_tensors(get: Getter, config: ModelConfig) -> Named:
    """Our parameter names and tensors, from the checkpoint's (in its dtype, on CPU)."""
    assert config.mla is not None and config.moe is not None
    yield "embed_tokens.weight", get("model.embed_tokens.weight")
    yield "norm.weight", get("model.norm.weight")
    if not config.tie_word_embeddings:
        yield "lm_head.weight", get("lm_head.weight")
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        yield from _attention_tensors(get, config, config.mla, src + "self_attn.", dst + "self_attn.")
        if config.moe.is_moe_layer(i):
            yield from _moe_tensors(get, config.moe, src + "mlp.", dst + "mlp.")
        else:
            yield from _mlp_tensors(get, src + "mlp.", dst + "mlp.")
        yield dst + "input_layernorm.weight", get(src + "input_layernorm.weight")
        yield dst + "post_attention_layernorm.weight", get(src + "post_attention_layernorm.weight")


def _attention_tensors(get: Getter, config: ModelConfig, mla: MlaShape, src: str,
                       dst: str) -> Named:
    q_name = src + ("q_proj" if mla.q_lora_rank is None else "q_a_proj")
    kv_a = get(src + "kv_a_proj_with_mqa.weight")
    yield dst + "qkv_a_proj.weight", torch.cat([get(q_name + ".weight"), kv_a])
    if config.attention_bias:
        kv_bias = get(src + "kv_a_proj_with_mqa.bias")
        # q_proj has no bias in transformers even with attention_bias: zeros in the fused one
        q_bias = (torch.zeros(config.num_attention_heads * mla.qk_head_dim, dtype=kv_bias.dtype)
                  if mla.q_lora_rank is None else get(q_name + ".bias"))
        yield dst + "qkv_a_proj.bias", torch.cat([q_bias, kv_bias])
        yield dst + "o_proj.bias", get(src + "o_proj.bias")
    if mla.q_lora_rank is not None:
        yield dst + "q_a_layernorm.weight", get(src + "q_a_layernorm.weight")
        yield dst + "q_b_proj.weight", get(src + "q_b_proj.weight")
    yield dst + "kv_a_layernorm.weight", get(src + "kv_a_layernorm.weight")
    yield dst + "attn.kv_b_proj.weight", get(src + "kv_b_proj.weight")
    yield dst + "o_proj.weight", get(src + "o_proj.weight")


def _mlp_tensors(get: Getter, src: str, dst: str) -> Named:
    yield dst + "gate_up_proj.weight", torch.cat([get(src + "gate_proj.weight"), get(src + "up_proj.weight")])
    yield dst + "down_proj.weight", get(src + "down_proj.weight")


def _moe_tensors(get: Getter, moe: MoeShape, src: str,
                 dst: str) -> Named:
    yield dst + "gate_weight", get(src + "gate.weight")
    bias_name = src + "gate.e_score_correction_bias"
    yield dst + "e_score_correction_bias", (get(bias_name) if moe.has_correction_bias
                                            else torch.zeros(moe.n_routed_experts))  # V2 has none
    experts = range(moe.n_routed_experts)
    yield dst + "experts_gate_up", torch.stack([
        torch.cat([get(f"{src}experts.{e}.gate_proj.weight"), get(f"{src}experts.{e}.up_proj.weight")])
        for e in experts])
    yield dst + "experts_down", torch.stack([get(f"{src}experts.{e}.down_proj.weight") for e in experts])
    if moe.n_shared_experts:
        yield from _mlp_tensors(get, src + "shared_experts.", dst + "shared_experts.")
