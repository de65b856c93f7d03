"""The machine's limit on a decode step, measured in the same run as the engine it judges.

Three parts, in the order the offline benchmark calls them: :func:`measure_machine` times a large
``copy_`` (memory bandwidth) and two GEMMs (a square one and the engine's decode shape); :func:`model_cost`
reads from the loaded model and its config what one decode step must move and compute; :func:`estimate`
combines both with the engine's pure-decode steps (``LLMEngine.step_stats``) into a
:class:`RooflineReport`: the fastest a decode step could be on this machine and how close the engine
comes to it.

Both families the engine serves are costed as the engine computes them. Llama-style attention reads each
cached token's keys and values and does ``2 x heads x head_dim`` multiply-adds on them per layer.
DeepSeek-V3's latent attention reads one latent row per cached token and layer and, weight-absorbed as the
engine decodes, does ``heads x (kv_lora_rank + qk_rope_head_dim)`` multiply-adds for the scores and
``heads x kv_lora_rank`` for the values. A mixture-of-experts layer streams its dense parts (router,
shared experts) every step but only the routed experts the step's batch hits: for a batch of B tokens
each choosing k of E experts, the expected number of distinct experts is ``E x (1 - (1 - k/E)^B)``
(routing taken as uniform and independent), averaged over the observed decode batches; each token
multiplies through only its k experts.

The bound is a lower bound on time, so every choice errs optimistic: bandwidth is the best of several
copies, compute uses the faster of the two GEMM rates, and step time is ``max(memory, compute)`` rather
than their sum. The one exception is the expert count: for a given k, uniform routing spreads a batch
over the most distinct experts, and a skewed router streams fewer.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from inference.models.config import ModelConfig
from inference.models.deepseek import DeepseekMoE
from inference.packed_linear import BlockedLinear

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
# A timed GEMM repeats until it has done about this much work, so a small shape outlasts timer noise.
GEMM_TARGET_FLOPS = 1e9
MAX_GEMM_ITERATIONS = 1000


@dataclass(slots=True, frozen=True)
class RooflineConfig:
    """How hard to measure: buffer size of the bandwidth copy, the square GEMM's side, repeats of each."""

    copy_mib: int = 256
    gemm_size: int = 1024
    repeats: int = 5

    def __post_init__(self) -> None:
        for name in ("copy_mib", "gemm_size", "repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")


@dataclass(slots=True, frozen=True)
class GemmRate:
    m: int
    k: int
    n: int
    gflops: float

    @property
    def shape(self) -> str:
        return f"[{self.m}, {self.k}] x [{self.k}, {self.n}]"


@dataclass(slots=True, frozen=True)
class MachineRates:
    """``bandwidth_bytes_per_s`` counts a copy's read and write together (as STREAM's copy does)."""

    bandwidth_bytes_per_s: float
    copy_bytes: int
    square_gemm: GemmRate
    decode_gemm: GemmRate
    dtype: str

    @property
    def peak_gflops(self) -> float:
        return max(self.square_gemm.gflops, self.decode_gemm.gflops)


@dataclass(slots=True, frozen=True)
class ModelCost:
    """What one decoded token costs the model, independent of the batch.

    ``streamed_weight_bytes``: the weights a decode step reads in full (all of them but an untied input
    embedding, of which a step gathers only its batch's rows, and the routed experts). ``matmul_params``:
    the weights every token multiplies through (2 FLOPs each), routed experts aside.
    ``attention_flops_per_context_token``: the scores and the weighted values over one cached token, all
    layers (4 x heads x head_dim x layers; latent attention: 2 x heads x (2 x kv_lora_rank +
    qk_rope_head_dim) x layers). Routed experts: ``routed_expert_bytes`` and ``routed_expert_params`` are
    one expert's share summed over the mixture-of-experts layers (all zero for a dense model).
    """

    num_params: int
    weight_bytes: int
    streamed_weight_bytes: int
    matmul_params: int
    kv_bytes_per_token: int
    attention_flops_per_context_token: int
    num_routed_experts: int = 0
    experts_per_token: int = 0
    num_moe_layers: int = 0
    routed_expert_bytes: int = 0
    routed_expert_params: int = 0
    attention_detail: str = ""  # how the attention FLOPs were counted, where not plain multi-head

    @property
    def active_matmul_params(self) -> int:
        """Weights one token multiplies through: the dense ones and its ``experts_per_token`` experts."""
        return self.matmul_params + self.experts_per_token * self.routed_expert_params

    def expected_experts_hit(self, batch: float) -> float:
        """Distinct routed experts a layer reads for ``batch`` tokens: E x (1 - (1 - k/E)^batch)."""
        e, k = self.num_routed_experts, self.experts_per_token
        if e == 0 or batch <= 0:
            return 0.0
        miss: float = (1.0 - k / e) ** batch
        return e * (1.0 - miss)


