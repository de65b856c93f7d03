"""Tokenizer: exact round-trips, special tokens, chat templates and streaming detokenization."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest

from inference.models.config import ModelLoadError
from inference.models.default import BEGIN_OF_TEXT, ENDOFTEXT, IM_END, IM_START
from inference.tokenizer import (
    MAX_PENDING_TOKENS,
    REPLACEMENT_CHAR,
    ChatTemplateError,
    IncrementalDetokenizer,
    Tokenizer,
)

TEXTS = (
    "",
    "plain ASCII, with punctuation!?",
    "  leading and trailing spaces  \n\ttabs\r\n",
    "emoji 🤖🚀👩‍👩‍👧‍👦 and flags 🇫🇷",
    "CJK 日本語の文章と中文句子 한국어",
    "combining marks: e\u0301 a\u0308 n\u0303 (not normalized)",
    "RTL שלום مرحبا and math ∑∫√∞ ≠ ≤",
    "zero width\u200bjoiner\u200d and BOM \ufeff",
)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(default_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_any_utf8_text_round_trips_exactly(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_random_bytes_decoded_as_text_round_trip(tokenizer: Tokenizer) -> None:
    rng = random.Random(7)
    for _ in range(50):
        text = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))).decode("utf-8", errors="replace")
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_encode_adds_bos_once_unless_told_not_to(tokenizer: Tokenizer) -> None:
    bos = tokenizer.token_to_id(BEGIN_OF_TEXT)
    with_bos = tokenizer.encode("hello")
    assert with_bos[0] == bos and with_bos.count(bos) == 1
    assert tokenizer.encode("hello", add_special_tokens=False) == with_bos[1:]
    assert tokenizer.bos_token_id == bos


def test_rendered_chat_prompt_gets_no_second_bos(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.startswith(BEGIN_OF_TEXT)
    ids = tokenizer.encode(prompt)
    assert ids == tokenizer.encode(prompt, add_special_tokens=False)
    assert ids.count(tokenizer.bos_token_id) == 1


def test_special_tokens_are_skipped_when_decoding(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(f"{IM_START}user\nhi{IM_END}", add_special_tokens=False)
    assert tokenizer.token_to_id(IM_START) in ids
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == f"{IM_START}user\nhi{IM_END}"


def test_eos_ids_gather_endoftext_and_im_end(tokenizer: Tokenizer) -> None:
    assert tokenizer.eos_token_ids == {tokenizer.token_to_id(ENDOFTEXT), tokenizer.token_to_id(IM_END)}
    assert tokenizer.vocab_size == 512


def test_chat_template_renders_chatml_with_generation_prompt(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert tokenizer.apply_chat_template(messages) == (
        f"{BEGIN_OF_TEXT}{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nHi?{IM_END}\n"
        f"{IM_START}assistant\n")
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith(f"Hi?{IM_END}\n")


def test_chat_template_joins_text_content_parts(tokenizer: Tokenizer) -> None:
    parts = [{"type": "text", "text": "one "}, {"type": "image_url", "image_url": {}},
             {"type": "text", "text": "two"}]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": parts}])
    assert f"user\none two{IM_END}" in prompt


def test_chat_template_matches_transformers(default_model_dir: Path, tokenizer: Tokenizer) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(default_model_dir)
    messages = [{"role": "user", "content": "Hello 🤖"}, {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "日本語?"}]
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.encode(prompt, add_special_tokens=False) == reference.encode(prompt,
                                                                                  add_special_tokens=False)
    assert tokenizer.encode("plain text") == reference.encode("plain text")


def _copy_tokenizer(default_model_dir: Path, tmp_path: Path, **config_changes: object) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(default_model_dir / "tokenizer.json", folder)
    config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_raise_exception_in_template_becomes_chat_template_error(default_model_dir: Path,
                                                                 tmp_path: Path) -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    tokenizer = Tokenizer.from_folder(_copy_tokenizer(default_model_dir, tmp_path, chat_template=template))
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_named_templates_use_the_default_one(default_model_dir: Path, tmp_path: Path) -> None:
    templates = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    tokenizer = Tokenizer.from_folder(_copy_tokenizer(default_model_dir, tmp_path, chat_template=templates))
    assert tokenizer.apply_chat_template([]) == "DEFAULT"


def test_chat_template_jinja_file_takes_precedence(default_model_dir: Path, tmp_path: Path) -> None:
    folder = _copy_tokenizer(default_model_dir, tmp_path)
    (folder / "chat_template.jinja").write_text("{{ messages | length }}{{ bos_token }}")
    assert Tokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": ""}]) == \
        f"1{BEGIN_OF_TEXT}"


def test_missing_chat_template_names_the_folder(default_model_dir: Path, tmp_path: Path) -> None:
    folder = _copy_tokenizer(default_model_dir, tmp_path, chat_template=None)
    tokenizer = Tokenizer.from_folder(folder)
    assert not tokenizer.has_chat_template
    with pytest.raises(ModelLoadError, match="^" + re.escape(f"{folder}: no chat template")):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_syntax_error_fails_at_load(default_model_dir: Path, tmp_path: Path) -> None:
    folder = _copy_tokenizer(default_model_dir, tmp_path, chat_template="{% for %}")
    with pytest.raises(ModelLoadError, match="chat template has a syntax error"):
        Tokenizer.from_folder(folder)


def test_add_bos_token_prepends_bos_when_post_processor_does_not(default_model_dir: Path,
                                                                 tmp_path: Path) -> None:
    folder = _copy_tokenizer(default_model_dir, tmp_path)
    raw = json.loads((folder / "tokenizer.json").read_text())
    raw["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(raw))
    tokenizer = Tokenizer.from_folder(folder)
    ids = tokenizer.encode("hello")
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: file not found"):
        Tokenizer.from_folder(tmp_path)


# --- streaming ----------------------------------------------------------------------------------------

def _stream(tokenizer: Tokenizer, ids: list[int], **kwargs: object) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, **kwargs)  # type: ignore[arg-type]
    chunks = [detokenizer.push(token_id) for token_id in ids]
    return [*chunks, detokenizer.flush()]


@pytest.mark.parametrize("text", TEXTS[1:])
def test_streamed_chunks_never_split_a_character(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    chunks = _stream(tokenizer, ids)
    assert all(REPLACEMENT_CHAR not in chunk for chunk in chunks)
    assert "".join(chunks) == tokenizer.decode(ids) == text


def test_multibyte_characters_span_several_tokens_in_these_tests(tokenizer: Tokenizer) -> None:
    # Guards the test above: with a 512-token vocabulary, CJK and emoji are split into byte tokens.
    assert len(tokenizer.encode("🤖", add_special_tokens=False)) > 1
    assert tokenizer.decode(tokenizer.encode("🤖", add_special_tokens=False)[:1]) == REPLACEMENT_CHAR


def test_stream_after_a_prompt_continues_the_prompt_text(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("The answer is", add_special_tokens=False)
    ids = tokenizer.encode(" 42 🤖 done.", add_special_tokens=False)
    chunks = _stream(tokenizer, ids, prompt_ids=prompt)
    assert "".join(chunks) == " 42 🤖 done."


def test_stream_skips_special_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(f"hi{IM_END}", add_special_tokens=False)
    assert "".join(_stream(tokenizer, ids)) == "hi"


def test_stream_of_long_generated_text_is_released_promptly(tokenizer: Tokenizer) -> None:
    text = "Hello there, this is a longer answer. " * 20
    ids = tokenizer.encode(text, add_special_tokens=False)
    chunks = _stream(tokenizer, ids)
    assert "".join(chunks) == text
    assert chunks[-1] == ""  # ASCII never waits for the flush


def test_invalid_bytes_do_not_hold_the_stream_forever(tokenizer: Tokenizer) -> None:
    lone_continuation = tokenizer.encode("é", add_special_tokens=False)[-1:]  # 0xA9 on its own
    chunks = _stream(tokenizer, lone_continuation * (MAX_PENDING_TOKENS + 1))
    assert chunks[MAX_PENDING_TOKENS] != ""
    assert "".join(chunks) == tokenizer.decode(lone_continuation * (MAX_PENDING_TOKENS + 1))


# --- logprob token strings ------------------------------------------------------------------------

def _sentencepiece_folder(tmp_path: Path) -> Path:
    """A Llama-2 style vocabulary (Unigram, "▁" word marks, byte fallback, the Strip decoder) built here."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "▁hello", "▁world", ",",
              "▁hé", "l", "o", "▁the", "▁end", "."]
    scores = [(piece, -1.0 if piece.startswith("▁") else -5.0) for piece in pieces]
    backend = Backend(models.Unigram(scores, unk_id=0, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    return tmp_path


def test_sentencepiece_token_bytes_join_into_the_text_they_decode_to(tmp_path: Path) -> None:
    """Logprobs show each token's own bytes: "▁hello" is " hello" (decoding it alone strips the space), and
    byte-fallback pieces are their bytes, so the tokens of an output join into its text."""
    tokenizer = Tokenizer.from_folder(_sentencepiece_folder(tmp_path))
    prompt = tokenizer.encode("hello")
    output = tokenizer.encode(" world, héllo ✓ the end.", add_special_tokens=False)
    pieces = [tokenizer.token_bytes(t) for t in output]
    assert pieces[:2] == [b" world", b","] and b"\xe2" in pieces  # ✓ is three byte-fallback pieces

    text = "".join(_stream(tokenizer, output, prompt_ids=prompt))
    assert b"".join(pieces).decode() == text == " world, héllo ✓ the end."
    assert tokenizer.token_bytes(prompt[0]) == b"<s>" and tokenizer.token_bytes(prompt[1]) == b" hello"


def test_byte_level_token_bytes_join_into_the_text_they_decode_to(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("The answer is", add_special_tokens=False)
    output = tokenizer.encode(" 42 🤖 done.", add_special_tokens=False)
    text = "".join(_stream(tokenizer, output, prompt_ids=prompt))
    assert b"".join(tokenizer.token_bytes(t) for t in output).decode() == text == " 42 🤖 done."


@pytest.mark.parametrize("text", [*TEXTS[1:], "Hello there, this is a longer answer. " * 20])
@pytest.mark.parametrize("streamed", [0, 3, 17])
def test_a_flush_with_the_last_tokens_releases_what_pushing_them_one_at_a_time_does(
        tokenizer: Tokenizer, text: str, streamed: int) -> None:
    """Offline requests decode their text at the end: ``streamed`` tokens pushed one at a time (a request
    with stop strings, or one aborted), the rest given to the flush."""
    prompt = tokenizer.encode("prompt ✓", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    one_at_a_time = "".join(_stream(tokenizer, ids, prompt_ids=prompt))
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    chunks = [detokenizer.push(token_id) for token_id in ids[:streamed]]
    assert "".join([*chunks, detokenizer.flush(ids[streamed:])]) == one_at_a_time == text
