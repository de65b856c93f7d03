"""Paged KV-cache block accounting with prefix caching (torch-free).

The pool holds ``num_blocks`` fixed-size blocks. A full block whose tokens are known gets a chained hash
(``hash(parent_hash, tokens)``), so two sequences with the same leading blocks share them. Blocks carry
reference counts; a block nobody references goes to the tail of a free queue but keeps its hash and
contents, so a later sequence with the same prefix can take it back (a prefix-cache hit). New blocks are
taken from the head of the queue, which evicts the least recently freed cached block first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from inference.sequence import Sequence

logger = logging.getLogger(__name__)

NO_PARENT = 0x5EED


def chain_hash(parent: int, tokens: Seq[int]) -> int:
    """The hash of a full block given its parent's hash; stable across processes for int tokens."""
    return hash((parent, tuple(tokens)))


def prefix_block_hashes(token_ids: Seq[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of ``token_ids`` (used by routers for prefix affinity too)."""
    hashes: list[int] = []
    parent = NO_PARENT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache


class BlockManager:
    """Allocates, shares, frees and evicts KV blocks for sequences."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_reserved = 0  # blocks held back (KV-pressure fault)
        self.stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return max(len(self.free_queue) - self.num_reserved, 0)

    @property
    def num_blocks_in_use(self) -> int:
        """Blocks referenced by sequences now (not the free ones, cached or not, and not the reserved)."""
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use by running sequences or reserved (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq``, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        parent = NO_PARENT
        for i in range(max_blocks):
            parent = chain_hash(parent, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self.cached.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: Seq[int] = ()) -> bool:
        if seq.block_table:
            cached_prefix = ()
        return sum(self._num_new_blocks(seq, num_new_tokens, cached_prefix)) <= self.num_free_blocks

    # ---- mutations -----------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_prefix: Seq[int] = ()) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens; False (and no change) if they don't fit.

        ``cached_prefix`` (from :meth:`find_cached_prefix`) is only used for a sequence holding no blocks.
        """
        if seq.block_table:
            cached_prefix = ()
        fresh, revived = self._num_new_blocks(seq, num_new_tokens, cached_prefix)
        if fresh + revived > self.num_free_blocks:
            return False
        if cached_prefix:
            self._take_cached(seq, cached_prefix)
        for _ in range(fresh):
            seq.block_table.append(self._take_free())
        return True

    def record_prompt_lookup(self, seq: Sequence) -> None:
        self.stats.queries += seq.num_tokens
        self.stats.hits += seq.num_cached_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register hashes for blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else NO_PARENT
        for i in range(len(seq.block_hashes), num_full):
            parent = chain_hash(parent, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            seq.block_hashes.append(parent)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and parent not in self.cached:
                block.block_hash = parent
                self.cached[parent] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; tail blocks are queued first so that they are evicted first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_table = []

    def reserve(self, num_blocks: int) -> None:
        """Hold back ``num_blocks`` of the free pool (KV-pressure fault); 0 releases them."""
        self.num_reserved = max(0, min(num_blocks, self.num_blocks))

    def reset_prefix_cache(self) -> None:
        for block_hash, block_id in list(self.cached.items()):
            if self.blocks[block_id].ref_count == 0:
                self.blocks[block_id].block_hash = None
                del self.cached[block_hash]

    # ---- internals -----------------------------------------------------------------------------
    def _num_new_blocks(self, seq: Sequence, num_new_tokens: int, cached_prefix: Seq[int]) -> tuple[int, int]:
        """(fresh blocks to take, cached blocks to take back from the free queue)."""
        if seq.block_table:
            have, computed, revived = len(seq.block_table), seq.num_computed_tokens, 0
        else:
            have, computed = len(cached_prefix), len(cached_prefix) * self.block_size
            # Cached blocks sitting in the free queue stop being free once taken.
            revived = sum(1 for b in cached_prefix if self.blocks[b].ref_count == 0)
        return max(self.num_blocks_needed(computed + num_new_tokens) - have, 0), revived

    def _take_cached(self, seq: Sequence, cached_prefix: Seq[int]) -> None:
        for block_id in cached_prefix:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            assert block.block_hash is not None
            seq.block_hashes.append(block.block_hash)
        seq.num_cached_tokens = len(cached_prefix) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens

    def _take_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: its contents are about to be overwritten
            del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id
