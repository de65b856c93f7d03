"""``python -m inference.bench offline``: the engine's offline throughput against Hugging Face transformers.

Data flow: a seeded random workload (token ids, no text) -> three paths timed one after another in this
process, on the same model folder, device, dtype and torch threads -> one :class:`OfflineResult` that is
printed as a table with the targets, the KV-cache footprint and the roofline block
(:mod:`inference.bench.offline_result`), and optionally written as JSON.

The paths: our engine with every request submitted at once (``LLM.generate``); transformers ``generate``
one request at a time; transformers on padded static batches in arrival order, where only each request's
own output tokens count as useful (the rest of a batch's tokens are the padding's waste). Every request is
greedy and ignores EOS, so every path computes exactly the requested number of tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from inference.bench.kv_cache import kv_cache_footprint
from inference.bench.offline_result import (
    ENGINE,
    HF_BATCH_SIZE,
    HF_ONE,
    HF_STATIC,
    LABELS,
    VLLM,
    Agreement,
    BenchRequest,
    OfflineConfig,
    OfflineResult,
    PathResult,
    WorkloadSpec,
    format_result,
)
from inference.bench.offline_result import TARGETS as TARGETS  # re-exported: the benchmark's interface
from inference.bench.roofline import (
    RooflineConfig,
    RooflineReport,
    estimate,
    mean_decode_context,
    measure_machine,
    model_cost,
    observe_decode,
)
from inference.config import KV_CACHE_DTYPES, EngineConfig
from inference.engine import LLM, LLMEngine
from inference.environment import child_environment
from inference.sampling_params import SamplingParams
from inference.step_profile import Breakdown, StepProfile, profiling

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"


class BenchmarkError(Exception):
    """The benchmark cannot run as configured (a missing optional dependency, an unusable model)."""


# Warm-up requests: short, and drawn from their own random stream so that no prompt block of the timed
# workload is already in the engine's prefix cache.
WARMUP_SPEC = WorkloadSpec(num_requests=2, min_prompt_len=8, max_prompt_len=24, min_output_len=4,
                           max_output_len=8)


# ---- the workload ------------------------------------------------------------------------------
def make_workload(spec: WorkloadSpec, *, vocab_size: int, special_ids: Iterable[int],
                  rng: random.Random | None = None) -> list[BenchRequest]:
    """``spec.num_requests`` requests from ``random.Random(spec.seed)`` (or ``rng``)."""
    rng = rng or random.Random(spec.seed)
    special = frozenset(special_ids)
    allowed = [t for t in range(vocab_size) if t not in special]
    if not allowed:
        raise BenchmarkError(f"every token id below {vocab_size} is special; no prompt can be drawn")
    requests = []
    for _ in range(spec.num_requests):
        prompt_len = rng.randint(spec.min_prompt_len, spec.max_prompt_len)
        output_len = rng.randint(spec.min_output_len, spec.max_output_len)
        requests.append(BenchRequest(tuple(rng.choices(allowed, k=prompt_len)), output_len))
    return requests


def special_token_ids(folder: Path, known: Iterable[int | None] = ()) -> frozenset[int]:
    """Ids marked special in ``tokenizer.json``'s added tokens, plus ``known`` (bos, eos)."""
    ids = {t for t in known if t is not None}
    path = folder / TOKENIZER_FILE
    if path.is_file():
        added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens") or []
        ids.update(int(t["id"]) for t in added if t.get("special"))
    return frozenset(ids)


def engine_special_ids(engine: LLMEngine) -> frozenset[int]:
    tok, mc = engine.tokenizer, engine.model_config
    return special_token_ids(engine.model_path,
                             [*tok.eos_token_ids, tok.bos_token_id, *mc.eos_token_ids, mc.bos_token_id])


# ---- the paths ---------------------------------------------------------------------------------
@contextmanager
def _progress(total: int, desc: str, *, enabled: bool) -> Iterator[tqdm]:
    bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=not enabled, dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


def _engine_params(requests: Sequence[BenchRequest]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in requests]


def _prompts(requests: Sequence[BenchRequest]) -> list[list[int]]:
    return [list(r.prompt_token_ids) for r in requests]


