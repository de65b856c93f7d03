"""The C++ paged decode kernel (inference/cpu_attention.py) against attention written out per sequence.

The kernel reads keys and values in place from scattered cache blocks; the reference gathers each
sequence's tokens by hand and applies softmax attention in float64. Engine-level agreement with
transformers (preemption, prefix hits) is in test_engine_equivalence.py. ``make test`` installs the
compiler and ninja the build needs (Debian's g++ and ninja-build); without them the kernel reports why it
is unavailable and these tests fail with that reason.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inference.attention import AttentionContext, DecodeKernel, attention_context, decode_group
from inference.config import EngineConfig
from inference.cpu_attention import (
    EXTENSION_NAME,
    SOURCE,
    CpuDecodeKernel,
    build_folder,
    build_signature,
    load_cpu_decode_kernel,
)
from inference.engine import LLMEngine
from inference.kv_quant import KVCacheStore
from inference.models.llama import LlamaDecoderLayer, RMSNorm
from inference.packed_linear import BlockedLinear, PackedLinear, pack_linears, row_bucket, unavailable_reason
from inference.sampling_params import SamplingParams

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def kernel() -> DecodeKernel:
    built, why = load_cpu_decode_kernel()
    assert built is not None, f"CPU decode kernel unavailable: {why}"
    return built


def paged_case(*, heads: int, kv_heads: int, dim: int, lengths: list[int], dtype: torch.dtype,
               seed: int) -> tuple[torch.Tensor, KVCacheStore, torch.Tensor, torch.Tensor]:
    """A query per sequence and a cache whose blocks are handed out in random order (as after churn);
    block tables padded with block 0, as the model runner pads them."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    needed = [-(-n // BLOCK_SIZE) for n in lengths]
    blocks = list(range(1, sum(needed) + 8))
    rng.shuffle(blocks)
    cache = KVCacheStore(len(blocks) + 1, BLOCK_SIZE, kv_heads, dim, dtype=dtype, device=torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    width = max(needed)
    tables = []
    for n in needed:
        tables.append(blocks[:n] + [0] * (width - n))
        blocks = blocks[n:]
    query = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
    return query, cache, torch.tensor(tables, dtype=torch.long), torch.tensor(lengths, dtype=torch.long)


def reference(query: torch.Tensor, cache: KVCacheStore, tables: torch.Tensor, lengths: torch.Tensor,
              scale: float) -> torch.Tensor:
    heads, kv_heads = query.shape[1], cache.k.shape[2]
    out = torch.empty(query.shape, dtype=torch.float64)
    for b, n in enumerate(lengths.tolist()):
        slots = [(int(tables[b, t // BLOCK_SIZE]), t % BLOCK_SIZE) for t in range(n)]
        keys = torch.stack([cache.k[blk, off] for blk, off in slots]).double()  # [n, KV, D]
        values = torch.stack([cache.v[blk, off] for blk, off in slots]).double()
        for h in range(heads):
            kv = h // (heads // kv_heads)
            weights = torch.softmax(keys[:, kv] @ query[b, h].double() * scale, dim=0)
            out[b, h] = weights @ values[:, kv]
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 1, 64), (16, 2, 128), (8, 2, 32), (4, 4, 16)])
def test_float32_matches_attention_written_out(kernel: DecodeKernel, heads: int, kv_heads: int,
                                               dim: int) -> None:
    # compiled sizes (G = 4 and 8 with D = 64 and 128: the AVX-512 loops where the CPU has them) and
    # run-time ones (the portable loops); lengths across block boundaries and the softmax's 16-score
    # vectors, one token, and one much longer than the rest (padding for the others)
    lengths = [1, 15, 16, 17, 40, 333, 64]
    query, cache, tables, lens = paged_case(heads=heads, kv_heads=kv_heads, dim=dim, lengths=lengths,
                                            dtype=torch.float32, seed=heads + dim)
    scale = 1 / math.sqrt(dim)
    out = kernel(query, cache, tables, lens, scale)
    assert out.shape == query.shape and out.dtype == torch.float32
    expected = reference(query, cache, tables, lens, scale)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)


def test_bfloat16_matches_within_its_rounding(kernel: DecodeKernel) -> None:
    query, cache, tables, lens = paged_case(heads=4, kv_heads=1, dim=64, lengths=[5, 100, 257],
                                            dtype=torch.bfloat16, seed=7)
    out = kernel(query, cache, tables, lens, 0.125)
    assert out.dtype == torch.bfloat16
    # bfloat16 keeps 8 significant bits: the output's own rounding is up to 2^-8 of its size
    expected = reference(query, cache, tables, lens, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)


def test_padding_blocks_are_never_read(kernel: DecodeKernel) -> None:
    """Whatever block 0 (the runner's padding) holds, a sequence's output depends on its own tokens only."""
    query, cache, tables, lens = paged_case(heads=4, kv_heads=1, dim=64, lengths=[3, 200],
                                            dtype=torch.float32, seed=3)
    before = kernel(query, cache, tables, lens, 0.125)
    cache.k[0].fill_(1e4)
    cache.v[0].fill_(float("nan"))
    torch.testing.assert_close(kernel(query, cache, tables, lens, 0.125), before, atol=0, rtol=0)


def test_bad_input_is_refused_with_a_message(kernel: DecodeKernel) -> None:
    query, cache, tables, lens = paged_case(heads=4, kv_heads=1, dim=64, lengths=[3], dtype=torch.float32,
                                            seed=0)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel(query.double(), cache, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="one block table row and one length per sequence"):
        kernel(query, cache, tables, torch.tensor([3, 4]), 0.125)


TORCH_PATH = EngineConfig(device="cpu", num_kv_blocks=64, cpu_decode_kernel=False)


def test_each_checkout_and_environment_has_a_build_of_its_own(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The build's name in torch's extension cache: one per source file, text and environment, so that two
    checkouts (or venvs) on a machine do not rebuild each other's kernel at every replica start."""
    text = "// the kernel\n"
    here, there = tmp_path / "a" / "paged_decode.cpp", tmp_path / "b" / "paged_decode.cpp"
    for source in (here, there):
        source.parent.mkdir()
        source.write_text(text)
    mine = build_signature(here)
    assert build_signature(here) == mine and len(mine) == 10  # stable: a second start loads the same build
    assert build_signature(there) != mine  # another checkout, the same text
    here.write_text(text + "// changed\n")
    assert build_signature(here) != mine  # another version of the kernel
    here.write_text(text)
    monkeypatch.setattr(sys, "prefix", "/srv/another-venv")
    assert build_signature(here) != mine  # another environment (torch's headers, its ABI)


def test_a_build_lock_left_by_a_killed_builder_is_not_waited_on(kernel: DecodeKernel, tmp_path: Path) -> None:
    """torch's builder marks a build in progress with a ``lock`` file and waits, polling, for as long as
    one exists; a builder killed midway (Ctrl-C at the first ``controlplane up``) leaves it, and before
    ``builder_turn`` every later start waited forever. Here: this machine's build, copied into a fresh
    extensions folder with such a file beside it, loads in seconds and the file is gone."""
    with resources.as_file(resources.files("inference") / "kernels" / SOURCE) as source:
        name = f"{EXTENSION_NAME}_{build_signature(source)}"
    built = build_folder(name)
    assert (built / f"{name}.so").exists(), f"no build in {built}"  # the kernel fixture made sure of it
    copy = tmp_path / "extensions" / name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "builder.lock"))
    (copy / "lock").touch()  # what a killed builder leaves
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    done = subprocess.run([sys.executable, "-m", "inference", "kernel"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "CPU decode kernel: on" in done.stdout, done.stdout + done.stderr
    assert not (copy / "lock").exists()
    assert "left by a build that did not finish" in done.stderr


def test_asked_for_where_it_cannot_serve_the_engine_says_why_and_runs_torch(tiny_llama_dir: Path) -> None:
    config = EngineConfig(device="cpu", dtype="float32", cpu_decode_kernel=True, kv_cache_dtype="int8",
                          num_kv_blocks=64)
    engine = LLMEngine(str(tiny_llama_dir), config)
    assert engine.cpu_decode_kernel == "unavailable: the INT8 KV cache"
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    outputs = [out for _ in range(20) if engine.has_unfinished_requests() for out in engine.step()]
    assert outputs[-1].finished and len(outputs[-1].output_token_ids) == 4
    off = LLMEngine(str(tiny_llama_dir), TORCH_PATH)
    assert off.cpu_decode_kernel is None and off.runner.fused_layers == 0


def test_by_default_a_cpu_engine_runs_the_kernel_where_it_applies(tiny_llama_dir: Path) -> None:
    """The default (None) takes the kernel on a CPU with a float32 or bfloat16 cache, and says why not
    with an INT8 cache (quietly: nobody asked for it)."""
    built, why = load_cpu_decode_kernel()
    assert built is not None, f"the kernel did not build on this machine: {why}"
    engine = LLMEngine(str(tiny_llama_dir), EngineConfig(device="cpu", num_kv_blocks=64))
    assert engine.cpu_decode_kernel == "on" and engine.runner.fused_layers == len(engine.model.layers)
    int8 = LLMEngine(str(tiny_llama_dir), EngineConfig(device="cpu", num_kv_blocks=64, kv_cache_dtype="int8"))
    assert int8.cpu_decode_kernel == "unavailable: the INT8 KV cache" and int8.runner.fused_layers == 0


@pytest.mark.parametrize("linears", ["plain", "onednn", "blocked"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decoder_layer_in_one_call_matches_the_layer_in_python(tiny_llama_dir: Path, dtype: str,
                                                                 linears: str) -> None:
    """A pure decode step through ``llama_decode_layer`` gives the Python layer's output and writes its
    cache, within the dtype's rounding: with plain linear weights; packed for oneDNN, whose linears run at
    a row bucket (9 sequences: 10 rows, one of padding); in the kernel's own blocks (the engine's default
    where the CPU runs them)."""
    engine = LLMEngine(str(tiny_llama_dir), EngineConfig(device="cpu", dtype=dtype, cpu_decode_kernel=True,
                                                         num_kv_blocks=64, pack_linear_weights=False))
    ops = engine.runner.model.fuse_decode_layers  # bound again below, once the linears are packed
    kernel, _ = load_cpu_decode_kernel()
    assert isinstance(kernel, CpuDecodeKernel)
    if linears != "plain":
        blocked = kernel.blocked_ops if linears == "blocked" else None
        if linears == "blocked" and (blocked is None or engine.dtype not in blocked.dtypes):
            pytest.skip(f"unavailable: this CPU's build of the kernel runs no blocked {dtype} linear")
        if linears == "onednn" and unavailable_reason(torch.device("cpu"), engine.dtype) is not None:
            pytest.skip(f"unavailable: {unavailable_reason(torch.device('cpu'), engine.dtype)}")
        assert pack_linears(engine.model, device=torch.device("cpu"), dtype=engine.dtype, blocked=blocked) > 0
        kind = BlockedLinear if linears == "blocked" else PackedLinear
        assert all(isinstance(m.mlp.down_proj, kind) for m in engine.model.layers)
        assert ops(kernel.layer_ops) == len(engine.model.layers)
    assert engine.runner.fused_layers == len(engine.model.layers) > 0
    layer = engine.model.layers[0]
    attn = layer.self_attn.attn
    cache = attn.cache
    assert isinstance(layer, LlamaDecoderLayer) and cache is not None and layer.fused_decode is not None
    gen = torch.Generator().manual_seed(3)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    lengths = [1, 17, 40, 33, 5, 12, 2, 29, 8]
    assert row_bucket(len(lengths)) > len(lengths)
    order = random.Random(3).sample(range(1, 64), sum(-(-n // BLOCK_SIZE) for n in lengths))
    width = max(-(-n // BLOCK_SIZE) for n in lengths)
    tables, slots = [], []
    for n in lengths:
        own, order = order[:-(-n // BLOCK_SIZE)], order[-(-n // BLOCK_SIZE):]
        tables.append(own + [0] * (width - len(own)))
        slots.append(own[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE)
    group = decode_group(0, torch.tensor(tables), torch.tensor(lengths), block_size=BLOCK_SIZE,
                         dtype=engine.dtype)
    ctx = AttentionContext(slot_mapping=torch.tensor(slots), prefills=[], decodes=[group])
    hidden = torch.randn(len(lengths), engine.model.config.hidden_size, generator=gen).to(engine.dtype)
    cos, sin = engine.model.rotary(torch.tensor(lengths) - 1, engine.dtype)
    before = cache.k.clone(), cache.v.clone()
    with torch.inference_mode(), attention_context(ctx):
        fused = layer(hidden, cos, sin)
        fused_cache = cache.k.clone(), cache.v.clone()
        cache.k.copy_(before[0])
        cache.v.copy_(before[1])
        layer.fused_decode = None
        layer.input_layernorm.fused = layer.post_attention_layernorm.fused = None
        layer.mlp.silu_mul = None
        python = layer(hidden, cos, sin)
    # float32: rounding (the norms' sums in another order); bfloat16: a rounding or two of its 8 bits, at
    # the scale of the tensor (the residual stream's values reach 15, where one rounding is 0.0625)
    tolerance = 1e-5 if dtype == "float32" else 1.6e-2
    for ours, theirs in ((fused, python), (fused_cache[0], cache.k), (fused_cache[1], cache.v)):
        scale = theirs.float().abs().max().item()
        torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance * scale)
    assert not torch.equal(fused_cache[0], before[0])  # the step's keys were written


@pytest.mark.parametrize(("rows", "width"), [(1024, 256), (31, 256), (7, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_activation_compute_what_the_python_layer_does(kernel: DecodeKernel, rows: int, width: int,
                                                                  dtype: torch.dtype) -> None:
    """``rms_norm`` and ``silu_mul`` (the norms and MLP activation of steps that also prefill) against the
    Python layer's own formulas: the same bits in bfloat16 with AVX-512 (both round each operator's result
    to it), float32 within its rounding. 1,024 rows are shared among threads; 100 columns take the loops'
    scalar tail."""
    assert isinstance(kernel, CpuDecodeKernel)
    ops = kernel._module  # the calls themselves, whether or not the engine takes them on this CPU
    gen = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    norm = RMSNorm(width, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=gen))
    norm = norm.to(dtype)
    gate_up = (torch.randn(rows, 6 * width, generator=gen) * 4).to(dtype)
    with torch.inference_mode():
        expected_norm = norm(x)
        gate, up = gate_up.chunk(2, dim=-1)
        expected_act = F.silu(gate) * up
        got_norm, got_act = ops.rms_norm(x, norm.weight, norm.eps), ops.silu_mul(gate_up)
    assert got_norm.dtype == got_act.dtype == dtype and got_act.shape == (rows, 3 * width)
    if dtype == torch.bfloat16 and kernel.vectorized:
        assert torch.equal(got_norm, expected_norm) and torch.equal(got_act, expected_act)
    elif dtype == torch.bfloat16:  # the portable loops (no AVX-512): another exp, another sum order
        torch.testing.assert_close(got_norm, expected_norm, rtol=8e-3, atol=1e-2)
        torch.testing.assert_close(got_act, expected_act, rtol=8e-3, atol=1e-2)
    else:
        torch.testing.assert_close(got_norm, expected_norm, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(got_act, expected_act, rtol=1e-6, atol=1e-6)


def test_norm_and_activation_refuse_what_they_cannot_compute(kernel: DecodeKernel) -> None:
    assert isinstance(kernel, CpuDecodeKernel)
    ops = kernel._module
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        ops.silu_mul(torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="even size"):
        ops.silu_mul(torch.ones(2, 5))
    with pytest.raises(RuntimeError, match="one weight per column"):
        ops.rms_norm(torch.ones(2, 4), torch.ones(3), 1e-6)


def test_the_engine_runs_every_step_s_norms_and_activation_in_the_kernel(tiny_llama_dir: Path) -> None:
    config = EngineConfig(device="cpu", cpu_decode_kernel=True, num_kv_blocks=64)
    engine = LLMEngine(str(tiny_llama_dir), config)
    layers = engine.model.layers
    assert engine.runner.fused_layers == len(layers) > 0
    built, _ = load_cpu_decode_kernel()
    assert isinstance(built, CpuDecodeKernel)
    # with AVX-512 the kernel's norm and activation; without, ATen's (faster than portable loops)
    taken = built.vectorized
    assert all(isinstance(m, LlamaDecoderLayer) and (m.input_layernorm.fused is not None) == taken
               and (m.post_attention_layernorm.fused is not None) == taken
               and (m.mlp.silu_mul is not None) == taken for m in layers)
    assert (engine.model.norm.fused is not None) == taken
    plain = LLMEngine(str(tiny_llama_dir), TORCH_PATH)
    assert plain.model.norm.fused is None


def test_layers_the_call_cannot_run_stay_in_python(tiny_llama_dir: Path) -> None:
    config = EngineConfig(device="cpu", cpu_decode_kernel=True, num_kv_blocks=64, pack_linear_weights=True)
    packed = LLMEngine(str(tiny_llama_dir), config)
    assert packed.cpu_decode_kernel == "on" and packed.runner.fused_layers == len(packed.model.layers)
    layer = packed.model.layers[0]
    assert isinstance(layer, LlamaDecoderLayer)
    layer.mlp.down_proj = nn.Linear(layer.mlp.down_proj.in_features, layer.mlp.down_proj.out_features,
                                    bias=False)
    assert not layer.fusable()  # one plain linear among packed ones
    plain = LLMEngine(str(tiny_llama_dir), TORCH_PATH)
    assert plain.runner.fused_layers == 0
