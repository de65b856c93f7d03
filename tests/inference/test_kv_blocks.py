"""Unit tests for inference.kv_blocks: paged KV-block accounting, prefix caching and eviction."""

from __future__ import annotations

import pytest

from inference.kv_blocks import BlockManager, prefix_block_hashes
from inference.sampling_params import SamplingParams
from inference.sequence import Sequence

BLOCK = 4


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(), arrival_time=float(seq_id))


def admit(bm: BlockManager, seq: Sequence) -> None:
    """Allocate ``seq``'s uncached tokens the way the scheduler admits it, and compute them."""
    cached = bm.find_cached_prefix(seq)
    num_new = seq.num_tokens - len(cached) * bm.block_size
    assert bm.allocate(seq, num_new, cached)
    compute(bm, seq, num_new)


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """What the engine does after a forward pass: tokens now have KV, full blocks get hashes."""
    seq.num_computed_tokens += num_tokens
    bm.cache_full_blocks(seq)


def free_queue(bm: BlockManager) -> list[int]:
    return list(bm.free_queue)


# ---- allocation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_tokens", "num_blocks"), [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_num_blocks_needed_is_tokens_over_block_size_rounded_up(num_tokens: int, num_blocks: int) -> None:
    assert BlockManager(8, BLOCK).num_blocks_needed(num_tokens) == num_blocks


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (8, 0), (-1, 4)])
def test_block_manager_rejects_non_positive_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_allocate_gives_ceil_tokens_over_block_size_distinct_blocks() -> None:
    bm = BlockManager(8, BLOCK)
    seq = make_seq(0, list(range(9)))

    assert bm.allocate(seq, 9)

    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    assert bm.num_free_blocks == 5


def test_allocate_adds_a_block_only_when_the_last_one_is_full() -> None:
    bm = BlockManager(8, BLOCK)
    seq = make_seq(0, list(range(5)))
    assert bm.allocate(seq, 5)
    compute(bm, seq, 5)
    sizes = []
    for token in range(5):  # decode tokens 6..10: positions 5..9
        seq.append_token(100 + token)
        assert bm.allocate(seq, 1)
        compute(bm, seq, 1)
        sizes.append(len(seq.block_table))

    assert sizes == [2, 2, 2, 3, 3]  # 6, 7, 8 tokens fit in 2 blocks; the 9th needs a third


def test_allocate_fails_without_side_effects_when_the_pool_is_short() -> None:
    bm = BlockManager(4, BLOCK)
    holder = make_seq(0, list(range(12)))
    assert bm.allocate(holder, 12)
    queue_before = free_queue(bm)
    seq = make_seq(1, list(range(100, 108)))

    assert not bm.can_allocate(seq, 8)
    assert not bm.allocate(seq, 8)

    assert seq.block_table == []
    assert seq.num_computed_tokens == 0
    assert free_queue(bm) == queue_before
    assert bm.num_free_blocks == 1
    assert [b.ref_count for b in bm.blocks] == [1, 1, 1, 0]


def test_allocate_with_a_cached_prefix_fails_without_side_effects_when_revival_does_not_fit() -> None:
    bm = BlockManager(3, BLOCK)
    first = make_seq(0, list(range(9)))
    admit(bm, first)
    bm.free(first)  # blocks 0 and 1 stay cached in the free queue
    queue_before = free_queue(bm)
    seq = make_seq(1, list(range(13)))  # 2 cached blocks + 5 new tokens: 4 blocks > 3
    cached = bm.find_cached_prefix(seq)
    assert len(cached) == 2

    assert not bm.can_allocate(seq, 5, cached)
    assert not bm.allocate(seq, 5, cached)

    assert seq.block_table == [] and seq.num_cached_tokens == 0 and seq.num_computed_tokens == 0
    assert free_queue(bm) == queue_before
    assert bm.find_cached_prefix(seq) == cached


def test_free_returns_every_block_to_the_pool() -> None:
    bm = BlockManager(8, BLOCK)
    seq = make_seq(0, list(range(10)))
    admit(bm, seq)
    assert bm.num_free_blocks == 5

    bm.free(seq)

    assert seq.block_table == []
    assert bm.num_free_blocks == 8
    assert all(b.ref_count == 0 for b in bm.blocks)


# ---- prefix caching ------------------------------------------------------------------------------


