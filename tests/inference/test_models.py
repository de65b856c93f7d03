"""Our Llama-family forward pass against transformers, and what a broken model folder reports."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.models.config import ModelConfig, ModelLoadError, RopeScaling
from inference.models.llama import LlamaForCausalLM
from inference.models.loader import load_model
from inference.tokenizer import Tokenizer

PROMPTS = (
    "Hello",
    "The replica answers every request from the queue.",
    "Once upon a time, 1234 small models served tokens; 日本語 and emoji 🤖 too.\nNext line",
    " ".join(["the cache holds blocks of keys and values"] * 5),
)
CPU = torch.device("cpu")


def _reference_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def _our_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)))
        return model.compute_logits(hidden)


def _assert_logits_match(folder: Path) -> None:
    tokenizer = Tokenizer.from_folder(folder)
    model, _ = load_model(folder, device=CPU, dtype=torch.float32)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        expected = _reference_logits(folder, ids)
        actual = _our_logits(model, ids)
        assert actual.shape == expected.shape
        relative = ((actual - expected).abs().max() / expected.abs().max()).item()
        assert relative < 1e-4, f"{prompt!r}: relative error {relative:.2e}"
        assert torch.equal(actual.argmax(-1), expected.argmax(-1))


def test_llama_logits_match_transformers(tiny_llama_dir: Path) -> None:
    _assert_logits_match(tiny_llama_dir)


def test_qwen2_logits_match_transformers(tiny_qwen2_dir: Path) -> None:
    _assert_logits_match(tiny_qwen2_dir)


def test_mistral_logits_match_transformers(tiny_mistral_dir: Path) -> None:
    _assert_logits_match(tiny_mistral_dir)


def test_sharded_llama_checkpoint_is_read_from_every_shard(tiny_llama_dir: Path) -> None:
    index = json.loads((tiny_llama_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, config = load_model(tiny_llama_dir, device=CPU, dtype=torch.float32)
    assert config.rope_scaling == RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=64)
    assert model.lm_head is not None


def test_config_reads_qwen2_biases_and_tied_embeddings(tiny_qwen2_dir: Path) -> None:
    config = ModelConfig.from_folder(tiny_qwen2_dir)
    assert (config.model_type, config.attention_bias, config.o_proj_bias) == ("qwen2", True, False)
    assert config.tie_word_embeddings and config.sliding_window is None


def test_mistral_sliding_window_caps_max_model_len(tiny_mistral_dir: Path) -> None:
    config = ModelConfig.from_folder(tiny_mistral_dir)
    assert (config.sliding_window, config.max_position_embeddings, config.max_model_len) == (128, 256, 128)


def test_generation_config_eos_ids_join_config_eos_ids(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    config = ModelConfig.from_folder(folder)
    assert set(config.eos_token_ids) >= {7, 9}


def test_bfloat16_load_keeps_greedy_tokens_close(tiny_llama_dir: Path) -> None:
    model32, _ = load_model(tiny_llama_dir, device=CPU, dtype=torch.float32)
    model16, _ = load_model(tiny_llama_dir, device=CPU, dtype=torch.bfloat16)
    ids = Tokenizer.from_folder(tiny_llama_dir).encode(PROMPTS[2])
    logits32, logits16 = _our_logits(model32, ids), _our_logits(model16, ids)
    assert logits16.dtype == torch.float32 and model16.embed_tokens.weight.dtype == torch.bfloat16
    agreement = (logits32.argmax(-1) == logits16.argmax(-1)).float().mean().item()
    assert agreement > 0.8


def test_model_with_capped_positions_keeps_a_short_rope_table(tiny_llama_dir: Path) -> None:
    model, _ = load_model(tiny_llama_dir, device=CPU, dtype=torch.float32, max_positions=32)
    assert model.rotary.cos.shape == (32, 8)


# --- config.json parsing ------------------------------------------------------------------------------

def _llama_raw(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }
    raw.update(overrides)
    return {k: v for k, v in raw.items() if v is not None}


def test_transformers_4_config_layout_uses_defaults_for_optional_fields() -> None:
    config = ModelConfig.from_dict(_llama_raw(), source="config.json")
    assert (config.num_key_value_heads, config.head_dim, config.rope_theta) == (4, 16, 10000.0)
    assert config.eos_token_ids == (2,) and config.torch_dtype == "bfloat16"
    assert config.rope_scaling is None and not config.tie_word_embeddings


def test_legacy_rope_scaling_type_key_is_read() -> None:
    config = ModelConfig.from_dict(_llama_raw(rope_theta=500000.0,
                                              rope_scaling={"type": "linear", "factor": 2.0}),
                                   source="config.json")
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("linear", factor=2.0)


def test_eos_token_id_may_be_a_list() -> None:
    config = ModelConfig.from_dict(_llama_raw(eos_token_id=[5, 6, 5]), source="config.json")
    assert config.eos_token_ids == (5, 6)


@pytest.mark.parametrize(("overrides", "field"), [
    ({"hidden_size": None}, "'hidden_size' is missing"),
    ({"num_attention_heads": "4"}, "'num_attention_heads' must be a positive integer"),
    ({"hidden_act": "gelu"}, "'hidden_act' must be 'silu'"),
    ({"mlp_bias": True}, "'mlp_bias' must be false"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "'rope_scaling' has rope type 'yarn', which is not supported"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic', which is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "field 'rope_scaling.low_freq_factor' is missing"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                       "original_max_position_embeddings": 64}},
     "high_freq_factor must be > low_freq_factor"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
     "'rope_parameters' has rope type 'yarn'"),
    ({"eos_token_id": "2"}, "'eos_token_id' must be a token id"),
    ({"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
])
def test_bad_config_field_is_named_in_the_error(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ModelLoadError, match=r"^/m/config\.json: ") as caught:
        ModelConfig.from_dict(_llama_raw(**overrides), source="/m/config.json")
    assert field in str(caught.value)


def test_qwen2_sliding_window_is_refused() -> None:
    raw = _llama_raw(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True)
    with pytest.raises(ModelLoadError, match="'use_sliding_window'"):
        ModelConfig.from_dict(raw, source="config.json")


# --- broken folders -----------------------------------------------------------------------------------

def _exactly(message: str) -> str:
    return f"^{re.escape(message)}$"


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "model"))


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del raw[key]
    path.write_text(json.dumps(raw))


def test_missing_config_json_names_the_file(tiny_mistral_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_mistral_dir, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=_exactly(f"{folder}/config.json: file not found")):
        load_model(folder, device=CPU, dtype=torch.float32)


def test_missing_folder_says_so(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere", device=CPU, dtype=torch.float32)


def test_missing_config_field_names_file_and_field(tiny_mistral_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_mistral_dir, tmp_path)
    _edit_config(folder, hidden_size=None)
    expected = f"{folder}/config.json: field 'hidden_size' is missing"
    with pytest.raises(ModelLoadError, match=_exactly(expected)):
        load_model(folder, device=CPU, dtype=torch.float32)


def test_unsupported_architecture_is_named(tiny_mistral_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_mistral_dir, tmp_path)
    _edit_config(folder, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    expected = (f"{folder}/config.json: architecture 'GPT2LMHeadModel' is not supported "
                "(supported: Llama, Qwen2, Mistral, DeepSeek-V2, DeepSeek-V3)")
    with pytest.raises(ModelLoadError) as caught:
        load_model(folder, device=CPU, dtype=torch.float32)
    assert str(caught.value) == expected


def test_invalid_json_names_the_file(tiny_mistral_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_mistral_dir, tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: is not valid JSON"):
        load_model(folder, device=CPU, dtype=torch.float32)


def _rewrite_weights(folder: Path, edit: Any) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_names_file_and_tensor(tiny_mistral_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_mistral_dir, tmp_path)
    _rewrite_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=_exactly(f"{folder}/model.safetensors: tensor "
                                                     "'model.layers.1.mlp.up_proj.weight' is missing")):
        load_model(folder, device=CPU, dtype=torch.float32)


def test_wrong_shape_names_file_tensor_and_shapes(tiny_mistral_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_mistral_dir, tmp_path)
    _rewrite_weights(folder, lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(ModelLoadError, match=r"model.safetensors: tensor 'model.norm.weight' has shape "
                                             r"\[63\], expected \[64\]$"):
        load_model(folder, device=CPU, dtype=torch.float32)


def test_unexpected_tensor_is_named(tiny_mistral_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_mistral_dir, tmp_path)
    _rewrite_weights(folder, lambda t: t.update({"model.layers.0.extra.weight": torch.ones(2)}))
    with pytest.raises(ModelLoadError, match=re.escape("unexpected tensor 'model.layers.0.extra.weight'")):
        load_model(folder, device=CPU, dtype=torch.float32)


def test_missing_shard_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    expected = f"index.json: shard '{shard.name}' is listed but not found"
    with pytest.raises(ModelLoadError, match=re.escape(expected)):
        load_model(folder, device=CPU, dtype=torch.float32)


@pytest.mark.parametrize("outside", ["../outside.safetensors", "{folder}/../outside.safetensors"])
def test_shard_outside_the_model_folder_is_refused(tiny_llama_dir: Path, tmp_path: Path,
                                                   outside: str) -> None:
    """A sharded index that names a file outside its folder (``../x``, or an absolute path) is refused
    before anything is opened, even though that file is a valid shard."""
    folder = _copy(tiny_llama_dir, tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.rename(tmp_path / "outside.safetensors")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = outside.format(folder=folder)
    index["weight_map"] = {k: name if v == shard.name else v for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    expected = f"shard {name!r} is not a file name in the model's folder"
    with pytest.raises(ModelLoadError, match=re.escape(expected)):
        load_model(folder, device=CPU, dtype=torch.float32)


def test_folder_without_weights_says_what_it_looked_for(tiny_mistral_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_mistral_dir, tmp_path)
    (folder / "model.safetensors").unlink()
    expected = "no model.safetensors or model.safetensors.index.json found"
    with pytest.raises(ModelLoadError, match=re.escape(expected)):
        load_model(folder, device=CPU, dtype=torch.float32)


def test_loading_a_model_and_building_an_engine_leave_torchs_compiler_unimported(
        default_model_dir: Path) -> None:
    """Built on the meta device through torch's initialisers, a model imported torch._dynamo (1.1 s of a
    replica's start); the loader skips the initialisers, and nothing else on the engine's path may bring
    the compiler back."""
    import subprocess
    import sys

    state = str(default_model_dir.parents[1])
    script = ("import sys; from inference.config import EngineConfig; "
              "from inference.engine import LLMEngine; "
              f"LLMEngine('default', EngineConfig(), state_dir={state!r}); "
              "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
