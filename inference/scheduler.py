"""Token-budget scheduler: continuous batching with chunked prefill, priorities and preemption.

Each step gets a budget of ``max_num_batched_tokens``. Running sequences are served first, decodes before
prefill chunks and then by priority (lower value first, then arrival); waiting sequences are admitted in
the same order while the budget, ``max_num_seqs`` and free KV blocks allow. When a running sequence needs
a block and none is free, the lowest-priority, latest-arriving running sequence that has not been
scheduled this step is preempted: its blocks are freed and it goes back to waiting to be recomputed.
Torch-free, so every rule is unit-tested without a model.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from inference.kv_blocks import BlockManager
from inference.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last uncomputed token, so a new token is sampled."""
        return self.num_new_tokens == self.seq.num_uncomputed_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []  # kept sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- queue management ----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting_tokens(self) -> int:
        return sum(s.num_uncomputed_tokens for s in self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Remove ``seq`` from whichever queue holds it and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget)
        # The model runner lays prefill chunks out first, then one token per decoding sequence.
        out.scheduled.sort(key=lambda s: s.num_new_tokens == 1)
        return out

    def update_after_step(self, out: SchedulerOutput, sampled: list[int | None]) -> None:
        """Advance each scheduled sequence by the tokens computed and append its sampled token."""
        for item, token in zip(out.scheduled, sampled, strict=True):
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(item.seq)
            if token is not None:
                item.seq.append_token(token)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        self.running.sort(key=lambda s: (s.is_prefilling, s.sort_key()))
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._num_tokens_to_schedule(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                i += 1
                continue
            if self._allocate_or_preempt(seq, num_new, i, out):
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
        return budget

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, first_unscheduled: int,
                             out: SchedulerOutput) -> bool:
        while not self.block_manager.allocate(seq, num_new):
            candidates = self.running[first_unscheduled:]
            victim = max(candidates, key=Sequence.sort_key)
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = self.block_manager.find_cached_prefix(seq)
            uncomputed = seq.num_tokens - len(cached) * self.block_manager.block_size
            num_new = self._num_tokens_to_schedule(uncomputed, budget)
            if num_new == 0 or not self.block_manager.allocate(seq, num_new, cached):
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.block_manager.record_prompt_lookup(seq)
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

    def _num_tokens_to_schedule(self, uncomputed: int, budget: int) -> int:
        if uncomputed <= budget:
            return uncomputed
        return budget if self.config.enable_chunked_prefill else 0
