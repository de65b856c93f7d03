"""Penalties and log-probabilities against Hugging Face transformers, in float32.

Our logprobs are ``log_softmax`` of the model's raw logits: they must equal those of transformers' logits
at every greedy step. Our penalties are vLLM's: greedy decoding with them must pick what a reference that
applies them to transformers' logits picks (for the repetition penalty, transformers' own processor).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from inference.config import EngineConfig
from inference.engine import LLMEngine
from inference.output import RequestOutput, TokenLogprob
from inference.sampler import Penalties, SamplingRow
from inference.sampling_params import InvalidParameterError, SamplingParams

transformers = pytest.importorskip("transformers")

PROMPTS = ([5, 17, 99, 230, 7], [300, 12, 12, 12, 12, 44, 18, 9, 101, 64, 13, 77, 200], [42] * 3)
MAX_TOKENS = 10
TOLERANCE = 1e-4  # absolute, on log-probabilities of order -1 to -10


def _engine(folder: Path, num_kv_blocks: int = 256) -> LLMEngine:
    return LLMEngine(str(folder), EngineConfig(device="cpu", dtype="float32", block_size=8,
                                               num_kv_blocks=num_kv_blocks, max_num_batched_tokens=2048,
                                               enable_prefix_caching=False))


Requests = dict[str, tuple[list[int], SamplingParams]]


def _run(engine: LLMEngine, requests: Requests) -> dict[str, RequestOutput]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    return model.eval()


def _hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([ids])).logits[0, -1].float()
    return logits


def _vllm_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], *, presence: float,
                    frequency: float, repetition: float) -> torch.Tensor:
    """vLLM's definition, written out token by token."""
    logits = logits.clone()
    for token in set(prompt) | set(output):
        value = logits[token]
        logits[token] = value / repetition if value > 0 else value * repetition
    for token in set(output):
        logits[token] -= frequency * output.count(token) + presence
    return logits


@functools.cache
def _reference_greedy(model: Any, prompt: tuple[int, ...], presence: float, frequency: float,
                      repetition: float) -> list[int]:
    output: list[int] = []
    for _ in range(MAX_TOKENS):
        logits = _vllm_penalties(_hf_logits(model, [*prompt, *output]), list(prompt), output,
                                 presence=presence, frequency=frequency, repetition=repetition)
        output.append(int(logits.argmax()))
    return output


def test_logprobs_equal_log_softmax_of_transformers_logits_at_every_greedy_step(tiny_llama_dir: Path,
                                                                                hf_model: Any) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    outputs = _run(_engine(tiny_llama_dir), {f"r{i}": (p, params) for i, p in enumerate(PROMPTS)})

    for i, prompt in enumerate(PROMPTS):
        out = outputs[f"r{i}"]
        assert out.logprobs is not None and len(out.logprobs) == MAX_TOKENS
        for step, entry in enumerate(out.logprobs):
            reference = torch.log_softmax(_hf_logits(hf_model, prompt + out.output_token_ids[:step]), dim=-1)
            values, ids = reference.topk(5)
            assert entry.token_id == out.output_token_ids[step] == int(ids[0])  # greedy: the most likely
            assert abs(entry.logprob - float(reference[entry.token_id])) < TOLERANCE
            assert [t for t, _ in entry.top] == ids.tolist()
            assert torch.allclose(torch.tensor([v for _, v in entry.top]), values, atol=TOLERANCE)


PENALTIES = {
    "presence": {"presence": 1.5, "frequency": 0.0, "repetition": 1.0},
    "frequency": {"presence": 0.0, "frequency": 2.0, "repetition": 1.0},
    "repetition": {"presence": 0.0, "frequency": 0.0, "repetition": 1.8},
    "all": {"presence": -0.5, "frequency": 0.6, "repetition": 1.3},
}


@pytest.mark.parametrize(("name", "num_kv_blocks"), [(name, 256) for name in PENALTIES] + [("all", 8)],
                         ids=[*PENALTIES, "all, preempted"])
