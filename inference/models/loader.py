"""Hugging Face folder -> ready :class:`CausalLM` (Llama family, DeepSeek-V3) on the chosen device and dtype.

Reads ``config.json`` through :class:`ModelConfig`, checks every tensor of ``model.safetensors`` (or the
shards a ``model.safetensors.index.json`` names) against the shapes the config implies, then fuses q/k/v
and gate/up (and stacks DeepSeek's experts, :mod:`inference.models.deepseek_weights`) as it copies them into
a module built on the ``meta`` device, so no weight is ever allocated twice.
Every problem with the folder surfaces as one :class:`ModelLoadError` naming the file and tensor;
safetensors' own errors are translated here and nowhere else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from inference.models import deepseek_weights
from inference.models.config import ModelConfig, ModelLoadError, read_json
from inference.models.deepseek import DeepseekV3ForCausalLM
from inference.models.llama import CausalLM, LlamaForCausalLM

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Tensors some checkpoints carry that the model recomputes or does not need.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

# An open safetensors file (``safe_open``'s handle, which has no public type).
_Handle = Any


@dataclass(slots=True, frozen=True)
class CheckpointFiles:
    """Which safetensors file holds each tensor; ``listing`` is the file that promised it (for errors)."""

    listing: Path
    tensor_files: dict[str, Path]

    def __post_init__(self) -> None:
        if not self.tensor_files:
            raise ModelLoadError(self.listing, "holds no tensors")


def load_model(folder: str | Path, *, device: torch.device, dtype: torch.dtype,
               max_positions: int | None = None) -> tuple[CausalLM, ModelConfig]:
    """Load a checkpoint for inference (eval mode, no grad).

    ``max_positions`` caps the RoPE table; by default it covers ``max_position_embeddings``.
    """
    started = time.perf_counter()
    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    files = find_checkpoint_files(folder)
    family = DeepseekV3ForCausalLM if config.mla is not None else LlamaForCausalLM
    with torch.device("meta"), _no_random_init():
        model = family(config, max_positions=max_positions)
    with _open_all(files) as handles:
        check_tensors(files, handles, config)
        state = {name: t.to(device=device, dtype=torch.float32 if _stays_float32(name) else dtype)
                 for name, t in _fused_tensors(handles, config)}
    model.load_state_dict(state, strict=True, assign=True)
    model.materialize(device)
    model.requires_grad_(False).eval()
    logger.info("loaded %s (%s, %d layers) from %s onto %s as %s in %.2fs", config.architecture,
                config.model_type, config.num_hidden_layers, folder, device, dtype,
                time.perf_counter() - started)
    return model, config


# What torch's layers call to fill their parameters when built. On the meta device there is nothing to fill,
# and the checkpoint's tensors replace them; yet the call goes through torch's reference implementations,
# whose first use imports torch's compiler: 1.1 of the 2.7 s a replica took to start on a quiet machine.
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                   "kaiming_normal_", "xavier_uniform_", "xavier_normal_")


@contextmanager
def _no_random_init() -> Iterator[None]:
    """While a model is built on the meta device, torch's parameter initialisers return their tensor as
    it is."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}

    def skip(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor

    try:
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, skip)
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


def find_checkpoint_files(folder: Path) -> CheckpointFiles:
    if (folder / INDEX_FILE).is_file():
        return _sharded_files(folder / INDEX_FILE)
    single = folder / SINGLE_FILE
    if single.is_file():
        return CheckpointFiles(single, dict.fromkeys(_tensor_names(single), single))
    hint = " (PyTorch .bin checkpoints are not supported)" if any(folder.glob("*.bin")) else ""
    raise ModelLoadError(folder, f"no {SINGLE_FILE} or {INDEX_FILE} found{hint}")


def _sharded_files(index: Path) -> CheckpointFiles:
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelLoadError(index, "field 'weight_map' is missing or is not an object of file names")
    tensor_files: dict[str, Path] = {}
    for shard_name in sorted(set(weight_map.values())):
        if not _is_plain_file_name(shard_name):  # the index must not reach outside its folder
            raise ModelLoadError(index, f"shard {shard_name!r} is not a file name in the model's folder")
        shard = index.parent / shard_name
        if not shard.is_file():
            raise ModelLoadError(index, f"shard {shard_name!r} is listed but not found")
        for name in _tensor_names(shard):
            tensor_files[name] = shard
    for name, shard_name in weight_map.items():
        if tensor_files.get(name) != index.parent / shard_name:
            raise ModelLoadError(index.parent / shard_name, f"tensor {name!r} is listed in {INDEX_FILE} "
                                 "but not stored in this shard")
    return CheckpointFiles(index, tensor_files)


