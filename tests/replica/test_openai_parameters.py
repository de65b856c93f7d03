"""The README's table of OpenAI parameters, row by row, against a real replica.

Each row names a request field, where OpenAI documents it, its status here and a value to test with. A
refused row must be a 400 in the OpenAI shape naming the field (and its values that ask for nothing must
be accepted); a supported row or an extension must show its effect. The table must list every field the
server knows, and its statuses must be those :mod:`inference.openai_fields` enforces.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from inference.openai_fields import EXTENSION_FIELDS, KNOWN_FIELDS, OPENAI_FIELDS, REFUSED

from .harness import DONE, MODEL, REPO_ROOT, ReplicaProcess, chat, completion, openai_error, sse_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SECTION = "### OpenAI parameters"
ENDPOINTS = {"both": ("completion", "chat"), "completions": ("completion",), "chat": ("chat",)}
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class Row:
    name: str
    endpoints: tuple[str, ...]
    status: str
    value: Any

    def __str__(self) -> str:
        return f"{self.name}-{'-'.join(self.endpoints)}"


def readme_rows() -> list[Row]:
    section = (REPO_ROOT / "README.md").read_text().split(SECTION, 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            name, endpoint, status, value = (cell.strip() for cell in line.strip("| ").split(" | ")[:4])
            rows.append(Row(name.strip("`"), ENDPOINTS[endpoint], status, json.loads(value.strip("`"))))
    return rows


ROWS = readme_rows()


def _cases(*statuses: str) -> list[Any]:
    return [pytest.param(row, kind, id=f"{row.name}-{kind}")
            for row in ROWS if row.status in statuses for kind in row.endpoints]


# ---- talking to the replica ------------------------------------------------------------------------
@dataclass
class Client:
    http: httpx.Client

    def post(self, kind: str, **fields: Any) -> httpx.Response:
        return self.http.post(PATHS[kind], json=(chat if kind == "chat" else completion)(**fields))

    def ask(self, kind: str, **fields: Any) -> dict[str, Any]:
        response = self.post(kind, **fields)
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    def choice(self, kind: str, **fields: Any) -> dict[str, Any]:
        choice: dict[str, Any] = self.ask(kind, **fields)["choices"][0]
        return choice

    def text(self, kind: str, **fields: Any) -> str:
        choice = self.choice(kind, **fields)
        return str(choice["message"]["content"] if kind == "chat" else choice["text"])

    def token_ids(self, kind: str, **fields: Any) -> list[int]:
        return list(self.choice(kind, return_token_ids=True, **fields)["token_ids"])

    def events(self, kind: str, **fields: Any) -> list[Any]:
        body = (chat if kind == "chat" else completion)(stream=True, **fields)
        with self.http.stream("POST", PATHS[kind], json=body) as response:
            assert response.status_code == 200, response.read()
            return list(sse_events(response))


@pytest.fixture
def client(replica: ReplicaProcess) -> Client:
    return Client(replica.http)


def _streamed_text(kind: str, events: list[Any]) -> str:
    chunks = [e for e in events if e != DONE and e["choices"]]
    return "".join(c["choices"][0]["delta"]["content"] if kind == "chat" else c["choices"][0]["text"]
                   for c in chunks)


def _chosen_and_best(kind: str, logprobs: dict[str, Any]) -> list[tuple[float, float]]:
    """Per token: its logprob and the highest logprob among the alternatives shown."""
    if kind == "chat":
        return [(e["logprob"], max(t["logprob"] for t in e["top_logprobs"])) for e in logprobs["content"]]
    return [(lp, max(top.values())) for lp, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"])]


def _logprobs_request(kind: str, top: int) -> dict[str, Any]:
    return {"logprobs": True, "top_logprobs": top} if kind == "chat" else {"logprobs": top}


# ---- what each supported field and extension does -----------------------------------------------
Check = Callable[[Client, str, Any], None]
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
SAMPLED = {"max_tokens": 8, "temperature": 1.0, "ignore_eos": True}


def check_model(c: Client, kind: str, value: Any) -> None:
    assert c.ask(kind, model=value)["model"] == MODEL
    assert openai_error(c.post(kind, model="no-such-model"), 404)["param"] == "model"


def check_prompt(c: Client, kind: str, value: Any) -> None:
    answer = c.ask(kind, prompt=value, return_token_ids=True, **GREEDY)
    as_ids = c.ask(kind, prompt=answer["prompt_token_ids"], **GREEDY)
    assert answer["choices"][0]["text"] and as_ids["choices"][0]["text"] == answer["choices"][0]["text"]


def check_messages(c: Client, kind: str, value: Any) -> None:
    short = c.ask(kind, messages=value, **GREEDY)
    longer = c.ask(kind, messages=[*value, {"role": "assistant", "content": "Hello."}, *value], **GREEDY)
    assert short["choices"][0]["message"]["role"] == "assistant"
    assert longer["usage"]["prompt_tokens"] > short["usage"]["prompt_tokens"]


def check_max_tokens(c: Client, kind: str, value: Any) -> None:
    assert c.ask(kind, max_tokens=value, ignore_eos=True)["usage"]["completion_tokens"] == value


def check_max_completion_tokens(c: Client, kind: str, value: Any) -> None:
    answer = c.ask(kind, max_completion_tokens=value, max_tokens=value + 5, ignore_eos=True)
    assert answer["usage"]["completion_tokens"] == value


def check_temperature(c: Client, kind: str, value: Any) -> None:
    """Greedy: every token is the most likely one (its logprob is the best alternative's)."""
    choice = c.choice(kind, **{**GREEDY, "temperature": value}, **_logprobs_request(kind, 1))
    pairs = _chosen_and_best(kind, choice["logprobs"])
    assert len(pairs) == GREEDY["max_tokens"] and all(chosen == best for chosen, best in pairs)


def check_top_p(c: Client, kind: str, value: Any) -> None:
    """A nucleus this small holds the most likely token alone: sampling becomes greedy."""
    assert c.token_ids(kind, top_p=value, seed=1, **SAMPLED) == c.token_ids(kind, **GREEDY)


def check_top_k(c: Client, kind: str, value: Any) -> None:
    assert c.token_ids(kind, top_k=value, seed=1, **SAMPLED) == c.token_ids(kind, **GREEDY)


def check_n(c: Client, kind: str, value: Any) -> None:
    assert len(c.ask(kind, n=value)["choices"]) == 1
    assert openai_error(c.post(kind, n=2), 400)["param"] == "n"


def check_seed(c: Client, kind: str, value: Any) -> None:
    first = c.token_ids(kind, seed=value, **SAMPLED)
    assert c.token_ids(kind, seed=value, **SAMPLED) == first
    assert c.token_ids(kind, seed=value + 1, **SAMPLED) != first


def check_stop(c: Client, kind: str, value: Any) -> None:
    full = c.text(kind, max_tokens=16, ignore_eos=True)
    cut = min((full.find(s) for s in value if s in full), default=-1)
    assert cut >= 0, f"no stop string of {value!r} in {full!r}: the check would prove nothing"
    choice = c.choice(kind, max_tokens=16, ignore_eos=True, stop=value)
    assert (choice["message"]["content"] if kind == "chat" else choice["text"]) == full[:cut]
    assert choice["finish_reason"] == "stop"


def check_stream(c: Client, kind: str, value: Any) -> None:
    assert value is True
    events = c.events(kind, **GREEDY)
    assert events[-1] == DONE
    assert _streamed_text(kind, events) == c.text(kind, **GREEDY)


def check_stream_options(c: Client, kind: str, value: Any) -> None:
    events = [e for e in c.events(kind, stream_options=value, **GREEDY) if e != DONE]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    assert all(e.get("usage") is None for e in events[:-1])


def _penalty_check(name: str) -> Check:
    def check(c: Client, kind: str, value: Any) -> None:
        plain = c.token_ids(kind, **{**GREEDY, "max_tokens": 12})
        penalized = c.token_ids(kind, **{**GREEDY, "max_tokens": 12, name: value})
        assert len(set(penalized)) > len(set(plain)), (plain, penalized)  # this model repeats itself
    return check


def check_logprobs(c: Client, kind: str, value: Any) -> None:
    top = 0 if kind == "chat" else value
    choice = c.choice(kind, logprobs=value, **GREEDY)
    logprobs = choice["logprobs"]
    if kind == "chat":
        assert len(logprobs["content"]) == GREEDY["max_tokens"]
        assert all(e["logprob"] <= 0 and e["bytes"] and e["top_logprobs"] == [] for e in logprobs["content"])
        return
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == GREEDY["max_tokens"]
    assert all(len(t) == top for t in logprobs["top_logprobs"])  # greedy: the chosen token is the top one
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])