@dataclass(slots=True, frozen=True)
class DecodeObservation:
    """The engine's pure-decode steps (no prefill token in the step); ``batch_steps``: (batch, steps)."""

    num_steps: int
    mean_seconds: float
    mean_batch: float
    batch_steps: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True, frozen=True)
class RooflineReport:
    rates: MachineRates
    cost: ModelCost
    observed: DecodeObservation
    mean_context: float  # cached tokens one decoded token attends to, averaged over decoded tokens

    @property
    def kv_bytes_per_step(self) -> float:
        return self.observed.mean_batch * self.mean_context * self.cost.kv_bytes_per_token

    @property
    def mean_experts_hit(self) -> float:
        """Expected distinct routed experts per layer and step, averaged over the observed steps."""
        cost, o = self.cost, self.observed
        if not o.batch_steps:
            return cost.expected_experts_hit(o.mean_batch)
        steps = sum(n for _, n in o.batch_steps)
        return sum(cost.expected_experts_hit(b) * n for b, n in o.batch_steps) / steps

    @property
    def weight_bytes_per_step(self) -> float:
        return self.cost.streamed_weight_bytes + self.mean_experts_hit * self.cost.routed_expert_bytes

    @property
    def weights_seconds(self) -> float:
        return self.weight_bytes_per_step / self.rates.bandwidth_bytes_per_s

    @property
    def kv_seconds(self) -> float:
        return self.kv_bytes_per_step / self.rates.bandwidth_bytes_per_s

    @property
    def memory_seconds(self) -> float:
        return self.weights_seconds + self.kv_seconds

    @property
    def flops_per_step(self) -> float:
        batch = self.observed.mean_batch
        attention = self.cost.attention_flops_per_context_token * self.mean_context
        return batch * (2 * self.cost.active_matmul_params + attention)

    @property
    def compute_seconds(self) -> float:
        return self.flops_per_step / (self.rates.peak_gflops * 1e9)

    @property
    def bound_seconds(self) -> float:
        return max(self.memory_seconds, self.compute_seconds)

    @property
    def percent_of_bound(self) -> float:
        """How close the engine's mean decode step comes to the bound: bound / measured, in percent."""
        return 100.0 * self.bound_seconds / self.observed.mean_seconds

    @property
    def bound_tokens_per_s(self) -> float:
        return self.observed.mean_batch / self.bound_seconds

    @property
    def observed_tokens_per_s(self) -> float:
        return self.observed.mean_batch / self.observed.mean_seconds


# ---- measuring the machine ---------------------------------------------------------------------
def measure_machine(*, device: torch.device, dtype: torch.dtype, decode_batch: int, hidden_size: int,
                    config: RooflineConfig, synchronize: Callable[[], None]) -> MachineRates:
    """Copy bandwidth, a square GEMM and the decode GEMM ``[batch, hidden] x [hidden, 3 * hidden]``."""
    copy_bytes = config.copy_mib * MIB
    bandwidth = measure_copy_bandwidth(nbytes=copy_bytes, repeats=config.repeats, device=device,
                                       synchronize=synchronize)
    size = config.gemm_size
    square = measure_gemm(size, size, size, dtype=dtype, device=device, repeats=config.repeats,
                          synchronize=synchronize)
    decode = measure_gemm(max(1, decode_batch), hidden_size, 3 * hidden_size, dtype=dtype, device=device,
                          repeats=config.repeats, synchronize=synchronize)
    rates = MachineRates(bandwidth, copy_bytes, square, decode, str(dtype).removeprefix("torch."))
    logger.info("machine: copy %.1f GB/s, GEMM %.1f GFLOP/s (%s), %.1f GFLOP/s (%s)",
                bandwidth / 1e9, square.gflops, square.shape, decode.gflops, decode.shape)
    return rates


