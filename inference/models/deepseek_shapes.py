"""DeepSeek's shapes as :class:`inference.models.config.ModelConfig` carries them: multi-head latent
attention (:class:`MlaShape`) and the mixture of experts (:class:`MoeShape`), validated on construction.
Imports no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass


def require_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


@dataclass(slots=True, frozen=True)
class MlaShape:
    """Multi-head latent attention (DeepSeek-V2/V3): the cache holds one ``kv_lora_rank`` latent and one
    shared ``qk_rope_head_dim`` rotary key per token, which ``kv_b_proj`` expands into every head's keys
    and values."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            require_positive_int(name, getattr(self, name))
        if self.q_lora_rank is not None:
            require_positive_int("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: must be even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Values cached per token per layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


@dataclass(slots=True, frozen=True)
class MoeShape:
    """DeepSeek's mixture of experts: dense MLPs in the first ``first_k_dense_replace`` layers, then shared
    experts plus ``num_experts_per_tok`` routed experts. V3 (``noaux_tc``): sigmoid scores plus a learnt
    correction bias, within the ``topk_group`` best of ``n_group`` groups (a group scored by its top 2).
    V2: softmax scores, the top k overall (``greedy``) or within the best groups by their best expert
    (``group_limited_greedy``)."""

    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    topk_method: str = "noaux_tc"

    @property
    def scoring_func(self) -> str:
        return "sigmoid" if self.topk_method == "noaux_tc" else "softmax"

    @property
    def has_correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"

    def __post_init__(self) -> None:
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported ({', '.join(TOPK_METHODS)})")
        for name in ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group",
                     "topk_group"):
            require_positive_int(name, getattr(self, name))
        if self.n_shared_experts < 0 or self.first_k_dense_replace < 0:
            raise ValueError("n_shared_experts and first_k_dense_replace must be >= 0")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts ({self.n_routed_experts}) must be a multiple of "
                             f"n_group ({self.n_group})")
        if self.topk_method == "noaux_tc" and self.n_routed_experts // self.n_group < 2:
            raise ValueError("each expert group needs at least 2 experts (groups are scored by their top 2)")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        per_group = self.n_routed_experts // self.n_group
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= the experts "
                             f"in topk_group groups ({self.topk_group * per_group})")
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise ValueError(f"routed_scaling_factor: must be > 0, got {self.routed_scaling_factor!r}")

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace
