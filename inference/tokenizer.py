"""Text <-> token ids for one model folder, and chat messages -> prompt text.

The server renders chat messages with :meth:`Tokenizer.apply_chat_template`, encodes the prompt with
:meth:`Tokenizer.encode`, and streams generated text through one :class:`IncrementalDetokenizer` per
request. Wraps the ``tokenizers`` library's ``tokenizer.json`` plus the special tokens and chat template
of ``tokenizer_config.json``, the way transformers reads them. Imports no torch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders

from inference.models.config import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    ModelLoadError,
    eos_token_ids_in,
    read_json,
)

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_JSON_FILE = "chat_template.json"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# Tokens of left context re-decoded with each new token: enough for decoders whose output for a token
# depends on its neighbours (leading-space rules), few enough to keep streaming cheap.
DETOKENIZER_CONTEXT_TOKENS = 6
# Released tokens stay in the window (their text is the next decode's context) up to this many tokens.
DETOKENIZER_WINDOW_TOKENS = 4 * DETOKENIZER_CONTEXT_TOKENS
# A UTF-8 character is at most 4 bytes, so at most 4 byte-level tokens. Text still ending in U+FFFD
# after more pending tokens than this is invalid bytes from the model, not a character in progress.
MAX_PENDING_TOKENS = 8
REPLACEMENT_CHAR = "\ufffd"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: each printable stand-in character -> its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF = _byte_level_alphabet()


def _word_boundary_mark(decoder: Any) -> str | None:
    """SentencePiece's word-boundary mark ("▁") when the decoder turns it back into a space (Llama-2,
    Mistral: ``Replace("▁", " ")`` in a sequence, or ``Metaspace``); None for other vocabularies."""
    if decoder is None:
        return None
    spec = json.loads(decoder.__getstate__())
    for step in spec.get("decoders") or [spec]:
        if step.get("type") == "Metaspace":
            return str(step.get("replacement") or "▁")
        mark = (step.get("pattern") or {}).get("String")
        if step.get("type") == "Replace" and step.get("content") == " " and isinstance(mark, str):
            return mark
    return None


def _fallback_byte(piece: str) -> bytes | None:
    """The byte of a SentencePiece byte-fallback piece ``<0xNN>``; None for any other piece."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    return None


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its ``raise_exception``) or failed while rendering."""


class Tokenizer:
    """One model's tokenizer; build it with :meth:`from_folder`."""

    def __init__(self, *, backend: BackendTokenizer, folder: Path, special_tokens: Mapping[str, str],
                 eos_token_ids: frozenset[int], prepend_bos: bool, chat_template: str | None) -> None:
        self._backend = backend
        self.folder = folder
        self.special_tokens = dict(special_tokens)
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = _token_id(backend, self.special_tokens.get("bos_token"))
        self._prepend_bos = prepend_bos and self.bos_token_id is not None
        self.chat_template = chat_template
        self._template = None if chat_template is None else _compile_template(chat_template, folder)
        self._is_byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._word_mark = None if self._is_byte_level else _word_boundary_mark(backend.decoder)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        backend = _read_backend(folder)
        config = _read_optional_json(folder / TOKENIZER_CONFIG_FILE)
        special = _special_tokens(config, folder / TOKENIZER_CONFIG_FILE)
        bos_id = _token_id(backend, special.get("bos_token"))
        return cls(backend=backend, folder=folder, special_tokens=special,
                   eos_token_ids=_eos_token_ids(folder, backend, special.get("eos_token")),
                   prepend_bos=_needs_prepended_bos(backend, config, bos_id),
                   chat_template=find_chat_template(folder, config))

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def token_to_id(self, token: str) -> int | None:
        return _token_id(self._backend, token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, which may be part of a UTF-8 character (for logprobs)."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._backend.get_added_tokens_decoder():
            return piece.encode()
        if self._is_byte_level and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        byte = _fallback_byte(piece)
        if byte is not None:
            return byte
        if self._word_mark is not None:  # the raw piece: decoding it alone strips its leading space
            return piece.replace(self._word_mark, " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids, with the tokenizer's BOS when ``add_special_tokens``.

        Rendered chat prompts hold their own special tokens; encode them with ``add_special_tokens=False``
        as transformers does. A text that already starts with the BOS token never gets a second one.
        """
        ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if not add_special_tokens or bos is None:
            return ids
        if self._prepend_bos:
            ids.insert(0, bos)
        if ids[:2] == [bos, bos] and text.startswith(self.special_tokens["bos_token"]):
            del ids[0]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        text: str = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            add_generation_prompt: bool = True) -> str:
        """Render OpenAI-style messages to prompt text with the model's own template."""
        if self._template is None:
            raise ModelLoadError(self.folder, f"no chat template (looked for {CHAT_TEMPLATE_FILE}, "
                                 f"{CHAT_TEMPLATE_JSON_FILE} and '{TOKENIZER_CONFIG_FILE}' field "
                                 "'chat_template')")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from exc


class IncrementalDetokenizer:
    """Streams one sequence's text, token by token, without ever splitting a UTF-8 character.

    Each push decodes a short window (a few tokens of left context plus the unreleased ones) and releases
    what the new token added, unless that text ends in U+FFFD: then the token ended mid-character and the
    text waits for the next one. ``prompt_ids`` seed the left context so the first token decodes as it
    would inside the whole text.
    """

    def __init__(self, tokenizer: Tokenizer, *, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-DETOKENIZER_CONTEXT_TOKENS:])  # left context, then pending tokens
        self._read_offset = len(self._ids)  # _ids before this are released (left context)
        self._context_text = self._decode(self._ids)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completed (often "", never half a character)."""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        pending = len(self._ids) - self._read_offset
        if len(text) <= len(self._context_text) or (text.endswith(REPLACEMENT_CHAR)
                                                    and pending <= MAX_PENDING_TOKENS):
            return ""
        return self._release(text)

    def flush(self, last_ids: Sequence[int] = ()) -> str:
        """Release whatever is still held, with ``last_ids`` added first (at the end of the sequence): what
        pushing them one at a time and then flushing releases, in one decode (a request whose text
        nothing reads before it ends)."""
        self._ids.extend(last_ids)
        text = self._decode(self._ids)
        return self._release(text) if len(text) > len(self._context_text) else ""

    def _release(self, text: str) -> str:
        """Everything decoded is released: ``text`` becomes the left context as it stands, and only once the
        window has grown past a few contexts is it cut back to the last tokens and decoded again (one
        decode a token, not two)."""
        new_text = text[len(self._context_text):]
        if len(self._ids) > DETOKENIZER_WINDOW_TOKENS:
            self._ids = self._ids[-DETOKENIZER_CONTEXT_TOKENS:]
            text = self._decode(self._ids)
        self._read_offset = len(self._ids)
        self._context_text = text
        return new_text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def find_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The template transformers would use: ``chat_template.jinja``, then ``chat_template.json``, then
    ``tokenizer_config.json`` (a string, or a list of named templates of which "default" is taken)."""
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return _read_text(folder / CHAT_TEMPLATE_FILE)
    if (folder / CHAT_TEMPLATE_JSON_FILE).is_file():
        return _template_field(read_json(folder / CHAT_TEMPLATE_JSON_FILE), folder / CHAT_TEMPLATE_JSON_FILE)
    return _template_field(config, folder / TOKENIZER_CONFIG_FILE)


def _template_field(config: Mapping[str, Any], path: Path) -> str | None:
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return str(named["default"])
        raise ModelLoadError(path, "field 'chat_template' lists no template named 'default'")
    raise ModelLoadError(path, "field 'chat_template' must be a string or a list of named templates")


def _compile_template(source: str, folder: Path) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(folder, f"chat template has a syntax error (line {exc.lineno}): "
                             f"{exc.message}") from exc


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' variant: jinja2's own tojson escapes HTML characters and ASCII-encodes.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _read_backend(folder: Path) -> BackendTokenizer:
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        hint = " (only fast tokenizers are supported; tokenizer.model was found)" if (
            folder / "tokenizer.model").is_file() else ""
        raise ModelLoadError(path, f"file not found{hint}")
    try:
        return BackendTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for every parse failure
        raise ModelLoadError(path, f"is not a valid tokenizers file: {exc}") from exc


def _read_optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(path, f"cannot be read: {exc}") from exc


def _special_tokens(config: Mapping[str, Any], path: Path) -> dict[str, str]:
    """bos/eos/unk/pad token strings; the config holds each as a string or an AddedToken object."""
    tokens: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise ModelLoadError(path, f"field {name!r} must be a string or an object with 'content'")
        tokens[name] = value
    return tokens


def _token_id(backend: BackendTokenizer, token: str | None) -> int | None:
    token_id: int | None = None if token is None else backend.token_to_id(token)
    return token_id


def _eos_token_ids(folder: Path, backend: BackendTokenizer, eos_token: str | None) -> frozenset[int]:
    ids = set(eos_token_ids_in(folder / CONFIG_FILE)) | set(eos_token_ids_in(folder / GENERATION_CONFIG_FILE))
    eos_id = _token_id(backend, eos_token)
    if eos_id is not None:
        ids.add(eos_id)
    if not ids:
        logger.warning("%s: no eos token found; generation stops only at max_tokens or stop strings", folder)
    return frozenset(ids)


def _needs_prepended_bos(backend: BackendTokenizer, config: Mapping[str, Any], bos_id: int | None) -> bool:
    """``add_bos_token`` asks for a BOS; the post-processor may already add it (then we must not)."""
    if not config.get("add_bos_token", False) or bos_id is None:
        return False
    return backend.encode("", add_special_tokens=True).ids[:1] != [bos_id]
