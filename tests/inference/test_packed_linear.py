"""Linear weights packed once for oneDNN, or in the CPU kernel's blocks: the same products as torch's
linear at every batch size, which layers are packed and which are left alone, where packing is refused
with its reason, and a replica's memory that stops growing however many batch sizes it meets.

The engine's greedy equivalence with transformers runs here with packing on, for every model family.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inference.config import EngineConfig
from inference.cpu_attention import CpuDecodeKernel, load_cpu_decode_kernel
from inference.engine import LLM, LLMEngine
from inference.mla import LatentAttention
from inference.models.loader import load_model
from inference.packed_linear import (
    BlockedLinear,
    BlockedOps,
    PackedLinear,
    pack_linears,
    row_bucket,
    row_buckets,
    unavailable_reason,
)
from inference.sampling_params import SamplingParams

CPU = torch.device("cpu")


def _require_onednn(dtype: torch.dtype) -> None:
    """float32 packing must be there (every CPU build of torch the project installs has oneDNN); bfloat16
    needs the CPU's support, and without it the engine uses torch's linear."""
    reason = unavailable_reason(CPU, dtype)
    if dtype == torch.float32:
        assert reason is None, reason
    elif reason is not None:
        pytest.skip(f"unavailable: {reason}")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 32, 257, 1024])
def test_a_packed_linear_computes_what_torch_linear_computes(rows: int, bias: bool) -> None:
    _require_onednn(torch.float32)
    torch.manual_seed(rows)
    linear = nn.Linear(256, 384, bias=bias).requires_grad_(False)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        expected, actual = F.linear(x, linear.weight, linear.bias), packed(x)
    assert actual.shape == (rows, 384)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-4)


def test_any_leading_shape_comes_back_as_it_went_in() -> None:
    _require_onednn(torch.float32)
    linear = nn.Linear(64, 48).requires_grad_(False)
    x = torch.randn(3, 7, 64)  # 21 rows, run at 24
    with torch.inference_mode():
        actual = PackedLinear(linear)(x)
    assert actual.shape == (3, 7, 48)
    torch.testing.assert_close(actual, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-4)


def test_row_buckets_pad_at_most_a_quarter_and_are_few() -> None:
    assert [row_bucket(n) for n in (1, 4, 5, 8, 9, 17, 33, 257, 1000)] == [1, 4, 5, 8, 10, 20, 40, 320, 1024]
    for rows in range(1, 5000):
        assert rows <= row_bucket(rows) <= rows * 1.25 + 1
        assert row_bucket(row_bucket(rows)) == row_bucket(rows)
    assert row_buckets(1024) == sorted({row_bucket(n) for n in range(1, 1025)})
    assert len(row_buckets(1024)) == 36


def test_memory_stops_growing_after_every_row_bucket_was_met(tmp_path: Path) -> None:
    """Every row count from 1 to 600, twice, in a process of its own (RSS is per process). oneDNN keeps a
    primitive and its memory per input shape: one per row count measured 1,092 MiB here, one per bucket
    (33 of them) 36 MiB; the second pass adds nothing."""
    _require_onednn(torch.float32)
    script = textwrap.dedent("""
        import torch
        from torch import nn
        from inference.packed_linear import PackedLinear
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096 / 2**20
        torch.set_num_threads(1)
        layer = PackedLinear(nn.Linear(256, 1536, bias=False).requires_grad_(False))
        x = torch.zeros(600, 256)
        with torch.inference_mode():
            layer(x)
            start = rss()
            for _ in range(2):
                for rows in range(1, 601):
                    layer(x[:rows])
                print(round(rss() - start, 1))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[2], check=True)
    first, second = (float(line) for line in run.stdout.split())
    assert first < 60, f"RSS grew {first} MiB over 600 row counts"
    assert second - first < 10, f"a second pass over the same row counts grew RSS by {second - first} MiB"


def test_bfloat16_weights_pack_too() -> None:
    _require_onednn(torch.bfloat16)
    linear = nn.Linear(128, 96, bias=False).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(16, 128, dtype=torch.bfloat16)
    with torch.inference_mode():
        actual = PackedLinear(linear)(x)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual, F.linear(x, linear.weight), rtol=2e-2, atol=2e-2)


