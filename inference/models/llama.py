"""The Llama family's forward pass (Llama, Qwen2, Mistral) over a flat batch of tokens.

``loader`` builds :class:`LlamaForCausalLM` from a :class:`ModelConfig` and fills its weights; the model
runner calls ``forward(input_ids, positions)`` on the step's tokens laid out flat (no batch dimension),
then ``compute_logits`` on the rows it samples from. Attention goes through
:class:`inference.attention.Attention`, which reads the step's paged-cache layout from the attention
context; without one, each layer attends causally over the whole input as one sequence.

The numerics follow Hugging Face transformers (RMSNorm in float32, ``rotate_half`` RoPE computed in
float32), but q/k/v and gate/up are fused into one matrix each for fewer, larger matmuls on CPU. With the
CPU decode kernel (``inference.cpu_attention``), a step that only decodes runs each decoder layer as one
C++ call computing the same layer (:meth:`CausalLM.fuse_decode_layers`; within the dtype's rounding).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inference import step_profile
from inference.attention import Attention, AttentionContext, get_context
from inference.kv_quant import KVCacheStore
from inference.models.config import ModelConfig
from inference.models.rope import RotaryEmbedding, apply_rotary
from inference.packed_linear import BlockedLinear, PackedLinear, row_bucket

# A decoder layer's decode step in one call (the CPU decode kernel's ``llama_decode_layer``): the layer's
# input, cos, sin, then its weights and the attention's cache and tables, as LlamaDecoderLayer passes them.
DecodeLayerFn = Callable[..., torch.Tensor]
RmsNormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x, weight, eps) -> RMSNorm(x)
SiluMulFn = Callable[[torch.Tensor], torch.Tensor]  # gate_up -> silu(gate) * up


@dataclass(frozen=True, slots=True)
class FusedOps:
    """The CPU kernel's calls for Llama layers (``inference.cpu_attention``): a pure decode step's whole
    layer (the Python layer's output within the dtype's rounding), and the RMSNorm and SiLU-and-multiply
    of every other step, prefill chunks included (bit for bit in bfloat16, within rounding in float32)."""

    decode_layer: DecodeLayerFn
    rms_norm: RmsNormFn | None  # None: the Python layer's (where the kernel's loops would be slower)
    silu_mul: SiluMulFn | None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused: RmsNormFn | None = None  # set by CausalLM.fuse_decode_layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and x.dtype == self.weight.dtype:
            return self.fused(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # Queries and keys rotated together: one pass of the rotary's elementwise kernels, not two.
        qk = apply_rotary(qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = torch.split(qk, [self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        o = self.attn(q, k, v)
        out: torch.Tensor = self.o_proj(o.reshape(num_tokens, self.q_size))
        return out


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.silu_mul: SiluMulFn | None = None  # set by CausalLM.fuse_decode_layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.silu_mul is not None:
            act = self.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        out: torch.Tensor = self.down_proj(act)
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size)
        self.fused_decode: DecodeLayerFn | None = None  # set by fuse_decode_layers
        # the fused call's arguments that stay the same from step to step (weights, cache, sizes), looked up
        # once instead of through the modules' attributes at every step (21 -> 6 us a layer under cProfile)
        self._fused_weights: tuple[object, ...] = ()
        self._fused_sizes: tuple[object, ...] = ()
        self._fused_rows: Callable[[int], int] = int  # the linears' row count for a step's tokens

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.fused_decode is not None and (ctx := get_context()) is not None and _decode_only(ctx, x):
            return self._fused(self.fused_decode, ctx, x, cos, sin)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out

    def fusable(self) -> bool:
        """Whether :meth:`_fused` can run this layer: linear layers all plain, all packed for oneDNN or all
        in the kernel's blocks, a float cache (not INT8) that the kernel reads, and one dtype for the norms,
        the projections and the cache."""
        attn = self.self_attn.attn
        linears = (self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)
        kinds = {type(m) for m in linears}
        if not (kinds in ({nn.Linear}, {PackedLinear}, {BlockedLinear}) and type(attn.cache) is KVCacheStore
                and self.mlp.gate_up_proj.bias is None and self.mlp.down_proj.bias is None):
            return False
        dtypes = {self.input_layernorm.weight.dtype, self.post_attention_layernorm.weight.dtype,
                  attn.cache.k.dtype, *(m.weight.dtype for m in linears)}
        return len(dtypes) == 1

    def _fused(self, fn: DecodeLayerFn, ctx: AttentionContext, x: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        group = ctx.decodes[0]
        if not self._fused_weights:
            self._bind_fused()
        step_profile.lap(step_profile.MODEL_REST)
        out = fn(x, cos, sin, *self._fused_weights, ctx.slot_mapping, group.block_tables, group.context_lens,
                 *self._fused_sizes, self._fused_rows(x.shape[0]))
        step_profile.lap(step_profile.DECODE_LAYERS)
        return out

    def _bind_fused(self) -> None:
        a, attn = self.self_attn, self.self_attn.attn
        assert attn.cache is not None
        self._fused_weights = (
            self.input_layernorm.weight, self.input_layernorm.eps, a.qkv_proj.weight, a.qkv_proj.bias,
            a.o_proj.weight, a.o_proj.bias, self.post_attention_layernorm.weight,
            self.post_attention_layernorm.eps, self.mlp.gate_up_proj.weight, self.mlp.down_proj.weight,
            attn.cache.k, attn.cache.v)
        self._fused_sizes = (attn.scale, attn.num_heads, attn.num_kv_heads, attn.head_dim)
        # packed linears run at their row buckets, whose oneDNN primitives the engine built at load
        self._fused_rows = row_bucket if isinstance(a.qkv_proj, PackedLinear) else int


def _decode_only(ctx: AttentionContext, x: torch.Tensor) -> bool:
    """The step only decodes, all its tokens in one decode group (the runner's layout with the kernel)."""
    return not ctx.prefills and len(ctx.decodes) == 1 and ctx.decodes[0].start == 0 and \
        ctx.decodes[0].end == x.shape[0]


class CausalLM(nn.Module):
    """Embedding, a stack of decoder layers, final norm and LM head; the families differ in their layers."""

    def __init__(self, config: ModelConfig, layers: list[nn.Module], *, max_positions: int | None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.rotary = RotaryEmbedding(config, max_positions or config.max_position_embeddings)

    def materialize(self, device: torch.device) -> None:
        """Compute the tensors no checkpoint holds (after building on ``meta`` and loading the weights)."""
        self.rotary.reset_cache(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: int64 [T] -> final-normed hidden states [T, hidden_size]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        out: torch.Tensor = self.norm(x)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]."""
        logits = F.linear(hidden, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)
        return logits.float()

    def fuse_decode_layers(self, ops: FusedOps) -> int:
        """Run the decoder layers that allow it (:meth:`LlamaDecoderLayer.fusable`) through
        ``ops.decode_layer`` on steps that only decode, and their norms and MLP activation through ``ops``
        on every other step (the final norm too, in the layers' dtype); how many layers do (0 in a family
        without Llama layers)."""
        layers = [m for m in self.layers if isinstance(m, LlamaDecoderLayer) and m.fusable()]
        for layer in layers:
            layer.fused_decode = ops.decode_layer
            layer._fused_weights = ()  # bound again at the next fused step
            layer.input_layernorm.fused = layer.post_attention_layernorm.fused = ops.rms_norm
            layer.mlp.silu_mul = ops.silu_mul
        if layers:
            self.norm.fused = ops.rms_norm  # None leaves the Python norm
        return len(layers)

    def expert_tokens(self) -> list[list[int]]:
        """Tokens routed to each expert so far, per mixture-of-experts layer ([] for a dense model)."""
        return []


class LlamaForCausalLM(CausalLM):
    """Llama, Qwen2, Mistral. ``max_positions`` caps the RoPE table (default: the config's)."""

    def __init__(self, config: ModelConfig, *, max_positions: int | None = None) -> None:
        super().__init__(config, [LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)],
                         max_positions=max_positions)

    @property
    def attention_layers(self) -> list[Attention]:
        """The layers' attention modules in order, for the runner to bind their KV caches."""
        return [module for module in self.modules() if isinstance(module, Attention)]
