"""The model's shape, read once from a Hugging Face folder's ``config.json``.

First stop of loading: :meth:`ModelConfig.from_folder` turns ``config.json`` (and the eos ids of
``generation_config.json``) into a typed, validated :class:`ModelConfig`; ``loader`` then builds the
module from it and fills the weights. Accepted: the Llama family (Llama, Qwen2, Mistral) and DeepSeek-V3
(multi-head latent attention and mixture-of-experts: :class:`MlaShape`, :class:`MoeShape`), only in the
variants the engine computes exactly; anything else fails here with one message that names the file and
the field. Imports no torch.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from inference.models.deepseek_shapes import MlaShape, MoeShape, require_positive_int

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# architecture name in config.json -> model_type
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")  # latent attention and mixtures of experts
SUPPORTED_ROPE_TYPES = ("linear", "llama3", "yarn")
YARN_MODEL_TYPES = DEEPSEEK_TYPES  # the families whose attention applies YaRN's mscale here
DEFAULT_ROPE_THETA = 10000.0

_MISSING: Any = object()
_POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")


class ModelLoadError(ValueError):
    """A model folder cannot be loaded; the message names the file and the field or tensor at fault."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """RoPE frequency scaling as transformers computes it: ``linear``, Llama 3.1's ``llama3``, or ``yarn``
    (DeepSeek-V3: NTK-by-parts frequencies, cos/sin scaled by ``attention_factor``, softmax by mscale)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # None: derived from factor and the mscales, as transformers does
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {self.rope_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if not self.factor > 0:
            raise ValueError(f"factor: must be > 0, got {self.factor!r}")
        if self.rope_type == "llama3":
            if not self.high_freq_factor > self.low_freq_factor > 0:
                raise ValueError("high_freq_factor must be > low_freq_factor > 0, got "
                                 f"{self.high_freq_factor!r} and {self.low_freq_factor!r}")
            if self.original_max_position_embeddings <= 0:
                raise ValueError("original_max_position_embeddings: must be > 0")
        if self.rope_type == "yarn" and self.original_max_position_embeddings <= 0:
            raise ValueError("original_max_position_embeddings: must be > 0")

    @property
    def cos_sin_scale(self) -> float:
        """YaRN's scale of the cos/sin tables (1.0 for the other types)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """DeepSeek's correction of the softmax scale under YaRN: mscale(factor, mscale_all_dim) squared."""
        if self.rope_type != "yarn" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Everything the engine needs to know about a checkpoint's shape and special tokens."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v
    o_proj_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    mla: MlaShape | None = None  # DeepSeek-V3
    moe: MoeShape | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported")
        for name in _POSITIVE_INT_FIELDS:
            require_positive_int(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim: must be even for rotary embeddings, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be > 0, got {value!r}")
        if self.sliding_window is not None:
            require_positive_int("sliding_window", self.sliding_window)
        if (self.model_type in DEEPSEEK_TYPES) != (self.mla is not None and self.moe is not None):
            raise ValueError("DeepSeek needs both its latent-attention and its expert shapes, "
                             "and only it has them")

    @property
    def max_model_len(self) -> int:
        """Longest context computed exactly: dense attention is wrong past a sliding window."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` when present) from a model folder."""
        folder = Path(folder)
        config = cls.from_dict(read_json(folder / CONFIG_FILE), source=folder / CONFIG_FILE)
        if config.max_model_len < config.max_position_embeddings:
            logger.info("%s: sliding window of %d tokens caps the context (max_position_embeddings %d)",
                        folder, config.max_model_len, config.max_position_embeddings)
        extra = eos_token_ids_in(folder / GENERATION_CONFIG_FILE)
        if not extra:
            return config
        return replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra)))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str | Path) -> ModelConfig:
        """Validate a parsed ``config.json``; ``source`` names the file in error messages."""
        return _parse(_Fields(raw, str(source)))


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object, translating every failure into :class:`ModelLoadError`."""
    if not path.is_file():
        raise ModelLoadError(path, "file not found" if path.parent.is_dir()
                             else f"folder {str(path.parent)!r} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(path, f"cannot be read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ModelLoadError(path, f"is not valid JSON (line {exc.lineno}, column {exc.colno})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(path, f"must hold a JSON object, not {type(data).__name__}")
    return data


class _Fields:
    """Typed access to a raw config dict; every failure names the file and the field."""

    def __init__(self, raw: dict[str, Any], source: str, prefix: str = "") -> None:
        self.raw = raw
        self.source = source
        self.prefix = prefix  # names nested fields: "rope_scaling.factor"

    def error(self, name: str, problem: str) -> ModelLoadError:
        return ModelLoadError(self.source, f"field {self.prefix + name!r} {problem}")

    def get(self, name: str, default: Any = _MISSING) -> Any:
        value = self.raw.get(name, default)
        if value is _MISSING:
            raise self.error(name, "is missing")
        return value

    def positive_int(self, name: str, default: Any = _MISSING) -> int:
        value = self.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.error(name, f"must be a positive integer, got {value!r}")
        return value

    def optional_int(self, name: str) -> int | None:
        return None if self.raw.get(name) is None else self.positive_int(name)

    def positive_float(self, name: str, default: Any = _MISSING) -> float:
        value = self.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise self.error(name, f"must be a positive number, got {value!r}")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise self.error(name, f"must be true or false, got {value!r}")
        return value


def _parse(f: _Fields) -> ModelConfig:
    architecture, model_type = _architecture(f)
    _check_unsupported_features(f, model_type)
    heads = f.positive_int("num_attention_heads")
    hidden = f.positive_int("hidden_size")
    rope_theta, rope_scaling = _rope(f, model_type)
    qkv_bias, o_bias = _attention_biases(f, model_type)
    try:
        mla, moe = (_mla(f), _moe(f, model_type)) if model_type in DEEPSEEK_TYPES else (None, None)
        return ModelConfig(
            architecture=architecture, model_type=model_type,
            vocab_size=f.positive_int("vocab_size"), hidden_size=hidden,
            intermediate_size=f.positive_int("intermediate_size"),
            num_hidden_layers=f.positive_int("num_hidden_layers"),
            num_attention_heads=heads, num_key_value_heads=f.positive_int("num_key_value_heads", heads),
            head_dim=mla.qk_rope_head_dim if mla else _head_dim(f, hidden, heads),
            rms_norm_eps=f.positive_float("rms_norm_eps", 1e-6),
            rope_theta=rope_theta, rope_scaling=rope_scaling,
            max_position_embeddings=f.positive_int("max_position_embeddings"),
            tie_word_embeddings=f.boolean("tie_word_embeddings", False),
            attention_bias=qkv_bias, o_proj_bias=o_bias, sliding_window=_sliding_window(f, model_type),
            bos_token_id=_token_id(f, "bos_token_id"), eos_token_ids=_token_ids(f, "eos_token_id"),
            torch_dtype=_dtype(f), mla=mla, moe=moe,
        )
    except ValueError as exc:
        raise ModelLoadError(f.source, str(exc)) from exc


def _mla(f: _Fields) -> MlaShape:
    return MlaShape(q_lora_rank=f.optional_int("q_lora_rank"), kv_lora_rank=f.positive_int("kv_lora_rank"),
                    qk_nope_head_dim=f.positive_int("qk_nope_head_dim"),
                    qk_rope_head_dim=f.positive_int("qk_rope_head_dim"),
                    v_head_dim=f.positive_int("v_head_dim"),
                    rope_interleave=f.boolean("rope_interleave", True))


def _moe(f: _Fields, model_type: str) -> MoeShape:
    n_group = f.optional_int("n_group") or 1
    topk_method = "noaux_tc" if model_type == "deepseek_v3" else f.get("topk_method", "greedy")
    if model_type == "deepseek_v2" and f.boolean("norm_topk_prob", False):
        # transformers' DeepSeek-V2 never normalises the routed weights; the engine follows it
        raise f.error("norm_topk_prob", "must be false for DeepSeek-V2 (transformers does not normalise)")
    return MoeShape(moe_intermediate_size=f.positive_int("moe_intermediate_size"),
                    n_routed_experts=f.positive_int("n_routed_experts"),
                    n_shared_experts=_non_negative_int(f, "n_shared_experts", 0),
                    num_experts_per_tok=f.positive_int("num_experts_per_tok"),
                    n_group=n_group, topk_group=f.optional_int("topk_group") or n_group,
                    first_k_dense_replace=_non_negative_int(f, "first_k_dense_replace", 0),
                    routed_scaling_factor=f.positive_float("routed_scaling_factor", 1.0),
                    norm_topk_prob=f.boolean("norm_topk_prob", False), topk_method=topk_method)


def _non_negative_int(f: _Fields, name: str, default: int) -> int:
    value = f.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise f.error(name, f"must be an integer >= 0, got {value!r}")
    return value


def _architecture(f: _Fields) -> tuple[str, str]:
    supported = "supported: Llama, Qwen2, Mistral, DeepSeek-V2, DeepSeek-V3"
    architectures = f.get("architectures", None)
    if architectures is None:
        model_type = f.get("model_type")
        by_type = {t: a for a, t in SUPPORTED_ARCHITECTURES.items()}
        if model_type not in by_type:
            raise f.error("model_type", f"{model_type!r} is not supported ({supported})")
        return by_type[model_type], model_type
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise f.error("architectures", f"must list exactly one architecture, got {architectures!r}")
    name = architectures[0]
    if name not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f.source, f"architecture {name!r} is not supported ({supported})")
    return name, SUPPORTED_ARCHITECTURES[name]


def _check_unsupported_features(f: _Fields, model_type: str) -> None:
    act = f.get("hidden_act", "silu")
    if act != "silu":
        raise f.error("hidden_act", f"must be 'silu', got {act!r}")
    if f.boolean("mlp_bias", False):
        raise f.error("mlp_bias", "must be false: biases in the MLP are not supported")
    if model_type == "qwen2" and f.boolean("use_sliding_window", False):
        raise f.error("use_sliding_window", "must be false: Qwen2 sliding-window attention is not supported")
    if f.get("partial_rotary_factor", 1.0) != 1.0:
        raise f.error("partial_rotary_factor", "must be 1.0: partial rotary embeddings are not supported")
    if model_type in DEEPSEEK_TYPES:
        _check_deepseek_features(f, model_type)


def _check_deepseek_features(f: _Fields, model_type: str) -> None:
    """The original DeepSeek releases' fields, where they would change the computation."""
    if f.get("quantization_config", None) is not None:
        raise f.error("quantization_config", "is set: quantized (FP8) checkpoints are not supported; "
                      "use a bfloat16 or float32 conversion")
    v3 = model_type == "deepseek_v3"
    name = "DeepSeek-V3" if v3 else "DeepSeek-V2"
    scoring = "sigmoid" if v3 else "softmax"
    if f.get("scoring_func", scoring) != scoring:
        raise f.error("scoring_func", f"must be {scoring!r} for {name}, got {f.get('scoring_func')!r}")
    methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    method = f.get("topk_method", methods[0])
    if method not in methods:
        wanted = " or ".join(repr(m) for m in methods)
        raise f.error("topk_method", f"must be {wanted} for {name}, got {method!r}")


