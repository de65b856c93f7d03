"""Linear layers whose weights are laid out once, at load, in oneDNN's blocked format (CPU).

torch's CPU linear hands the weight to the GEMM as it is stored, and the GEMM packs it into its blocked
layout on every call. At the engine's shapes (a decode batch of tens of rows against weights of a few
hundred columns) that packing costs as much as the product itself: measured on the development machine,
2 threads, float32, 32 rows: 256 -> 1,536 in 199 us through ``F.linear`` against 90 us with the weight
packed once, 768 -> 256 in 84 against 41 us. oneDNN's linear (the one torch's own compiler calls for CPU
inference) takes the packed weight; vLLM's CPU backend packs its weights the same way.

A model module that reads a linear layer's ``weight`` itself (multi-head latent attention absorbs
``kv_b_proj`` into its decode query) names that layer in ``unpacked_linears``; it is left as it is.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# The batch the packed layout is chosen for. Measured at 1, 2, 4 and 32 rows against hints of 1 and 256
# (256 -> 1,536 and 256 -> 384 columns, float32, 2 threads): 32 was as fast as either or faster.
BATCH_HINT = 32
_PACKABLE = (torch.float32, torch.bfloat16)


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
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}"


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


def pack_linears(model: nn.Module, *, device: torch.device, dtype: torch.dtype) -> int:
    """Replace the model's linear layers by :class:`PackedLinear` where the machine allows; returns how many.

    Layers whose parent lists them in ``unpacked_linears`` stay as they are (their weight is read directly).
    """
    reason = unavailable_reason(device, dtype)
    if reason is not None:
        logger.info("linear weights not packed: %s", reason)
        return 0
    packed = 0
    for parent in list(model.modules()):
        keep = getattr(parent, "unpacked_linears", ())
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and name not in keep and child.weight.dtype == dtype:
                setattr(parent, name, PackedLinear(child))
                packed += 1
    logger.info("packed the weights of %d linear layers for oneDNN", packed)
    return packed
