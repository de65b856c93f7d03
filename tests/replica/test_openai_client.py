"""The official ``openai`` client works against the replica unchanged: completions and chat, streaming or
not, usage in the last chunk, seeded sampling, stop strings."""

from __future__ import annotations

import re
from collections.abc import Iterator

import openai
import pytest

from .harness import MODEL, ReplicaProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROMPT = "The replica answers"
MESSAGES = [{"role": "user", "content": "Say hello to the replica."}]


@pytest.fixture
def client(replica: ReplicaProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{replica.base_url}/v1", api_key=replica.api_key, max_retries=0) as c:
        yield c


def test_streamed_completion_concatenates_to_the_non_streamed_greedy_text(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    chunks = list(stream)

    assert whole.choices[0].text
    assert whole.usage is not None and whole.usage.completion_tokens == 16
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"


def test_streamed_chat_concatenates_to_the_non_streamed_greedy_message(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                            stream=True)
    chunks = list(stream)

    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_include_usage_puts_the_token_counts_in_the_last_chunk(client: openai.OpenAI, kind: str) -> None:
    common = {"model": MODEL, "max_tokens": 6, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True}}
    if kind == "chat":
        chunks = list(client.chat.completions.create(messages=MESSAGES, **common))  # type: ignore[call-overload]
    else:
        chunks = list(client.completions.create(prompt=PROMPT, **common))  # type: ignore[call-overload]

    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 6
    assert last.usage.prompt_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + 6
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"


def test_seeded_sampling_at_temperature_one_repeats_its_text(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=seed)
        return out.choices[0].text

    first, again, other_seed = sample(7), sample(7), sample(8)

    assert first == again
    assert first != other_seed  # it did sample: another seed walks elsewhere


def _stop_string(text: str) -> str:
    """Two letters from the middle of ``text``: a stop string known to occur there."""
    match = re.search(r"[A-Za-z]{2}", text[len(text) // 3:])
    assert match, f"no two letters in a row in {text!r}"
    return match.group()


def test_stop_string_cuts_the_text_before_its_first_occurrence(client: openai.OpenAI) -> None:
    common = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "seed": 11}
    full = client.completions.create(**common).choices[0].text  # type: ignore[call-overload]
    stop = _stop_string(full)

    cut = client.completions.create(stop=[stop], **common)  # type: ignore[call-overload]
    streamed = list(client.completions.create(stop=stop, stream=True, **common))  # type: ignore[call-overload]
    streamed_text = "".join(c.choices[0].text for c in streamed)

    assert cut.choices[0].text == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].text
    assert streamed_text == cut.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_stop_string_in_chat_never_appears_in_the_message(client: openai.OpenAI) -> None:
    common = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 1.0, "seed": 5}
    full = client.chat.completions.create(**common).choices[0].message.content  # type: ignore[call-overload]
    assert full
    stop = _stop_string(full)

    cut = client.chat.completions.create(stop=stop, **common)  # type: ignore[call-overload]

    assert cut.choices[0].message.content == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_parameters_the_client_passes_as_none_take_their_defaults(client: openai.OpenAI) -> None:
    """Wrappers often pass every parameter explicitly; the OpenAI API reads ``null`` as "the default"."""
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=None,
                                         temperature=None, top_p=None, stop=None, seed=None,
                                         stream_options=None)

    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage is not None and 1 <= out.usage.completion_tokens <= 4