def _head_dim(f: _Fields, hidden: int, heads: int) -> int:
    head_dim = f.optional_int("head_dim")
    if head_dim is not None:
        return head_dim
    if hidden % heads != 0:
        raise f.error("hidden_size", f"({hidden}) must be a multiple of num_attention_heads ({heads}) "
                      "when head_dim is not given")
    return hidden // heads


def _attention_biases(f: _Fields, model_type: str) -> tuple[bool, bool]:
    if model_type == "qwen2":
        return True, False  # Qwen2 always biases q/k/v and never o_proj
    if model_type == "mistral":
        return False, False
    bias = f.boolean("attention_bias", False)
    return bias, bias


def _sliding_window(f: _Fields, model_type: str) -> int | None:
    if model_type != "mistral":
        return None  # Qwen2's field is inert unless use_sliding_window, which is refused above
    return f.optional_int("sliding_window")


def _rope(f: _Fields, model_type: str) -> tuple[float, RopeScaling | None]:
    """Both layouts: transformers 4 (``rope_theta`` + ``rope_scaling``) and 5 (``rope_parameters``)."""
    params = f.get("rope_parameters", None)
    if params is not None:
        if not isinstance(params, dict):
            raise f.error("rope_parameters", f"must be an object, got {params!r}")
        nested = _Fields(params, f.source, prefix="rope_parameters.")
        theta = nested.positive_float("rope_theta", f.raw.get("rope_theta", DEFAULT_ROPE_THETA))
        return theta, _rope_scaling(f, "rope_parameters", params, model_type)
    theta = f.positive_float("rope_theta", DEFAULT_ROPE_THETA)
    scaling = f.get("rope_scaling", None)
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        raise f.error("rope_scaling", f"must be an object or null, got {scaling!r}")
    return theta, _rope_scaling(f, "rope_scaling", scaling, model_type)


