"""Unit tests for inference.scheduler, driven by a simulated engine loop (no model, no torch).

``step`` plays the engine: it schedules, "computes" the scheduled tokens, samples a fake token for every
sequence whose chunk reached its end, and finishes sequences that produced ``max_tokens`` tokens.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from inference.kv_blocks import BlockManager
from inference.sampling_params import SamplingParams
from inference.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from inference.sequence import FinishReason, Sequence, SequenceStatus

BLOCK = 4
REPO_ROOT = Path(__file__).resolve().parents[2]


def make_scheduler(num_blocks: int = 16, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 32,
                   chunked: bool = True, prefix_caching: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, chunked)
    return Scheduler(config, BlockManager(num_blocks, BLOCK, enable_prefix_caching=prefix_caching))


def make_seq(seq_id: int, prompt: int | list[int], *, max_tokens: int = 4, priority: int = 0,
             arrival: float | None = None) -> Sequence:
    """``prompt`` is a token list, or a length for a prompt unique to this sequence."""
    tokens = list(range(seq_id * 1000, seq_id * 1000 + prompt)) if isinstance(prompt, int) else prompt
    return Sequence(seq_id, tokens, SamplingParams(max_tokens=max_tokens),
                    arrival_time=float(seq_id) if arrival is None else arrival, priority=priority)


def fake_token(seq: Sequence) -> int:
    """Deterministic per sequence and position, so a recomputed sequence's output can be checked."""
    return 500_000 + seq.seq_id * 100 + seq.num_output_tokens


def expected_output(seq: Sequence) -> list[int]:
    return [500_000 + seq.seq_id * 100 + i for i in range(seq.params.max_tokens)]


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    check_invariants(sched, out)
    # .samples depends on num_computed_tokens, so read it before update_after_step moves it.
    tokens = [fake_token(item.seq) if item.samples else None for item in out.scheduled]
    sched.update_after_step(out, tokens)
    for item in out.scheduled:
        seq = item.seq
        if not seq.is_finished and seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, FinishReason.LENGTH)
    return out


