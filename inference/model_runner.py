"""All tensor work of one engine step: input preparation, the forward pass over block tables, sampling.

The runner owns the paged KV cache (one :class:`KVCacheStore` per attention layer) and binds it to the
model's attention layers. ``run`` takes the scheduler's plan and returns one sampled token (or ``None``
for a prefill chunk that does not reach the end of its sequence) per scheduled sequence, with its
log-probabilities where the request asked for them.
"""

from __future__ import annotations

import array
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from inference import step_profile
from inference.attention import (
    Attention,
    AttentionContext,
    DecodeGroup,
    DecodeKernel,
    PrefillChunk,
    attention_context,
    decode_group,
)
from inference.decode_graphs import DecodeGraphs, unsupported_reason
from inference.kv_quant import (
    GatherWorkspace,
    Int8KVCacheStore,
    Int8LatentCacheStore,
    KVCacheStore,
    LatentCacheStore,
)
from inference.mla import LatentAttention
from inference.models.config import ModelConfig
from inference.models.llama import CausalLM, FusedOps
from inference.output import TokenLogprob
from inference.sampler import Sampler, SamplingRow
from inference.scheduler import ScheduledSeq, SchedulerOutput
from inference.sequence import Sequence
from inference.step_profile import LOGITS, MODEL_REST, PREPARE, SAMPLING

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    context: AttentionContext
    sample_rows: list[int]  # rows of the flat batch whose logits are sampled
    sample_items: list[int]  # index into the scheduled list for each sampled row


@dataclass(slots=True, frozen=True)
class CacheLayout:
    num_blocks: int
    block_size: int
    num_kv_heads: int  # keys and values per token per layer: num_kv_heads x head_dim each
    head_dim: int
    num_layers: int
    bytes_per_block: int  # all layers together
    latent_width: int | None = None  # multi-head latent attention: one row of this width instead

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size


def cache_bytes_per_block(config: ModelConfig, *, block_size: int, dtype: torch.dtype, int8: bool) -> int:
    """What one block of the paged cache costs across all layers, as the engine stores it."""
    if config.mla is not None:
        latent = Int8LatentCacheStore if int8 else LatentCacheStore
        per_layer = latent.latent_bytes_per_block(block_size, config.mla.latent_width, dtype)
    else:
        store = Int8KVCacheStore if int8 else KVCacheStore
        per_layer = store.bytes_per_block(block_size, config.num_key_value_heads, config.head_dim, dtype)
    return per_layer * config.num_hidden_layers


def multi_head_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """What one token would cost across all layers as per-head keys and values of ``dtype``.

    Multi-head latent attention: every head's key (``qk_nope_head_dim + qk_rope_head_dim``) and value
    (``v_head_dim``), the cache that the latent row replaces. Otherwise the keys and values of the
    ``num_key_value_heads`` heads, which is what the engine stores (``cache_bytes_per_block`` / block
    size, scales of an int8 cache aside).
    """
    if config.mla is not None:
        mla = config.mla
        values = config.num_attention_heads * (mla.qk_head_dim + mla.v_head_dim)
    else:
        values = 2 * config.num_key_value_heads * config.head_dim
    return values * dtype.itemsize * config.num_hidden_layers


def plan_cache(*, memory_bytes: int, num_blocks: int, block_size: int, config: ModelConfig,
               dtype: torch.dtype, int8: bool) -> CacheLayout:
    per_block = cache_bytes_per_block(config, block_size=block_size, dtype=dtype, int8=int8)
    n = num_blocks or memory_bytes // per_block
    if n < 2:
        raise ValueError(f"kv_cache_memory_bytes: {memory_bytes} bytes hold fewer than 2 blocks "
                         f"of {per_block} bytes")
    return CacheLayout(n, block_size, config.num_key_value_heads, config.head_dim, config.num_hidden_layers,
                       per_block, None if config.mla is None else config.mla.latent_width)


# Starting another decode group costs a few small kernels per layer; padding a group costs gathering
# one block per sequence per layer. Cut a new group once it would pad more than this many blocks.
GROUP_PADDING_BLOCKS = 48


