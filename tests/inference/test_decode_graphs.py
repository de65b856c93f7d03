"""Decode steps through the bucketed, padded static path of inference/decode_graphs.py.

On the CPU the buckets run eagerly on the same buffers a CUDA graph replays (no CUDA here: this checks the
bucketing, the padding rows, the scratch block and the row order); ``LLMSRE_TEST_DEVICE=cuda`` runs the
same tests with the graphs captured and replayed on a GPU. Either way the engine's greedy output and
logits must equal transformers', as the eager engine's do.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.decode_graphs import batch_buckets, smallest_at_least, width_buckets
from tests.inference.test_engine_equivalence import (
    DEVICE,
    assert_equal_to_reference,
    base_config,
    make_prompts,
    reference,
)
from tests.inference.test_engine_equivalence import run_engine as run_engine_with

transformers = pytest.importorskip("transformers")

# Five prompts: decode steps of five sequences run in the bucket of 8, three rows of it padding.
LENGTHS = (3, 17, 45, 81, 100)


def test_buckets_cover_every_batch_and_context() -> None:
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert width_buckets(128) == (8, 16, 32, 64, 128)
    assert width_buckets(100) == (8, 16, 32, 64, 100)
    assert width_buckets(5) == (5,)
    assert smallest_at_least(batch_buckets(64), 5) == 8
    assert smallest_at_least(batch_buckets(64), 65) is None


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir", "tiny_mistral_dir"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def vocab_of(folder: Path) -> int:
    return int(transformers.AutoConfig.from_pretrained(folder).vocab_size)


def test_padded_decode_buckets_keep_output_equal(model_dir: Path) -> None:
    prompts = make_prompts(vocab_of(model_dir), seed=5, lengths=LENGTHS)
    run = run_engine_with(model_dir, prompts, base_config(decode_graphs=True))
    graphs = run.engine.runner.graphs
    assert graphs is not None and graphs.replays > 0, "decode steps should have run in a bucket"
    assert graphs.padded_rows >= 3 * graphs.replays  # five sequences at most, in a bucket of eight
    assert graphs.captured == DEVICE.startswith("cuda")  # on a GPU, replayed graphs, not the fallback
    assert_equal_to_reference(run, *reference(model_dir, prompts))


def test_padding_rows_never_touch_a_sequence_blocks(tiny_llama_dir: Path) -> None:
    """A pool so small that sequences are preempted and their blocks reused: a padding row that wrote into
    a live block would change some later output."""
    prompts = make_prompts(vocab_of(tiny_llama_dir), seed=2)
    run = run_engine_with(tiny_llama_dir, prompts,
                          base_config(decode_graphs=True, num_kv_blocks=20, enable_prefix_caching=False))
    assert run.engine.scheduler.num_preemptions > 0
    graphs = run.engine.runner.graphs
    assert graphs is not None and graphs.replays > 0 and graphs.padded_rows > 0
    assert_equal_to_reference(run, *reference(tiny_llama_dir, prompts))


def test_models_the_graphs_cannot_capture_run_eagerly_and_say_why(tiny_deepseek_v3_dir: Path,
                                                                   tiny_llama_dir: Path) -> None:
    prompts = make_prompts(vocab_of(tiny_deepseek_v3_dir), seed=7, lengths=LENGTHS)
    run = run_engine_with(tiny_deepseek_v3_dir, prompts, base_config(decode_graphs=True))
    assert run.engine.runner.graphs is None
    assert run.engine.runner.graphs_unavailable == "latent attention (MLA) is not captured yet"
    assert_equal_to_reference(run, *reference(tiny_deepseek_v3_dir, prompts))
    int8 = run_engine_with(tiny_llama_dir, make_prompts(vocab_of(tiny_llama_dir), lengths=(3,)),
                           base_config(decode_graphs=True, kv_cache_dtype="int8"))
    assert int8.engine.runner.graphs is None
    assert "INT8" in (int8.engine.runner.graphs_unavailable or "")



def test_graphs_are_on_by_default_with_cuda_only(tiny_llama_dir: Path) -> None:
    run = run_engine_with(tiny_llama_dir, make_prompts(vocab_of(tiny_llama_dir), lengths=(3,)),
                          base_config(decode_graphs=None))
    assert (run.engine.runner.graphs is not None) == DEVICE.startswith("cuda")


def test_contexts_past_the_captured_width_run_eagerly(tiny_llama_dir: Path) -> None:
    """Captured widths stop at ``decode_graphs_max_context``: a step with a longer context runs eagerly,
    and the output is the same either way."""
    prompts = make_prompts(vocab_of(tiny_llama_dir), seed=8, lengths=LENGTHS)
    # two waves: 3, 17 and 45 tokens (at most 57 with their outputs) first, then 81 and 100
    run = run_engine_with(tiny_llama_dir, prompts,
                          base_config(decode_graphs=True, decode_graphs_max_context=64), waves=2)
    graphs = run.engine.runner.graphs
    assert graphs is not None and graphs.widths == (8,)  # 64 tokens in blocks of 8
    decode_steps = sum(1 for s in run.engine.step_stats if s.num_prefill_tokens == 0)
    assert 0 < graphs.replays < decode_steps  # the first wave replayed, the second not
    assert_equal_to_reference(run, *reference(tiny_llama_dir, prompts))
