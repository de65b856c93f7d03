"""Paged KV-cache storage for one attention layer: full precision, or INT8 with per-block per-head scales.

Layout: ``[num_blocks, block_size, num_kv_heads, head_dim]`` so that a flat slot index
(``block * block_size + offset``) addresses one token's keys for every head. Multi-head latent attention
(DeepSeek-V3) caches one row per token instead of keys and values: :class:`LatentCacheStore` and
:class:`Int8LatentCacheStore` keep it as a single "head" whose width is the latent plus the rotary key.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0


class GatherWorkspace:
    """Reusable buffers for gathered blocks, shared by every layer (layers run one after another).

    Gathering into a fresh tensor each time costs page faults on every step; reusing a buffer that only
    grows avoids them.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, name: str, rows: int, cols: int, *, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < rows * cols:
            buf = torch.empty(max(rows * cols, 2 * (0 if buf is None else buf.numel())), dtype=dtype,
                              device=device)
            self._buffers[key] = buf
        return buf[:rows * cols].view(rows, cols)


class KVCacheStore:
    """Full-precision keys and values."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 *, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.workspace = GatherWorkspace()  # the model runner shares one across layers
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * block_size * num_kv_heads * head_dim * dtype.itemsize

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.k.view(-1, *self.k.shape[2:]).index_copy_(0, slots, k.to(self.k.dtype))
        self.v.view(-1, *self.v.shape[2:]).index_copy_(0, slots, v.to(self.v.dtype))

    def gather(self, block_tables: torch.Tensor, length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``block_tables`` [B, nb] as [B, KV, L, D]; L = length or nb * block_size."""
        return (self._gather("k", self.k, block_tables, length),
                self._gather("v", self.v, block_tables, length))

    def _gather(self, name: str, cache: torch.Tensor, block_tables: torch.Tensor,
                length: int | None) -> torch.Tensor:
        return _gather_blocks(self.workspace, name, cache, block_tables, self.block_size, length)


class Int8KVCacheStore(KVCacheStore):
    """INT8 keys and values; each (block, kv head) has one scale that only grows while the block fills.

    A block is filled from offset 0 upwards, so a write at offset 0 starts a fresh block: its scale is
    reset. When a new token needs a larger scale, the block's earlier tokens are requantized to it.
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.int8, device=device)
        self.out_dtype = dtype
        self.k_scale = torch.zeros((num_blocks, num_kv_heads), dtype=torch.float32, device=device)
        self.v_scale = torch.zeros((num_blocks, num_kv_heads), dtype=torch.float32, device=device)

    @staticmethod
    def bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * (block_size * num_kv_heads * head_dim + num_kv_heads * 4)

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        fresh = blocks[slots % self.block_size == 0]
        self._write_one(self.k, self.k_scale, k, slots, blocks, fresh)
        self._write_one(self.v, self.v_scale, v, slots, blocks, fresh)

    def _write_one(self, cache: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, slots: torch.Tensor,
                   blocks: torch.Tensor, fresh: torch.Tensor) -> None:
        x = x.float()
        scale[fresh] = 0.0
        touched = torch.unique(blocks)
        old = scale[touched].clone()
        need = x.abs().amax(dim=-1) / INT8_MAX  # [T, KV]
        scale.scatter_reduce_(0, blocks.unsqueeze(1).expand_as(need), need, "amax", include_self=True)
        new = scale[touched]
        grown = (new > old) & (old > 0)
        if bool(grown.any()):
            ratio = torch.where(grown, old / new.clamp_min(1e-30), torch.ones_like(new))
            cache[touched] = torch.round(cache[touched].float() * ratio[:, None, :, None]).to(torch.int8)
        s = scale[blocks].clamp_min(1e-30).unsqueeze(-1)  # [T, KV, 1]
        q = torch.round(x / s).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, q)

    def gather(self, block_tables: torch.Tensor, length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        return (self._dequant(self.k, self.k_scale, block_tables, length),
                self._dequant(self.v, self.v_scale, block_tables, length))

    def _dequant(self, cache: torch.Tensor, scale: torch.Tensor, block_tables: torch.Tensor,
                 length: int | None) -> torch.Tensor:
        b, nb = block_tables.shape
        flat = block_tables.flatten()
        scales = scale.index_select(0, flat)[:, None, :, None].to(self.out_dtype)
        raw = self.workspace.take("int8", flat.numel(), cache[0].numel(), dtype=cache.dtype,
                                  device=cache.device)
        x = _select_blocks(cache, flat, raw).view(-1, *cache.shape[1:]).to(self.out_dtype) * scales
        x = x.view(b, nb * self.block_size, *cache.shape[2:])
        if length is not None:
            x = x[:, :length]
        return x.transpose(1, 2)


def _gather_blocks(workspace: GatherWorkspace, name: str, cache: torch.Tensor, block_tables: torch.Tensor,
                   block_size: int, length: int | None) -> torch.Tensor:
    """The blocks of ``block_tables`` [B, nb] of a [blocks, block_size, heads, dim] cache as [B, heads, L,
    dim]; L = length or nb * block_size."""
    b, nb = block_tables.shape
    flat = block_tables.flatten()
    out = workspace.take(name, flat.numel(), cache[0].numel(), dtype=cache.dtype, device=cache.device)
    x = _select_blocks(cache, flat, out).view(b, nb * block_size, *cache.shape[2:])
    if length is not None:
        x = x[:, :length]
    return x.transpose(1, 2)


def _select_blocks(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rows of ``cache`` [num_blocks, ...] as [len(block_ids), block elements].

    On CPU, index_select over a 2-D view copies whole rows and is 20-30x faster than over the 4-D
    cache or advanced indexing (measured: 0.25 ms against 6.9 ms for 1,000 blocks of 8 KiB).
    """
    return torch.index_select(cache.view(cache.shape[0], -1), 0, block_ids, out=out)


