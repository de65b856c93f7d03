"""Linear layers whose weights are laid out once, at load, in oneDNN's blocked format (CPU).

torch's CPU linear hands the weight to the GEMM as it is stored, and the GEMM packs it into its blocked
layout on every call. At the engine's shapes (a decode batch of tens of rows against weights of a few
hundred columns) that packing costs as much as the product itself: measured on the development machine,
2 threads, float32, 32 rows: 256 -> 1,536 in 199 us through ``F.linear`` against 90 us with the weight
packed once, 768 -> 256 in 84 against 41 us. oneDNN's linear (the one torch's own compiler calls for CPU
inference) takes the packed weight; vLLM's CPU backend packs its weights the same way.

oneDNN builds (and caches, up to 1,024 entries) one primitive per input shape, each with its own
generated code and scratch memory: measured at about half a MiB per entry here. A continuous-batching
engine runs a linear at every token count from 1 to its batch budget, so a replica's memory grew with every
new count it met (every count from 1 to 1,100 through six weight shapes of this model's size: 1.3 GiB).
A packed linear therefore runs at a bounded set of row counts, :func:`row_bucket` (1, 2, 3, then four per
doubling: at most a quarter of the rows are padding): 36 counts up to 1,024 rows, 89 MiB for the default
model's 4 weight shapes, then no more however long the replica serves. The engine has
:func:`pack_linears` build every count a step can run (up to the larger of its sequence and token
budgets) at load: 0.14 s and 41 MiB for the default model up to 1,024 rows (2026-12-06), so a replica's
memory is flat from the moment it is ready.

The engine packs by default on a CPU (``EngineConfig.pack_linear_weights``): at a decode batch of 31 a
layer's four linears took 278 us packed against 393 us through ``F.linear`` (AMD EPYC, 2 threads), and
the CPU kernel's fused decoder layer (``inference/cpu_attention.py``) calls oneDNN's linear itself.

Where the CPU kernel is on and was built for the dtype (float32 with AVX-512, bfloat16 with AVX512_BF16),
the engine lays the weights out in the kernel's own blocks instead (:class:`BlockedLinear`): oneDNN's
linear spends about 20 us a call before its product (finding its primitive, wrapping its tensors: a
[32, 64] x [64, 64] product took 23-35 us), four calls a layer, and the kernel's loops run these shapes at
the machine's GEMM rate. The same layer's four linears at 32 rows: 115 us against 216 (bfloat16), 229
against 351 (float32), AMD EPYC, 2 threads; no primitive cache, so no row buckets and no memory per row
count. A layer whose shape the blocks do not fit (columns not a multiple of 16) is packed for oneDNN.

A model module that reads a linear layer's ``weight`` itself (multi-head latent attention absorbs
``kv_b_proj`` into its decode query) names that layer in ``unpacked_linears``; it is left as it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

# The batch the packed layout is chosen for. Measured at 1, 2, 4 and 32 rows against hints of 1 and 256
# (256 -> 1,536 and 256 -> 384 columns, float32, 2 threads): 32 was as fast as either or faster.
BATCH_HINT = 32
_PACKABLE = (torch.float32, torch.bfloat16)


def row_bucket(rows: int) -> int:
    """The row count a packed linear runs ``rows`` rows at: ``rows`` up to 4, then the next of four steps
    per doubling (4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ...)."""
    if rows <= 4:
        return rows
    step = 1 << (rows.bit_length() - 3)  # a quarter of the power of two at or below rows
    return -(-rows // step) * step


def row_buckets(max_rows: int) -> list[int]:
    """Every row count :func:`row_bucket` gives for 1 to ``max_rows`` rows, ascending."""
    buckets = [1]
    while buckets[-1] < max_rows:
        buckets.append(row_bucket(buckets[-1] + 1))
    return buckets


class PackedLinear(nn.Module):
    """``y = x W^T + b`` through oneDNN with ``W`` reordered once. Holds no copy of the plain weight.

    The packed weight stays the module's ``weight`` parameter (an opaque oneDNN tensor: its size and bytes
    are the plain weight's), so what counts a model's parameters counts it; it cannot be viewed or sliced.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        padded = row_bucket(rows)
        flat = x.reshape(rows, self.in_features)
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, self.in_features)])
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")
        return out[:rows].view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}"


