"""The engine records each prompt chunk (when, how many tokens) only while traces are exported
(``LLMEngine.record_prefill_chunks``, set by ``inference serve --otlp-traces-endpoint``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.config import EngineConfig
from inference.engine import LLMEngine
from inference.output import RequestOutput
from inference.sampling_params import SamplingParams

CHUNK = 8  # max_num_batched_tokens: a 20-token prompt takes three steps


def run(engine: LLMEngine, prompt: list[int]) -> RequestOutput:
    engine.add_request("r", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final is not None and final.finished
    return final


@pytest.fixture(scope="module")
def engine(default_model_dir: Path) -> LLMEngine:
    return LLMEngine(str(default_model_dir), EngineConfig(device="cpu", max_num_batched_tokens=CHUNK))


@pytest.mark.parametrize("record", [False, True])
def test_prompt_chunks_are_recorded_only_while_traced(engine: LLMEngine, record: bool) -> None:
    engine.record_prefill_chunks = record
    prompt = list(range(40, 60) if record else range(10, 30))  # apart: no prefix cache hit between the two
    m = run(engine, prompt).metrics
    if not record:
        assert m.prefill_chunks is None
        return
    assert m.prefill_chunks is not None
    assert [n for _, _, n in m.prefill_chunks] == [8, 8, 4]
    starts = [start for start, _, _ in m.prefill_chunks]
    assert m.first_scheduled_time == starts[0] and starts == sorted(starts)
    assert all(start <= end for start, end, _ in m.prefill_chunks)
    assert m.first_token_time is not None and m.prefill_chunks[-1][1] <= m.first_token_time
