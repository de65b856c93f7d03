"""Offline generation asks the engine for finished outputs only (``final_only``): no output for each token,
and a request without stop strings has its text decoded once when it ends. What a user gets must be what
the token-by-token path gives: the same tokens, text, finish reasons and logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.config import EngineConfig
from inference.engine import LLM, LLMEngine
from inference.output import RequestOutput
from inference.sampling_params import SamplingParams

CONFIG = EngineConfig(device="cpu", num_kv_blocks=256, max_num_seqs=8)
PROMPTS = ["The answer is", "Once upon a time 🤖", "日本語の文章", "def f(x):\n    return", "a b c d e f",
           "Hello", "zero width\u200bjoiner", "flags 🇫🇷 and more"]


def _params() -> list[SamplingParams]:
    """Greedy to the length limit, sampled (a few stop on EOS), stop strings, logprobs."""
    greedy = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True) for _ in range(2)]
    sampled = [SamplingParams(max_tokens=96, temperature=1.0, seed=seed) for seed in range(3)]
    stops = [SamplingParams(max_tokens=60, temperature=1.0, seed=7, stop=("e", "\n"))]
    logprobs = [SamplingParams(max_tokens=20, temperature=0.8, seed=3, logprobs=2) for _ in range(2)]
    return greedy + sampled + stops + logprobs


def _token_by_token(engine: LLMEngine, prompts: list[str],
                    params: list[SamplingParams]) -> tuple[list[RequestOutput], list[str]]:
    """Every request's final output and the text its per-token outputs streamed."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    final: dict[str, RequestOutput] = {}
    streamed = {f"r{i}": "" for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] += out.delta_text
            if out.finished:
                final[out.request_id] = out
    ids = [f"r{i}" for i in range(len(prompts))]
    return [final[rid] for rid in ids], [streamed[rid] for rid in ids]


def test_offline_outputs_equal_the_token_by_token_ones(default_model_dir: Path) -> None:
    params = _params()
    reference, streamed = _token_by_token(LLMEngine(str(default_model_dir), CONFIG), PROMPTS, params)
    offline = LLM(str(default_model_dir), CONFIG).generate(PROMPTS, params)
    reasons = [o.finish_reason for o in reference]
    assert "stop" in reasons and "length" in reasons  # both ends of a text are covered
    assert any(o.finish_reason == "stop" and not p.stop for o, p in zip(reference, params))  # an EOS
    for ours, theirs, text in zip(offline, reference, streamed, strict=True):
        assert ours.output_token_ids == theirs.output_token_ids
        assert ours.text == theirs.text == text
        assert ours.finish_reason == theirs.finish_reason
        assert ours.logprobs == theirs.logprobs
        assert ours.metrics.detokenize_seconds > 0


def test_final_only_steps_return_finished_outputs_only(default_model_dir: Path) -> None:
    engine = LLMEngine(str(default_model_dir), CONFIG)
    engine.add_request("a", "Hello", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                       final_only=True)
    engine.add_request("b", "Hello", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    seen: list[tuple[str, bool]] = []
    while engine.has_unfinished_requests():
        seen += [(o.request_id, o.finished) for o in engine.step()]
    assert [s for s in seen if s[0] == "a"] == [("a", True)]
    assert len([s for s in seen if s[0] == "b"]) == 5


@pytest.mark.parametrize("stop", [(), ("e",)])
def test_an_aborted_final_only_request_keeps_the_text_of_its_tokens(default_model_dir: Path,
                                                                     stop: tuple[str, ...]) -> None:
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True, stop=stop)
    streamed = LLMEngine(str(default_model_dir), CONFIG)
    offline = LLMEngine(str(default_model_dir), CONFIG)
    streamed.add_request("s", "Once upon a time 🤖", params)
    offline.add_request("o", "Once upon a time 🤖", params, final_only=True)
    for _ in range(6):
        streamed.step()
        assert offline.step() == []
    theirs, ours = streamed.abort_request("s"), offline.abort_request("o")
    assert theirs is not None and ours is not None
    assert len(ours.output_token_ids) == 6 and ours.finish_reason == "abort"
    assert (ours.output_token_ids, ours.text) == (theirs.output_token_ids, theirs.text)