def measure_copy_bandwidth(*, nbytes: int, repeats: int, device: torch.device,
                           synchronize: Callable[[], None]) -> float:
    """Bytes per second of ``dst.copy_(src)``, read plus write, best of ``repeats``."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults and allocation, not bandwidth
    seconds = _best_time(lambda: dst.copy_(src), repeats=repeats, synchronize=synchronize)
    return 2 * src.numel() * src.element_size() / seconds


def measure_gemm(m: int, k: int, n: int, *, dtype: torch.dtype, device: torch.device, repeats: int,
                 synchronize: Callable[[], None]) -> GemmRate:
    """GFLOP/s of ``[m, k] @ [k, n]`` (2mkn FLOPs), best of ``repeats``."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    out = torch.empty(m, n, dtype=dtype, device=device)
    flops = 2.0 * m * k * n
    iterations = max(1, min(MAX_GEMM_ITERATIONS, round(GEMM_TARGET_FLOPS / flops)))

    def run() -> None:
        for _ in range(iterations):
            torch.matmul(a, b, out=out)

    run()  # warm-up
    seconds = _best_time(run, repeats=repeats, synchronize=synchronize)
    return GemmRate(m, k, n, flops * iterations / seconds / 1e9)


def _best_time(fn: Callable[[], object], *, repeats: int, synchronize: Callable[[], None]) -> float:
    best = math.inf
    for _ in range(repeats):
        synchronize()
        started = time.perf_counter()
        fn()
        synchronize()
        best = min(best, time.perf_counter() - started)
    return best


