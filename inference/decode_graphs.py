"""Decode steps replayed as CUDA graphs at bucketed batch sizes and context widths.

A decode step of a small model on a GPU is bound by launching its kernels, not by running them: a few
hundred small kernels per step, each a Python call and a driver call. A CUDA graph records one step's
kernels once and replays them with a single launch. A graph replays fixed shapes on fixed memory, so each
(batch, width) bucket gets its own graph over static buffers:

- a pure-decode step of ``n`` sequences runs in the smallest captured batch ``B >= n``; rows ``n..B`` are
  padding: token 0 at position 0, attending to one key, writing their keys and values into a scratch
  block that no sequence owns (the cache is allocated one block larger than the block manager's pool);
- its longest context, in blocks, picks the smallest captured width ``W``; every block table is padded to
  ``W`` with block 0 and the score bias hides the padding, so the result equals the eager path's (whose
  decode groups pad less), to float rounding;
- the step's integers (token ids, positions, cache slots, context lengths, block tables) are laid out in
  one host array and copied to the device in one transfer, into one packed buffer the graph reads.

Everything else (prefill chunks, mixed steps, batches or contexts past the largest bucket) runs eagerly,
as do models whose decode path is not capturable as written: an INT8 cache (its scale update branches on
data), latent attention, a fused decode kernel. Graphs are captured once, when the runner is built, all
sharing one memory pool (captured widest and largest first, as vLLM does), outside any step profile.

Without CUDA (``capture=False``) the same buckets, buffers and padding run eagerly: that is what the tests
check on a machine without a GPU; a GPU run checks the capture itself (``LLMSRE_TEST_DEVICE=cuda``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from inference import step_profile
from inference.attention import Attention, AttentionContext, attention_context, decode_group
from inference.kv_quant import GatherWorkspace, KVCacheStore
from inference.models.llama import CausalLM
from inference.scheduler import ScheduledSeq
from inference.step_profile import MODEL_REST, PREPARE

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger(__name__)

# Batch buckets: every size to 4 (short fleets decode few sequences), then steps of 8, as vLLM does.
SMALL_BATCHES = (1, 2, 4)
BATCH_STEP = 8
# Width buckets in blocks: powers of two from this one up to the longest context, which is always one.
MIN_WIDTH_BLOCKS = 8


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    sizes = {b for b in SMALL_BATCHES if b <= max_num_seqs}
    sizes |= set(range(BATCH_STEP, max_num_seqs + 1, BATCH_STEP)) | {max_num_seqs}
    return tuple(sorted(sizes))


def width_buckets(max_blocks: int) -> tuple[int, ...]:
    widths = {max_blocks}
    w = MIN_WIDTH_BLOCKS
    while w < max_blocks:
        widths.add(w)
        w *= 2
    return tuple(sorted(widths))


def smallest_at_least(buckets: Sequence[int], n: int) -> int | None:
    return next((b for b in buckets if b >= n), None)


def unsupported_reason(attention_layers: Sequence[object], *, int8_kv: bool,
                       fused_kernel: bool) -> str | None:
    """Why this model's decode step cannot be captured as written; None when it can."""
    if int8_kv:
        return "an INT8 KV cache updates its scales with data-dependent branches"
    if fused_kernel:
        return "a fused decode kernel is in use"
    if not all(isinstance(layer, Attention) for layer in attention_layers):
        return "latent attention (MLA) is not captured yet"
    return None


@dataclass(slots=True)
class _Bucket:
    """One captured (batch, width) shape: its packed inputs, its output and its graph."""

    batch: int
    width: int
    packed: torch.Tensor  # int64 [4 * batch + batch * width]: ids, positions, slots, lens, block tables
    logits: torch.Tensor  # float32 [batch, vocab]: written by each replay
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly on the same buffers (no CUDA)
    forward: Callable[[], torch.Tensor]

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            self.logits.copy_(self.forward())
        else:
            self.graph.replay()
        return self.logits


class DecodeGraphs:
    """Captured decode steps of one model runner; :meth:`run` replays one when a step fits."""

    def __init__(self, model: CausalLM, stores: Sequence[KVCacheStore], *, block_size: int,
                 scratch_block: int, max_num_seqs: int, max_blocks: int, device: torch.device,
                 dtype: torch.dtype, capture: bool) -> None:
        self.model = model
        self.stores = list(stores)
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = device
        self.dtype = dtype
        self.batches = batch_buckets(max_num_seqs)
        self.widths = width_buckets(max_blocks)
        # steps served by a bucket, the rows they ran and how many of those were padding (benchmark, tests)
        self.replays = self.rows = self.padded_rows = 0
        self.captured = capture
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        # The gathered keys and values of every bucket: sized by the first (largest) one's warm-up, outside
        # the graphs' pool, and shared, as only one bucket runs at a time; the eager path keeps its own.
        self._workspace = GatherWorkspace()
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if capture else None
        with step_profile.paused():
            for width in reversed(self.widths):  # the largest first: the later ones reuse its memory
                for batch in reversed(self.batches):
                    self._buckets[(batch, width)] = self._capture(batch, width, pool)
        self.capture_seconds = time.perf_counter() - started
        logger.info("decode graphs: %d buckets (batches %s x widths %s blocks) %s in %.2f s",
                    len(self._buckets), list(self.batches), list(self.widths),
                    "captured" if capture else "prepared without CUDA", self.capture_seconds)

    # ---- capture -------------------------------------------------------------------------------
    def _capture(self, batch: int, width: int, pool: _POOL_HANDLE | None) -> _Bucket:
        packed = torch.from_numpy(self._padding(batch, width)).to(self.device)
        forward = self._forward(packed, batch, width)
        if pool is None:
            with torch.inference_mode():
                return _Bucket(batch, width, packed, forward().clone(), None, forward)
        stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            forward()  # warm-up: lazy initialisation (cuBLAS handles, workspaces) stays out of the graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
            logits = forward()
        return _Bucket(batch, width, packed, logits, graph, forward)

    def _forward(self, packed: torch.Tensor, batch: int, width: int) -> Callable[[], torch.Tensor]:
        ids, positions, slots, lens = (packed[i * batch:(i + 1) * batch] for i in range(4))
        tables = packed[4 * batch:].view(batch, width)
        model, dtype, block_size, workspace = self.model, self.dtype, self.block_size, self._workspace

        def forward() -> torch.Tensor:
            eager = [store.workspace for store in self.stores]
            for store in self.stores:
                store.workspace = workspace
            try:
                group = decode_group(0, tables, lens, block_size=block_size, dtype=dtype)
                with attention_context(AttentionContext(slot_mapping=slots, prefills=[], decodes=[group])):
                    hidden = model(ids, positions)
                return model.compute_logits(hidden).float()
            finally:
                for store, own in zip(self.stores, eager, strict=True):
                    store.workspace = own

        return forward

    def _padding(self, batch: int, width: int) -> np.ndarray:
        """The packed inputs of a batch of padding rows only."""
        packed = np.zeros(4 * batch + batch * width, dtype=np.int64)
        scratch = self.scratch_block * self.block_size
        packed[2 * batch:3 * batch] = scratch + np.arange(batch) % self.block_size
        packed[3 * batch:4 * batch] = 1  # one key each: softmax over one finite score, never over none
        return packed

    def summary(self) -> str:
        how = "captured as CUDA graphs" if self.captured else "run eagerly (no CUDA)"
        padding = f"{self.padded_rows / self.rows:.0%}" if self.rows else "-"
        return (f"{len(self._buckets)} buckets (batches {','.join(map(str, self.batches))} x widths "
                f"{','.join(map(str, self.widths))} blocks) {how} in {self.capture_seconds:.2f} s; "
                f"{self.replays} decode steps replayed, {padding} of their rows padding")

    # ---- the step ------------------------------------------------------------------------------
    def run(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[int]] | None:
        """Logits of a pure-decode step from a graph, rows in the order of the returned scheduled indices;
        None when the step does not fit a bucket (the caller runs it eagerly)."""
        if not scheduled or any(item.num_new_tokens != 1 or not item.samples for item in scheduled):
            return None
        n = len(scheduled)
        order = sorted(range(n), key=lambda i: scheduled[i].seq.num_computed_tokens)  # as the eager path
        bs = self.block_size
        longest = scheduled[order[-1]].seq.num_computed_tokens + 1
        batch = smallest_at_least(self.batches, n)
        width = smallest_at_least(self.widths, -(-longest // bs))
        if batch is None or width is None:
            return None
        bucket = self._buckets[(batch, width)]
        host = self._padding(batch, width)
        tables = host[4 * batch:].reshape(batch, width)
        for row, index in enumerate(order):
            seq = scheduled[index].seq
            position = seq.num_computed_tokens
            table = seq.block_table
            host[row] = seq.token_ids[position]
            host[batch + row] = position
            host[2 * batch + row] = table[position // bs] * bs + position % bs
            host[3 * batch + row] = position + 1
            used = min(len(table), width)  # a table may hold a block past the context already
            tables[row, :used] = table[:used]
        bucket.packed.copy_(torch.from_numpy(host), non_blocking=False)
        step_profile.lap(PREPARE)
        logits = bucket.replay()[:n]
        step_profile.lap(MODEL_REST)
        self.replays += 1
        self.rows += batch
        self.padded_rows += batch - n
        return logits, order