def check_top_logprobs(c: Client, kind: str, value: Any) -> None:
    content = c.choice(kind, logprobs=True, top_logprobs=value, **GREEDY)["logprobs"]["content"]
    assert all(len(e["top_logprobs"]) == value for e in content)
    assert all([t["logprob"] for t in e["top_logprobs"]] == sorted((t["logprob"] for t in e["top_logprobs"]),
                                                                   reverse=True) for e in content)


def _identifier_check(name: str) -> Check:
    def check(c: Client, kind: str, value: Any) -> None:
        assert c.token_ids(kind, **{name: value}, **GREEDY) == c.token_ids(kind, **GREEDY)
    return check


def check_min_tokens(c: Client, kind: str, value: Any) -> None:
    assert c.ask(kind, min_tokens=value, max_tokens=value)["usage"]["completion_tokens"] == value


def check_ignore_eos(c: Client, kind: str, value: Any) -> None:
    choice = c.ask(kind, ignore_eos=value, max_tokens=12)
    assert choice["usage"]["completion_tokens"] == 12 and choice["choices"][0]["finish_reason"] == "length"


def check_priority(c: Client, kind: str, value: Any) -> None:
    """Its effect is on scheduling order under load; here: accepted, clamped, and typed."""
    assert c.token_ids(kind, priority=value, **GREEDY) == c.token_ids(kind, priority=99, **GREEDY)
    assert openai_error(c.post(kind, priority="high"), 400)["param"] == "priority"