# ---- what the model costs ----------------------------------------------------------------------
def model_cost(model: nn.Module, config: ModelConfig, *, kv_bytes_per_token: int) -> ModelCost:
    """Read parameter counts and bytes from the loaded model (whatever dtype it was loaded in), and the
    attention and expert shapes from its config."""
    params = list(model.named_parameters())
    has_lm_head = any(name.endswith("lm_head.weight") for name, _ in params)
    moe_layers = [m for m in model.modules() if isinstance(m, DeepseekMoE)]
    routed = {id(p) for m in moe_layers for p in (m.experts_gate_up, m.experts_down)}
    blocked = {id(m.weight) for m in model.modules() if isinstance(m, BlockedLinear)}  # 3-D, a matrix
    num_params = weight_bytes = streamed = matmul = routed_bytes = routed_params = 0
    for name, p in params:
        nbytes = p.numel() * p.element_size()
        num_params += p.numel()
        weight_bytes += nbytes
        if id(p) in routed:  # [experts, out, in]: read and multiplied only where the batch routes
            routed_bytes += nbytes
            routed_params += p.numel()
            continue
        gathered = name.endswith("embed_tokens.weight") and has_lm_head  # untied: rows looked up, not read
        if not gathered:
            streamed += nbytes
            if p.dim() == 2 or id(p) in blocked:
                matmul += p.numel()
    heads, layers, detail = config.num_attention_heads, config.num_hidden_layers, ""
    if config.mla is None:
        attention = 4 * heads * config.head_dim * layers
    else:  # weight-absorbed decode: scores over [latent | rope], values in latent space
        latent, rope = config.mla.kv_lora_rank, config.mla.qk_rope_head_dim
        attention = 2 * heads * (2 * latent + rope) * layers
        detail = (f"latent rows, weight-absorbed: 2 x {heads} heads x (({latent} + {rope}) scores + {latent} "
                  f"values) x {layers} layers")
    e, k = (0, 0) if config.moe is None or not moe_layers else (config.moe.n_routed_experts,
                                                                 config.moe.num_experts_per_tok)
    return ModelCost(num_params, weight_bytes, streamed, matmul, kv_bytes_per_token, attention,
                     num_routed_experts=e, experts_per_token=k, num_moe_layers=len(moe_layers),
                     routed_expert_bytes=routed_bytes // max(e, 1),
                     routed_expert_params=routed_params // max(e, 1), attention_detail=detail)


# ---- what the engine did -----------------------------------------------------------------------
class StepLike(Protocol):
    """What :func:`observe_decode` reads of ``inference.engine.StepStat``."""

    @property
    def duration(self) -> float: ...
    @property
    def num_prefill_tokens(self) -> int: ...
    @property
    def num_decode_tokens(self) -> int: ...


def observe_decode(step_stats: Iterable[StepLike]) -> DecodeObservation | None:
    """Mean duration and batch of the steps that decoded without any prefill; None when there were none."""
    steps = [s for s in step_stats if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
    if not steps:
        return None
    batches = Counter(s.num_decode_tokens for s in steps)
    return DecodeObservation(len(steps), sum(s.duration for s in steps) / len(steps),
                             sum(s.num_decode_tokens for s in steps) / len(steps),
                             tuple(sorted(batches.items())))


def mean_decode_context(lengths: Iterable[tuple[int, int]]) -> float:
    """Mean number of cached tokens a decoded token attends to, over all decoded tokens.

    ``lengths`` holds (prompt tokens, output tokens) per request. The first output token comes from the
    prefill; the i-th decode step of a request (i = 1 .. n-1) attends to prompt + i tokens.
    """
    total = count = 0
    for prompt, output in lengths:
        steps = output - 1
        if steps > 0:
            total += steps * prompt + steps * (steps + 1) // 2
            count += steps
    return total / count if count else 0.0


def estimate(rates: MachineRates, cost: ModelCost, observed: DecodeObservation,
             mean_context: float) -> RooflineReport:
    return RooflineReport(rates, cost, observed, mean_context)


# ---- printing ----------------------------------------------------------------------------------
def format_report(report: RooflineReport) -> str:
    r, c, o = report.rates, report.cost, report.observed
    bw = r.bandwidth_bytes_per_s / 1e9
    batch, ctx = o.mean_batch, report.mean_context
    lines = [
        "Machine limit on a decode step (roofline)",
        f"  memory bandwidth  {bw:.2f} GB/s  (torch copy_ of {r.copy_bytes // MIB} MiB, best run; "
        "read + write bytes)",
        f"  GEMM {r.dtype:<12} {r.square_gemm.gflops:.1f} GFLOP/s at {r.square_gemm.shape}; "
        f"{r.decode_gemm.gflops:.1f} GFLOP/s at decode shape {r.decode_gemm.shape}",
        f"  model             {c.num_params / 1e6:.2f} M parameters, {c.weight_bytes / 1e6:.1f} MB; "
        f"{report.weight_bytes_per_step / 1e6:.1f} MB read per decode step; "
        f"KV {c.kv_bytes_per_token / 1024:.1f} KiB per token",
        *_family_lines(report),
        f"  engine decode     {o.num_steps} pure-decode steps: mean {o.mean_seconds * 1e3:.2f} ms, "
        f"mean batch {batch:.1f}, mean context {ctx:.0f} tokens",
        f"  memory time   = (weights + batch x context x KV/token) / bandwidth"
        f" = ({report.weight_bytes_per_step / 1e6:.1f} MB + {report.kv_bytes_per_step / 1e6:.1f} MB)"
        f" / {bw:.2f} GB/s = {report.memory_seconds * 1e3:.2f} ms",
        f"  compute time  = batch x (2 x {'active ' if c.num_routed_experts else ''}matmul params + "
        f"attention FLOPs/token x context) / peak GEMM"
        f" = {batch:.1f} x (2 x {c.active_matmul_params / 1e6:.2f} M + "
        f"{c.attention_flops_per_context_token} x {ctx:.0f}) / {r.peak_gflops:.1f} GFLOP/s = "
        f"{report.compute_seconds * 1e3:.2f} ms",
        f"  bound         = max(memory, compute) = {report.bound_seconds * 1e3:.2f} ms per step "
        f"({report.bound_tokens_per_s:.0f} tokens/s at batch {batch:.1f}; engine decodes "
        f"{report.observed_tokens_per_s:.0f} tokens/s)",
        f"  engine at {report.percent_of_bound:.1f}% of the bound (bound / measured mean step)",
    ]
    return "\n".join(lines)


def _family_lines(report: RooflineReport) -> list[str]:
    """What latent attention and routed experts change in the count; nothing for a dense Llama."""
    c, lines = report.cost, []
    if c.attention_detail:
        lines.append(f"  attention         {c.attention_detail} = "
                     f"{c.attention_flops_per_context_token} FLOPs per cached token")
    if c.num_routed_experts:
        e, k = c.num_routed_experts, c.experts_per_token
        lines.append(
            f"  experts           {e} routed, {k} per token, in {c.num_moe_layers} layers "
            f"({c.routed_expert_bytes / 1e6:.2f} MB per expert across them): expected "
            f"{report.mean_experts_hit:.1f} of {e} hit per layer and step = E x (1 - (1 - k/E)^batch) "
            f"over the observed batches; {c.streamed_weight_bytes / 1e6:.1f} MB dense "
            f"+ {report.mean_experts_hit * c.routed_expert_bytes / 1e6:.1f} MB experts")
    return lines