def run_engine(llm: LLM, requests: Sequence[BenchRequest], *, warmup: Sequence[BenchRequest],
               show_progress: bool, repeats: int = 1) -> PathResult:
    """Warm up, then time every request submitted at once; best of ``repeats`` runs.

    The prefix cache is emptied before each run, so a repeat gets no free hits from the previous one;
    the step statistics kept are those of the best run.
    """
    llm.generate(_prompts(warmup), _engine_params(warmup))
    prompts, params = _prompts(requests), _engine_params(requests)
    best: tuple[float, int, list[Any]] | None = None
    for attempt in range(repeats):
        llm.engine.block_manager.reset_prefix_cache()
        llm.engine.step_stats.clear()
        label = "engine" if repeats == 1 else f"engine (run {attempt + 1}/{repeats})"
        with _progress(len(requests), label, enabled=show_progress) as bar:
            def advance(done: int, _total: int) -> None:
                bar.update(done - bar.n)

            started = time.perf_counter()
            outputs = llm.generate(prompts, params, progress=advance)
            seconds = time.perf_counter() - started
        tokens = sum(len(o.output_token_ids) for o in outputs)
        if best is None or seconds < best[0]:
            best = (seconds, tokens, list(llm.engine.step_stats))
    assert best is not None
    seconds, tokens, stats = best
    llm.engine.step_stats.clear()
    llm.engine.step_stats.extend(stats)
    note = f"best of {repeats} runs" if repeats > 1 else ""
    return PathResult(ENGINE, LABELS[ENGINE], len(requests), tokens, tokens, seconds, note)


def profile_engine(llm: LLM, requests: Sequence[BenchRequest], *, show_progress: bool) -> Breakdown | None:
    """One more run of the workload with the step profile on: the mean phases of its pure-decode steps.

    Not one of the timed runs (each phase mark synchronizes an accelerator); the run's step statistics
    are put back as they were, so the roofline still reads the best timed run's.
    """
    kept = list(llm.engine.step_stats)
    llm.engine.block_manager.reset_prefix_cache()
    profile = StepProfile(synchronize=llm.engine.device.synchronize)
    with _progress(len(requests), "engine (profiled)", enabled=show_progress) as bar, profiling(profile):
        llm.generate(_prompts(requests), _engine_params(requests),
                     progress=lambda done, _total: bar.update(done - bar.n))
    llm.engine.step_stats.clear()
    llm.engine.step_stats.extend(kept)
    return profile.decode_breakdown()


AGREEMENT_REQUESTS = 16  # the workload's first requests, run again at float32 for a reduced-precision run


def float32_agreement(llm: LLM, requests: Sequence[BenchRequest], config: OfflineConfig) -> Agreement | None:
    """How far the engine's greedy tokens follow a float32 engine's on the same requests; None when the
    engine already runs float32. Both engines run the workload's first requests on the same device."""
    if llm.engine.dtype == torch.float32:
        return None
    subset = requests[:AGREEMENT_REQUESTS]
    prompts, params = _prompts(subset), _engine_params(subset)
    ours = [o.output_token_ids for o in llm.generate(prompts, params)]
    reference_config = dataclasses.replace(config.engine, dtype="float32")
    reference = LLM(config.model, reference_config)
    theirs = [o.output_token_ids for o in reference.generate(prompts, params)]
    return Agreement.of(ours, theirs)


VLLM_CHILD = Path(__file__).with_name("vllm_child.py")
VLLM_TIMEOUT_S = 3600.0


