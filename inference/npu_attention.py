"""Fused paged-attention decode on Ascend NPUs, behind the engine's ``DecodeKernel`` hook.

Where it sits: on an NPU device the model runner calls :func:`make_npu_decode_kernel` once and, when it
returns a kernel, sets ``Attention.decode_kernel`` on every layer. Prefill and the writes into the cache
keep the plain-torch path in ``attention.py``.

Kernels, in order of preference; each is used only if ``hasattr(torch_npu, name)``:

1. ``torch_npu._npu_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
   block_table, context_lens, out)``: the decode path of vllm-ascend
   (``vllm_ascend/attention/attention_v1.py``, ``AscendAttentionBackendImpl``). query and out are
   ``[B, H, D]``; key_cache and value_cache are ``[num_blocks, block_size, KV, D]``, the layout of
   ``KVCacheStore``, so no copy is needed; block_table is int32 ``[B, max_blocks]`` on the device;
   context_lens is int32 ``[B]`` on the host (vllm-ascend passes its CPU ``seq_lens``).
2. ``torch_npu.npu_incre_flash_attention(query, key, value, *, actual_seq_lengths, block_table, num_heads,
   num_key_value_heads, scale_value, input_layout="BSH", block_size)``: the documented incremental flash
   attention in page-attention mode (Ascend "torch_npu API" reference). query is ``[B, 1, H*D]``; key and
   value are the caches viewed as ``[num_blocks, block_size, KV*D]``; block_table is int32;
   actual_seq_lengths is a host ``list[int]``; the result is ``[B, 1, H*D]``.

Both take float16/bfloat16 only. The INT8 cache (one scale per block and head, while the kernels' antiquant
scales are per channel) and float32 caches go through :func:`reference_decode` instead.

:func:`make_npu_decode_kernel` returns None when torch_npu is not installed, fails to import, or exposes
neither function (an old torch_npu); the reason is logged. It was written against the sources above and
has not been run on an NPU; the tests check the argument layout with a fake torch_npu on the CPU.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F

from inference.attention import DecodeKernel
from inference.device import import_torch_npu
from inference.kv_quant import KVCacheStore

logger = logging.getLogger(__name__)

FUSED_DTYPES = (torch.float16, torch.bfloat16)
PAGED_ATTENTION = "_npu_paged_attention"
INCRE_FLASH_ATTENTION = "npu_incre_flash_attention"


def make_npu_decode_kernel() -> DecodeKernel | None:
    """The fused decode kernel torch_npu offers here, or None (reason logged)."""
    torch_npu, reason = import_torch_npu()
    if torch_npu is None:
        logger.info("no NPU decode kernel: %s", reason)
        return None
    return select_npu_decode_kernel(torch_npu)


def select_npu_decode_kernel(torch_npu: ModuleType) -> DecodeKernel | None:
    """The first kernel class, in order of preference, whose torch_npu function exists."""
    for kernel_class in (PagedAttentionKernel, IncreFlashAttentionKernel):
        if hasattr(torch_npu, kernel_class.function):
            logger.info("NPU decode kernel: torch_npu.%s", kernel_class.function)
            return kernel_class(torch_npu)
    logger.info("no NPU decode kernel: torch_npu %s has neither %s nor %s",
                getattr(torch_npu, "__version__", "?"), PAGED_ATTENTION, INCRE_FLASH_ATTENTION)
    return None


def is_fused_supported(query: torch.Tensor, cache: KVCacheStore) -> bool:
    return cache.k.dtype in FUSED_DTYPES and query.dtype == cache.k.dtype


class PagedAttentionKernel:
    """``torch_npu._npu_paged_attention`` (layout in the module docstring)."""

    __slots__ = ("_torch_npu",)
    function = PAGED_ATTENTION

    def __init__(self, torch_npu: ModuleType) -> None:
        self._torch_npu = torch_npu

    def __call__(self, query: torch.Tensor, cache: KVCacheStore, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        if not is_fused_supported(query, cache):
            return reference_decode(query, cache, block_tables, context_lens, scale)
        out = torch.empty_like(query)
        self._torch_npu._npu_paged_attention(
            query=query.contiguous(), key_cache=cache.k, value_cache=cache.v,
            num_kv_heads=cache.k.shape[2], num_heads=query.shape[1], scale_value=scale,
            block_table=block_tables.to(torch.int32),
            context_lens=context_lens.to(device="cpu", dtype=torch.int32), out=out)
        return out


class IncreFlashAttentionKernel:
    """``torch_npu.npu_incre_flash_attention`` in page-attention mode (layout in the module docstring)."""

    __slots__ = ("_torch_npu",)
    function = INCRE_FLASH_ATTENTION

    def __init__(self, torch_npu: ModuleType) -> None:
        self._torch_npu = torch_npu

    def __call__(self, query: torch.Tensor, cache: KVCacheStore, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        if not is_fused_supported(query, cache):
            return reference_decode(query, cache, block_tables, context_lens, scale)
        batch, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, _ = cache.k.shape
        out: torch.Tensor = self._torch_npu.npu_incre_flash_attention(
            query.reshape(batch, 1, num_heads * head_dim),
            cache.k.view(num_blocks, block_size, num_kv_heads * head_dim),
            cache.v.view(num_blocks, block_size, num_kv_heads * head_dim),
            actual_seq_lengths=context_lens.tolist(), block_table=block_tables.to(torch.int32),
            num_heads=num_heads, num_key_value_heads=num_kv_heads, scale_value=scale,
            input_layout="BSH", block_size=block_size)
        return out.view(batch, num_heads, head_dim)


def reference_decode(query: torch.Tensor, cache: KVCacheStore, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain-torch decode, same contract as the kernels: query [B, H, D] sees its first context_lens keys."""
    k, v = cache.gather(block_tables, None)  # [B, KV, max_blocks * block_size, D]
    positions = torch.arange(k.shape[2], device=query.device)
    mask = (positions.unsqueeze(0) < context_lens.to(query.device).unsqueeze(1))[:, None, None, :]
    o = F.scaled_dot_product_attention(query.unsqueeze(2), k.to(query.dtype), v.to(query.dtype),
                                       attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != k.shape[1])
    return o.squeeze(2)
