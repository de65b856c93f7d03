"""The engine: ``LLMEngine.step()`` is schedule, run, postprocess.

Requests come in through :meth:`LLMEngine.add_request`; each step the scheduler picks what to compute,
the model runner computes it and samples, and postprocessing appends tokens, detokenizes, applies stop
conditions and frees finished sequences. :class:`LLM` wraps the loop for offline batch generation; the
server drives the same engine from a background thread (``inference.async_engine``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from inference import step_profile
from inference.config import EngineConfig
from inference.cpu_attention import KERNEL_DTYPES, CpuDecodeKernel, load_cpu_decode_kernel
from inference.device import select_device
from inference.kv_blocks import BlockManager
from inference.model_runner import GraphsConfig, ModelRunner, plan_cache
from inference.models.default import ensure_default_model
from inference.models.default_moe import ensure_default_moe_model
from inference.models.loader import load_model
from inference.npu_attention import make_npu_decode_kernel
from inference.output import Clock, RequestMetrics, RequestOutput, TextAssembler, TokenLogprob
from inference.packed_linear import BlockedOps, pack_linears, unavailable_reason
from inference.run_delay import run_delay
from inference.sampler import SamplingRow
from inference.sampling_params import InvalidParameterError, SamplingParams
from inference.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from inference.sequence import FinishReason, Sequence
from inference.step_profile import POSTPROCESS, SCHEDULE
from inference.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _cpu_path_state(asked: bool | None, device_kind: str, what: str, fallback: str,
                    attempt: Callable[[], str | None]) -> str | None:
    """A CPU path's state (the C++ decode kernel, packed weights): "on", "unavailable: <why>", or None when
    it was turned off (``asked`` False), or left to the default (None) on a device other than a CPU.
    ``attempt()`` sets the path up and says why it cannot run (None: it runs); where it cannot, the reason
    is logged, as a warning when the path was asked for."""
    if asked is False or (asked is None and device_kind != "cpu"):
        return None
    why = attempt()
    if why is None:
        return "on"
    log = logger.warning if asked else logger.info
    log("%s unavailable: %s; %s", what, why, fallback)
    return f"unavailable: {why}"


class PromptTooLongError(InvalidParameterError):
    def __init__(self, num_tokens: int, max_model_len: int) -> None:
        super().__init__("prompt", f"the prompt has {num_tokens} tokens; this model's context holds "
                                   f"{max_model_len} (prompt and output together)")
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len


@dataclass(slots=True, frozen=True)
class StepStat:
    start: float
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    # The step's work in the replica profile's terms (controlplane.autoscale.profile): keys the decoded
    # tokens attended to, and the (query, key) pairs of the prefill chunks' attention.
    context_tokens: int = 0
    prefill_pairs: int = 0
    # CPU seconds the stepping thread ran within ``duration`` (its own CPU clock): less than ``duration``
    # when it waited for a core (other processes or replicas on the same cores) or the interpreter lock.
    cpu: float = 0.0
    # Of ``duration``, the seconds the stepping thread waited for a core (its run delay, see
    # inference.run_delay); the rest not on a CPU it slept, on the interpreter lock mostly. None where the
    # kernel does not count it.
    runqueue: float | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass(slots=True)
class _Request:
    request_id: str
    seq: Sequence
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer
    text: TextAssembler
    # With SamplingParams.logprobs and ``keep_logprobs``: one per output token, for the finished output. A
    # streamed request sends each token's in its own output and keeps none (up to 20 alternatives a token).
    logprobs: list[TokenLogprob] | None = None
    # Only the finished output is wanted (offline generation): no output for each token, and without stop
    # strings, which need the text as it grows, the text is decoded once at the end.
    final_only: bool = False
    num_detokenized: int = 0  # output tokens handed to the detokenizer (or found to be the stopping EOS)

    @property
    def text_at_end(self) -> bool:
        return self.final_only and not self.seq.params.stop


# Bundled models, built on first use under the state folder: a Llama and a DeepSeek-V3 (MLA + MoE).
BUNDLED_MODELS: dict[str, Callable[[Path | None], Path]] = {"default": ensure_default_model,
                                                            "default-moe": ensure_default_moe_model}


def resolve_model(model: str, state_dir: Path | None = None) -> Path:
    """A bundled model's name (``default``, ``default-moe``; built on first use) or a Hugging Face folder."""
    if model in BUNDLED_MODELS:
        return BUNDLED_MODELS[model](state_dir)
    folder = Path(model).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    return folder


