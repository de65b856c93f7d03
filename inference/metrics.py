"""The replica's ``/metrics`` page: vLLM's metric names and buckets, plus HTTP, admission and device metrics.

Engine state (queue lengths, KV usage, prefix-cache and preemption counters) is read at scrape time by a
collector, so the page always agrees with the engine; per-request histograms are observed when a request
finishes. Every series carries vLLM's labels, ``model_name`` and ``engine`` (the engine's index within the
server: always ``"0"``, one engine per replica), plus our ``replica`` and ``zone``. The vLLM series and
their buckets follow vLLM's documented list (kept in ``tests/replica/data/vllm_metrics.json``); the
project's own metrics carry the ``llmsre_`` prefix (:data:`inference.runtime_metrics.NAMESPACE`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inference.output import RequestOutput
from inference.run_delay import unavailable_reason as run_delay_unavailable
from inference.runtime_metrics import NAMESPACE, register_runtime_metrics

if TYPE_CHECKING:
    from inference.engine import LLMEngine, StepStat

# Like vLLM: no `_created` series (they double the page and Prometheus ignores them in text format).
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated

LABELS = ("model_name", "engine", "replica", "zone")
ENGINE_INDEX = "0"  # vLLM numbers the engines of one server from 0; a replica runs one
FINISH_REASONS = ("stop", "length", "abort")
# Why the server refuses a request before it starts (``observe_rejected``); exported at 0 from start-up.
REJECT_REASONS = ("unauthorized", "body_too_large", "invalid", "prompt_too_long", "draining",
                  "device_failure", "injected_error", "queue_full", "queue_tokens_full",
                  "client_disconnected")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)

# The project's own series on the replica's page.
KV_BLOCKS_IN_USE = f"{NAMESPACE}kv_cache_blocks_in_use"
DEVICE_MEMORY_USED = f"{NAMESPACE}device_memory_used_bytes"
DEVICE_MEMORY_TOTAL = f"{NAMESPACE}device_memory_total_bytes"
DEVICE_UTILIZATION = f"{NAMESPACE}device_utilization_ratio"
HTTP_REQUESTS = f"{NAMESPACE}http_requests"  # the page shows it with prometheus_client's ``_total``
REJECTED_REQUESTS = f"{NAMESPACE}rejected_requests"
# The sum of the squared prompt lengths of finished requests: with vllm:prompt_tokens and
# vllm:request_success, the spread of prompt lengths (the autoscaler's M/G/c prefill queue), which the
# 1-2-5 buckets of vllm:request_prompt_tokens are too coarse for.
PROMPT_TOKENS_SQUARED = f"{NAMESPACE}prompt_tokens_squared"
# The same for output lengths, with vllm:generation_tokens: the autoscaler's TPOT tail (short answers whose
# few steps carry prefill chunks miss the TPOT SLO) depends on how many answers are short.
GENERATION_TOKENS_SQUARED = f"{NAMESPACE}generation_tokens_squared"
KV_BYTES_PER_TOKEN = f"{NAMESPACE}kv_cache_bytes_per_token"
KV_CAPACITY_BYTES = f"{NAMESPACE}kv_cache_capacity_bytes"
ENGINE_INFO = f"{NAMESPACE}engine_info"  # 1, labelled with how the engine runs (EngineInfo)
EXPERT_TOKENS = f"{NAMESPACE}moe_expert_tokens"  # a counter: the page shows it with ``_total``
EXPERT_IMBALANCE = f"{NAMESPACE}moe_expert_load_imbalance"
# The engine's time and its steps' work in the replica profile's terms, so the control plane can tell how far
# the replica runs from its profile (controlplane.autoscale.drift): both counters, shown with ``_total``.
ENGINE_BUSY_SECONDS = f"{NAMESPACE}engine_busy_seconds"
ENGINE_TURN_SECONDS = f"{NAMESPACE}engine_turn_seconds"  # of the busy seconds, those between two steps
ENGINE_STEP_CPU_SECONDS = f"{NAMESPACE}engine_step_cpu_seconds"  # of the steps' seconds, those on a CPU
# of the steps' seconds, those the engine's thread waited for a core (not exported where the kernel does not
# count it: inference.run_delay)
ENGINE_STEP_RUNQUEUE_SECONDS = f"{NAMESPACE}engine_step_runqueue_seconds"
ENGINE_STEP_WORK = f"{NAMESPACE}engine_step_work"
STEP_WORK_TERMS = ("steps", "decode_sequences", "prefill_tokens", "context_tokens", "prefill_pairs")


def buckets_1_2_5(maximum: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``maximum`` (vLLM's token-count buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > maximum:
                return tuple(out)
            out.append(value)
        exponent += 1


@dataclass(slots=True, frozen=True)
class EngineGauges:
    """What the collector reads from the engine at scrape time."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    device_memory_used: int
    device_memory_total: int
    device_utilization: float | None
    kv_blocks_in_use: int = 0  # exact: blocks referenced by sequences (kv_cache_usage also counts reserved)
    expert_tokens: list[list[int]] = field(default_factory=list)  # per MoE layer, per expert, cumulative


@dataclass(slots=True, frozen=True)
class CacheConfigInfo:
    block_size: int
    num_gpu_blocks: int
    cache_dtype: str
    enable_prefix_caching: bool
    bytes_per_token: int = 0  # what one token's cache costs, all layers (MLA: the latent rows)


@dataclass(slots=True, frozen=True)
class EngineInfo:
    """How the replica's engine runs, as labels of ``llmsre_engine_info``: the device kind, the model's
    dtype, and the states of the CPU decode kernel and of the packed linear weights ("on", "off", or
    "unavailable" with the reason in the replica's log; "off" also where the device is not a CPU)."""

    device: str = "cpu"
    dtype: str = "float32"
    cpu_decode_kernel: str = "off"
    packed_weights: str = "off"

    @staticmethod
    def kernel_state(engine_state: str | None) -> str:
        """The label for ``LLMEngine.cpu_decode_kernel`` or ``packed_weights`` ("on", "unavailable: <why>"
        or None)."""
        return "off" if engine_state is None else engine_state.split(":", 1)[0]


class _EngineCollector(Collector):
    def __init__(self, read: Callable[[], EngineGauges], labels: tuple[str, ...],
                 info: CacheConfigInfo, engine_info: EngineInfo) -> None:
        self.read = read
        self.labels = list(labels)
        self.info = info
        self.engine_info = engine_info

    def collect(self) -> Iterable[Metric]:
        g = self.read()
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          g.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                          g.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          g.kv_cache_usage)
        # vLLM's name for it before 0.9, still read by older dashboards (its own example's earlier revisions).
        yield self._gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage. "
                          "DEPRECATED: use vllm:kv_cache_usage_perc.", g.kv_cache_usage)
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                            "queried tokens.", g.prefix_cache_queries)
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                            "tokens.", g.prefix_cache_hits)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
                            g.num_preemptions)
        yield self._gauge(KV_BLOCKS_IN_USE, "KV-cache blocks referenced by sequences now (0 when "
                          "idle: a block still held then has leaked).", g.kv_blocks_in_use)
        yield self._gauge(DEVICE_MEMORY_USED, "Device memory in use by this replica.",
                          g.device_memory_used)
        yield self._gauge(DEVICE_MEMORY_TOTAL, "Device memory in total.", g.device_memory_total)
        if g.device_utilization is not None:
            yield self._gauge(DEVICE_UTILIZATION, "Device busy share since the last scrape "
                              "(CPU: cores used by this process).", g.device_utilization)
        yield self._cache_info()
        yield self._engine_info()
        i = self.info
        yield self._gauge(KV_BYTES_PER_TOKEN, "Bytes of KV cache one token takes, all layers (multi-head "
                          "latent attention: its latent rows).", i.bytes_per_token)
        yield self._gauge(KV_CAPACITY_BYTES, "Bytes of the paged KV-cache pool.",
                          i.bytes_per_token * i.block_size * i.num_gpu_blocks)
        if g.expert_tokens:
            yield from self._expert_load(g.expert_tokens)

    def _expert_load(self, per_layer: list[list[int]]) -> Iterable[Metric]:
        tokens = CounterMetricFamily(EXPERT_TOKENS, "Tokens routed to each expert, summed over the "
                                     "mixture-of-experts layers.", labels=[*LABELS, "expert"])
        for expert, count in enumerate(map(sum, zip(*per_layer, strict=True))):
            tokens.add_metric([*self.labels, str(expert)], count)
        yield tokens
        yield self._gauge(EXPERT_IMBALANCE, "Busiest expert's tokens over the mean, in the most unbalanced "
                          "layer, since start (1 is even; 0 before any token).", expert_imbalance(per_layer))

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        m = GaugeMetricFamily(name, doc, labels=LABELS)
        m.add_metric(self.labels, value)
        return m

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        m = CounterMetricFamily(name, doc, labels=LABELS)
        m.add_metric(self.labels, value)
        return m

    def _cache_info(self) -> GaugeMetricFamily:
        keys = ["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"]
        m = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                              labels=[*LABELS, *keys])
        i = self.info
        m.add_metric([*self.labels, str(i.block_size), str(i.num_gpu_blocks), i.cache_dtype,
                      str(i.enable_prefix_caching)], 1.0)
        return m

    def _engine_info(self) -> GaugeMetricFamily:
        e = self.engine_info
        m = GaugeMetricFamily(ENGINE_INFO, "How the engine runs: device kind, model dtype, CPU decode kernel "
                              "and packed linear weights (on, off or unavailable).",
                              labels=[*LABELS, "device", "dtype", "cpu_decode_kernel", "packed_weights"])
        m.add_metric([*self.labels, e.device, e.dtype, e.cpu_decode_kernel, e.packed_weights], 1.0)
        return m


def expert_imbalance(per_layer: list[list[int]]) -> float:
    """max / mean tokens per expert, worst layer; 0.0 when no token was routed yet."""
    ratios = [max(layer) * len(layer) / sum(layer) for layer in per_layer if sum(layer)]
    return max(ratios, default=0.0)


class ReplicaMetrics:
    def __init__(self, *, model_name: str, replica: str, zone: str, max_model_len: int,
                 read_engine: Callable[[], EngineGauges], cache_info: CacheConfigInfo,
                 engine_info: EngineInfo = EngineInfo()) -> None:
        self.registry = CollectorRegistry()
        self.label_values = (model_name, ENGINE_INDEX, replica, zone)
        self.registry.register(_EngineCollector(read_engine, self.label_values, cache_info, engine_info))
        register_runtime_metrics(self.registry)
        r = self.registry
        token_buckets = buckets_1_2_5(max_model_len)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*LABELS, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_squared = counter(PROMPT_TOKENS_SQUARED, "Sum of the squared prompt lengths, in "
                                             "tokens, of the requests counted by vllm:prompt_tokens.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.generation_tokens_squared = counter(GENERATION_TOKENS_SQUARED, "Sum of the squared output "
                                                 "lengths, in tokens, of the requests counted by "
                                                 "vllm:request_success.")
        self.request_success = counter("vllm:request_success", "Count of successfully processed requests.",
                                       ("finished_reason",))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                              "seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in "
                             "seconds.", ITL_BUCKETS)
        # vLLM's older name for the inter-token latency, still read by older dashboards: the same values.
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                              "seconds. DEPRECATED: use vllm:inter_token_latency_seconds.", ITL_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds", "Histogram of "
                                      "time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in "
                             "seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING "
                               "phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL "
                                 "phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE "
                                "phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds", "Histogram of time spent in "
                                   "RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens "
                                               "processed.", token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens", "Number of generation "
                                                   "tokens processed.", token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens "
                                          "per engine_step.", ITERATION_TOKEN_BUCKETS)
        self.max_num_generation_tokens = histogram("vllm:request_max_num_generation_tokens", "Histogram of "
                                                   "maximum number of requested generation tokens.",
                                                   token_buckets)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                  PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens "
                                           "request parameter.", token_buckets)
        self.http_requests = Counter(HTTP_REQUESTS, "HTTP requests by path and status code.",
                                     [*LABELS, "path", "status_code"], registry=r)
        self.rejected_requests = counter(REJECTED_REQUESTS, "Requests refused before they started, by "
                                         "reason.", ("reason",))
        self.engine_busy = counter(ENGINE_BUSY_SECONDS, "Seconds the engine spent in steps, with the turn "
                                   "between two back-to-back steps (the step period a stream sees).")
        self.engine_turn = counter(ENGINE_TURN_SECONDS, "Of the engine's busy seconds, those between two "
                                   "back-to-back steps (handing out tokens, taking in requests, waiting "
                                   "for the interpreter lock).")
        self.engine_step_cpu = counter(ENGINE_STEP_CPU_SECONDS, "CPU seconds the engine's thread ran within "
                                       "its steps (busy less turn seconds): the rest it waited for a core "
                                       "(other processes or replicas on the same cores) or for the "
                                       "interpreter lock. With several torch threads, the engine thread's "
                                       "own share.")
        # Only where the kernel counts run delays: a counter stuck at 0 would read as never waiting.
        self.engine_step_runqueue = None if run_delay_unavailable() else counter(
            ENGINE_STEP_RUNQUEUE_SECONDS, "Of the engine's step seconds, those its thread waited for a core "
            "(runnable, on the kernel's run queue): other processes or replicas on the same cores. Step "
            "seconds neither on a CPU nor waiting for one, it slept: on the interpreter lock, held by the "
            "replica's HTTP server, mostly.")
        self.step_work = counter(ENGINE_STEP_WORK, "Engine steps and their work by term: decoded sequences, "
                                 "prefill tokens, keys the decoded tokens attended to, prefill attention "
                                 "pairs.", ("term",))
        self._create_series()
        # The per-token and per-step series, labelled once: ``labels()`` hashes and locks on every call, and
        # these are observed on the event loop for every token the replica streams.
        lv = self.label_values
        self._ttft_series = self.ttft.labels(*lv)
        self._itl_series = self.itl.labels(*lv)
        self._tpot_series = self.tpot.labels(*lv)
        self._iteration_series = self.iteration_tokens.labels(*lv)
        self._busy_series = self.engine_busy.labels(*lv)
        self._turn_series = self.engine_turn.labels(*lv)
        self._step_cpu_series = self.engine_step_cpu.labels(*lv)
        self._step_runqueue_series = None if self.engine_step_runqueue is None else \
            self.engine_step_runqueue.labels(*lv)
        self._work_series = tuple(self.step_work.labels(*lv, term) for term in STEP_WORK_TERMS)
        self._busy_until: float | None = None  # the last step's end while the engine still had work
        self._last_step: StepStat | None = None

    def _create_series(self) -> None:
        """Export every vLLM series at 0 from start-up, as vLLM does, so a quiet replica shows zeros."""
        lv = self.label_values
        for metric in (self.prompt_tokens, self.prompt_tokens_squared, self.generation_tokens,
                       self.generation_tokens_squared, self.ttft,
                       self.itl, self.tpot, self.request_tpot, self.e2e, self.queue, self.prefill,
                       self.decode, self.inference, self.request_prompt_tokens,
                       self.request_generation_tokens, self.iteration_tokens, self.max_num_generation_tokens,
                       self.params_n, self.params_max_tokens, self.engine_busy, self.engine_turn,
                       self.engine_step_cpu):
            metric.labels(*lv)
        if self.engine_step_runqueue is not None:
            self.engine_step_runqueue.labels(*lv)
        for reason in FINISH_REASONS:
            self.request_success.labels(*lv, reason)
        for reason in REJECT_REASONS:
            self.rejected_requests.labels(*lv, reason)
        for term in STEP_WORK_TERMS:
            self.step_work.labels(*lv, term)
        for path in ("/v1/completions", "/v1/chat/completions"):  # so a rate sees the first requests
            for status in ("200", "500", "503"):
                self.http_requests.labels(*lv, path, status)

    def observe_token(self, first: bool, seconds_since_previous: float) -> None:
        if first:
            self._ttft_series.observe(seconds_since_previous)
            return
        self._itl_series.observe(seconds_since_previous)
        self._tpot_series.observe(seconds_since_previous)  # the deprecated name: the same observation

    def observe_finished(self, out: RequestOutput, *, max_tokens: int, n: int = 1) -> None:
        """A request that ended without error, with the ``max_tokens`` and ``n`` it asked for."""
        lv = self.label_values
        m = out.metrics
        num_generated = len(out.output_token_ids)
        self.prompt_tokens.labels(*lv).inc(len(out.prompt_token_ids))
        self.prompt_tokens_squared.labels(*lv).inc(len(out.prompt_token_ids) ** 2)
        self.generation_tokens.labels(*lv).inc(num_generated)
        self.generation_tokens_squared.labels(*lv).inc(num_generated ** 2)
        self.request_success.labels(*lv, out.finish_reason or "unknown").inc()
        self.e2e.labels(*lv).observe(m.e2e_time)
        self.queue.labels(*lv).observe(m.queue_time)
        self.prefill.labels(*lv).observe(m.prefill_time)
        self.decode.labels(*lv).observe(m.decode_time)
        self.inference.labels(*lv).observe(m.prefill_time + m.decode_time)
        # As vLLM: (e2e - TTFT) over the tokens after the first; a request of one token or none counts 0.
        per_token = (m.e2e_time - m.ttft) / (num_generated - 1) if num_generated > 1 else 0.0
        self.request_tpot.labels(*lv).observe(max(per_token, 0.0))
        self.request_prompt_tokens.labels(*lv).observe(len(out.prompt_token_ids))
        self.request_generation_tokens.labels(*lv).observe(num_generated)
        self.max_num_generation_tokens.labels(*lv).observe(max_tokens)
        self.params_n.labels(*lv).observe(n)
        self.params_max_tokens.labels(*lv).observe(max_tokens)

    def after_step(self, engine: LLMEngine) -> None:
        """The engine loop's hook after each step (a step that scheduled nothing records no stat)."""
        if engine.step_stats and engine.step_stats[-1] is not self._last_step:
            self._last_step = engine.step_stats[-1]
            self.observe_step(self._last_step, more_work=engine.has_unfinished_requests())

    def observe_step(self, step: StepStat, *, more_work: bool) -> None:
        """One engine step; ``more_work``: the engine had requests left after it, so the next step follows
        at once and the turn between the two (handing out tokens, taking in requests) is the replica's
        time, as the profile's measured step periods count it."""
        self._iteration_series.observe(step.num_tokens)
        turn = 0.0 if self._busy_until is None else max(step.start - self._busy_until, 0.0)
        end = step.start + step.duration
        self._busy_until = end if more_work else None
        self._busy_series.inc(step.duration + turn)
        self._turn_series.inc(turn)
        self._step_cpu_series.inc(step.cpu)
        if self._step_runqueue_series is not None and step.runqueue is not None:
            self._step_runqueue_series.inc(step.runqueue)
        steps, decode, prefill, context, pairs = self._work_series
        steps.inc()
        decode.inc(step.num_decode_tokens)
        prefill.inc(step.num_prefill_tokens)
        context.inc(step.context_tokens)
        pairs.inc(step.prefill_pairs)

    def observe_http(self, path: str, status_code: int) -> None:
        self.http_requests.labels(*self.label_values, path, str(status_code)).inc()

    def observe_rejected(self, reason: str) -> None:
        self.rejected_requests.labels(*self.label_values, reason).inc()
