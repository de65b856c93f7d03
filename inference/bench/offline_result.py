"""The offline benchmark's configuration, its results and their printed report.

:mod:`inference.bench.offline` runs the benchmark and fills an :class:`OfflineResult`;
:func:`format_result` prints it: the header, the paths' table, the targets, the KV-cache footprint
(:mod:`inference.bench.kv_cache`) and the roofline block (:mod:`inference.bench.roofline`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from inference.bench.kv_cache import KvCacheFootprint, format_kv_cache
from inference.bench.roofline import RooflineConfig, RooflineReport, format_report
from inference.config import EngineConfig
from inference.step_profile import Breakdown

ENGINE = "engine"
HF_ONE = "hf-one-at-a-time"
HF_STATIC = "hf-static-batches"
VLLM = "vllm"
LABELS = {ENGINE: "engine (all at once)", HF_ONE: "HF one at a time", HF_STATIC: "HF static batches",
          VLLM: "vLLM CPU (all at once)"}
# (baseline path, how many times its output tokens/s the engine must reach); vLLM's only when it ran
TARGETS = ((HF_STATIC, 5.0), (HF_ONE, 15.0))
VLLM_TARGET = (VLLM, 1.0)
# a pure decode step's mean time within 3x of the roofline bound, judged where the batch is large enough
# for the bound to mean something (a step of a few sequences is latency-, not bandwidth-bound)
BOUND_TARGET_PERCENT = 100.0 / 3
BOUND_TARGET_MIN_BATCH = 16
HF_BATCH_SIZE = 16


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    """Random requests: lengths uniform in the closed ranges, token ids uniform over non-special ids."""

    num_requests: int = 64
    min_prompt_len: int = 32
    max_prompt_len: int = 512
    min_output_len: int = 16
    max_output_len: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "min_prompt_len", "max_prompt_len", "min_output_len", "max_output_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.min_prompt_len > self.max_prompt_len:
            raise ValueError(f"prompt lengths: min {self.min_prompt_len} > max {self.max_prompt_len}")
        if self.min_output_len > self.max_output_len:
            raise ValueError(f"output lengths: min {self.min_output_len} > max {self.max_output_len}")


@dataclass(slots=True, frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    output_len: int


@dataclass(slots=True, frozen=True)
class OfflineConfig:
    """``hf_one_at_a_time_requests``: run that baseline on the first N requests only (None: all)."""

    model: str = "default"
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    engine: EngineConfig = field(default_factory=EngineConfig)
    skip_hf: bool = False
    hf_one_at_a_time_requests: int | None = None
    hf_batch_size: int = HF_BATCH_SIZE
    roofline: RooflineConfig = field(default_factory=RooflineConfig)
    show_progress: bool = True
    repeats: int = 3  # the engine and the static batches: best of this many runs (one-at-a-time: one run)
    vllm_python: str | None = None  # an interpreter whose environment has vLLM: run it too (--vs-vllm)

    def __post_init__(self) -> None:
        n = self.hf_one_at_a_time_requests
        if n is not None and not 1 <= n <= self.workload.num_requests:
            raise ValueError(f"hf_one_at_a_time_requests: must be between 1 and num_requests "
                             f"({self.workload.num_requests}), got {n}")
        if self.repeats <= 0:
            raise ValueError(f"repeats: must be a positive integer, got {self.repeats}")
        if self.hf_batch_size <= 0:
            raise ValueError(f"hf_batch_size: must be a positive integer, got {self.hf_batch_size}")


@dataclass(slots=True, frozen=True)
class PathResult:
    """One timed path. ``num_output_tokens`` counts useful tokens: each request's own requested output;
    ``num_generated_tokens`` everything the path computed (more than that only for padded batches)."""

    name: str
    label: str
    num_requests: int
    num_output_tokens: int
    num_generated_tokens: int
    seconds: float
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds


@dataclass(slots=True, frozen=True)
class Target:
    baseline: str
    baseline_label: str
    required_ratio: float
    ratio: float | None  # None when the baseline was skipped

    @property
    def passed(self) -> bool | None:
        return None if self.ratio is None else self.ratio >= self.required_ratio

    @property
    def description(self) -> str:
        return f"engine >= {self.required_ratio:g}x {self.baseline_label}"


@dataclass(slots=True, frozen=True)
class Agreement:
    """Greedy tokens of a reduced-precision engine against a float32 engine's, on the same requests."""

    num_requests: int
    num_identical: int  # outputs equal token for token
    tokens_before_divergence: int  # summed over the requests: tokens equal before the first difference
    num_tokens: int

    @classmethod
    def of(cls, ours: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> Agreement:
        before = 0
        for a, b in zip(ours, reference, strict=True):
            before += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return cls(len(ours), sum(list(a) == list(b) for a, b in zip(ours, reference)), before,
                   sum(len(b) for b in reference))

    @property
    def share_before_divergence(self) -> float:
        return self.tokens_before_divergence / self.num_tokens if self.num_tokens else 1.0


@dataclass(slots=True, frozen=True)
class OfflineResult:
    model_path: str
    device: str
    dtype: str
    num_threads: int
    workload: WorkloadSpec
    num_prompt_tokens: int
    output_lens: tuple[int, ...]  # each request's requested output length, in arrival order
    max_num_seqs: int
    kv_cache_dtype: str
    num_preemptions: int
    paths: tuple[PathResult, ...]
    roofline: RooflineReport | None
    kv_cache: KvCacheFootprint | None = None
    decode_profile: Breakdown | None = None  # where a pure-decode step's time goes (a profiled run)
    float32_agreement: Agreement | None = None  # below float32 only
    decode_graphs: str | None = None  # when on or asked for: what was captured and replayed, or why not
    cpu_decode_kernel: str | None = None  # on a CPU: "on", "off" or "unavailable: <why>"
    packed_weights: str | None = None  # on a CPU: "on", "off" or "unavailable: <why>"

    @property
    def num_requested_output_tokens(self) -> int:
        return sum(self.output_lens)

    def path(self, name: str) -> PathResult | None:
        return next((p for p in self.paths if p.name == name), None)

    def ratio(self, name: str, baseline: str) -> float | None:
        """``name``'s output tokens/s over ``baseline``'s; None when either path did not run."""
        path, base = self.path(name), self.path(baseline)
        if path is None or base is None:
            return None
        return path.tokens_per_s / base.tokens_per_s

    @property
    def baselines(self) -> tuple[PathResult, ...]:
        return tuple(p for p in self.paths if p.name != ENGINE)

    @property
    def targets(self) -> tuple[Target, ...]:
        wanted = TARGETS + ((VLLM_TARGET,) if self.path(VLLM) is not None else ())
        return tuple(Target(name, _label_of(self, name), required, self.ratio(ENGINE, name))
                     for name, required in wanted)

    @property
    def bound_target(self) -> bool | None:
        """The decode step within 3x of the roofline bound; None when the roofline was not measured or
        its mean batch was under ``BOUND_TARGET_MIN_BATCH``."""
        r = self.roofline
        if r is None or r.observed.mean_batch < BOUND_TARGET_MIN_BATCH:
            return None
        return r.percent_of_bound >= BOUND_TARGET_PERCENT

    @property
    def missed(self) -> bool:
        """A target whose baseline ran was not reached, or the decode step's share of the bound."""
        return any(t.passed is False for t in self.targets) or self.bound_target is False

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["paths"] = [{**asdict(p), "tokens_per_s": p.tokens_per_s,
                          "ratios": {b.name: self.ratio(p.name, b.name) for b in self.baselines}}
                         for p in self.paths]
        data["targets"] = [{"description": t.description, "baseline": t.baseline,
                            "required_ratio": t.required_ratio, "ratio": t.ratio, "passed": t.passed}
                           for t in self.targets]
        data["bound_target"] = {"required_percent": BOUND_TARGET_PERCENT, "passed": self.bound_target}
        if self.roofline is not None:
            r = self.roofline
            data["roofline"]["derived"] = {
                "weights_seconds": r.weights_seconds, "kv_seconds": r.kv_seconds,
                "memory_seconds": r.memory_seconds, "compute_seconds": r.compute_seconds,
                "bound_seconds": r.bound_seconds, "percent_of_bound": r.percent_of_bound,
                "bound_tokens_per_s": r.bound_tokens_per_s, "peak_gflops": r.rates.peak_gflops,
                "weight_bytes_per_step": r.weight_bytes_per_step, "mean_experts_hit": r.mean_experts_hit}
        if self.decode_profile is not None:
            data["decode_profile"] = self.decode_profile.to_dict()
        if self.kv_cache is not None:
            kv = self.kv_cache
            data["kv_cache"]["derived"] = {"pool_bytes": kv.pool_bytes, "ratio": kv.ratio,
                                           "multi_head_blocks": kv.multi_head_blocks}
        return data


def _label_of(result: OfflineResult, name: str) -> str:
    path = result.path(name)
    return path.label if path is not None else LABELS[name]


# ---- the report ----------------------------------------------------------------------------------
def format_result(result: OfflineResult) -> str:
    w = result.workload
    lines = [
        f"Offline throughput: {w.num_requests} requests (seed {w.seed}), prompts {w.min_prompt_len}-"
        f"{w.max_prompt_len} tokens ({result.num_prompt_tokens} in all), outputs {w.min_output_len}-"
        f"{w.max_output_len} tokens ({result.num_requested_output_tokens} in all); greedy, ignore_eos",
        f"model {result.model_path} on {result.device}, {result.dtype}, torch threads {result.num_threads}; "
        f"engine max_num_seqs {result.max_num_seqs}, kv cache {result.kv_cache_dtype}, "
        f"{result.num_preemptions} preemptions",
        "",
        format_table(result),
        "",
        format_targets(result),
    ]
    if result.float32_agreement is not None:
        a = result.float32_agreement
        lines += ["", f"Agreement with a float32 engine (greedy, the first {a.num_requests} requests): "
                      f"{a.share_before_divergence:.1%} of tokens before the first divergence, "
                      f"{a.num_identical} of {a.num_requests} outputs identical"]
    if result.decode_graphs is not None:
        lines += ["", f"Decode graphs: {result.decode_graphs}"]
    if result.cpu_decode_kernel is not None:
        lines += ["", f"CPU decode kernel: {result.cpu_decode_kernel}"]
    if result.packed_weights is not None:
        lines += [f"Packed linear weights: {result.packed_weights}"]
    if result.kv_cache is not None:
        lines += ["", format_kv_cache(result.kv_cache)]
    if result.decode_profile is not None:
        lines += ["", format_profile(result.decode_profile)]
    if result.roofline is not None:
        lines += ["", format_report(result.roofline)]
    else:
        lines += ["", "Machine limit: the engine ran no pure-decode step; nothing to compare."]
    return "\n".join(lines)


def format_table(result: OfflineResult) -> str:
    baselines = result.baselines
    header = ["path", "requests", "output tokens", "seconds", "output tok/s",
              *(f"vs {b.label}" for b in baselines)]
    rows = [header]
    notes: list[str] = []
    for p in result.paths:
        label = p.label
        if p.note:
            notes.append(f"{'*' * (len(notes) + 1)} {p.label}: {p.note}")
            label += " " + "*" * len(notes)
        ratios = [result.ratio(p.name, b.name) for b in baselines]
        rows.append([label, str(p.num_requests), str(p.num_output_tokens), f"{p.seconds:.2f}",
                     f"{p.tokens_per_s:.1f}", *(f"{r:.2f}x" for r in ratios if r is not None)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    text = ["  ".join(cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i])
                      for i, cell in enumerate(row)) for row in rows]
    return "\n".join(text + notes)


def format_targets(result: OfflineResult) -> str:
    lines = ["Targets"]
    for t in result.targets:
        verdict = "SKIPPED (baseline not run)" if t.passed is None else (
            f"{'PASS' if t.passed else 'FAIL'} ({t.ratio:.2f}x)")
        lines.append(f"  {t.description}: {verdict}")
    bound = (f"  decode step within 3x of the roofline bound, >= {BOUND_TARGET_PERCENT:.1f}% "
             f"(batch >= {BOUND_TARGET_MIN_BATCH}): ")
    if result.bound_target is None:
        lines.append(bound + "SKIPPED (" + ("roofline not measured" if result.roofline is None
                                            else "mean decode batch under the minimum") + ")")
    else:
        assert result.roofline is not None
        lines.append(bound + f"{'PASS' if result.bound_target else 'FAIL'} "
                             f"({result.roofline.percent_of_bound:.1f}%)")
    return "\n".join(lines)


def format_profile(profile: Breakdown) -> str:
    """The phases of a pure-decode step, mean milliseconds and share, largest first."""
    total = profile.step_seconds
    lines = [f"Where a decode step goes (a profiled run, not timed above: {profile.num_steps} pure-decode "
             f"steps, mean batch {profile.mean_batch:.1f}, {total * 1e3:.2f} ms per step)"]
    width = max(len(p) for p in profile.seconds)
    for phase, seconds in sorted(profile.seconds.items(), key=lambda kv: -kv[1]):
        if seconds > 0:
            share = seconds / total if total > 0 else 0.0
            lines.append(f"  {phase.ljust(width)}  {seconds * 1e3:7.3f} ms  {share:6.1%}")
    # a phase this path never entered (the C++ layer call holds attention whole) is not a 0 measured
    if idle := [phase for phase, seconds in profile.seconds.items() if seconds <= 0]:
        lines.append(f"  not a phase of its own on this path: {', '.join(idle)}")
    return "\n".join(lines)
