"""Seeded sampling is a property of the request alone: the same seed gives the same tokens in any batch."""

from __future__ import annotations

from pathlib import Path

from inference.config import EngineConfig
from inference.engine import LLMEngine
from inference.sampling_params import SamplingParams


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
    return done


def test_seeded_request_gets_the_same_tokens_alone_and_in_a_mixed_batch(default_model_dir: Path) -> None:
    engine = LLMEngine(str(default_model_dir), EngineConfig(device="cpu", max_num_batched_tokens=64))
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    prompt = list(range(20, 60))
    alone = _run(engine, {"alone": (prompt, seeded)})["alone"]
    # Neighbours with other parameters and prompt lengths, so that the batch mixes chunked prefills with
    # decodes and the seeded rows land in different places of the layout.
    mixed: dict[str, tuple[list[int], SamplingParams]] = {
        f"n{i}": (list(range(30, 30 + 9 * (5 - i) + 3)),  # earlier arrivals have longer contexts
                  SamplingParams(max_tokens=30 - i, temperature=0.7 + 0.1 * i, seed=i, ignore_eos=True))
        for i in range(5)}
    mixed.update({f"s{i}": (prompt, seeded) for i in range(3)})
    outputs = _run(engine, mixed)
    assert all(outputs[f"s{i}"] == alone for i in range(3))
    assert len({tuple(outputs[f"n{i}"][:5]) for i in range(5)}) > 1  # the neighbours really sampled
