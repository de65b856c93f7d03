"""The bundled default model: same bytes everywhere, built once, safe to build concurrently."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from inference.models import default
from inference.models.config import ModelConfig
from inference.models.default import (
    COMPLETE_MARKER,
    DEFAULT_MODEL_NAME,
    build_tokenizer,
    default_state_dir,
    ensure_default_model,
)
from inference.models.loader import load_model
from inference.tokenizer import Tokenizer


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_default_model_builds_byte_identical_files_twice(default_model_dir: Path, tmp_path: Path) -> None:
    again = ensure_default_model(tmp_path)
    assert again != default_model_dir
    assert _digests(again) == _digests(default_model_dir)
    assert set(_digests(again)) == {COMPLETE_MARKER, "config.json", "generation_config.json",
                                    "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def test_tokenizer_training_is_identical_in_another_process() -> None:
    script = ("import hashlib; from inference.models.default import build_tokenizer; "
              "print(hashlib.sha256(build_tokenizer().to_str().encode()).hexdigest())")
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parents[2])
    assert other.stdout.strip() == hashlib.sha256(build_tokenizer().to_str().encode()).hexdigest()


def test_default_model_loads_with_the_documented_shape(default_model_dir: Path) -> None:
    model, config = load_model(default_model_dir, device=torch.device("cpu"), dtype=torch.float32)
    assert config == ModelConfig.from_folder(default_model_dir)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (256, 768, 6)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 1, 64)
    assert (config.vocab_size, config.max_position_embeddings) == (512, 2048)
    assert config.tie_word_embeddings
    tokenizer = Tokenizer.from_folder(default_model_dir)
    assert set(config.eos_token_ids) == tokenizer.eos_token_ids
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]),
                           add_special_tokens=False)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))
    assert logits.shape == (len(ids), 512) and torch.isfinite(logits).all()


def test_default_model_matches_transformers(default_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    model, _ = load_model(default_model_dir, device=torch.device("cpu"), dtype=torch.float32)
    ids = Tokenizer.from_folder(default_model_dir).encode("Check the replica latency, please.")
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
        actual = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))
    assert ((actual - expected).abs().max() / expected.abs().max()).item() < 1e-4


def test_second_call_returns_the_folder_without_rebuilding(default_model_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(folder: Path) -> None:
        raise AssertionError("rebuilt a complete default model")

    monkeypatch.setattr(default, "build_default_model", refuse)
    assert ensure_default_model(default_model_dir.parents[1]) == default_model_dir


def test_concurrent_builds_into_one_state_dir_both_get_a_complete_model(tmp_path: Path) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def build() -> None:
        barrier.wait()
        try:
            results.append(ensure_default_model(tmp_path))
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    folder = tmp_path / "models" / DEFAULT_MODEL_NAME
    assert results == [folder, folder]
    assert (folder / COMPLETE_MARKER).is_file()
    leftovers = [p.name for p in folder.parent.iterdir() if p.name != DEFAULT_MODEL_NAME]
    assert leftovers == [f".{DEFAULT_MODEL_NAME}.lock"]  # no staging folder is left behind


def test_folder_without_marker_is_rebuilt(default_model_dir: Path, tmp_path: Path) -> None:
    half = tmp_path / "models" / DEFAULT_MODEL_NAME
    half.mkdir(parents=True)
    (half / "config.json").write_text("{")  # what an interrupted copy by hand might leave
    folder = ensure_default_model(tmp_path)
    assert folder == half
    assert _digests(folder) == _digests(default_model_dir)


def test_failed_build_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(default, "build_default_model", crash)
    with pytest.raises(OSError, match="disk full"):
        ensure_default_model(tmp_path)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [f".{DEFAULT_MODEL_NAME}.lock"]


def test_state_dir_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMSRE_STATE_DIR", str(tmp_path))
    assert default_state_dir() == tmp_path
    monkeypatch.delenv("LLMSRE_STATE_DIR")
    assert default_state_dir() == Path.home() / ".local" / "state" / "llm-sre"


def test_the_torch_free_registry_names_every_bundled_model_where_its_builder_puts_it(
        default_model_dir: Path) -> None:
    from inference.engine import BUNDLED_MODELS
    from inference.models.bundled import BUNDLED_FOLDERS, built_folder

    assert set(BUNDLED_FOLDERS) == set(BUNDLED_MODELS)
    state = default_model_dir.parents[1]
    assert built_folder("default", state) == default_model_dir == BUNDLED_MODELS["default"](state)
    assert built_folder("default-moe", default_model_dir) is None  # not built there
    assert built_folder("a/folder", state) is None


def test_the_control_plane_finds_a_built_model_without_importing_torch(default_model_dir: Path) -> None:
    """Importing torch cost the control plane 2 s at every start (in a thread, holding the loop back while
    its replicas waited to be spawned) only to see that the model was already built."""
    script = ("import sys; from pathlib import Path; from controlplane.fleet.models import "
              "ensure_bundled_model as ensure; "
              f"print(ensure('default', Path({str(default_model_dir.parents[1])!r}))); "
              "assert 'torch' not in sys.modules, 'torch imported'")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(default_model_dir)