def decode_group_bounds(context_lens: list[int], block_size: int) -> list[tuple[int, int]]:
    """Cut ascending context lengths into [lo, hi) groups that keep block padding small."""
    bounds: list[tuple[int, int]] = []
    lo, widest = 0, 0
    for i, length in enumerate(context_lens):
        blocks = -(-length // block_size)
        if i > lo and (blocks - widest) * (i - lo) > GROUP_PADDING_BLOCKS:
            bounds.append((lo, i))
            lo = i
        widest = blocks
    if context_lens:
        bounds.append((lo, len(context_lens)))
    return bounds


@dataclass(slots=True, frozen=True)
class GraphsConfig:
    """Decode graphs' bounds: batches up to ``max_num_seqs``, contexts up to ``max_blocks`` blocks."""

    max_num_seqs: int
    max_blocks: int


LogitsHook = Callable[[list[ScheduledSeq], torch.Tensor], None]


class ModelRunner:
    def __init__(self, model: CausalLM, layout: CacheLayout, *, device: torch.device,
                 dtype: torch.dtype, int8_kv: bool = False, seed: int = 0,
                 decode_kernel: DecodeKernel | None = None, graphs: GraphsConfig | None = None,
                 layer_ops: FusedOps | None = None) -> None:
        self.model = model
        self.layout = layout
        self.device = device
        self.dtype = dtype
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention | LatentAttention)]
        if len(self.attention_layers) != layout.num_layers:
            raise ValueError(f"model has {len(self.attention_layers)} attention layers, "
                             f"cache planned for {layout.num_layers}")
        self.graphs_unavailable = None if graphs is None else unsupported_reason(
            self.attention_layers, int8_kv=int8_kv, fused_kernel=decode_kernel is not None)
        if graphs is not None and self.graphs_unavailable is not None:
            logger.warning("decode graphs unavailable: %s; decode steps run eagerly", self.graphs_unavailable)
        use_graphs = graphs is not None and self.graphs_unavailable is None
        # Decode graphs pad batches with rows that write into a block no sequence owns: one past the pool.
        num_blocks = layout.num_blocks + (1 if use_graphs else 0)
        workspace = GatherWorkspace()
        for layer in self.attention_layers:
            if isinstance(layer, LatentAttention):
                latent_store = Int8LatentCacheStore if int8_kv else LatentCacheStore
                layer.cache = latent = latent_store(num_blocks, layout.block_size, layer.latent_width,
                                                    dtype=dtype, device=device)
                latent.workspace = workspace
            else:
                kv_store = Int8KVCacheStore if int8_kv else KVCacheStore
                layer.cache = kv = kv_store(num_blocks, layout.block_size, layout.num_kv_heads,
                                            layout.head_dim, dtype=dtype, device=device)
                kv.workspace = workspace
                layer.decode_kernel = decode_kernel
        # every layer decodes through the fused kernel (latent layers keep the torch path, which pads)
        self._fused_decode = decode_kernel is not None and all(isinstance(layer, Attention)
                                                               for layer in self.attention_layers)
        # with the CPU kernel, a pure decode step runs each Llama decoder layer as one C++ call (and other
        # steps its norms and MLP activation)
        self.fused_layers = model.fuse_decode_layers(layer_ops) if (
            layer_ops is not None and self._fused_decode and not use_graphs) else 0
        self.sampler = Sampler(device, seed)
        self.logits_hook: LogitsHook | None = None  # tests compare logits with a reference model
        self.graphs: DecodeGraphs | None = None
        if graphs is not None and use_graphs:
            stores = [layer.cache for layer in self.attention_layers if isinstance(layer, Attention)]
            self.graphs = DecodeGraphs(model, [s for s in stores if s is not None],
                                       block_size=layout.block_size, scratch_block=layout.num_blocks,
                                       max_num_seqs=graphs.max_num_seqs, max_blocks=graphs.max_blocks,
                                       device=device, dtype=dtype, capture=device.type == "cuda")

    @torch.inference_mode()
    def run(self, out: SchedulerOutput,
            rows: list[SamplingRow]) -> tuple[list[int | None], list[TokenLogprob | None]]:
        """``rows`` holds sampling parameters for the scheduled items that sample, in order."""
        tokens: list[int | None] = [None] * len(out.scheduled)
        logprobs: list[TokenLogprob | None] = [None] * len(out.scheduled)
        replayed = None if self.graphs is None else self.graphs.run(out.scheduled)
        if replayed is not None:
            logits, sample_items = replayed
        else:
            batch = self.prepare(out.scheduled)
            step_profile.lap(PREPARE)
            with attention_context(batch.context):
                hidden = self.model(batch.input_ids, batch.positions)
            step_profile.lap(MODEL_REST)
            if not batch.sample_rows:
                return tokens, logprobs
            every_row = len(batch.sample_rows) == hidden.shape[0]
            logits = self.model.compute_logits(hidden if every_row else hidden[batch.sample_rows]).float()
            step_profile.lap(LOGITS)
            sample_items = batch.sample_items
        if self.logits_hook is not None:
            self.logits_hook([out.scheduled[i] for i in sample_items], logits)
        # ``rows`` follow the scheduled order; the logits follow the batch layout (prefills first, then
        # decodes by context length).
        row_of = dict(zip((i for i, s in enumerate(out.scheduled) if s.samples), rows, strict=True))
        laid_out = [row_of[i] for i in sample_items]
        sampled = self.sampler(logits, laid_out)
        for item, token, logprob in zip(sample_items, sampled.token_ids, sampled.logprobs, strict=True):
            tokens[item], logprobs[item] = token, logprob
        step_profile.lap(SAMPLING)
        return tokens, logprobs

    def prepare(self, scheduled: list[ScheduledSeq]) -> PreparedBatch:
        """Lay out prefill chunks first, then decodes sorted by context length (see DecodeGroup)."""
        if self._fused_decode and all(item.num_new_tokens == 1 for item in scheduled):
            return self._prepare_decodes(scheduled)
        bs = self.layout.block_size
        prefill_items = [i for i, item in enumerate(scheduled) if item.num_new_tokens > 1]
        decode_items = sorted((i for i, item in enumerate(scheduled) if item.num_new_tokens == 1),
                              key=lambda i: scheduled[i].seq.num_computed_tokens)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillChunk] = []
        sample_rows: list[int] = []
        sample_items: list[int] = []
        for index in prefill_items + decode_items:
            item = scheduled[index]
            seq, n, start = item.seq, item.num_new_tokens, item.seq.num_computed_tokens
            table = seq.block_table
            if n > 1:
                blocks = self._tensor(table[:-(-(start + n) // bs)])
                prefills.append(PrefillChunk(len(ids), n, start + n, blocks))
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if item.samples:
                sample_rows.append(len(ids) - 1)
                sample_items.append(index)
        first_decode = len(ids) - len(decode_items)
        decodes = [scheduled[i].seq for i in decode_items]
        # A fused kernel reads each sequence's blocks in place: padding costs it nothing, so one group.
        bounds = ([(0, len(decodes))] if decodes else []) if self._fused_decode else \
            decode_group_bounds([s.num_computed_tokens + 1 for s in decodes], bs)
        groups = [self._decode_group(first_decode + lo, decodes[lo:hi]) for lo, hi in bounds]
        context = AttentionContext(slot_mapping=self._tensor(slots), prefills=prefills, decodes=groups)
        return PreparedBatch(self._tensor(ids), self._tensor(positions), context, sample_rows, sample_items)

    def _prepare_decodes(self, scheduled: list[ScheduledSeq]) -> PreparedBatch:
        """:meth:`prepare` for a step of one token a sequence through a fused kernel (most steps): the same
        layout, its five index tensors cut from one tensor built from one list."""
        bs = self.layout.block_size
        order = sorted(range(len(scheduled)), key=lambda i: scheduled[i].seq.num_computed_tokens)
        seqs = [scheduled[i].seq for i in order]
        n = len(seqs)
        positions = [s.num_computed_tokens for s in seqs]
        width = -(-(positions[-1] + 1) // bs)  # the longest context's blocks (ascending order)
        flat = [s.token_ids[p] for s, p in zip(seqs, positions)]
        flat += positions
        flat += [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)]  # slots
        flat += [p + 1 for p in positions]  # context lengths
        for s in seqs:
            table = s.block_table[:width]
            flat += table
            flat += [0] * (width - len(table))
        values = self._tensor(flat)
        group = decode_group(0, values[4 * n:].view(n, width), values[3 * n:4 * n], block_size=bs,
                             dtype=self.dtype, masked=False)
        context = AttentionContext(slot_mapping=values[2 * n:3 * n], prefills=[], decodes=[group])
        samples = [row for row, i in enumerate(order) if scheduled[i].samples]
        return PreparedBatch(values[:n], values[n:2 * n], context, samples, [order[row] for row in samples])

    def _decode_group(self, start: int, seqs: list[Sequence]) -> DecodeGroup:
        bs = self.layout.block_size
        lens = [s.num_computed_tokens + 1 for s in seqs]
        width = -(-max(lens) // bs)
        flat = [block for s in seqs for block in s.block_table + [0] * (width - len(s.block_table))]
        tables = self._tensor(flat).view(len(seqs), width)
        return decode_group(start, tables, self._tensor(lens), block_size=bs, dtype=self.dtype,
                            masked=not self._fused_decode)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        """int64 on the device. Through an array's buffer: a quarter of ``torch.tensor``'s time on a list
        (a step's few hundred indices: 40 -> 11 us)."""
        if not values:
            return torch.empty(0, dtype=torch.long, device=self.device)
        host = torch.frombuffer(array.array("q", values), dtype=torch.long)  # keeps the array alive
        return host if self.device.type == "cpu" else host.to(self.device)
