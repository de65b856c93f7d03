"""Model folders shared by the inference tests: the bundled default model and tiny random checkpoints.

The tiny checkpoints are written by Hugging Face transformers itself (``save_pretrained``), so they are
exactly what a user downloads, and carry the default model's tokenizer files to be complete folders.
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from inference.models.default import ensure_default_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TINY_SHAPE: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "initializer_range": 0.2,  # well-separated logits, so greedy argmaxes do not flip on rounding
}


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("state"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """Llama 3.1-style rope scaling, untied head, saved in several shards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY_SHAPE, rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    return _save(LlamaForCausalLM, config, tmp_path_factory.mktemp("tiny-llama"), default_model_dir,
                 max_shard_size="100KB")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """q/k/v biases and tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**TINY_SHAPE, rope_theta=1000000.0, tie_word_embeddings=True)
    return _save(Qwen2ForCausalLM, config, tmp_path_factory.mktemp("tiny-qwen2"), default_model_dir)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A sliding window longer than any test prompt, one safetensors file."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**TINY_SHAPE, sliding_window=128, tie_word_embeddings=False)
    return _save(MistralForCausalLM, config, tmp_path_factory.mktemp("tiny-mistral"), default_model_dir)


def _save(model_class: Any, config: Any, folder: Path, default_model_dir: Path, **save_kwargs: Any) -> Path:
    torch.manual_seed(0)
    model = model_class(config).eval()
    _randomize_zero_initialized(model)
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        save_kwargs["safe_serialization"] = True  # transformers 4; 5 always writes safetensors
    model.save_pretrained(folder, **save_kwargs)
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_dir / name, folder / name)
    return folder


def _randomize_zero_initialized(model: torch.nn.Module) -> None:
    """transformers starts biases at 0 and norms at 1; random values prove the loader reads them."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
            elif "norm" in name:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