def _rope_scaling(f: _Fields, field: str, params: dict[str, Any], model_type: str) -> RopeScaling | None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    supported = [t for t in SUPPORTED_ROPE_TYPES if t != "yarn" or model_type in YARN_MODEL_TYPES]
    if rope_type not in supported:
        raise f.error(field, f"has rope type {rope_type!r}, which is not supported "
                      f"(supported: default, {', '.join(supported)})")
    p = _Fields(params, f.source, prefix=f"{field}.")
    if rope_type == "linear":
        return RopeScaling("linear", factor=p.positive_float("factor"))
    if rope_type == "yarn":
        return _yarn(f, field, p)
    factor, low, high = (p.positive_float(name) for name in ("factor", "low_freq_factor", "high_freq_factor"))
    original = p.positive_int("original_max_position_embeddings")
    try:
        return RopeScaling("llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                           original_max_position_embeddings=original)
    except ValueError as exc:
        raise f.error(field, str(exc)) from exc


def _yarn(f: _Fields, field: str, p: _Fields) -> RopeScaling:
    original = p.positive_int("original_max_position_embeddings")
    # transformers: without a factor, the ratio of the context lengths is the factor
    factor = p.positive_float("factor", f.positive_int("max_position_embeddings") / original)

    def optional(name: str) -> float | None:
        return None if p.raw.get(name) is None else p.positive_float(name)

    return RopeScaling("yarn", factor=factor, original_max_position_embeddings=original,
                       beta_fast=optional("beta_fast") or 32.0, beta_slow=optional("beta_slow") or 1.0,
                       mscale=optional("mscale"), mscale_all_dim=optional("mscale_all_dim"),
                       attention_factor=optional("attention_factor"), truncate=p.boolean("truncate", True))


def _token_id(f: _Fields, name: str) -> int | None:
    value = f.get(name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise f.error(name, f"must be a token id (integer >= 0) or null, got {value!r}")
    return value


def _token_ids(f: _Fields, name: str) -> tuple[int, ...]:
    """An id field that may be null, one id or a list of ids (``eos_token_id``)."""
    value = f.get(name, None)
    values = [] if value is None else value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise f.error(name, f"must be a token id, a list of token ids or null, got {value!r}")
    return tuple(dict.fromkeys(values))


def _dtype(f: _Fields) -> str | None:
    name = "torch_dtype" if "torch_dtype" in f.raw else "dtype"  # transformers 5 writes "dtype"
    value = f.raw.get(name)
    if value is not None and not isinstance(value, str):
        raise f.error(name, f"must be a string, got {value!r}")
    return value


def eos_token_ids_in(path: Path) -> tuple[int, ...]:
    """The ``eos_token_id`` ids of a JSON file such as ``generation_config.json``; () when it is absent."""
    if not path.is_file():
        return ()
    return _token_ids(_Fields(read_json(path), str(path)), "eos_token_id")
