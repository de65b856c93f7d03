"""Engine configuration: one typed home for every engine knob, with defaults that run out of the box;
and the replica's trace export settings (:class:`TracingConfig`, which the gateway shares)."""

from __future__ import annotations

import urllib.parse
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
    # CPU: linear weights laid out once at load (inference/packed_linear.py): in the C++ kernel's blocks
    # where the kernel is on and runs the dtype (float32 with AVX-512, bfloat16 with AVX512_BF16), else
    # reordered for oneDNN, with its primitives for every row count a step can run built at load too
    # (memory flat from then on). None: on where it applies (a CPU, float32 or bfloat16, the kernel or a
    # torch with oneDNN's linear; engine.packed_weights says why not); True: the same, with a warning where
    # it cannot; False: torch's linear.
    pack_linear_weights: bool | None = None
    # CPU: pure-decode attention (and, built with AVX-512, the Llama layers' norm and activation) by a C++
    # extension that reads keys and values in place from the paged cache (inference/cpu_attention.py),
    # built once per machine on first use. None: on where it applies (a CPU, float32 or bfloat16, no INT8
    # KV cache) and builds; where it does not, the torch path (engine.cpu_decode_kernel says why). True:
    # the same, with a warning when it cannot run. False: the torch path.
    cpu_decode_kernel: bool | None = None
    # Pure-decode steps replayed as CUDA graphs at bucketed batch sizes and context widths
    # (inference/decode_graphs.py). None: on where the device is CUDA. Asked for without CUDA, the same
    # padded buckets run eagerly (what tests check on a CPU).
    decode_graphs: bool | None = None
    # The longest context a captured step covers (longer ones run eagerly): a graph gathers keys and values
    # at its bucket's full width, so this bounds that memory (max_num_seqs x this x KV bytes per token).
    decode_graphs_max_context: int = 4096

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("block_size", self.block_size)
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        _positive("decode_graphs_max_context", self.decode_graphs_max_context)
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


def switch_args(option: str, value: bool | None) -> list[str]:
    """A replica command's on/off switch (``--X`` / ``--no-X``) for a tri-state engine setting such as
    ``EngineConfig.cpu_decode_kernel``: None gives no flag, the replica's own default."""
    if value is None:
        return []
    return [option if value else "--no-" + option.removeprefix("--")]


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


@dataclass(slots=True, frozen=True)
class TracingConfig:
    """OpenTelemetry trace export (OTLP over HTTP/protobuf); off while ``endpoint`` is empty.

    ``endpoint`` is the collector's traces URL (``http://collector:4318/v1/traces``); a URL without a path
    gets OTLP's ``/v1/traces``. ``sample_ratio`` is the share of new traces kept: at a replica, a request
    that arrives with a W3C ``traceparent`` follows its parent's decision instead, so a sampled gateway
    span's replica spans are sampled too (the gateway trusts a client's "sampled" flag no further than
    the ratio: :func:`inference.tracing.start_provider`).
    """

    endpoint: str = ""
    sample_ratio: float = 1.0

    def __post_init__(self) -> None:
        for name, reason in tracing_problems(self.endpoint, self.sample_ratio):
            raise ValueError(f"{name}: {reason}")

    @property
    def is_enabled(self) -> bool:
        return bool(self.endpoint)

    @property
    def traces_url(self) -> str:
        """Where spans are POSTed: the endpoint, with ``/v1/traces`` when it names no path."""
        url = urllib.parse.urlsplit(self.endpoint)
        return self.endpoint if url.path not in ("", "/") else self.endpoint.rstrip("/") + "/v1/traces"


def tracing_problems(endpoint: str, sample_ratio: float) -> list[tuple[str, str]]:
    """(setting, reason) for each bad trace export setting, named as the gateway's config names them."""
    problems = []
    url = urllib.parse.urlsplit(endpoint)
    if endpoint and (url.scheme not in ("http", "https") or not url.hostname):
        problems.append(("otlp_traces_endpoint", f"must be an http(s) URL such as "
                                                 f"http://127.0.0.1:4318/v1/traces, got {endpoint!r}"))
    if isinstance(sample_ratio, bool) or not isinstance(sample_ratio, (int, float)) \
            or not 0.0 <= sample_ratio <= 1.0:
        problems.append(("otlp_sample_ratio", f"must be in [0, 1], got {sample_ratio!r}"))
    return problems
