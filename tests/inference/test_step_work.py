"""Each engine step records its work in the replica profile's terms (``StepStat.context_tokens`` and
``prefill_pairs`` beside the token counts), which the replica exports so that the control plane can price
the steps with the profile and compare with the time they took (``controlplane.autoscale.drift``). The
sums must be the ones the profile and the fleet simulator count: every prompt's attention triangle once,
however it was chunked, and each decoded token's keys."""

from __future__ import annotations

from pathlib import Path

from controlplane.autoscale.profile import attention_pairs
from inference.config import EngineConfig
from inference.engine import LLMEngine
from inference.sampling_params import SamplingParams

CHUNK = 8  # max_num_batched_tokens: a 20-token prompt is prefilled in chunks of 8, 8 and 4


def test_step_work_sums_to_each_prompts_attention_triangle_and_each_tokens_context(
        default_model_dir: Path) -> None:
    engine = LLMEngine(str(default_model_dir), EngineConfig(device="cpu", max_num_batched_tokens=CHUNK,
                                                            enable_prefix_caching=False))
    requests = [(list(range(10, 30)), 4), (list(range(40, 51)), 3)]  # (prompt, tokens to generate)
    for i, (prompt, tokens) in enumerate(requests):  # one at a time: no step mixes the two
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                           ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    steps = list(engine.step_stats)

    assert [s.num_prefill_tokens for s in steps if s.num_prefill_tokens] == [8, 8, 4, 8, 3]
    assert sum(s.prefill_pairs for s in steps) == sum(attention_pairs(len(p)) for p, _ in requests)
    assert [s.prefill_pairs for s in steps if s.num_prefill_tokens][:3] == [
        attention_pairs(8, 0), attention_pairs(8, 8), attention_pairs(4, 16)]
    # the first token comes from the prompt's last chunk; each later one from a decode step that
    # attends to the prompt and every token before it, itself included
    assert sum(s.num_decode_tokens for s in steps) == sum(n - 1 for _, n in requests)
    assert [s.context_tokens for s in steps if s.num_decode_tokens] == [21, 22, 23, 12, 13]
    assert all(s.context_tokens == 0 for s in steps if not s.num_decode_tokens)
    # each step's CPU time on the stepping thread's own clock: some, within the step's wall time
    assert all(0 < s.cpu <= s.duration + 1e-6 for s in steps)
