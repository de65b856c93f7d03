"""Multi-head latent attention (DeepSeek-V2/V3) over block tables.

The paged cache holds, per token and layer, one row ``[latent | rotary key]`` (``kv_lora_rank`` +
``qk_rope_head_dim`` values) shared by every head, written through the step's ``slot_mapping`` like the
keys and values of :class:`inference.attention.Attention`. ``kv_b_proj`` maps a latent to every head's
non-rotary key and value.

- Prefill expands the chunk's context into per-head keys and values and attends as multi-head attention
  (the context is read once per chunk; expansion is the cheaper side when many queries share it).
- Decode never expands the cache: the query's non-rotary part is multiplied into latent space through the
  key half of ``kv_b_proj`` (weight absorption), the step attends with one shared key head over the cached
  rows, and the value half of ``kv_b_proj`` maps the attended latent to each head's output.

Without an attention context the layer attends causally over its input as one sequence (the reference
path of the equivalence tests), expanding like prefill.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference import step_profile
from inference.attention import DecodeGroup, PrefillChunk, get_context
from inference.kv_quant import LatentStore
from inference.step_profile import ATTEND, CACHE_WRITE, GATHER, MODEL_REST


class LatentAttention(nn.Module):
    """Attention for queries [T, H, nope + rope] over latent rows [T, latent + rope]; returns [T, H, v]."""

    unpacked_linears = ("kv_b_proj",)  # its weight is absorbed into the decode query and output

    def __init__(self, *, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = scale
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.cache: LatentStore | None = None  # bound by the model runner

    @property
    def latent_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def forward(self, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if ctx is None or self.cache is None:
            return self._expanded(q, latent, None)
        step_profile.lap(MODEL_REST)
        self.cache.write_latent(latent, ctx.slot_mapping)
        step_profile.lap(CACHE_WRITE)
        out = q.new_empty(q.shape[0], self.num_heads, self.v_head_dim)
        for chunk in ctx.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            if chunk.context_len == chunk.query_len:  # nothing cached before it
                out[rows] = self._expanded(q[rows], latent[rows], None)
            else:
                out[rows] = self._prefill(q[rows], chunk)
            step_profile.lap(ATTEND)
        for group in ctx.decodes:
            out[group.start:group.end] = self._decode(q[group.start:group.end], group)
            step_profile.lap(ATTEND)
        return out

    # ---- prefill: expand the context into per-head keys and values ------------------------------------
    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [L, latent + rope] -> keys [H, L, nope + rope], values [H, L, v]."""
        length = latent.shape[0]
        c, k_rope = torch.split(latent, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c).view(length, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.unsqueeze(1).expand(length, self.num_heads, -1)), dim=-1)
        return k.transpose(0, 1), v.transpose(0, 1)

    def _expanded(self, q: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        k, v = self._expand(latent)
        o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return o.squeeze(0).transpose(0, 1)

    def _prefill(self, q: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        assert self.cache is not None
        rows = self.cache.gather_latent(chunk.block_table.unsqueeze(0), chunk.context_len)[0, 0]
        step_profile.lap(GATHER)
        past = chunk.context_len - chunk.query_len
        query_pos = torch.arange(chunk.query_len, device=q.device).unsqueeze(1) + past
        key_pos = torch.arange(chunk.context_len, device=q.device).unsqueeze(0)
        return self._expanded(q, rows, key_pos <= query_pos)

    # ---- decode: absorb kv_b_proj into the query and the output -------------------------------------
    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as [H, nope, latent] (keys) and [H, v, latent] (values)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim,
                                       self.kv_lora_rank)
        return w[:, :self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    def _decode(self, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        assert self.cache is not None
        w_k, w_v = self._absorbed_weights()
        q_nope, q_rope = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w_k)
        query = torch.cat((q_latent, q_rope), dim=-1).unsqueeze(2)  # [n, H, 1, latent + rope]
        step_profile.lap(ATTEND)
        rows = self.cache.gather_latent(group.block_tables, None)  # [n, 1, L, latent + rope]
        step_profile.lap(GATHER)
        assert group.mask is not None, "latent layers decode through the torch path, which masks"
        o = F.scaled_dot_product_attention(query, rows, rows[..., :self.kv_lora_rank], attn_mask=group.mask,
                                           scale=self.scale, enable_gqa=True)  # [n, H, 1, latent]
        return torch.einsum("nhc,hvc->nhv", o.squeeze(2), w_v)
