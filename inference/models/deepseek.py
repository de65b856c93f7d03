"""DeepSeek-V3's (and V2's) forward pass over a flat batch of tokens.

The same interface as :mod:`inference.models.llama` (``forward(input_ids, positions)`` then
``compute_logits``), with the two parts that make the architecture:

- **Multi-head latent attention**: queries through a low-rank ``q_a``/``q_b`` pair (or one ``q_proj``),
  and one compressed row per token, ``[kv_a_layernorm(latent) | rotated shared key]``, which is all the
  paged cache holds (:class:`inference.mla.LatentAttention`).
- **Mixture of experts** after the first ``first_k_dense_replace`` dense layers: shared experts on every
  token, plus ``num_experts_per_tok`` routed experts chosen by sigmoid scores (plus a learnt correction
  bias that steers the choice but not the weights) within the best ``topk_group`` of ``n_group`` groups.
  Tokens are sorted by expert and each expert runs once on all of its tokens; the per-expert token counts
  accumulate in ``expert_tokens`` for the replica's metrics. DeepSeek-V2 differs only in its routing
  (softmax scores, no correction bias) and in laying its rotary pairs out interleaved, which gives the
  same dot products as V3's de-interleaved layout since queries and keys share it.

Numerics follow Hugging Face transformers: RMSNorm and routing in float32 (the router's weights stay
float32 whatever the model's dtype), YaRN's mscale on the softmax scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference.mla import LatentAttention
from inference.models.config import ModelConfig
from inference.models.deepseek_shapes import MlaShape, MoeShape
from inference.models.llama import CausalLM, LlamaMLP, RMSNorm
from inference.models.rope import apply_rotary, apply_rotary_interleaved


class DeepseekAttention(nn.Module):
    def __init__(self, config: ModelConfig, mla: MlaShape) -> None:
        super().__init__()
        self.mla = mla
        self.num_heads = config.num_attention_heads
        self.q_size = self.num_heads * mla.qk_head_dim
        # q_a (or q) and kv_a read the same input: one fused matrix
        q_out = mla.q_lora_rank if mla.q_lora_rank is not None else self.q_size
        self.q_out = q_out
        self.qkv_a_proj = nn.Linear(config.hidden_size, q_out + mla.latent_width, bias=config.attention_bias)
        self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6) if mla.q_lora_rank is not None else None
        self.q_b_proj = (nn.Linear(mla.q_lora_rank, self.q_size, bias=False)
                         if mla.q_lora_rank is not None else None)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.o_proj = nn.Linear(self.num_heads * mla.v_head_dim, config.hidden_size,
                                bias=config.attention_bias)
        softmax_scale = mla.qk_head_dim**-0.5
        if config.rope_scaling is not None:
            softmax_scale *= config.rope_scaling.softmax_scale_factor
        self.attn = LatentAttention(num_heads=self.num_heads, kv_lora_rank=mla.kv_lora_rank,
                                    qk_nope_head_dim=mla.qk_nope_head_dim,
                                    qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
                                    scale=softmax_scale)
        self.rotate = apply_rotary_interleaved if mla.rope_interleave else apply_rotary

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        mla, num_tokens = self.mla, x.shape[0]
        q, compressed = self.qkv_a_proj(x).split([self.q_out, mla.latent_width], dim=-1)
        if self.q_b_proj is not None and self.q_a_layernorm is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(num_tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = compressed.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        k_rope = self.rotate(k_rope.unsqueeze(1), cos, sin).squeeze(1)
        row = torch.cat((self.kv_a_layernorm(latent), k_rope), dim=-1)
        o = self.attn(torch.cat((q_nope, self.rotate(q_rope, cos, sin)), dim=-1), row)
        out: torch.Tensor = self.o_proj(o.reshape(num_tokens, -1))
        return out


class DeepseekMoE(nn.Module):
    """Shared experts plus grouped top-k routed experts; expert weights stacked as [E, ...] tensors."""

    e_score_correction_bias: torch.Tensor
    expert_tokens: torch.Tensor

    def __init__(self, config: ModelConfig, moe: MoeShape) -> None:
        super().__init__()
        self.moe = moe
        e, hidden, inter = moe.n_routed_experts, config.hidden_size, moe.moe_intermediate_size
        self.gate_weight = nn.Parameter(torch.empty(e, hidden, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(e, hidden, inter))
        self.shared_experts = (LlamaMLP(hidden, inter * moe.n_shared_experts)
                               if moe.n_shared_experts else None)
        # Tokens routed to each expert since the model was built (read by the replica's metrics).
        self.register_buffer("expert_tokens", torch.zeros(e, dtype=torch.int64), persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k])."""
        moe = self.moe
        logits = F.linear(x.float(), self.gate_weight.float())
        if moe.topk_method == "noaux_tc":  # V3
            scores = logits.sigmoid()
            biased = scores + self.e_score_correction_bias  # steers the choice, not the weights
            choice = self._within_best_groups(biased, top=2, masked=float("-inf"))
        else:  # V2
            scores = logits.softmax(dim=-1)
            choice = (scores if moe.topk_method == "greedy"
                      else self._within_best_groups(scores, top=1, masked=0.0))
        ids = choice.topk(moe.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, ids

    def _within_best_groups(self, choice: torch.Tensor, *, top: int, masked: float) -> torch.Tensor:
        """``choice`` with the experts outside the ``topk_group`` best groups set to ``masked``; a group
        scores the sum of its ``top`` best experts."""
        moe = self.moe
        per_group = moe.n_routed_experts // moe.n_group
        group_scores = choice.view(-1, moe.n_group, per_group).topk(top, dim=-1)[0].sum(dim=-1)
        groups = group_scores.topk(moe.topk_group, dim=-1, sorted=False)[1]
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        allowed = allowed.unsqueeze(-1).expand(-1, moe.n_group, per_group).reshape(-1, moe.n_routed_experts)
        return choice.masked_fill(~allowed, masked)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.moe.n_routed_experts)
        self.expert_tokens += counts
        token_of = torch.div(order, self.moe.num_experts_per_tok, rounding_mode="floor")
        routed = x[token_of]
        out_rows = torch.empty_like(routed)
        start = 0
        for expert, n in enumerate(counts.tolist()):  # one matmul pair per expert, on all its tokens
            if n:
                rows = routed[start:start + n]
                gate, up = F.linear(rows, self.experts_gate_up[expert]).chunk(2, dim=-1)
                out_rows[start:start + n] = F.linear(F.silu(gate) * up, self.experts_down[expert])
                start += n
        out_rows *= weights.flatten()[order].unsqueeze(1).to(out_rows.dtype)
        out = torch.zeros_like(x).index_add_(0, token_of, out_rows)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        assert config.mla is not None and config.moe is not None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DeepseekAttention(config, config.mla)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (DeepseekMoE(config, config.moe) if config.moe.is_moe_layer(index)
                               else LlamaMLP(config.hidden_size, config.intermediate_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3, and V2 (its routing is a setting of :class:`DeepseekMoE`). ``max_positions`` caps the
    RoPE table (default: the config's)."""

    def __init__(self, config: ModelConfig, *, max_positions: int | None = None) -> None:
        if config.mla is None or config.moe is None:
            raise ValueError(f"{config.architecture} is not a DeepSeek-V3 configuration")
        super().__init__(config, [DeepseekDecoderLayer(config, i) for i in range(config.num_hidden_layers)],
                         max_positions=max_positions)

    def materialize(self, device: torch.device) -> None:
        super().materialize(device)
        for layer in self.moe_layers:
            layer.expert_tokens = torch.zeros(layer.moe.n_routed_experts, dtype=torch.int64, device=device)

    @property
    def moe_layers(self) -> list[DeepseekMoE]:
        return [m for m in self.modules() if isinstance(m, DeepseekMoE)]

    def expert_tokens(self) -> list[list[int]]:
        return [layer.expert_tokens.tolist() for layer in self.moe_layers]
