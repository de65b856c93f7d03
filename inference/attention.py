"""Attention over block tables in plain torch (CPU, CUDA, NPU).

The model runner lays out one step's tokens flat: every prefill chunk first (each sequence's chunk
contiguous), then one token per decoding sequence. It publishes an :class:`AttentionContext` before the
forward pass; each :class:`Attention` layer writes this step's keys and values into its paged cache through
``slot_mapping`` and attends over the sequence's blocks through its block table.

Without a context (``get_context() is None``) a layer treats its input as one sequence and runs plain
causal attention with no cache: the path used to compare logits with a reference model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inference import step_profile
from inference.kv_quant import KVCacheStore
from inference.step_profile import ATTEND, CACHE_WRITE, GATHER, MODEL_REST


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's prefill chunk in the flat batch."""

    query_start: int  # index of its first token in the flat batch
    query_len: int  # tokens computed this step
    context_len: int  # tokens the chunk attends over, its own included
    block_table: torch.Tensor  # int64 [num_blocks] covering context_len tokens


@dataclass(slots=True)
class DecodeGroup:
    """Decoding sequences of similar context length, attended together over padded block tables.

    The runner sorts decodes by context length and cuts them into groups so that padding to the
    longest context in a group wastes little gathering.
    """

    start: int  # first row in the flat batch
    end: int
    block_tables: torch.Tensor  # int64 [n, max_blocks], padded with block 0
    context_lens: torch.Tensor  # int64 [n]
    # bool [n, 1, 1, max_blocks * block_size]: True = attend; and the same as an additive score bias in the
    # model's dtype (0 = attend, -inf = padding). None where a decode kernel reads the lengths instead.
    mask: torch.Tensor | None
    bias: torch.Tensor | None


def score_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A decode group's mask as an additive bias on its scores: 0 where True (attend), -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def decode_group(start: int, block_tables: torch.Tensor, context_lens: torch.Tensor, *, block_size: int,
                 dtype: torch.dtype, masked: bool = True) -> DecodeGroup:
    """The group of rows ``start..`` over padded ``block_tables`` [n, width], its mask and score bias built
    from ``context_lens`` (on the tables' device: the eager path's tensors, or a decode graph's buffers);
    without them when not ``masked`` (a decode kernel reads the lengths)."""
    n, width = block_tables.shape
    if not masked:
        return DecodeGroup(start, start + n, block_tables, context_lens, None, None)
    span = torch.arange(width * block_size, device=block_tables.device)
    mask = (span.unsqueeze(0) < context_lens.unsqueeze(1)).view(n, 1, 1, -1)
    return DecodeGroup(start, start + n, block_tables, context_lens, mask, score_bias(mask, dtype))


@dataclass(slots=True)
class AttentionContext:
    slot_mapping: torch.Tensor  # int64 [num_tokens]: where each token's K/V goes in the flat cache
    prefills: list[PrefillChunk]
    decodes: list[DecodeGroup]


_context: AttentionContext | None = None


def get_context() -> AttentionContext | None:
    return _context


@contextmanager
def attention_context(ctx: AttentionContext) -> Iterator[None]:
    global _context
    previous, _context = _context, ctx
    try:
        yield
    finally:
        _context = previous


# A fused kernel (e.g. torch-npu's paged attention) may replace the plain-torch decode path; it takes
# (query [B, H, D], cache, block_tables, context_lens, scale) and returns [B, H, D].
DecodeKernel = Callable[[torch.Tensor, KVCacheStore, torch.Tensor, torch.Tensor, float], torch.Tensor]


class Attention(nn.Module):
    """Scaled dot-product attention with grouped-query heads over a paged KV cache."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = head_dim**-0.5 if scale is None else scale
        self.cache: KVCacheStore | None = None  # bound by the model runner
        self.decode_kernel: DecodeKernel | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KV, D]; returns [T, H, D]."""
        ctx = get_context()
        if ctx is None or self.cache is None:
            return self._dense_causal(q, k, v)
        step_profile.lap(MODEL_REST)
        self.cache.write(k, v, ctx.slot_mapping)
        step_profile.lap(CACHE_WRITE)
        out = torch.empty_like(q)
        for chunk in ctx.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            if chunk.context_len == chunk.query_len:  # nothing cached before it: attend to itself
                out[rows] = self._dense_causal(q[rows], k[rows], v[rows])
            else:
                out[rows] = self._prefill(q[rows], chunk)
            step_profile.lap(ATTEND)
        for group in ctx.decodes:
            out[group.start:group.end] = self._decode(q[group.start:group.end], group)
            step_profile.lap(ATTEND)
        return out

    def _dense_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return o.squeeze(0).transpose(0, 1)

    def _prefill(self, q: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        assert self.cache is not None
        k, v = self.cache.gather(chunk.block_table.unsqueeze(0), chunk.context_len)  # [1, KV, L, D]
        step_profile.lap(GATHER)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
        # Query i (absolute position past + i) sees keys 0..past + i.
        past = chunk.context_len - chunk.query_len
        rows = torch.arange(chunk.query_len, device=q.device).unsqueeze(1) + past
        cols = torch.arange(chunk.context_len, device=q.device).unsqueeze(0)
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=cols <= rows, scale=self.scale,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return o.squeeze(0).transpose(0, 1)

    def _decode(self, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """One query token per sequence. Each KV head's query heads form a short block of queries against
        that head's keys: two batched matrix products, with no copy of the keys and values per query head
        (which ``scaled_dot_product_attention``'s grouped-query path makes on CPU, at 2-3x the time)."""
        assert self.cache is not None
        if self.decode_kernel is not None:
            return self.decode_kernel(q, self.cache, group.block_tables, group.context_lens, self.scale)
        k, v = self.cache.gather(group.block_tables, None)  # [n, KV, max_blocks * block_size, D]
        step_profile.lap(GATHER)
        n = q.shape[0]
        queries = q.reshape(n, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
        assert group.bias is not None, "a decode group without its bias is for a decode kernel"
        scores = torch.matmul(queries, k.transpose(-1, -2)).mul_(self.scale).add_(group.bias)  # [n, KV, G, L]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        return torch.matmul(probs, v).view(n, self.num_heads, self.head_dim)