def _is_plain_file_name(name: str) -> bool:
    """A name of a file directly in the folder: no directory part, not absolute, not ``.`` or ``..``."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name \
        and "\0" not in name


def _tensor_names(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(path, f"is not a readable safetensors file: {exc}") from exc


@contextmanager
def _open_all(files: CheckpointFiles) -> Iterator[dict[str, _Handle]]:
    """Open each file once; yields tensor name -> open safetensors handle."""
    with ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(str(path), framework="pt"))
                   for path in set(files.tensor_files.values())}
        yield {name: handles[path] for name, path in files.tensor_files.items()}


def _stays_float32(name: str) -> bool:
    return name.endswith(deepseek_weights.FLOAT32_SUFFIXES)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape, for every tensor the checkpoint must hold."""
    if config.mla is not None:
        return deepseek_weights.expected_shapes(config)
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden),
                                          "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        shapes.update(_layer_shapes(config, f"model.layers.{i}.", hidden, inter, q_size, kv_size))
    return shapes


def _layer_shapes(config: ModelConfig, prefix: str, hidden: int, inter: int, q_size: int,
                  kv_size: int) -> dict[str, tuple[int, ...]]:
    attn = prefix + "self_attn."
    shapes: dict[str, tuple[int, ...]] = {
        attn + "q_proj.weight": (q_size, hidden), attn + "k_proj.weight": (kv_size, hidden),
        attn + "v_proj.weight": (kv_size, hidden), attn + "o_proj.weight": (hidden, q_size),
        prefix + "mlp.gate_proj.weight": (inter, hidden), prefix + "mlp.up_proj.weight": (inter, hidden),
        prefix + "mlp.down_proj.weight": (hidden, inter),
        prefix + "input_layernorm.weight": (hidden,), prefix + "post_attention_layernorm.weight": (hidden,),
    }
    if config.attention_bias:
        shapes.update({attn + "q_proj.bias": (q_size,), attn + "k_proj.bias": (kv_size,),
                       attn + "v_proj.bias": (kv_size,)})
    if config.o_proj_bias:
        shapes[attn + "o_proj.bias"] = (hidden,)
    return shapes


def check_tensors(files: CheckpointFiles, handles: dict[str, _Handle], config: ModelConfig) -> None:
    """Every expected tensor present with its shape and a float dtype; nothing unexplained left over."""
    expected = expected_shapes(config)
    for name, shape in expected.items():
        if name not in handles:
            raise ModelLoadError(files.listing, f"tensor {name!r} is missing")
        piece = handles[name].get_slice(name)
        if tuple(piece.get_shape()) != shape:
            raise ModelLoadError(files.tensor_files[name], f"tensor {name!r} has shape "
                                 f"{list(piece.get_shape())}, expected {list(shape)}")
        if piece.get_dtype() not in FLOAT_DTYPES:
            raise ModelLoadError(files.tensor_files[name], f"tensor {name!r} has dtype {piece.get_dtype()}; "
                                 "only float checkpoints are supported")
    for name in sorted(handles.keys() - expected.keys()):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            logger.debug("ignoring lm_head.weight: tie_word_embeddings is true")
        elif config.mla is not None and deepseek_weights.is_extra_layer(name, config):
            logger.debug("ignoring %s: a multi-token-prediction layer, unused for decoding", name)
        elif not name.endswith(_IGNORED_SUFFIXES):
            raise ModelLoadError(files.tensor_files[name], f"unexpected tensor {name!r}")


def _fused_tensors(handles: dict[str, _Handle], config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Our parameter names and tensors, in checkpoint dtype on CPU, q/k/v and gate/up concatenated."""

    def get(name: str) -> torch.Tensor:
        tensor: torch.Tensor = handles[name].get_tensor(name)
        return tensor

    if config.mla is not None:
        yield from deepseek_weights.fused_tensors(get, config)
        return

    yield "embed_tokens.weight", get("model.embed_tokens.weight")
    yield "norm.weight", get("model.norm.weight")
    if not config.tie_word_embeddings:
        yield "lm_head.weight", get("lm_head.weight")
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        yield dst + "self_attn.qkv_proj.weight", torch.cat([get(attn + f"{p}_proj.weight") for p in "qkv"])
        if config.attention_bias:
            yield dst + "self_attn.qkv_proj.bias", torch.cat([get(attn + f"{p}_proj.bias") for p in "qkv"])
        yield dst + "self_attn.o_proj.weight", get(attn + "o_proj.weight")
        if config.o_proj_bias:
            yield dst + "self_attn.o_proj.bias", get(attn + "o_proj.bias")
        yield dst + "mlp.gate_up_proj.weight", torch.cat([get(src + "mlp.gate_proj.weight"),
                                                          get(src + "mlp.up_proj.weight")])
        yield dst + "mlp.down_proj.weight", get(src + "mlp.down_proj.weight")
        yield dst + "input_layernorm.weight", get(src + "input_layernorm.weight")
        yield dst + "post_attention_layernorm.weight", get(src + "post_attention_layernorm.weight")
