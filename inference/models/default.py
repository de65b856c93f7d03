"""The bundled default model: a small random Llama built on first use, so nothing needs a download.

``ensure_default_model()`` returns an ordinary Hugging Face Llama folder under the state directory
(``config.json``, ``model.safetensors``, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json`` with a ChatML-like template) that ``loader.load_model`` and ``Tokenizer`` read
like any other checkpoint. Everything in it is derived from fixed seeds, so every machine builds the same
bytes: the tokenizer is a byte-level BPE trained on a corpus generated here, the weights are drawn from
one seeded generator. The model's output is noise; it exists to exercise the serving path at the speed
of a real forward pass, sized so three replicas and the control plane share a 2-core machine.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Re-exported: callers name these from here.
from inference.models.bundled import COMPLETE_MARKER as COMPLETE_MARKER
from inference.models.bundled import DEFAULT_MODEL_NAME as DEFAULT_MODEL_NAME
from inference.models.bundled import STATE_DIR_ENV as STATE_DIR_ENV
from inference.models.bundled import default_state_dir as default_state_dir
from inference.models.bundled import ensure_bundled_model
from inference.models.bundled import is_complete as is_complete

logger = logging.getLogger(__name__)


# Shape (decided for the 2-core budget; cited by the README).
HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 768
NUM_HIDDEN_LAYERS = 6
NUM_ATTENTION_HEADS = 4
NUM_KEY_VALUE_HEADS = 1  # multi-query attention: half the KV traffic per decode step of 2 heads
HEAD_DIM = HIDDEN_SIZE // NUM_ATTENTION_HEADS
VOCAB_SIZE = 512
MAX_POSITION_EMBEDDINGS = 2048
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5
INIT_STD = 0.02
WEIGHTS_SEED = 1234
CORPUS_SEED = 4321
CORPUS_CHARS = 300_000

ENDOFTEXT = "<|endoftext|>"
BEGIN_OF_TEXT = "<|begin_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, BEGIN_OF_TEXT, IM_START, IM_END)  # ids 0..3, in this order
EOS_TOKENS = (ENDOFTEXT, IM_END)

# ChatML with a leading BOS. Content may be a string or OpenAI content parts (text parts are joined).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORD_LIST = (
    "the of and to in is that it for on with as was by he she they we you at be this from or have an not "
    "are but his her which one all were there when been has more if will can would who what so no out up "
    "said about into than them then some time could only other new these two may first any like now my "
    "over such our man me even most made after also did many before must through back years where much "
    "your way well down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three small large model "
    "request token server replica latency queue batch cache memory error retry stream answer question "
    "please thank hello help system user assistant data value number test run start stop fast slow"
)
_WORDS = tuple(_WORD_LIST.split())
_PUNCTUATION = (".", ".", ".", "?", "!", ",", ";", ":")
_ROLES = ("system", "user", "assistant")


def ensure_default_model(state_dir: Path | None = None) -> Path:
    """The default model's folder, built on first use; safe against crashes and concurrent builders."""
    return ensure_bundled_model(DEFAULT_MODEL_NAME, build_default_model, state_dir)


def build_default_model(folder: Path) -> None:
    """Write every file of the default model into an existing empty folder, the marker last."""
    ids = write_tokenizer_files(folder)
    write_json(folder / "config.json", _model_config(ids))
    write_json(folder / "generation_config.json", generation_config(ids))
    save_file(build_weights(), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / COMPLETE_MARKER).write_text(f"{DEFAULT_MODEL_NAME}\n", encoding="utf-8")


def write_tokenizer_files(folder: Path) -> dict[str, int]:
    """The bundled tokenizer's files; returns the special tokens' ids."""
    tokenizer = build_tokenizer()
    tokenizer.save(str(folder / "tokenizer.json"), pretty=True)
    write_json(folder / "tokenizer_config.json", _tokenizer_config())
    return {token: _special_id(tokenizer, token) for token in SPECIAL_TOKENS}


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE: every UTF-8 string round-trips; merges learnt from :func:`training_corpus`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    bos_id = _special_id(tokenizer, BEGIN_OF_TEXT)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BEGIN_OF_TEXT} $A", pair=f"{BEGIN_OF_TEXT} $A {BEGIN_OF_TEXT}:1 $B:1",
        special_tokens=[(BEGIN_OF_TEXT, bos_id)])
    if tokenizer.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError(f"default tokenizer has {tokenizer.get_vocab_size()} tokens, "
                           f"expected {VOCAB_SIZE}")
    return tokenizer


def training_corpus() -> list[str]:
    """Deterministic English-like lines (prose, numbers, ChatML-shaped turns) of about CORPUS_CHARS."""
    rng = random.Random(CORPUS_SEED)
    lines: list[str] = []
    size = 0
    while size < CORPUS_CHARS:
        line = _chat_turn(rng) if rng.random() < 0.2 else _sentence(rng)
        lines.append(line)
        size += len(line)
    return lines


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
    return " ".join(words).capitalize() + rng.choice(_PUNCTUATION) + "\n"


def _chat_turn(rng: random.Random) -> str:
    return f"{rng.choice(_ROLES)}\n{_sentence(rng)}"


def build_weights() -> dict[str, torch.Tensor]:
    """Hugging Face-named float32 tensors: normal(0, INIT_STD) matrices, RMSNorm weights of 1."""
    generator = torch.Generator().manual_seed(WEIGHTS_SEED)

    def normal(*shape: int) -> torch.Tensor:
        return torch.normal(0.0, INIT_STD, size=shape, generator=generator)

    q_size, kv_size = NUM_ATTENTION_HEADS * HEAD_DIM, NUM_KEY_VALUE_HEADS * HEAD_DIM
    tensors = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN_SIZE)}
    for i in range(NUM_HIDDEN_LAYERS):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(q_size, HIDDEN_SIZE)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_size, HIDDEN_SIZE)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_size, HIDDEN_SIZE)
        tensors[p + "self_attn.o_proj.weight"] = normal(HIDDEN_SIZE, q_size)
        tensors[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        tensors[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        tensors[p + "mlp.down_proj.weight"] = normal(HIDDEN_SIZE, INTERMEDIATE_SIZE)
        tensors[p + "input_layernorm.weight"] = torch.ones(HIDDEN_SIZE)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN_SIZE)
    tensors["model.norm.weight"] = torch.ones(HIDDEN_SIZE)
    return tensors


def _special_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"default tokenizer lacks {token!r}")
    return int(token_id)


def _model_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN_SIZE, "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_HIDDEN_LAYERS, "num_attention_heads": NUM_ATTENTION_HEADS,
        "num_key_value_heads": NUM_KEY_VALUE_HEADS, "head_dim": HEAD_DIM, "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS, "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
        "mlp_bias": False, "tie_word_embeddings": True, "initializer_range": INIT_STD,
        "bos_token_id": ids[BEGIN_OF_TEXT], "eos_token_id": [ids[t] for t in EOS_TOKENS],
        "pad_token_id": ids[ENDOFTEXT], "torch_dtype": "float32", "use_cache": True,
    }


def generation_config(ids: dict[str, int]) -> dict[str, Any]:
    return {"bos_token_id": ids[BEGIN_OF_TEXT], "eos_token_id": [ids[t] for t in EOS_TOKENS],
            "pad_token_id": ids[ENDOFTEXT]}


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BEGIN_OF_TEXT, "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT, "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": CHAT_TEMPLATE,
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