def run_vllm(python: str, llm: LLM, requests: Sequence[BenchRequest], config: OfflineConfig) -> PathResult:
    """The same requests through vLLM, installed in the environment of the interpreter ``python``: every
    request at once, greedy, ignore EOS, the same model folder, dtype and torch threads; best of
    ``config.repeats`` runs. BenchmarkError with the end of vLLM's log when it fails."""
    engine = llm.engine
    job = {"model": str(engine.model_path), "dtype": str(engine.dtype).removeprefix("torch."),
           "num_threads": torch.get_num_threads(), "repeats": config.repeats,
           "max_num_seqs": config.engine.max_num_seqs, "max_model_len": engine.max_model_len,
           "kv_cache_gib": max(1, -(-config.engine.kv_cache_memory_bytes // 2**30)),
           "requests": [{"prompt": list(r.prompt_token_ids), "output_len": r.output_len} for r in requests]}
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        job_path, out_path, log_path = (Path(tmp) / name for name in ("in.json", "out.json", "vllm.log"))
        job_path.write_text(json.dumps(job), encoding="utf-8")
        if config.show_progress:
            print(f"vLLM: the workload through {python} (its start takes a minute or more)", file=sys.stderr)
        try:
            command = [python, str(VLLM_CHILD), str(job_path), str(out_path)]
            with log_path.open("wb") as log:
                status = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=VLLM_TIMEOUT_S,
                                        env=child_environment(), check=False).returncode
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BenchmarkError(f"vLLM via {python}: {exc}") from exc
        if status != 0 or not out_path.is_file():
            tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-8:]
            raise BenchmarkError(f"vLLM via {python} exited with status {status}:\n  " + "\n  ".join(tail))
        result = json.loads(out_path.read_text(encoding="utf-8"))
    tokens = int(result["tokens"])
    note = f"vLLM {result['version']}, best of {len(result['runs'])} runs"
    return PathResult(VLLM, LABELS[VLLM], len(requests), tokens, tokens, float(result["seconds"]), note)


HfGenerate = Callable[[torch.Tensor, torch.Tensor, int], int]


def load_hf_generate(folder: Path, *, device: torch.device, dtype: torch.dtype) -> HfGenerate:
    """transformers' model for ``folder``; returns ``generate(ids, mask, n) -> new tokens per row``."""
    try:
        import transformers
    except ImportError as exc:
        raise BenchmarkError("the Hugging Face baselines need transformers (pip install transformers), "
                             "or pass --skip-hf") from exc
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).to(device=device, dtype=dtype).eval()
    pad_id = model.generation_config.pad_token_id
    pad_id = 0 if pad_id is None else int(pad_id)

    def generate(input_ids: torch.Tensor, attention_mask: torch.Tensor, num_tokens: int) -> int:
        # min_new_tokens == max_new_tokens: EOS can never end a row early, as ignore_eos in the engine.
        out = model.generate(input_ids.to(device), attention_mask=attention_mask.to(device), do_sample=False,
                             max_new_tokens=num_tokens, min_new_tokens=num_tokens, use_cache=True,
                             pad_token_id=pad_id)
        return int(out.shape[1] - input_ids.shape[1])

    return generate


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask [batch, longest], each prompt flush right."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def run_hf_one_at_a_time(generate: HfGenerate, requests: Sequence[BenchRequest], *,
                         warmup: Sequence[BenchRequest], num_workload_requests: int,
                         show_progress: bool) -> PathResult:
    def one(r: BenchRequest) -> int:
        ids = torch.tensor([r.prompt_token_ids], dtype=torch.long)
        return generate(ids, torch.ones_like(ids), r.output_len)

    one(warmup[0])
    with _progress(len(requests), "HF one at a time", enabled=show_progress) as bar:
        tokens = 0
        started = time.perf_counter()
        for r in requests:
            tokens += one(r)
            bar.update(1)
        seconds = time.perf_counter() - started
    note = ""
    if len(requests) < num_workload_requests:
        note = (f"measured on the first {len(requests)} of {num_workload_requests} requests; "
                "tokens/s is that subset's rate, not extrapolated")
    return PathResult(HF_ONE, LABELS[HF_ONE], len(requests), tokens, tokens, seconds, note)


def run_hf_static_batches(generate: HfGenerate, requests: Sequence[BenchRequest], *,
                          warmup: Sequence[BenchRequest], batch_size: int, show_progress: bool,
                          repeats: int = 1) -> PathResult:
    """Batches of ``batch_size`` in arrival order, each run to its longest request's output length.

    Best of ``repeats`` runs, like the engine, so that both get the same chance against a noisy machine.
    """
    def batch(rs: Sequence[BenchRequest]) -> tuple[int, int]:
        ids, mask = left_pad([r.prompt_token_ids for r in rs])
        new = generate(ids, mask, max(r.output_len for r in rs))
        return sum(min(r.output_len, new) for r in rs), new * len(rs)

    batch(warmup)
    best = float("inf")
    for attempt in range(repeats):
        useful = generated = 0
        label = "HF static batches" if repeats == 1 else f"HF static batches (run {attempt + 1}/{repeats})"
        with _progress(len(requests), label, enabled=show_progress) as bar:
            started = time.perf_counter()
            for start in range(0, len(requests), batch_size):
                rs = requests[start:start + batch_size]
                u, g = batch(rs)
                useful, generated = useful + u, generated + g
                bar.update(len(rs))
            best = min(best, time.perf_counter() - started)
    seconds = best
    note = (f"generated {generated} tokens; only each request's own {useful} count "
            "(the rest: rows decoding past their own request's length)"
            + (f"; best of {repeats} runs" if repeats > 1 else ""))
    return PathResult(HF_STATIC, f"{LABELS[HF_STATIC]} of {batch_size}", len(requests), useful, generated,
                      seconds, note)