def test_greedy_with_penalties_picks_what_transformers_logits_with_vllm_penalties_pick(
        name: str, num_kv_blocks: int, tiny_llama_dir: Path, hf_model: Any) -> None:
    p = PENALTIES[name]
    penalized = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1,
                               presence_penalty=p["presence"], frequency_penalty=p["frequency"],
                               repetition_penalty=p["repetition"])
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # Penalized and plain requests share every step: the penalties must stay on their own rows.
    requests = {f"p{i}": (prompt, penalized) for i, prompt in enumerate(PROMPTS)}
    requests.update({f"g{i}": (prompt, plain) for i, prompt in enumerate(PROMPTS)})
    engine = _engine(tiny_llama_dir, num_kv_blocks)
    outputs = _run(engine, requests)

    # 8 blocks of 8 tokens cannot hold six sequences: some are preempted, their counts rebuilt on return.
    assert (engine.scheduler.num_preemptions > 0) == (num_kv_blocks == 8)
    for i, prompt in enumerate(PROMPTS):
        assert outputs[f"p{i}"].output_token_ids == _reference_greedy(hf_model, tuple(prompt), **p), i
        assert outputs[f"g{i}"].output_token_ids == _reference_greedy(hf_model, tuple(prompt), 0.0, 0.0, 1.0)
    assert any(outputs[f"p{i}"].output_token_ids != outputs[f"g{i}"].output_token_ids
               for i in range(len(PROMPTS))), "the penalties changed nothing: the test proves nothing"
    # Logprobs stay those of the raw distribution, whatever the penalties did to the choice.
    first = outputs["p0"].logprobs
    assert first is not None
    raw = torch.log_softmax(_hf_logits(hf_model, list(PROMPTS[0])), dim=-1)
    assert abs(first[0].logprob - float(raw[first[0].token_id])) < TOLERANCE


def test_repetition_penalty_matches_transformers_own_processor(tiny_llama_dir: Path, hf_model: Any) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, repetition_penalty=1.8)
    outputs = _run(_engine(tiny_llama_dir), {f"r{i}": (p, params) for i, p in enumerate(PROMPTS)})
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                          min_new_tokens=MAX_TOKENS, do_sample=False, repetition_penalty=1.8,
                                          pad_token_id=0)
        assert outputs[f"r{i}"].output_token_ids == generated[0, len(prompt):].tolist()


def test_a_resumed_request_penalizes_the_tokens_output_before_it_as_output(default_model_dir: Path) -> None:
    """A gateway resumes a stream with the tokens already sent at the end of the prompt and
    ``output_offset`` saying how many they are: the continuation must be the undisturbed run's tail."""
    engine = LLMEngine(str(default_model_dir), EngineConfig(device="cpu", num_kv_blocks=64))
    prompt = engine.tokenizer.encode("The replica answers")
    whole = _run(engine, {"w": (prompt, SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5,
        repetition_penalty=1.2))})["w"].output_token_ids
    done = 5
    tail = _run(engine, {"t": (prompt + whole[:done], SamplingParams(
        max_tokens=12 - done, temperature=0.0, ignore_eos=True, output_offset=done, presence_penalty=1.0,
        frequency_penalty=0.5, repetition_penalty=1.2))})["t"]
    assert tail.output_token_ids == whole[done:]


def test_a_streamed_request_keeps_no_logprobs_and_sends_each_tokens_once(default_model_dir: Path) -> None:
    """A stream sends each token's logprobs in its own output: the engine holds none of them back for the
    end (64 streams x 8k tokens x 20 alternatives would be hundreds of MB for nothing)."""
    engine = LLMEngine(str(default_model_dir), EngineConfig(device="cpu", num_kv_blocks=64))
    prompt = engine.tokenizer.encode("The replica answers")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    engine.add_request("kept", prompt, params)
    engine.add_request("streamed", prompt, params, keep_logprobs=False)
    sent: dict[str, list[TokenLogprob]] = {"kept": [], "streamed": []}
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        if "streamed" in engine.requests:
            assert engine.requests["streamed"].logprobs is None
        for out in engine.step():
            assert out.new_logprobs is not None and len(out.new_logprobs) == len(out.new_token_ids)
            sent[out.request_id] += out.new_logprobs
            if out.finished:
                final[out.request_id] = out

    assert final["streamed"].logprobs is None
    assert final["kept"].logprobs == sent["kept"] == sent["streamed"]
    assert len(sent["streamed"]) == 8 and all(len(lp.top) == 3 for lp in sent["streamed"])


def test_penalties_follow_vllm_on_known_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    params = SamplingParams(presence_penalty=0.25, frequency_penalty=0.5, repetition_penalty=2.0)
    # prompt [0], then output 1, 1, 2
    row = SamplingRow(params, output_index=3, history=[0, 1, 1, 2], num_prompt_tokens=1)
    penalized = Penalties()(logits, [row])
    assert penalized.tolist() == [[1.0, -1.0 * 2 - 0.5 * 2 - 0.25, 0.5 / 2 - 0.5 - 0.25, 1.0]]
    assert logits.tolist() == [[2.0, -1.0, 0.5, 1.0]]  # the raw logits stay for logprobs


def test_a_batch_without_penalties_is_sampled_from_the_logits_as_given() -> None:
    logits = torch.randn(3, 16)
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0), SamplingRow(SamplingParams(seed=3), 5)]
    assert Penalties()(logits, rows) is logits  # no copy, no counts: the fast path


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("repetition_penalty", 0.0), ("logprobs", 21),
    ("logprobs", -1)])
def test_out_of_range_values_name_their_field(field: str, value: float) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert caught.value.param == field