def test_second_sequence_shares_the_cached_full_blocks_of_the_first() -> None:
    bm = BlockManager(16, BLOCK)
    first = make_seq(0, list(range(10)))
    admit(bm, first)
    second = make_seq(1, [*range(8), 50, 51, 52])

    cached = bm.find_cached_prefix(second)
    assert bm.allocate(second, second.num_tokens - 8, cached)

    assert second.num_cached_tokens == 8
    assert second.num_computed_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert [bm.blocks[b].ref_count for b in second.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == 16 - 4


def test_record_prompt_lookup_counts_prompt_tokens_and_cached_hits() -> None:
    bm = BlockManager(16, BLOCK)
    first = make_seq(0, list(range(10)))
    admit(bm, first)
    bm.record_prompt_lookup(first)
    second = make_seq(1, list(range(10)))
    cached = bm.find_cached_prefix(second)
    assert bm.allocate(second, 2, cached)
    bm.record_prompt_lookup(second)

    assert (bm.stats.queries, bm.stats.hits) == (20, 8)


def test_fully_cached_prompt_still_leaves_one_token_to_compute() -> None:
    bm = BlockManager(16, BLOCK)
    admit(bm, make_seq(0, list(range(9))))

    block_aligned = make_seq(1, list(range(8)))  # both blocks cached, but the last token must run
    one_past = make_seq(2, list(range(9)))

    assert len(bm.find_cached_prefix(block_aligned)) == 1
    assert len(bm.find_cached_prefix(one_past)) == 2
    assert bm.allocate(one_past, 1, bm.find_cached_prefix(one_past))
    assert one_past.num_uncomputed_tokens == 1


def test_different_first_block_gives_no_hit_even_when_later_blocks_match() -> None:
    bm = BlockManager(16, BLOCK)
    admit(bm, make_seq(0, [0, 1, 2, 3, 4, 5, 6, 7, 8]))
    other_head = make_seq(1, [9, 9, 9, 9, 4, 5, 6, 7, 8])

    assert bm.find_cached_prefix(other_head) == []


def test_block_is_not_cached_until_all_its_tokens_are_computed() -> None:
    bm = BlockManager(16, BLOCK)
    first = make_seq(0, list(range(9)))
    assert bm.allocate(first, 9)
    compute(bm, first, 3)  # a chunk that stops inside the first block

    assert bm.find_cached_prefix(make_seq(1, list(range(9)))) == []
    compute(bm, first, 1)
    assert len(bm.find_cached_prefix(make_seq(2, list(range(9))))) == 1


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(16, BLOCK, enable_prefix_caching=False)
    admit(bm, make_seq(0, list(range(9))))

    assert bm.find_cached_prefix(make_seq(1, list(range(9)))) == []


def test_block_hashes_match_prefix_block_hashes_used_by_routers() -> None:
    bm = BlockManager(16, BLOCK)
    seq = make_seq(0, list(range(11)))
    admit(bm, seq)

    assert seq.block_hashes == prefix_block_hashes(seq.token_ids, BLOCK)
    assert len(seq.block_hashes) == 2


def test_shared_block_stays_out_of_the_free_queue_until_its_last_reference_is_freed() -> None:
    bm = BlockManager(16, BLOCK)
    first, second = make_seq(0, list(range(9))), make_seq(1, list(range(9)))
    admit(bm, first)
    admit(bm, second)
    shared = first.block_table[0]

    bm.free(first)
    assert bm.blocks[shared].ref_count == 1
    assert shared not in bm.free_queue
    bm.free(second)
    assert bm.blocks[shared].ref_count == 0
    assert shared in bm.free_queue


def test_freed_cached_blocks_are_revived_by_a_later_sequence() -> None:
    bm = BlockManager(8, BLOCK)
    first = make_seq(0, list(range(9)))
    admit(bm, first)
    head = first.block_table[:2]
    bm.free(first)
    second = make_seq(1, list(range(9)))

    cached = bm.find_cached_prefix(second)
    assert cached == head
    assert bm.allocate(second, 1, cached)

    assert second.block_table[:2] == head
    assert second.num_cached_tokens == 8
    assert all(b not in bm.free_queue and bm.blocks[b].ref_count == 1 for b in head)
    # 9 tokens need 3 blocks: 2 revived and 1 new, nothing more.
    assert len(second.block_table) == bm.num_blocks_needed(second.num_tokens)
    assert bm.num_free_blocks == 8 - 3


def test_revival_fits_when_the_free_queue_holds_exactly_the_blocks_needed() -> None:
    bm = BlockManager(3, BLOCK)
    first = make_seq(0, list(range(9)))
    admit(bm, first)
    bm.free(first)
    second = make_seq(1, list(range(9)))
    cached = bm.find_cached_prefix(second)

    assert bm.can_allocate(second, 1, cached)
    assert bm.allocate(second, 1, cached)
    assert len(second.block_table) == 3
    assert bm.num_free_blocks == 0


# ---- eviction --------------------------------------------------------------------------------------


def test_free_blocks_are_taken_from_the_head_of_the_queue() -> None:
    bm = BlockManager(8, BLOCK)
    first, second = make_seq(0, list(range(8))), make_seq(1, list(range(100, 104)))

    assert bm.allocate(first, 8)
    assert bm.allocate(second, 4)

    assert first.block_table == [0, 1]
    assert second.block_table == [2]


def test_freed_sequence_tail_blocks_are_evicted_before_its_head_blocks() -> None:
    bm = BlockManager(4, BLOCK)
    first = make_seq(0, list(range(16)))
    admit(bm, first)
    table = list(first.block_table)
    bm.free(first)
    assert free_queue(bm) == table[::-1]

    other = make_seq(1, list(range(100, 104)))
    assert bm.allocate(other, 4)

    assert other.block_table == [table[-1]]
    # The head blocks survived: a sequence with the same prompt still hits all three of them.
    assert bm.find_cached_prefix(make_seq(2, list(range(16)))) == table[:3]


def test_least_recently_freed_cached_blocks_are_evicted_first() -> None:
    bm = BlockManager(4, BLOCK)
    older, newer = make_seq(0, list(range(5))), make_seq(1, list(range(100, 105)))
    admit(bm, older)
    admit(bm, newer)
    newer_head = newer.block_table[0]
    bm.free(older)
    bm.free(newer)

    assert bm.allocate(make_seq(2, list(range(200, 208))), 8)

    assert bm.find_cached_prefix(make_seq(3, list(range(5)))) == []
    assert bm.find_cached_prefix(make_seq(4, list(range(100, 105)))) == [newer_head]


def test_evicted_block_loses_its_hash_so_it_gives_no_stale_hit() -> None:
    bm = BlockManager(2, BLOCK)
    first = make_seq(0, list(range(5)))
    admit(bm, first)
    first_hash = first.block_hashes[0]
    bm.free(first)

    overwriter = make_seq(1, list(range(100, 108)))
    assert bm.allocate(overwriter, 8)

    assert first_hash not in bm.cached
    assert all(bm.blocks[b].block_hash is None for b in overwriter.block_table)
    assert bm.find_cached_prefix(make_seq(2, list(range(5)))) == []


def test_reset_prefix_cache_forgets_only_unreferenced_blocks() -> None:
    bm = BlockManager(8, BLOCK)
    live, gone = make_seq(0, list(range(5))), make_seq(1, list(range(100, 105)))
    admit(bm, live)
    admit(bm, gone)
    bm.free(gone)

    bm.reset_prefix_cache()

    assert len(bm.find_cached_prefix(make_seq(2, list(range(5))))) == 1
    assert bm.find_cached_prefix(make_seq(3, list(range(100, 105)))) == []


# ---- KV-pressure reservation -------------------------------------------------------------------------


def test_reserve_lowers_free_blocks_and_raises_usage() -> None:
    bm = BlockManager(8, BLOCK)
    assert (bm.num_free_blocks, bm.usage) == (8, 0.0)

    bm.reserve(6)

    assert bm.num_free_blocks == 2
    assert bm.usage == pytest.approx(0.75)
    assert not bm.allocate(make_seq(0, list(range(12))), 12)
    assert bm.allocate(make_seq(1, list(range(8))), 8)
    assert (bm.num_free_blocks, bm.usage) == (0, 1.0)


def test_reserve_zero_releases_the_held_blocks() -> None:
    bm = BlockManager(8, BLOCK)
    bm.reserve(8)
    assert bm.num_free_blocks == 0

    bm.reserve(0)

    assert bm.num_free_blocks == 8
    assert bm.usage == 0.0


def test_reserve_more_than_the_pool_is_clamped_and_never_negative() -> None:
    bm = BlockManager(8, BLOCK)
    bm.reserve(100)

    assert bm.num_free_blocks == 0
    assert bm.usage == 1.0
