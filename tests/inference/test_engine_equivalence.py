"""Our engine's greedy output and logits equal Hugging Face transformers', token for token, in float32.

Prompts of different lengths are submitted together and decoded concurrently; the reference runs each
prompt alone through ``generate``. Variants force the paths that could break equality: prefix-cache hits,
preemption under a tiny KV pool, and chunked prefill.

The engine runs on the CPU; ``LLMSRE_TEST_DEVICE=cuda`` runs it on a GPU instead (the reference stays on
the CPU), which is how a machine with one checks the CUDA path.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from inference.config import EngineConfig
from inference.engine import LLMEngine
from inference.sampling_params import SamplingParams
from inference.scheduler import ScheduledSeq

transformers = pytest.importorskip("transformers")

PROMPT_LENGTHS = (3, 9, 17, 30, 45, 64, 81, 100)
MAX_TOKENS = 12
BLOCK_SIZE = 8
DEVICE = os.environ.get("LLMSRE_TEST_DEVICE", "cpu")


@dataclass
class Run:
    outputs: dict[str, list[int]]
    logits: dict[str, list[torch.Tensor]]
    engine: LLMEngine


def make_prompts(vocab: int, *, shared_prefix: int = 0, seed: int = 0,
                 lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(10, vocab) for _ in range(n)] for n in lengths]


def run_engine(folder: Path, prompts: list[list[int]], config: EngineConfig, *,
               waves: int = 1) -> Run:
    engine = LLMEngine(str(folder), config)
    logits: dict[int, list[torch.Tensor]] = {}

    def capture(items: list[ScheduledSeq], rows: torch.Tensor) -> None:
        for item, row in zip(items, rows):
            # a copy on the CPU, where the reference is (the engine may run on a GPU)
            logits.setdefault(item.seq.seq_id, []).append(row.to("cpu", copy=True))

    engine.runner.logits_hook = capture
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    seq_of: dict[str, int] = {}
    per_wave = -(-len(prompts) // waves)
    for w in range(waves):
        for i in range(w * per_wave, min((w + 1) * per_wave, len(prompts))):
            engine.add_request(f"r{i}", prompts[i], params)
            seq_of[f"r{i}"] = engine.requests[f"r{i}"].seq.seq_id
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.output_token_ids)
    return Run(outputs, {rid: logits[sid] for rid, sid in seq_of.items()}, engine)


def reference(folder: Path, prompts: list[list[int]]) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    outs: dict[str, list[int]] = {}
    logits: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                                 attention_mask=torch.ones_like(ids), pad_token_id=0)
            outs[f"r{i}"] = gen[0, len(prompt):].tolist()
            full = model(gen[:, :-1]).logits[0, len(prompt) - 1:]
            logits[f"r{i}"] = full
    return outs, logits


def assert_equal_to_reference(run: Run, ref_out: dict[str, list[int]],
                              ref_logits: dict[str, torch.Tensor]) -> None:
    assert run.outputs == ref_out
    for rid, rows in run.logits.items():
        ours = torch.stack(rows[-MAX_TOKENS:])
        theirs = ref_logits[rid]
        rel = (ours - theirs).abs().max() / theirs.abs().max()
        assert rel < 1e-4, f"{rid}: logits differ by {rel:.2e} (relative)"
    assert run.engine.block_manager.num_free_blocks == run.engine.block_manager.num_blocks


def base_config(**overrides: object) -> EngineConfig:
    # decode graphs off: on a GPU these tests check the eager path (test_decode_graphs.py the graphs); the
    # CPU decode kernel off: on a CPU they check the torch path, the one accelerators and the INT8 cache
    # take (test_cpu_decode_kernel_keeps_output_equal the kernel, on by default on a CPU)
    values: dict[str, object] = {"device": DEVICE, "dtype": "float32", "block_size": BLOCK_SIZE,
                                 "decode_graphs": False, "cpu_decode_kernel": False,
                                 "num_kv_blocks": 256, "max_num_batched_tokens": 2048}
    values.update(overrides)
    return EngineConfig(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir", "tiny_mistral_dir",
                                        "tiny_deepseek_v3_dir", "tiny_deepseek_v3_plain_dir",
                                        "tiny_deepseek_v2_dir"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def vocab(model_dir: Path) -> int:
    return int(transformers.AutoConfig.from_pretrained(model_dir).vocab_size)


def test_concurrent_greedy_output_equals_transformers(model_dir: Path, vocab: int) -> None:
    prompts = make_prompts(vocab)
    run = run_engine(model_dir, prompts, base_config())
    assert_equal_to_reference(run, *reference(model_dir, prompts))


def test_prefix_cache_hits_keep_output_equal(model_dir: Path, vocab: int) -> None:
    # Kept within 128 tokens with the output: the Mistral checkpoint has a 128-token sliding window.
    prompts = make_prompts(vocab, shared_prefix=48, seed=1, lengths=(3, 9, 17, 30, 45, 52, 60, 64))
    run = run_engine(model_dir, prompts, base_config(), waves=2)
    stats = run.engine.block_manager.stats
    assert stats.hits >= 48 * (len(prompts) // 2), "the second wave should reuse the shared prefix"
    assert_equal_to_reference(run, *reference(model_dir, prompts))


def test_preemption_under_small_kv_pool_keeps_output_equal(model_dir: Path, vocab: int) -> None:
    prompts = make_prompts(vocab, seed=2)
    # 20 blocks of 8 tokens hold 160 tokens: far less than the batch needs, enough for the longest request.
    run = run_engine(model_dir, prompts, base_config(num_kv_blocks=20, enable_prefix_caching=False))
    assert run.engine.scheduler.num_preemptions > 0
    assert_equal_to_reference(run, *reference(model_dir, prompts))


def test_chunked_prefill_keeps_output_equal(model_dir: Path, vocab: int) -> None:
    prompts = make_prompts(vocab, seed=3)
    run = run_engine(model_dir, prompts, base_config(max_num_batched_tokens=24))
    chunked = [s for s in run.engine.step_stats if s.num_prefill_tokens and s.num_decode_tokens]
    assert chunked, "some step should mix a prefill chunk with decodes"
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in run.engine.step_stats) <= 24
    assert_equal_to_reference(run, *reference(model_dir, prompts))


def test_int8_kv_cache_fits_more_blocks_and_mostly_agrees_with_fp32(tiny_llama_dir: Path) -> None:
    """INT8 keys/values (per-block, per-head scales) against the FP32 cache, greedy, same prompts."""
    budget = 4 * 1024 * 1024
    vocab = int(transformers.AutoConfig.from_pretrained(tiny_llama_dir).vocab_size)
    prompts = make_prompts(vocab, seed=4)
    fp32 = run_engine(tiny_llama_dir, prompts, base_config(num_kv_blocks=0, kv_cache_memory_bytes=budget))
    int8 = run_engine(tiny_llama_dir, prompts, base_config(num_kv_blocks=0, kv_cache_memory_bytes=budget,
                                                           kv_cache_dtype="int8"))
    assert int8.engine.block_manager.num_blocks >= 2 * fp32.engine.block_manager.num_blocks
    matched = [_common_prefix(fp32.outputs[r], int8.outputs[r]) for r in fp32.outputs]
    whole = sum(m == MAX_TOKENS for m in matched) / len(matched)
    prefix = sum(matched) / (MAX_TOKENS * len(matched))
    print(f"int8 KV greedy agreement with fp32 on {len(prompts)} prompts: {whole:.0%} identical outputs, "
          f"{prefix:.0%} of tokens before the first divergence; "
          f"blocks {int8.engine.block_manager.num_blocks} vs {fp32.engine.block_manager.num_blocks}")
    # The first token comes from a prefill that attends to fresh keys, never to quantized ones.
    assert all(m >= 1 for m in matched)
    assert prefix >= 0.75


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_cpu_decode_kernel_keeps_output_equal(model_dir: Path, vocab: int) -> None:
    """The C++ paged decode kernel (inference/cpu_attention.py) in place of the torch decode path, through
    preemption (block tables rebuilt under it) and prefix-cache hits (blocks shared between sequences).
    Latent-attention models keep the torch path for their latent layers; the test checks they still agree."""
    config = base_config(device="cpu", cpu_decode_kernel=True)
    prompts = make_prompts(vocab, seed=2)
    run = run_engine(model_dir, prompts, replace(config, num_kv_blocks=20, enable_prefix_caching=False))
    assert run.engine.cpu_decode_kernel == "on", run.engine.cpu_decode_kernel
    assert run.engine.scheduler.num_preemptions > 0
    assert_equal_to_reference(run, *reference(model_dir, prompts))
    prompts = make_prompts(vocab, shared_prefix=48, seed=1, lengths=(3, 9, 17, 30, 45, 52, 60, 64))
    run = run_engine(model_dir, prompts, config, waves=2)
    assert run.engine.block_manager.stats.hits >= 48 * (len(prompts) // 2)
    assert_equal_to_reference(run, *reference(model_dir, prompts))
