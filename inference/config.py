"""Engine configuration: one typed home for every engine knob, with defaults that run out of the box."""

from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(slots=True)
class EngineConfig:
    """Scheduling and memory limits of one engine.

    ``num_kv_blocks`` of 0 means "size the pool from ``kv_cache_memory_bytes``".
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    num_kv_blocks: int = 0
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    device: str = "auto"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA/NPU
    num_threads: int = 0  # 0: torch's default

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("block_size", self.block_size)
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.num_kv_blocks < 0:
            raise ValueError(f"num_kv_blocks: must be >= 0, got {self.num_kv_blocks}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len: must be >= 0, got {self.max_model_len}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype: must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads: must be >= 0, got {self.num_threads}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens: must be >= block_size")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