def run_until_done(sched: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    outs: list[SchedulerOutput] = []
    while sched.has_unfinished():
        assert len(outs) < max_steps, "scheduler made no progress"
        outs.append(step(sched))
    return outs


def check_invariants(sched: Scheduler, out: SchedulerOutput) -> None:
    bm = sched.block_manager
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert sched.num_running <= sched.config.max_num_seqs
    assert len({id(item.seq) for item in out.scheduled}) == len(out.scheduled)
    for item in out.scheduled:
        assert item.seq.status is SequenceStatus.RUNNING
        assert item.num_new_tokens >= 1
        # Exactly the blocks its tokens need: none missing, none wasted.
        needed = bm.num_blocks_needed(item.seq.num_computed_tokens + item.num_new_tokens)
        assert len(item.seq.block_table) == needed
    for seq in sched.waiting:
        assert seq.block_table == []
    refs = Counter(b for seq in sched.running for b in seq.block_table)
    assert [b.ref_count for b in bm.blocks] == [refs[b.block_id] for b in bm.blocks]
    assert set(bm.free_queue) == {b.block_id for b in bm.blocks if b.ref_count == 0}


def assert_pool_empty(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert sched.waiting == [] and sched.running == []
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def scheduled_tokens(out: SchedulerOutput) -> dict[int, int]:
    return {item.seq.seq_id: item.num_new_tokens for item in out.scheduled}


# ---- configuration and basics ------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{"max_num_seqs": 0}, {"max_num_batched_tokens": 0}])
def test_scheduler_config_rejects_non_positive_limits(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SchedulerConfig(**kwargs)


def test_bookkeeping_modules_import_without_torch() -> None:
    code = ("import inference.scheduler, inference.kv_blocks, inference.sequence, inference.sampling_params, "
            "inference.config, inference.output, sys; assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_schedule_with_nothing_to_do_is_empty() -> None:
    sched = make_scheduler()

    out = sched.schedule()

    assert out.is_empty and out.preempted == []
    assert not sched.has_unfinished()


def test_sequence_runs_prefill_then_one_decode_per_step_until_max_tokens() -> None:
    sched = make_scheduler()
    seq = make_seq(0, 6, max_tokens=3)
    sched.add(seq)

    outs = run_until_done(sched)

    assert [scheduled_tokens(o) for o in outs] == [{0: 6}, {0: 1}, {0: 1}]
    assert seq.output_token_ids == expected_output(seq)
    assert seq.finish_reason is FinishReason.LENGTH
    assert_pool_empty(sched)


# ---- admission order -----------------------------------------------------------------------------------


def test_waiting_sequences_are_admitted_by_priority_then_arrival() -> None:
    sched = make_scheduler(max_num_seqs=1)
    order = [(0, 2, 0.0), (1, 0, 3.0), (2, 1, 1.0), (3, 0, 1.0), (4, 2, -1.0)]  # (id, priority, arrival)
    for seq_id, priority, arrival in order:
        sched.add(make_seq(seq_id, 3, max_tokens=1, priority=priority, arrival=arrival))

    admitted = [out.scheduled[0].seq.seq_id for out in run_until_done(sched)]

    assert admitted == [3, 1, 2, 4, 0]


def test_max_num_seqs_caps_running_and_later_sequences_wait() -> None:
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(i, 3, max_tokens=2) for i in range(5)]
    for seq in seqs:
        sched.add(seq)

    out = step(sched)

    assert set(scheduled_tokens(out)) == {0, 1}
    assert sched.num_running == 2 and sched.num_waiting == 3
    outs = run_until_done(sched)
    assert max(len(o.scheduled) for o in outs) <= 2
    assert all(s.output_token_ids == expected_output(s) for s in seqs)


# ---- token budget and chunked prefill --------------------------------------------------------------------


def test_long_prompt_is_chunked_across_steps_and_samples_only_at_the_end() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    seq = make_seq(0, 20, max_tokens=1)
    sched.add(seq)

    chunks, samples, computed = [], [], []
    for _ in range(3):
        out = sched.schedule()
        (item,) = out.scheduled
        chunks.append(item.num_new_tokens)
        samples.append(item.samples)
        sched.update_after_step(out, [fake_token(seq) if item.samples else None])
        computed.append(seq.num_computed_tokens)

    assert chunks == [8, 8, 4]
    assert samples == [False, False, True]
    assert computed == [8, 16, 20]
    assert seq.num_output_tokens == 1


def test_long_prompt_waits_without_chunked_prefill_and_blocks_those_behind_it() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, chunked=False)
    sched.add(make_seq(0, 20))
    sched.add(make_seq(1, 3))

    out = sched.schedule()

    assert out.is_empty
    assert sched.num_waiting == 2 and sched.num_running == 0
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_prompt_waits_without_chunked_prefill_until_the_budget_left_by_decodes_fits_it() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, chunked=False)
    decoder = make_seq(0, 2, max_tokens=3)
    sched.add(decoder)
    step(sched)
    prompt = make_seq(1, 8, max_tokens=1)
    sched.add(prompt)

    while_decoding = [scheduled_tokens(step(sched)) for _ in range(2)]
    after = scheduled_tokens(step(sched))

    assert while_decoding == [{0: 1}, {0: 1}]  # 1 decode token leaves 7 < 8
    assert after == {1: 8}


def test_decodes_get_the_budget_before_prefill_chunks_even_of_higher_priority() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    decoder = make_seq(0, 3, max_tokens=10, priority=5)
    sched.add(decoder)
    step(sched)
    prefiller = make_seq(1, 30, priority=0)
    sched.add(prefiller)

    mixed = step(sched)  # decode of 0 plus the first chunk of 1 in one step
    out = step(sched)  # 1 is now running and prefilling; 0 still decodes first

    assert scheduled_tokens(mixed) == {0: 1, 1: 7}
    assert scheduled_tokens(out) == {0: 1, 1: 7}
    assert out.num_batched_tokens == 8


def test_scheduled_list_puts_prefill_chunks_before_decodes() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    for i in range(2):
        sched.add(make_seq(i, 3, max_tokens=5))
    step(sched)
    sched.add(make_seq(2, 10))

    out = step(sched)

    assert [(item.seq.seq_id, item.num_new_tokens) for item in out.scheduled] == [(2, 10), (0, 1), (1, 1)]


def test_batched_tokens_never_exceed_the_budget_under_load() -> None:
    sched = make_scheduler(64, max_num_batched_tokens=10)
    for i in range(6):
        sched.add(make_seq(i, 3 + 4 * i, max_tokens=3))

    outs = run_until_done(sched)

    assert max(o.num_batched_tokens for o in outs) == 10
    assert all(o.num_batched_tokens <= 10 for o in outs)
    assert_pool_empty(sched)


# ---- prefix caching through the scheduler ----------------------------------------------------------------


def test_second_sequence_with_the_same_prefix_gets_cached_blocks_and_stats_count_them() -> None:
    sched = make_scheduler()
    bm = sched.block_manager
    first = make_seq(0, list(range(10)), max_tokens=5)
    sched.add(first)
    step(sched)
    second = make_seq(1, [*range(8), 77, 78], max_tokens=5)
    sched.add(second)

    out = step(sched)

    assert scheduled_tokens(out) == {0: 1, 1: 2}
    assert second.num_cached_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert [bm.blocks[b].ref_count for b in second.block_table[:2]] == [2, 2]
    assert (bm.stats.queries, bm.stats.hits) == (20, 8)
    run_until_done(sched)
    assert second.output_token_ids == expected_output(second)
    assert_pool_empty(sched)


def test_prefix_hits_survive_the_first_sequence_finishing() -> None:
    sched = make_scheduler(8)
    bm = sched.block_manager
    first = make_seq(0, list(range(9)), max_tokens=2)
    sched.add(first)
    run_until_done(sched)
    second = make_seq(1, list(range(9)), max_tokens=2)
    sched.add(second)

    out = step(sched)

    assert scheduled_tokens(out) == {1: 1}
    assert second.num_cached_tokens == 8
    assert bm.stats.hits == 8
    assert len(second.block_table) == bm.num_blocks_needed(second.num_tokens)
    assert bm.num_free_blocks == bm.num_blocks - bm.num_blocks_needed(second.num_tokens)
    run_until_done(sched)
    assert second.output_token_ids == expected_output(second)
    assert_pool_empty(sched)


# ---- preemption ------------------------------------------------------------------------------------------


def test_preempted_sequence_loses_its_blocks_but_keeps_its_tokens() -> None:
    sched = make_scheduler(2, prefix_caching=False)
    first, second = make_seq(0, 4, max_tokens=3), make_seq(1, 4, max_tokens=3)
    sched.add(first)
    sched.add(second)
    step(sched)  # both prefill one full block each and sample: the pool is full

    out = step(sched)  # first needs a second block; second is the latest arrival

    assert out.preempted == [second]
    assert scheduled_tokens(out) == {0: 1}
    assert second.status is SequenceStatus.WAITING and second in sched.waiting
    assert second.num_computed_tokens == 0 and second.block_table == []
    assert second.output_token_ids == expected_output(second)[:1]
    assert second.num_preemptions == 1 and sched.num_preemptions == 1


def test_preempted_sequence_recomputes_and_finishes_with_every_expected_token() -> None:
    sched = make_scheduler(2, prefix_caching=False)
    seqs = [make_seq(0, 4, max_tokens=3), make_seq(1, 4, max_tokens=3)]
    for seq in seqs:
        sched.add(seq)

    outs = run_until_done(sched)

    recompute = [o for o in outs if scheduled_tokens(o).get(1, 0) > 1][-1]
    assert scheduled_tokens(recompute)[1] == 5  # 4 prompt tokens + the token it had generated
    assert sched.num_preemptions >= 1
    assert [s.output_token_ids for s in seqs] == [expected_output(s) for s in seqs]
    assert_pool_empty(sched)


def _three_decoders(priorities: list[int], arrivals: list[float]) -> tuple[Scheduler, list[Sequence]]:
    """Three one-block sequences decoding in a 4-block pool: the second block request must preempt."""
    sched = make_scheduler(4, prefix_caching=False)
    seqs = [make_seq(i, 4, max_tokens=3, priority=p, arrival=a)
            for i, (p, a) in enumerate(zip(priorities, arrivals, strict=True))]
    for seq in seqs:
        sched.add(seq)
    step(sched)
    return sched, seqs


def test_preemption_takes_the_latest_arrival_among_equal_priorities() -> None:
    sched, seqs = _three_decoders([0, 0, 0], [0.0, 1.0, 2.0])

    out = step(sched)

    assert out.preempted == [seqs[2]]
    assert scheduled_tokens(out) == {0: 1, 1: 1}


def test_preemption_takes_the_lowest_priority_even_if_it_arrived_first() -> None:
    sched, seqs = _three_decoders([1, 0, 0], [0.0, 1.0, 2.0])

    out = step(sched)

    assert out.preempted == [seqs[0]]
    assert scheduled_tokens(out) == {1: 1, 2: 1}


def test_step_that_preempts_admits_no_waiting_sequence_even_if_it_would_fit() -> None:
    sched = make_scheduler(5, prefix_caching=False)
    seqs = [make_seq(0, 4), make_seq(1, 4), make_seq(2, 9)]  # 1 + 1 + 3 blocks: the pool is full
    for seq in seqs:
        sched.add(seq)
    step(sched)
    sched.add(make_seq(9, 1, arrival=-1.0))

    preempting = step(sched)  # 0 and 1 each need a block; 2 (3 blocks) is preempted, 1 block is left
    after = step(sched)

    assert preempting.preempted == [seqs[2]]
    assert scheduled_tokens(preempting) == {0: 1, 1: 1}
    assert sched.block_manager.num_free_blocks == 0
    assert scheduled_tokens(after) == {0: 1, 1: 1, 9: 1}


# ---- KV pressure -----------------------------------------------------------------------------------------


def test_reserved_blocks_hold_admission_until_released() -> None:
    sched = make_scheduler(8)
    sched.block_manager.reserve(7)
    sched.add(make_seq(0, 8, max_tokens=1))

    held = sched.schedule()
    assert held.is_empty and sched.num_waiting == 1
    assert sched.block_manager.usage == pytest.approx(7 / 8)

    sched.block_manager.reserve(0)
    released = step(sched)

    assert scheduled_tokens(released) == {0: 8}


# ---- aborts and leaks ------------------------------------------------------------------------------------


def test_finish_abort_removes_waiting_and_running_sequences_and_frees_blocks() -> None:
    sched = make_scheduler(max_num_seqs=1)
    running, waiting = make_seq(0, 6), make_seq(1, 6)
    sched.add(running)
    sched.add(waiting)
    step(sched)

    sched.finish(waiting, FinishReason.ABORT)
    sched.finish(running, FinishReason.ABORT)

    for seq in (running, waiting):
        assert seq.is_finished and seq.finish_reason is FinishReason.ABORT
        assert seq.block_table == []
    assert not sched.has_unfinished()
    assert_pool_empty(sched)


def _mixed_workload(sched: Scheduler) -> tuple[list[Sequence], set[int]]:
    shared = list(range(900, 908))  # two full blocks several prompts start with
    specs: list[tuple[int | list[int], int, int]] = [  # (prompt, max_tokens, priority)
        ([*shared, 1, 2, 3], 6, 0), ([*shared, 4, 5], 8, 1), (13, 5, 0), ([*shared, 6], 7, 2),
        ([*shared, *range(20, 32)], 4, 0), (9, 10, 1), (shared, 3, 0), (17, 6, 2),
        ([*shared, 7, 8, 9, 10], 9, 0), (5, 2, 1), ([*shared, 11], 5, 0), (21, 3, 0),
    ]
    seqs = [make_seq(i, prompt, max_tokens=n, priority=p) for i, (prompt, n, p) in enumerate(specs)]
    aborted: set[int] = set()
    pending = list(seqs)
    for step_no in range(500):
        if step_no % 2 == 0 and pending:  # requests keep arriving while others run
            sched.add(pending.pop(0))
        if step_no == 6 and sched.waiting:
            victim = sched.waiting[-1]
            aborted.add(victim.seq_id)
            sched.finish(victim, FinishReason.ABORT)
        if step_no == 9 and sched.running:
            victim = sched.running[0]
            aborted.add(victim.seq_id)
            sched.finish(victim, FinishReason.ABORT)
        if not pending and not sched.has_unfinished():
            break
        step(sched)
    return seqs, aborted


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_mixed_workload_with_preemptions_and_aborts_leaks_no_block(prefix_caching: bool) -> None:
    sched = make_scheduler(10, max_num_seqs=4, max_num_batched_tokens=12, prefix_caching=prefix_caching)

    seqs, aborted = _mixed_workload(sched)

    assert sched.num_preemptions > 0  # the workload really exercised preemption
    assert len(aborted) == 2
    assert_pool_empty(sched)
    for seq in seqs:
        assert seq.is_finished
        if seq.seq_id in aborted:
            assert seq.finish_reason is FinishReason.ABORT
        else:
            assert seq.finish_reason is FinishReason.LENGTH
            assert seq.output_token_ids == expected_output(seq)
    if prefix_caching:
        assert sched.block_manager.stats.hits > 0