def run_hf(folder: Path, requests: Sequence[BenchRequest], *, warmup: Sequence[BenchRequest],
           device: torch.device, dtype: torch.dtype, config: OfflineConfig) -> list[PathResult]:
    generate = load_hf_generate(folder, device=device, dtype=dtype)
    subset = requests[:config.hf_one_at_a_time_requests or len(requests)]
    one = run_hf_one_at_a_time(generate, subset, warmup=warmup, num_workload_requests=len(requests),
                               show_progress=config.show_progress)
    static = run_hf_static_batches(generate, requests, warmup=warmup, batch_size=config.hf_batch_size,
                                   show_progress=config.show_progress, repeats=config.repeats)
    return [one, static]


def measure_roofline(engine: LLMEngine, requests: Sequence[BenchRequest],
                     config: RooflineConfig) -> RooflineReport | None:
    """The machine limit for the engine's pure-decode steps; None when the run had none."""
    observed = observe_decode(engine.step_stats)
    if observed is None:
        return None
    mc = engine.model_config
    cost = model_cost(engine.model, mc, kv_bytes_per_token=engine.runner.layout.bytes_per_token)
    rates = measure_machine(device=engine.device.torch_device, dtype=engine.dtype,
                            decode_batch=round(observed.mean_batch), hidden_size=mc.hidden_size,
                            config=config, synchronize=engine.device.synchronize)
    context = mean_decode_context((len(r.prompt_token_ids), r.output_len) for r in requests)
    return estimate(rates, cost, observed, context)


# ---- the run -----------------------------------------------------------------------------------
def run_offline(config: OfflineConfig) -> OfflineResult:
    """Build the workload, time the engine and the baselines, measure the machine; nothing is printed."""
    if not config.skip_hf and importlib.util.find_spec("transformers") is None:
        raise BenchmarkError("the Hugging Face baselines need transformers (pip install transformers), "
                             "or pass --skip-hf")
    llm = LLM(config.model, config.engine)
    engine = llm.engine
    vocab = min(engine.model_config.vocab_size, engine.tokenizer.vocab_size)
    special = engine_special_ids(engine)
    requests = make_workload(config.workload, vocab_size=vocab, special_ids=special)
    warmup = make_workload(WARMUP_SPEC, vocab_size=vocab, special_ids=special,
                           rng=random.Random(f"warmup-{config.workload.seed}"))
    preemptions = engine.scheduler.num_preemptions
    paths = [run_engine(llm, requests, warmup=warmup, show_progress=config.show_progress,
                        repeats=config.repeats)]
    preemptions = engine.scheduler.num_preemptions - preemptions
    roofline = measure_roofline(engine, requests, config.roofline)  # from the best timed run's steps
    decode_profile = profile_engine(llm, requests, show_progress=config.show_progress)
    agreement = float32_agreement(llm, requests, config)
    if config.vllm_python:
        paths.append(run_vllm(config.vllm_python, llm, requests, config))
    if not config.skip_hf:
        paths += run_hf(engine.model_path, requests, warmup=warmup, device=engine.device.torch_device,
                        dtype=engine.dtype, config=config)
    return OfflineResult(
        model_path=str(engine.model_path), device=str(engine.device.torch_device),
        dtype=str(engine.dtype).removeprefix("torch."), num_threads=torch.get_num_threads(),
        workload=config.workload, num_prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        output_lens=tuple(r.output_len for r in requests),
        max_num_seqs=config.engine.max_num_seqs, kv_cache_dtype=config.engine.kv_cache_dtype,
        num_preemptions=preemptions, paths=tuple(paths), roofline=roofline,
        kv_cache=kv_cache_footprint(engine), decode_profile=decode_profile, float32_agreement=agreement,
        decode_graphs=graphs_summary(engine) if graphs_asked(engine, config) else None,
        cpu_decode_kernel=engine.cpu_decode_kernel or ("off" if engine.device.kind == "cpu" else None),
        packed_weights=engine.packed_weights or ("off" if engine.device.kind == "cpu" else None))