def check_return_token_ids(c: Client, kind: str, value: Any) -> None:
    answer = c.ask(kind, return_token_ids=value, **GREEDY)
    assert len(answer["choices"][0]["token_ids"]) == answer["usage"]["completion_tokens"]
    assert len(answer["prompt_token_ids"]) == answer["usage"]["prompt_tokens"]


def check_output_offset(c: Client, kind: str, value: Any) -> None:
    """A seeded request resumed after ``value`` tokens goes on as the undisturbed one did."""
    whole = c.ask(kind, return_token_ids=True, seed=3, **SAMPLED)
    ids = whole["choices"][0]["token_ids"]
    rest = c.token_ids(kind, prompt=whole["prompt_token_ids"] + ids[:value], output_offset=value,
                       **{**SAMPLED, "seed": 3, "max_tokens": SAMPLED["max_tokens"] - value})
    assert rest == ids[value:]


CHECKS: dict[str, Check] = {
    "model": check_model, "prompt": check_prompt, "messages": check_messages, "max_tokens": check_max_tokens,
    "max_completion_tokens": check_max_completion_tokens, "temperature": check_temperature,
    "top_p": check_top_p, "n": check_n, "seed": check_seed, "stop": check_stop, "stream": check_stream,
    "stream_options": check_stream_options, "presence_penalty": _penalty_check("presence_penalty"),
    "frequency_penalty": _penalty_check("frequency_penalty"), "logprobs": check_logprobs,
    "top_logprobs": check_top_logprobs, "user": _identifier_check("user"),
    "safety_identifier": _identifier_check("safety_identifier"),
    "prompt_cache_key": _identifier_check("prompt_cache_key"), "metadata": _identifier_check("metadata"),
    "repetition_penalty": _penalty_check("repetition_penalty"), "top_k": check_top_k,
    "min_tokens": check_min_tokens, "ignore_eos": check_ignore_eos, "priority": check_priority,
    "return_token_ids": check_return_token_ids, "output_offset": check_output_offset,
}