def test_every_llama_linear_is_packed_and_counted_as_a_parameter(tiny_llama_dir: Path) -> None:
    _require_onednn(torch.float32)
    model, _ = load_model(tiny_llama_dir, device=CPU, dtype=torch.float32)
    before = sum(p.numel() for p in model.parameters())
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert pack_linears(model, device=CPU, dtype=torch.float32) == linears > 0
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(p.numel() for p in model.parameters()) == before  # the roofline reads these


def test_latent_attentions_absorbed_projection_stays_plain(tiny_deepseek_v3_dir: Path) -> None:
    _require_onednn(torch.float32)
    model, _ = load_model(tiny_deepseek_v3_dir, device=CPU, dtype=torch.float32)
    assert pack_linears(model, device=CPU, dtype=torch.float32) > 0
    latent = [m for m in model.modules() if isinstance(m, LatentAttention)]
    assert latent and all(type(m.kv_b_proj) is nn.Linear for m in latent)


def test_a_cpu_engine_packs_by_default_and_builds_every_step_s_row_count_at_load(
        tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """For oneDNN where the CPU kernel is off (with it, below, the kernel's blocks)."""
    _require_onednn(torch.float32)
    with caplog.at_level("INFO", logger="inference.packed_linear"):
        packed = LLMEngine(str(tiny_llama_dir), EngineConfig(
            num_kv_blocks=64, max_num_seqs=24, max_num_batched_tokens=200, cpu_decode_kernel=False))
    plain = LLMEngine(str(tiny_llama_dir), EngineConfig(num_kv_blocks=64, pack_linear_weights=False))
    assert packed.packed_weights == "on" and plain.packed_weights is None
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    # Every row count a step runs its linears at (one per sequence decoding, up to max_num_seqs; one per
    # token of a step, up to max_num_batched_tokens) has its primitive at load: RSS is flat from ready on.
    shapes = {(m.in_features, m.out_features) for m in packed.model.modules() if isinstance(m, PackedLinear)}
    built = [r.getMessage() for r in caplog.records if r.getMessage().startswith("built oneDNN primitives")]
    assert len(built) == 1, caplog.text
    assert built[0].startswith(f"built oneDNN primitives for {len(shapes)} weight shapes at "
                               f"{len(row_buckets(200))} row counts (1-{row_bucket(200)})"), built


def test_where_packing_cannot_run_the_engine_says_why_and_runs_torch_s_linear(tiny_llama_dir: Path) -> None:
    asked = LLMEngine(str(tiny_llama_dir), EngineConfig(num_kv_blocks=64, dtype="float16",
                                                        pack_linear_weights=True))
    assert asked.packed_weights == "unavailable: oneDNN linear takes float32 or bfloat16, not torch.float16"
    assert not any(isinstance(m, PackedLinear) for m in asked.model.modules())


@pytest.mark.parametrize(("device", "dtype", "why"), [
    (torch.device("meta"), torch.float32, "a CPU path"),
    (CPU, torch.float16, "float32 or bfloat16"),
])
def test_where_packing_does_not_apply_it_says_why_and_packs_nothing(device: torch.device, dtype: torch.dtype,
                                                                    why: str) -> None:
    reason = unavailable_reason(device, dtype)
    assert reason is not None and why in reason
    model = nn.Sequential(nn.Linear(8, 8))
    assert pack_linears(model, device=device, dtype=dtype) == 0
    assert type(model[0]) is nn.Linear


@pytest.mark.parametrize("folder", ["tiny_llama_dir", "tiny_deepseek_v3_dir"])
def test_packed_weights_generate_the_same_greedy_tokens(folder: str, request: pytest.FixtureRequest) -> None:
    _require_onednn(torch.float32)
    path = str(request.getfixturevalue(folder))
    prompts = [[5 + i, 17, 42 + 3 * i, 8, 99 - i] * (2 + i) for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engines = [LLM(path, EngineConfig(num_kv_blocks=64, pack_linear_weights=pack)) for pack in (False, True)]
    outputs = [[o.output_token_ids for o in engine.generate(prompts, params)] for engine in engines]
    assert outputs[0] == outputs[1] and all(len(tokens) == 12 for tokens in outputs[1])


def _blocked_ops(dtype: torch.dtype) -> BlockedOps:
    """The kernel's linear for ``dtype``: float32 on a CPU with AVX-512, bfloat16 with AVX512_BF16 too;
    elsewhere the engine packs for oneDNN (the tests above), and these say so."""
    kernel, why = load_cpu_decode_kernel()
    assert isinstance(kernel, CpuDecodeKernel), f"CPU decode kernel unavailable: {why}"
    ops = kernel.blocked_ops
    if ops is None or dtype not in ops.dtypes:
        pytest.skip(f"unavailable: this CPU's build of the kernel runs no blocked {dtype} linear")
    return ops


@pytest.mark.parametrize(("k", "n"), [(256, 384), (768, 256), (64, 48), (256, 272)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 31, 97, 1030])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_blocked_linear_computes_what_torch_linear_computes(dtype: torch.dtype, rows: int, bias: bool,
                                                              k: int, n: int) -> None:
    """Every tile shape: rows past a multiple of 6, column groups of 1-4 blocks, more rows than one task."""
    ops = _blocked_ops(dtype)
    torch.manual_seed(rows * n)
    linear = nn.Linear(k, n, bias=bias).to(dtype).requires_grad_(False)
    blocked = BlockedLinear(linear, ops)
    x = torch.randn(rows, k, dtype=dtype)
    with torch.inference_mode():
        actual = blocked(x)
    bias_values = None if linear.bias is None else linear.bias.double()
    expected = F.linear(x.double(), linear.weight.double(), bias_values)
    assert actual.shape == (rows, n) and actual.dtype == dtype
    # float32: the sums in another order; bfloat16: the output's own rounding (8 bits) over exact products
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected, rtol=tolerance, atol=tolerance * scale)
    assert blocked.weight.numel() == linear.weight.numel()


def test_a_blocked_linear_keeps_the_leading_shape() -> None:
    ops = _blocked_ops(torch.float32)
    linear = nn.Linear(64, 48).requires_grad_(False)
    x = torch.randn(3, 7, 64)
    with torch.inference_mode():
        actual = BlockedLinear(linear, ops)(x)
    assert actual.shape == (3, 7, 48)
    torch.testing.assert_close(actual, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_layers_the_blocks_do_not_fit_are_packed_for_onednn(tiny_llama_dir: Path) -> None:
    ops = _blocked_ops(torch.float32)
    _require_onednn(torch.float32)
    model, _ = load_model(tiny_llama_dir, device=CPU, dtype=torch.float32)
    layer = model.layers[0]
    layer.mlp.down_proj = nn.Linear(layer.mlp.down_proj.in_features, 40, bias=False)  # 40 columns: no blocks
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert pack_linears(model, device=CPU, dtype=torch.float32, blocked=ops) == linears
    assert type(layer.mlp.down_proj) is PackedLinear and type(layer.mlp.gate_up_proj) is BlockedLinear


def test_a_cpu_engine_with_the_kernel_packs_its_linears_in_blocks(tiny_llama_dir: Path) -> None:
    _blocked_ops(torch.float32)
    engine = LLMEngine(str(tiny_llama_dir), EngineConfig(num_kv_blocks=64))
    assert engine.cpu_decode_kernel == "on" and engine.packed_weights == "on"
    linears = [m for m in engine.model.modules() if isinstance(m, BlockedLinear | PackedLinear | nn.Linear)]
    assert linears and all(isinstance(m, BlockedLinear) for m in linears)
    assert engine.runner.fused_layers == len(engine.model.layers)
    without = LLMEngine(str(tiny_llama_dir), EngineConfig(num_kv_blocks=64, cpu_decode_kernel=False))
    assert any(isinstance(m, PackedLinear) for m in without.model.modules())
    assert not any(isinstance(m, BlockedLinear) for m in without.model.modules())
