"""The offline benchmark's KV-cache section: what a token costs the engine's paged cache, against the
per-head keys and values the same model would cache without latent attention.

The engine's pool is sized in bytes (``kv_cache_memory_bytes``), so bytes per token decide how many blocks,
and so how many concurrent tokens, a replica holds. DeepSeek-V3's latent attention stores one row of
``kv_lora_rank + qk_rope_head_dim`` values per token and layer; the multi-head equivalent stores every
head's key and value (:func:`inference.model_runner.multi_head_bytes_per_token`). A Llama-family model
stores its key/value heads either way, so both columns agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from inference.model_runner import multi_head_bytes_per_token

if TYPE_CHECKING:
    from inference.engine import LLMEngine


@dataclass(slots=True, frozen=True)
class KvCacheFootprint:
    """``stored_bytes_per_token``: all layers, as the engine stores it (an int8 cache's scales included);
    ``multi_head_bytes_per_token``: per-head keys and values in the cache's element type."""

    attention: str  # "latent" or "multi-head"
    values_per_token_layer: int  # as stored
    multi_head_values_per_token_layer: int
    element_bytes: int
    num_layers: int
    block_size: int
    num_blocks: int
    bytes_per_block: int
    stored_bytes_per_token: int
    multi_head_bytes_per_token: int

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def multi_head_blocks(self) -> int:
        """Blocks of the multi-head cache that the engine's pool bytes would hold."""
        return self.pool_bytes // (self.multi_head_bytes_per_token * self.block_size)

    @property
    def ratio(self) -> float:
        """Multi-head bytes per token over stored bytes per token."""
        return self.multi_head_bytes_per_token / self.stored_bytes_per_token


def kv_cache_footprint(engine: LLMEngine) -> KvCacheFootprint:
    mc, layout = engine.model_config, engine.runner.layout
    element = torch.int8 if engine.config.kv_cache_dtype == "int8" else engine.dtype
    multi_head = multi_head_bytes_per_token(mc, element)
    multi_head_values = multi_head // (element.itemsize * mc.num_hidden_layers)
    if layout.latent_width is not None:
        attention, stored_values = "latent", layout.latent_width
    else:
        attention, stored_values = "multi-head", 2 * layout.num_kv_heads * layout.head_dim
    return KvCacheFootprint(attention, stored_values, multi_head_values, element.itemsize, layout.num_layers,
                            layout.block_size, layout.num_blocks, layout.bytes_per_block,
                            layout.bytes_per_token, multi_head)


def format_kv_cache(fp: KvCacheFootprint) -> str:
    per_token = f"values x {fp.element_bytes} B x {fp.num_layers} layers"
    stored_how = "latent rows" if fp.attention == "latent" else "keys and values of the KV heads"
    lines = [
        "KV cache (bytes per token, all layers)",
        f"  stored (engine)     {fp.stored_bytes_per_token:>12,} B  ({stored_how}: "
        f"{fp.values_per_token_layer} {per_token}); pool {fp.pool_bytes / 2**20:.1f} MiB = "
        f"{fp.num_blocks:,} blocks of {fp.block_size} tokens",
    ]
    if fp.attention == "latent":
        lines.append(
            f"  multi-head equiv.   {fp.multi_head_bytes_per_token:>12,} B  (every head's key and value: "
            f"{fp.multi_head_values_per_token_layer} {per_token}); {fp.ratio:.1f}x the stored; the same pool "
            f"would hold {fp.multi_head_blocks:,} blocks")
    else:
        lines.append(f"  multi-head equiv.   {fp.multi_head_bytes_per_token:>12,} B  (the same: the cache "
                     f"already holds per-head keys and values); {fp.multi_head_blocks:,} blocks")
    return "\n".join(lines)