# ---- the tests ---------------------------------------------------------------------------------
def test_the_table_lists_every_field_with_the_status_the_server_enforces() -> None:
    names = {row.name for row in ROWS}
    assert names == KNOWN_FIELDS
    assert {row.name for row in ROWS if row.status == "refused"} == set(REFUSED)
    assert {row.name for row in ROWS if row.status == "extension"} == EXTENSION_FIELDS
    assert {row.name for row in ROWS if row.status == "supported"} == OPENAI_FIELDS - set(REFUSED)
    assert {row.name for row in ROWS if row.status != "refused"} == set(CHECKS)


@pytest.mark.parametrize(("row", "kind"), _cases("refused"))
def test_a_refused_field_is_a_400_naming_it_unless_it_asks_for_nothing(client: Client, row: Row,
                                                                       kind: str) -> None:
    error = openai_error(client.post(kind, **{row.name: row.value}), 400)
    assert error["param"] == row.name and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{row.name}: not supported")
    for harmless in (None, *REFUSED[row.name][0]):
        response = client.post(kind, **{row.name: harmless}, max_tokens=1)
        assert response.status_code == 200, (harmless, response.text)


@pytest.mark.parametrize(("row", "kind"), _cases("supported", "extension"))
def test_a_supported_field_or_extension_has_its_effect(client: Client, row: Row, kind: str) -> None:
    CHECKS[row.name](client, kind, row.value)


@pytest.mark.parametrize(("kind", "fields", "param"), [
    ("completion", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": -3}, "frequency_penalty"),
    ("completion", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completion", {"logprobs": 21}, "logprobs"),
    ("completion", {"logprobs": True}, "logprobs"),
    ("completion", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": 2}, "logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_an_out_of_range_value_is_a_400_naming_its_field(client: Client, kind: str, fields: dict[str, Any],
                                                         param: str) -> None:
    assert openai_error(client.post(kind, **fields), 400)["param"] == param


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_logprobs_are_the_non_streamed_ones_chunk_by_chunk(client: Client, kind: str) -> None:
    fields = {**GREEDY, **_logprobs_request(kind, 2)}
    whole = client.choice(kind, **fields)["logprobs"]
    events = [e for e in client.events(kind, **fields) if e != DONE and e["choices"]]
    chunks = [e["choices"][0]["logprobs"] for e in events]
    if kind == "chat":
        assert [entry for lp in chunks for entry in lp["content"]] == whole["content"]
    else:
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [v for lp in chunks for v in lp[key]] == whole[key], key


# ---- the official client -----------------------------------------------------------------------------
@pytest.fixture
def official(replica: ReplicaProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{replica.base_url}/v1", api_key=replica.api_key, max_retries=0) as c:
        yield c


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_openai_client_reads_chat_logprobs(official: openai.OpenAI, stream: bool) -> None:
    common: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2,
                              "extra_body": {"ignore_eos": True}}
    if stream:
        chunks = list(official.chat.completions.create(stream=True, **common))
        content = [e for c in chunks if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content or []]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        choice = official.chat.completions.create(**common).choices[0]
        assert choice.logprobs is not None
        content, text = choice.logprobs.content or [], choice.message.content or ""
    assert len(content) == 6
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob for e in content)
    assert b"".join(bytes(e.bytes or []) for e in content).decode(errors="replace") == text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_openai_client_reads_completion_logprobs(official: openai.OpenAI, stream: bool) -> None:
    common: dict[str, Any] = {"model": MODEL, "prompt": "The replica answers", "max_tokens": 6,
                              "temperature": 0, "logprobs": 3, "extra_body": {"ignore_eos": True}}
    if stream:
        chunks = [c.choices[0].logprobs for c in official.completions.create(stream=True, **common)
                  if c.choices and c.choices[0].logprobs]
        tokens = [t for lp in chunks for t in lp.tokens or []]
        values = [v for lp in chunks for v in lp.token_logprobs or []]
        tops = [t for lp in chunks for t in lp.top_logprobs or []]
    else:
        logprobs = official.completions.create(**common).choices[0].logprobs
        assert logprobs is not None
        tokens, values = logprobs.tokens or [], logprobs.token_logprobs or []
        tops = logprobs.top_logprobs or []
    assert len(tokens) == len(values) == len(tops) == 6
    assert all(top[token] == value == max(top.values()) for token, value, top in zip(tokens, values, tops))
    assert all(len(top) == 3 for top in tops)