def graphs_asked(engine: LLMEngine, config: OfflineConfig) -> bool:
    return engine.runner.graphs is not None or bool(config.engine.decode_graphs)


def graphs_summary(engine: LLMEngine) -> str:
    runner = engine.runner
    if runner.graphs is None:
        return f"unavailable: {runner.graphs_unavailable}"
    return runner.graphs.summary()


# ---- the command line --------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    defaults, engine = WorkloadSpec(), EngineConfig()
    p.add_argument("--model", default="default",
                   help="'default' (Llama) or 'default-moe' (DeepSeek-V3), built on first use, or a "
                        "Hugging Face folder")
    p.add_argument("--num-requests", type=int, default=defaults.num_requests)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--max-num-seqs", type=int, default=engine.max_num_seqs)
    p.add_argument("--kv-cache-dtype", default=engine.kv_cache_dtype, choices=KV_CACHE_DTYPES)
    p.add_argument("--dtype", default=engine.dtype, choices=("auto", "float32", "bfloat16", "float16"),
                   help="the model's dtype for every path (auto: float32 on CPU, bfloat16 on CUDA/NPU); "
                        "other than float32, the engine's greedy tokens are compared with a float32 engine's")
    p.add_argument("--device", default=engine.device, help="auto, cpu, cuda[:N] or npu[:N]")
    p.add_argument("--num-threads", type=int, default=engine.num_threads,
                   help="torch threads for every path (0: torch's default)")
    p.add_argument("--packed-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine's linear weights packed once at load (the C++ kernel's blocks, or "
                        "oneDNN's) instead of torch's linear (default: on where it applies, as a replica)")
    p.add_argument("--cpu-decode-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="decode attention by the C++ paged kernel (inference/cpu_attention.py; built once "
                        "per machine on first use, 20-40 s; default: on where it applies)")
    p.add_argument("--decode-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine replays pure-decode steps as CUDA graphs (inference/decode_graphs.py; "
                        "default: on with CUDA)")
    p.add_argument("--skip-hf", action="store_true", help="time only the engine")
    p.add_argument("--hf-one-at-a-time-requests", type=int, default=None, metavar="N",
                   help="run the one-at-a-time baseline on the first N requests only (default: all)")
    p.add_argument("--hf-batch-size", type=int, default=HF_BATCH_SIZE,
                   help="rows per padded static batch of the transformers baseline")
    p.add_argument("--repeats", type=int, default=OfflineConfig().repeats,
                   help="best of N runs for the engine and the static batches (the machine is noisy)")
    p.add_argument("--vs-vllm", default=None, metavar="PYTHON",
                   help="also run the workload through vLLM, installed in the environment of this "
                        "interpreter (make bench-vllm builds one), and compare")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def config_from_args(args: argparse.Namespace) -> OfflineConfig:
    return OfflineConfig(
        model=args.model,
        workload=WorkloadSpec(num_requests=args.num_requests, seed=args.seed),
        engine=EngineConfig(max_num_seqs=args.max_num_seqs, kv_cache_dtype=args.kv_cache_dtype,
                            device=args.device, num_threads=args.num_threads, dtype=args.dtype,
                            pack_linear_weights=args.packed_weights, decode_graphs=args.decode_graphs,
                            cpu_decode_kernel=args.cpu_decode_kernel),
        skip_hf=args.skip_hf, hf_one_at_a_time_requests=args.hf_one_at_a_time_requests,
        hf_batch_size=args.hf_batch_size, show_progress=not args.no_progress, repeats=args.repeats,
        vllm_python=args.vs_vllm)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        result = run_offline(config)
    except (BenchmarkError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_result(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
        print(f"\nresults written to {args.json}")
    if result.missed:
        print("\na target was missed (exit 1)", file=sys.stderr)
        return 1
    return 0