class LLMEngine:
    def __init__(self, model: str = "default", config: EngineConfig | None = None, *,
                 clock: Clock = time.monotonic, state_dir: Path | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.clock = clock
        self.model_path = resolve_model(model, state_dir)
        self.model_name = model if model in BUNDLED_MODELS else self.model_path.name
        self.device = select_device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dtype = self.device.default_dtype() if config.dtype == "auto" else _DTYPES[config.dtype]
        self.model, self.model_config = load_model(
            self.model_path, device=self.device.torch_device, dtype=self.dtype,
            max_positions=config.max_model_len or None)
        self.cpu_decode_kernel = self._cpu_decode_kernel(config)  # "on" or "unavailable: <why>"; None: off
        self.packed_weights = self._pack_weights(config)  # "on" or "unavailable: <why>"; None: off
        self.tokenizer = Tokenizer.from_folder(self.model_path)
        mc = self.model_config
        layout = plan_cache(memory_bytes=config.kv_cache_memory_bytes, num_blocks=config.num_kv_blocks,
                            block_size=config.block_size, config=mc, dtype=self.dtype,
                            int8=config.kv_cache_dtype == "int8")
        self.max_model_len = self._max_model_len(layout.num_blocks * layout.block_size)
        self.block_manager = BlockManager(layout.num_blocks, layout.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.enable_chunked_prefill), self.block_manager)
        kernel = make_npu_decode_kernel() if self.device.kind == "npu" else None
        layer_ops = None
        if self.cpu_decode_kernel == "on":
            kernel, _ = load_cpu_decode_kernel()
            layer_ops = kernel.layer_ops if isinstance(kernel, CpuDecodeKernel) else None
        use_graphs = self.device.kind == "cuda" if config.decode_graphs is None else config.decode_graphs
        captured_context = min(self.max_model_len, config.decode_graphs_max_context)
        graphs = (GraphsConfig(config.max_num_seqs, -(-captured_context // layout.block_size))
                  if use_graphs else None)
        self.runner = ModelRunner(self.model, layout, device=self.device.torch_device, dtype=self.dtype,
                                  int8_kv=config.kv_cache_dtype == "int8", decode_kernel=kernel,
                                  graphs=graphs, layer_ops=layer_ops)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}  # the same requests, by sequence id
        self.step_stats: deque[StepStat] = deque(maxlen=4096)
        self.record_prefill_chunks = False  # per request, for traces (inference.tracing); off: no work
        self._seq_ids = itertools.count()
        logger.info("engine ready: model=%s device=%s dtype=%s kv_blocks=%d block_size=%d max_model_len=%d",
                    self.model_path, self.device.torch_device, self.dtype, layout.num_blocks,
                    layout.block_size, self.max_model_len)

    def _pack_weights(self, config: EngineConfig) -> str | None:
        """Pack the linear weights where asked and possible (:func:`_cpu_path_state`): in the CPU kernel's
        blocks where the kernel is on and runs the dtype (:class:`BlockedLinear`), else for oneDNN, whose
        primitive for every row count a step runs its linears at (up to the larger of the sequence and
        token budgets) is built now."""
        def attempt() -> str | None:
            blocked = self._blocked_ops()
            why = None if blocked is not None else unavailable_reason(self.device.torch_device, self.dtype)
            rows = max(config.max_num_seqs, config.max_num_batched_tokens)
            if why is None and not pack_linears(self.model, device=self.device.torch_device, dtype=self.dtype,
                                                max_rows=rows, blocked=blocked):
                why = "the model has no linear layer of its dtype to pack"
            return why

        return _cpu_path_state(config.pack_linear_weights, self.device.kind, "packed weights",
                               "the linear layers run on torch's", attempt)

    def _blocked_ops(self) -> BlockedOps | None:
        """The CPU kernel's linear where the kernel is on and runs this dtype."""
        if self.cpu_decode_kernel != "on":
            return None
        kernel, _ = load_cpu_decode_kernel()
        ops = kernel.blocked_ops if isinstance(kernel, CpuDecodeKernel) else None
        return ops if ops is not None and self.dtype in ops.dtypes else None

    def _cpu_decode_kernel(self, config: EngineConfig) -> str | None:
        """Whether the C++ paged decode kernel serves this engine (:func:`_cpu_path_state`)."""
        def attempt() -> str | None:
            if self.device.kind != "cpu":
                return f"the device is {self.device.kind} (the kernel is for CPUs)"
            if config.kv_cache_dtype == "int8":
                return "the INT8 KV cache"
            if self.dtype not in KERNEL_DTYPES:
                return f"{self.dtype} (float32 and bfloat16 only)"
            return load_cpu_decode_kernel()[1]

        return _cpu_path_state(config.cpu_decode_kernel, self.device.kind, "CPU decode kernel",
                               "decode attention runs on torch", attempt)

    def _max_model_len(self, pool_tokens: int) -> int:
        limit = min(self.model_config.max_model_len, pool_tokens)
        if self.config.max_model_len:
            limit = min(limit, self.config.max_model_len)
        if not self.config.enable_chunked_prefill:
            limit = min(limit, self.config.max_num_batched_tokens)
        return limit

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams, *,
                    priority: int = 0, arrival_time: float | None = None, keep_logprobs: bool = True,
                    final_only: bool = False) -> None:
        """Queue a request. ``keep_logprobs``: the finished output carries every token's logprobs (a
        non-streamed answer); off, each output carries only its new tokens' (a stream). ``final_only``:
        :meth:`step` returns this request's output once, finished (vLLM's ``FINAL_ONLY``)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(tokens)
        arrival = self.clock() if arrival_time is None else arrival_time
        seq = Sequence(next(self._seq_ids), tokens, params, arrival, priority)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids=tokens)
        request = _Request(request_id, seq, RequestMetrics(arrival), detokenizer, TextAssembler(params.stop),
                           [] if params.logprobs is not None and keep_logprobs else None, final_only)
        self.requests[request_id] = request
        self._by_seq[seq.seq_id] = request
        self.scheduler.add(seq)

    def validate_prompt(self, tokens: Seq[int]) -> None:
        if not tokens:
            raise InvalidParameterError("prompt", "must not be empty")
        if len(tokens) >= self.max_model_len:
            raise PromptTooLongError(len(tokens), self.max_model_len)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise InvalidParameterError("prompt", f"token ids must be in [0, {vocab})")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Cancel a request; its KV blocks are free when this returns."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        return self._finish(req, FinishReason.ABORT, self.clock())

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every request with an error (the device failed under them)."""
        now = self.clock()
        requests = list(self.requests.values())
        return [self._finish(req, FinishReason.ERROR, now, error=error) for req in requests]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start, cpu_start, waited_before = self.clock(), time.thread_time(), run_delay()
        profile = step_profile.current()
        if profile is not None:
            profile.begin()
        out = self.scheduler.schedule()
        for seq in out.preempted:  # counted even when the preemption leaves nothing to run this step
            self._by_seq[seq.seq_id].metrics.num_preemptions += 1
        if out.is_empty:
            return []
        rows = self._begin(out, start)
        step_profile.lap(SCHEDULE)
        sampled, logprobs = self.runner.run(out, rows)
        self.scheduler.update_after_step(out, sampled)
        cpu = time.thread_time() - cpu_start  # read inside the step's wall span: never more than it
        waited_after = run_delay()
        now = self.clock()
        runqueue = None if waited_before is None or waited_after is None else waited_after - waited_before
        if self.record_prefill_chunks:
            self._record_prefill_chunks(out, start, now)
        outputs = [o for item, token, logprob in zip(out.scheduled, sampled, logprobs)
                   if token is not None and
                   (o := self._postprocess(self._by_seq[item.seq.seq_id], token, logprob, now)) is not None]
        self._record_step(out, start, now, cpu, runqueue)
        if profile is not None:
            profile.lap(POSTPROCESS)
            decode = self.step_stats[-1].num_decode_tokens
            profile.end(out.num_batched_tokens - decode, decode)
        return outputs

    def _begin(self, out: SchedulerOutput, now: float) -> list[SamplingRow]:
        rows = []
        for item in out.scheduled:
            req = self._by_seq[item.seq.seq_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                req.metrics.num_cached_tokens = item.seq.num_cached_tokens
            if item.samples:
                rows.append(self._sampling_row(item.seq))
        return rows

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        p = seq.params
        early = seq.num_output_tokens < p.min_tokens and not p.ignore_eos
        banned = self.eos_token_ids if early else frozenset()
        if not p.has_penalties:
            return SamplingRow(p, seq.num_output_tokens + p.output_offset, banned)
        # A resumed stream's prompt ends with the ``output_offset`` tokens it output elsewhere: penalties
        # count them as output, so the continuation samples what the undisturbed run would have.
        num_prompt = seq.num_prompt_tokens - min(p.output_offset, seq.num_prompt_tokens)
        return SamplingRow(p, seq.num_output_tokens + p.output_offset, banned, seq.token_ids, num_prompt,
                           seq.seq_id)

    def _postprocess(self, req: _Request, token: int, logprob: TokenLogprob | None,
                     now: float) -> RequestOutput | None:
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        if req.logprobs is not None and logprob is not None:
            req.logprobs.append(logprob)
        new_logprobs = None if logprob is None else [logprob]
        delta, reason = self._append_text(req, token)
        if reason is not None:
            return self._finish(req, reason, now, new_tokens=[token], delta=delta, new_logprobs=new_logprobs)
        if req.final_only:
            return None
        return self._output(req, [token], delta, finished=False, reason=None, new_logprobs=new_logprobs)

    def _append_text(self, req: _Request, token: int) -> tuple[str, FinishReason | None]:
        """Detokenize ``token`` (unless the request's text waits for its end) and decide whether the
        request stops here."""
        seq, params = req.seq, req.seq.params
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        delta, stopped = "", False
        if not req.text_at_end:
            started = time.perf_counter()
            delta, stopped = req.text.push("" if is_eos else req.detokenizer.push(token))
            req.num_detokenized += 1
            req.metrics.detokenize_seconds += time.perf_counter() - started
        if is_eos or stopped:
            return delta, FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return delta, FinishReason.LENGTH
        return delta, None

    def _finish(self, req: _Request, reason: FinishReason, now: float, *, delta: str = "",
                new_tokens: list[int] | None = None, error: str | None = None,
                new_logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        self.scheduler.finish(req.seq, reason)
        del self.requests[req.request_id]
        del self._by_seq[req.seq.seq_id]
        req.metrics.finished_time = now
        if not req.text.stopped:
            started = time.perf_counter()
            delta += req.text.push(req.detokenizer.flush(self._not_detokenized(req, reason)))[0]
            delta += req.text.flush()
            req.metrics.detokenize_seconds += time.perf_counter() - started
        return self._output(req, new_tokens or [], delta, finished=True, reason=reason.value, error=error,
                            new_logprobs=new_logprobs)

    def _not_detokenized(self, req: _Request, reason: FinishReason) -> list[int]:
        """The output tokens not yet detokenized (all of them where the text waits for the end), but a
        stopping EOS, which has no text."""
        output = req.seq.output_token_ids
        rest = output[req.num_detokenized:]
        if rest and reason is FinishReason.STOP and rest[-1] in self.eos_token_ids:
            rest.pop()
        req.num_detokenized = len(output)
        return rest

    def _output(self, req: _Request, new_tokens: list[int], delta: str, *, finished: bool,
                reason: str | None, error: str | None = None,
                new_logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        seq = req.seq
        if seq.params.logprobs is not None and new_logprobs is None:
            new_logprobs = []
        return RequestOutput(req.request_id, seq.prompt_token_ids, seq.output_token_ids, new_tokens,
                             req.text.text[:req.text.emitted], delta, finished, reason, req.metrics, error,
                             new_logprobs, req.logprobs if finished else None)

    def _record_prefill_chunks(self, out: SchedulerOutput, start: float, end: float) -> None:
        """The prompt chunks this step computed, per request, for its trace (before its first token)."""
        for item in out.scheduled:
            metrics = self._by_seq[item.seq.seq_id].metrics
            if metrics.first_token_time is None:
                chunks = metrics.prefill_chunks = metrics.prefill_chunks or []
                chunks.append((start, end, item.num_new_tokens))

    def _record_step(self, out: SchedulerOutput, start: float, end: float, cpu: float,
                     runqueue: float | None) -> None:
        """The step's shape and time (after ``update_after_step``: each sequence's computed tokens include
        this step's)."""
        decode = context = pairs = 0
        for item in out.scheduled:
            computed, new = item.seq.num_computed_tokens, item.num_new_tokens
            if new == 1:
                decode += 1
                context += computed
            else:  # a chunk of ``new`` tokens after ``computed - new`` already in the cache
                pairs += new * (computed - new) + new * (new + 1) // 2
        self.step_stats.append(StepStat(start, end - start, out.num_batched_tokens - decode, decode,
                                        self.scheduler.num_running, self.scheduler.num_waiting, context,
                                        pairs, cpu, runqueue))


ProgressCallback = Callable[[int, int], None]


class LLM:
    """Offline batch generation: submit everything, step until done."""

    def __init__(self, model: str = "default", config: EngineConfig | None = None, **kwargs: object) -> None:
        self.engine = LLMEngine(model, config, **kwargs)  # type: ignore[arg-type]

    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams],
                 *, priorities: Seq[int] | None = None,
                 progress: ProgressCallback | None = None) -> list[RequestOutput]:
        per_request = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_request) != len(prompts):
            raise ValueError("params: one SamplingParams, or one per prompt")
        ids = [f"offline-{i}" for i in range(len(prompts))]
        for i, (rid, prompt) in enumerate(zip(ids, prompts)):
            prio = priorities[i] if priorities is not None else 0
            self.engine.add_request(rid, prompt, per_request[i], priority=prio, final_only=True)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for o in self.engine.step():
                if o.finished:
                    final[o.request_id] = o
                    if progress is not None:
                        progress(len(final), len(ids))
        return [final[rid] for rid in ids]