@dataclass(frozen=True, slots=True)
class BlockedOps:
    """The CPU kernel's own linear (``inference/kernels/paged_decode.cpp``): ``pack`` lays a weight [N, K]
    out in blocks of 16 columns, ``linear(x, packed, bias)`` runs over it; for the dtypes it was built for."""

    pack: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    dtypes: frozenset[torch.dtype]

    def fits(self, linear: nn.Linear) -> bool:
        pairs = 2 if linear.weight.dtype == torch.bfloat16 else 1
        return linear.weight.dtype in self.dtypes and linear.out_features % 16 == 0 and \
            linear.in_features % pairs == 0


class BlockedLinear(nn.Module):
    """``y = x W^T + b`` through the CPU kernel's linear, ``W`` laid out once in its blocks of 16 columns.

    Its weight parameter is the blocked tensor (``[N / 16, K, 16]``, bfloat16 ``[N / 16, K / 2, 32]``: the
    plain weight's values and size), so what counts a model's parameters counts it. No primitive cache: a
    call costs its product at any row count.
    """

    def __init__(self, linear: nn.Linear, ops: BlockedOps) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = nn.Parameter(ops.pack(linear.weight.detach()), requires_grad=False)
        self.bias = linear.bias
        self._linear = ops.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, blocked"


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why weights cannot be packed for ``device`` and ``dtype``; None when they can."""
    if device.type != "cpu":
        return f"packed weights are a CPU path (device {device.type})"
    has_onednn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]  # torch leaves it bare
    if not has_onednn or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN linear"
    if dtype not in _PACKABLE:
        return f"oneDNN linear takes float32 or bfloat16, not {dtype}"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no bfloat16 support in oneDNN"
    return None


def pack_linears(model: nn.Module, *, device: torch.device, dtype: torch.dtype, max_rows: int = 0,
                 blocked: BlockedOps | None = None) -> int:
    """Replace the model's linear layers by packed ones where the machine allows; returns how many.

    With ``blocked`` (the CPU kernel's linear, for this dtype), every layer it fits becomes a
    :class:`BlockedLinear`; the others a :class:`PackedLinear` where oneDNN takes the dtype. Layers whose
    parent lists them in ``unpacked_linears`` stay as they are (their weight is read directly). With
    ``max_rows``, oneDNN's primitives for every row bucket up to it are built now (see the module's
    docstring), once per distinct weight shape.
    """
    blocked = blocked if blocked is not None and device.type == "cpu" and dtype in blocked.dtypes else None
    onednn_reason = unavailable_reason(device, dtype)
    if onednn_reason is not None and blocked is None:
        logger.info("linear weights not packed: %s", onednn_reason)
        return 0
    counts = {"blocked": 0, "onednn": 0}
    for parent in list(model.modules()):
        keep = getattr(parent, "unpacked_linears", ())
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or name in keep or child.weight.dtype != dtype:
                continue
            if blocked is not None and blocked.fits(child):
                setattr(parent, name, BlockedLinear(child, blocked))
                counts["blocked"] += 1
            elif onednn_reason is None:
                setattr(parent, name, PackedLinear(child))
                counts["onednn"] += 1
    logger.info("packed the weights of %d linear layers: %d in the CPU kernel's blocks, %d for oneDNN",
                sum(counts.values()), counts["blocked"], counts["onednn"])
    if counts["onednn"] and max_rows > 0:
        _build_primitives(model, max_rows)
    return sum(counts.values())


def _build_primitives(model: nn.Module, max_rows: int) -> None:
    """Run one layer of each distinct shape at every row bucket up to ``max_rows``: oneDNN caches what it
    builds by shape, so every other layer of that shape finds it there."""
    started = time.perf_counter()
    layers: dict[tuple[int, int, bool, torch.dtype], PackedLinear] = {}
    for module in model.modules():
        if isinstance(module, PackedLinear):
            key = (module.in_features, module.out_features, module.bias is not None, module.weight.dtype)
            layers.setdefault(key, module)
    buckets = row_buckets(max_rows)
    with torch.inference_mode():
        for layer in layers.values():
            x = torch.zeros(buckets[-1], layer.in_features, dtype=layer.weight.dtype)
            for rows in buckets:
                layer(x[:rows])
    logger.info("built oneDNN primitives for %d weight shapes at %d row counts (1-%d) in %.2f s",
                len(layers), len(buckets), buckets[-1], time.perf_counter() - started)