class LatentCacheStore:
    """MLA: one ``[kv_lora_rank | qk_rope_head_dim]`` row per token, shared by every head; no values.

    Laid out as a one-head cache, so gathering returns ``[B, 1, L, width]``: the key tensor of a
    one-key-head attention, whose first ``kv_lora_rank`` columns are also its values.
    """

    def __init__(self, num_blocks: int, block_size: int, width: int, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.workspace = GatherWorkspace()
        self.k = torch.zeros((num_blocks, block_size, 1, width), dtype=dtype, device=device)

    @staticmethod
    def latent_bytes_per_block(block_size: int, width: int, dtype: torch.dtype) -> int:
        return block_size * width * dtype.itemsize

    def write_latent(self, latent: torch.Tensor, slots: torch.Tensor) -> None:
        """latent: [T, width]."""
        self.k.view(-1, self.k.shape[-1]).index_copy_(0, slots, latent.to(self.k.dtype))

    def gather_latent(self, block_tables: torch.Tensor, length: int | None) -> torch.Tensor:
        """Rows of ``block_tables`` [B, nb] as [B, 1, L, width]; L = length or nb * block_size."""
        return _gather_blocks(self.workspace, "k", self.k, block_tables, self.block_size, length)


class Int8LatentCacheStore(LatentCacheStore):
    """INT8 latent rows with one float32 scale per token.

    A row mixes the normalised latent with the rotary key, whose magnitudes differ from token to token;
    a scale per token (4 bytes against the row's ``width``) keeps each row's own range and never needs
    requantizing as a block fills.
    """

    def __init__(self, num_blocks: int, block_size: int, width: int, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(num_blocks, block_size, width, dtype=torch.int8, device=device)
        self.out_dtype = dtype
        self.scale = torch.zeros((num_blocks, block_size), dtype=torch.float32, device=device)

    @staticmethod
    def latent_bytes_per_block(block_size: int, width: int, dtype: torch.dtype) -> int:
        return block_size * (width + 4)

    def write_latent(self, latent: torch.Tensor, slots: torch.Tensor) -> None:
        x = latent.float()
        scale = (x.abs().amax(dim=-1) / INT8_MAX).clamp_min(1e-30)  # [T]
        q = torch.round(x / scale.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        self.k.view(-1, self.k.shape[-1]).index_copy_(0, slots, q)
        self.scale.view(-1).index_copy_(0, slots, scale)

    def gather_latent(self, block_tables: torch.Tensor, length: int | None) -> torch.Tensor:
        b, nb = block_tables.shape
        flat = block_tables.flatten()
        raw = self.workspace.take("int8", flat.numel(), self.k[0].numel(), dtype=self.k.dtype,
                                  device=self.k.device)
        rows = _select_blocks(self.k, flat, raw).view(b, nb * self.block_size, -1)
        scales = self.scale.index_select(0, flat).view(b, nb * self.block_size, 1)
        x = rows.to(self.out_dtype) * scales.to(self.out_dtype)
        if length is not None:
            x = x[:, :length]
        return x.unsqueeze(1)


LatentStore = LatentCacheStore | Int8LatentCacheStore
