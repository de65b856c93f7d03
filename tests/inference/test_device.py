"""Device selection (npu > cuda > cpu), the guarded torch-npu import, and the NPU decode-kernel hook."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch

from inference import device as device_mod
from inference.attention import Attention, AttentionContext, DecodeGroup, attention_context, score_bias
from inference.device import (
    BackendProbe,
    CpuDevice,
    CpuUsageMeter,
    DeviceRequest,
    MemoryStats,
    cpu_memory_stats,
    cpu_model_name,
    parse_device,
    plan_device,
    select_device,
)
from inference.kv_quant import Int8KVCacheStore, KVCacheStore
from inference.npu_attention import (
    IncreFlashAttentionKernel,
    PagedAttentionKernel,
    make_npu_decode_kernel,
    reference_decode,
    select_npu_decode_kernel,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None
needs_plain_cpu_machine = pytest.mark.skipif(HAS_CUDA or HAS_TORCH_NPU,
                                             reason="claims about a machine without CUDA and torch_npu")

# ---------------------------------------------------------------------------------------------------------
# parse and plan (pure)


@pytest.mark.parametrize(("text", "expected"), [
    ("auto", DeviceRequest("auto")),
    (" CPU ", DeviceRequest("cpu")),
    ("cuda", DeviceRequest("cuda")),
    ("cuda:1", DeviceRequest("cuda", 1)),
    ("npu", DeviceRequest("npu")),
    ("npu:0", DeviceRequest("npu", 0)),
])
def test_parse_device_accepts_documented_forms(text: str, expected: DeviceRequest) -> None:
    assert parse_device(text) == expected


@pytest.mark.parametrize("text", ["", "gpu", "cuda:", "cuda:x", "npu:-1", "cpu:0", "auto:1", "mps"])
def test_parse_device_rejects_other_strings_with_one_line_message(text: str) -> None:
    with pytest.raises(ValueError, match="invalid device") as info:
        parse_device(text)
    assert "\n" not in str(info.value)


def _probes(npu: BackendProbe | None = None, cuda: BackendProbe | None = None) -> dict[str, BackendProbe]:
    return {"npu": npu or BackendProbe("npu", 0, "torch_npu is not installed"),
            "cuda": cuda or BackendProbe("cuda", 0, "torch.cuda.is_available() is False")}


def test_plan_auto_prefers_npu_over_cuda() -> None:
    plan = plan_device(DeviceRequest("auto"), _probes(BackendProbe("npu", 2), BackendProbe("cuda", 1)))
    assert (plan.kind, plan.index, plan.fallback_reason) == ("npu", 0, None)


def test_plan_auto_takes_cuda_and_says_why_not_npu() -> None:
    plan = plan_device(DeviceRequest("auto"), _probes(cuda=BackendProbe("cuda", 1)))
    assert (plan.kind, plan.index) == ("cuda", 0)
    assert plan.fallback_reason == "npu: torch_npu is not installed"


def test_plan_auto_falls_back_to_cpu_with_every_reason() -> None:
    plan = plan_device(DeviceRequest("auto"), _probes())
    assert plan.kind == "cpu"
    assert plan.fallback_reason == ("npu: torch_npu is not installed; "
                                    "cuda: torch.cuda.is_available() is False")


def test_plan_explicit_unavailable_accelerator_is_a_clear_error() -> None:
    with pytest.raises(ValueError) as info:
        plan_device(DeviceRequest("cuda"), _probes())
    assert str(info.value) == "device 'cuda' requested but torch.cuda.is_available() is False"


def test_plan_explicit_index_past_device_count_is_a_clear_error() -> None:
    with pytest.raises(ValueError) as info:
        plan_device(DeviceRequest("npu", 3), _probes(BackendProbe("npu", 2)))
    assert str(info.value) == "device 'npu:3' requested but torch.npu.device_count() is 2"


def test_plan_explicit_index_is_kept() -> None:
    plan = plan_device(DeviceRequest("cuda", 1), _probes(cuda=BackendProbe("cuda", 2)))
    assert (plan.kind, plan.index, plan.fallback_reason) == ("cuda", 1, None)


# ---------------------------------------------------------------------------------------------------------
# select_device on this machine


@needs_plain_cpu_machine
def test_auto_picks_cpu_here_and_records_why() -> None:
    dev = select_device("auto")
    assert dev.kind == "cpu"
    assert dev.torch_device == torch.device("cpu")
    assert dev.default_dtype() is torch.float32
    assert dev.name
    assert dev.fallback_reason is not None
    assert "npu: torch_npu is not installed" in dev.fallback_reason
    assert "cuda: torch.cuda.is_available() is False" in dev.fallback_reason


def test_explicit_cpu_records_no_fallback_reason() -> None:
    dev = select_device("cpu")
    assert dev.kind == "cpu"
    assert dev.fallback_reason is None
    dev.synchronize()
    dev.empty_cache()


@needs_plain_cpu_machine
def test_requesting_npu_when_absent_is_a_clear_error() -> None:
    with pytest.raises(ValueError) as info:
        select_device("npu")
    assert str(info.value) == "device 'npu' requested but torch_npu is not installed"


@needs_plain_cpu_machine
def test_requesting_cuda_when_absent_is_a_clear_error() -> None:
    with pytest.raises(ValueError) as info:
        select_device("cuda:1")
    assert str(info.value) == "device 'cuda:1' requested but torch.cuda.is_available() is False"


# ---------------------------------------------------------------------------------------------------------
# a broken torch_npu


class _BrokenTorchNpuFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``torch_npu`` look installed while executing it raises ``error``, as a missing CANN would."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        return importlib.machinery.ModuleSpec(name, self) if name == "torch_npu" else None

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return None

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        raise self.error


@pytest.mark.parametrize("error", [
    OSError("libascendcl.so: cannot open shared object file: No such file or directory"),
    ImportError("libhccl.so: cannot open shared object file"),
    RuntimeError("torch_npu 2.1 requires torch 2.1"),
])
def test_broken_torch_npu_falls_back_to_cpu_with_the_reason(monkeypatch: pytest.MonkeyPatch,
                                                            error: Exception) -> None:
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenTorchNpuFinder(error), *sys.meta_path])
    monkeypatch.setitem(device_mod._PROBES, "cuda",
                        lambda: BackendProbe("cuda", 0, "torch.cuda.is_available() is False"))

    dev = select_device("auto")

    assert dev.kind == "cpu"
    assert dev.fallback_reason is not None
    assert f"npu: torch_npu import failed: {type(error).__name__}: {error}" in dev.fallback_reason
    a = torch.arange(6, dtype=torch.float32).view(2, 3)
    assert (a @ a.T).tolist() == [[5.0, 14.0], [14.0, 50.0]]
    with pytest.raises(ValueError, match=r"^device 'npu' requested but torch_npu import failed"):
        select_device("npu")
    assert make_npu_decode_kernel() is None


def _write_broken_torch_npu_package(root: Path) -> None:
    """A torch_npu that fails as one without CANN does, registered for torch's backend autoload like it."""
    pkg = root / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        'raise OSError("libascendcl.so: cannot open shared object file: No such file or directory")\n')
    dist = root / "torch_npu-2.5.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.5.1\n")
    (dist / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")


def _run_python(code: str, fake_root: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    env["PYTHONPATH"] = os.pathsep.join([str(fake_root), str(REPO_ROOT)])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(HAS_CUDA, reason="asserts the cpu fallback")
def test_broken_torch_npu_package_on_path_leaves_import_torch_and_cpu_working(tmp_path: Path) -> None:
    _write_broken_torch_npu_package(tmp_path)
    result = _run_python("""
        from inference.device import select_device
        import torch
        dev = select_device("auto")
        a = torch.ones(2, 3)
        print(dev.kind, (a @ a.T).sum().item())
        print(dev.fallback_reason)
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    first, reason = result.stdout.splitlines()[:2]
    assert first == "cpu 12.0"
    assert "npu: torch_npu import failed: OSError: libascendcl.so" in reason


def test_that_broken_package_does_break_import_torch_when_autoload_is_on(tmp_path: Path) -> None:
    """The control for the test above: without device.py's guard, ``import torch`` itself fails."""
    _write_broken_torch_npu_package(tmp_path)
    result = _run_python("import torch", tmp_path)
    assert result.returncode != 0
    assert "Failed to load the backend extension: torch_npu" in result.stderr


# ---------------------------------------------------------------------------------------------------------
# a simulated NPU


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """torch_npu importable, torch.npu reporting one Ascend device; torch.device('npu:0') made valid.

    Renaming torch's PrivateUse1 backend to 'npu' is what the real torch_npu does at import; torch allows
    it once per process, so it stays for the rest of the session (no other test uses PrivateUse1).
    """
    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    npu = types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 1,
        get_device_name=lambda index: "Ascend910B3",
        memory_allocated=lambda index: 3 << 30,
        memory_reserved=lambda index: 4 << 30,
        max_memory_allocated=lambda index: 5 << 30,
        mem_get_info=lambda index: (60 << 30, 64 << 30),
        synchronize=lambda device: None,
        empty_cache=lambda: None,
    )
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5")
    return npu


def test_simulated_npu_is_picked_as_npu_0(fake_npu: types.SimpleNamespace) -> None:
    dev = select_device("auto")
    assert dev.kind == "npu"
    assert str(dev.torch_device) == "npu:0"
    assert dev.name == "Ascend910B3"
    assert dev.fallback_reason is None
    assert dev.visible_devices == "4,5"
    assert dev.default_dtype() is torch.bfloat16
    assert dev.memory_stats() == MemoryStats(used_bytes=3 << 30, total_bytes=64 << 30,
                                             reserved_bytes=4 << 30, peak_bytes=5 << 30)
    assert dev.utilization() is None  # this torch.npu offers no utilization()
    dev.synchronize()
    dev.empty_cache()


def test_simulated_npu_reports_utilization_where_torch_npu_offers_it(fake_npu: types.SimpleNamespace) -> None:
    fake_npu.utilization = lambda index: 37
    assert select_device("npu:0").utilization() == pytest.approx(0.37)


def test_simulated_npu_index_past_count_is_a_clear_error(fake_npu: types.SimpleNamespace) -> None:
    with pytest.raises(ValueError, match=r"^device 'npu:1' requested but torch.npu.device_count\(\) is 1$"):
        select_device("npu:1")


def test_torch_npu_without_devices_falls_back_to_cpu(fake_npu: types.SimpleNamespace,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fake_npu.is_available = lambda: False
    monkeypatch.setitem(device_mod._PROBES, "cuda",
                        lambda: BackendProbe("cuda", 0, "torch.cuda.is_available() is False"))
    dev = select_device("auto")
    assert dev.kind == "cpu"
    assert dev.fallback_reason is not None
    assert dev.fallback_reason.startswith("npu: torch.npu.is_available() is False")


# ---------------------------------------------------------------------------------------------------------
# CPU memory and utilization


def test_cpu_memory_stats_are_plausible() -> None:
    stats = CpuDevice().memory_stats()
    assert 1 << 20 < stats.used_bytes < stats.total_bytes  # python + torch hold more than 1 MiB
    assert stats.peak_bytes is None or stats.peak_bytes >= stats.used_bytes
    assert 0.0 < stats.used_fraction < 1.0


def test_cpu_memory_stats_agree_with_the_kernels_view_of_this_process() -> None:
    stats = cpu_memory_stats()
    kernel = {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in
              Path("/proc/self/status").read_text().splitlines()) if k in ("VmRSS", "VmHWM")}
    mem_total = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    assert stats.total_bytes == mem_total
    assert abs(stats.used_bytes - kernel["VmRSS"]) < 0.1 * kernel["VmRSS"]
    assert stats.peak_bytes is not None and stats.peak_bytes >= max(stats.used_bytes, kernel["VmHWM"] * 0.9)


def test_memory_stats_reject_negative_numbers() -> None:
    with pytest.raises(ValueError, match="used_bytes"):
        MemoryStats(used_bytes=-1, total_bytes=10)


def test_cpu_model_name_comes_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Kunpeng 920\n")
    assert cpu_model_name(cpuinfo) == "Kunpeng 920"
    assert cpu_model_name(tmp_path / "missing")


def test_cpu_usage_meter_reports_cores_busy_since_last_reading() -> None:
    clock, cpu = [100.0], [10.0]
    meter = CpuUsageMeter(clock=lambda: clock[0], cpu_seconds=lambda: cpu[0], num_cpus=4)
    clock[0], cpu[0] = 104.0, 12.0
    assert meter.read() == pytest.approx(0.5)
    clock[0], cpu[0] = 105.0, 20.0  # more CPU seconds than cores allow (coarse clocks): clamped
    assert meter.read() == 4.0
    assert meter.read() == 0.0  # no wall time passed


def test_cpu_utilization_after_work_is_within_zero_and_cpu_count() -> None:
    dev = CpuDevice()
    start = device_mod.process_cpu_seconds()
    a = torch.randn(128, 128)
    deadline = time.monotonic() + 10.0
    while device_mod.process_cpu_seconds() - start < 0.05 and time.monotonic() < deadline:
        a = torch.tanh(a @ a)
    busy = dev.utilization()
    assert isinstance(busy, float)
    assert 0.0 < busy <= device_mod.available_cpu_count()


# ---------------------------------------------------------------------------------------------------------
# NPU decode kernel selection and argument layout


@pytest.mark.skipif(HAS_TORCH_NPU, reason="claims about a machine without torch_npu")
def test_no_npu_decode_kernel_without_torch_npu() -> None:
    assert make_npu_decode_kernel() is None


def _fake_torch_npu(*names: str) -> types.ModuleType:
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    for name in names:
        setattr(module, name, lambda *args, **kwargs: None)
    return module


def test_kernel_selection_prefers_paged_attention() -> None:
    both = _fake_torch_npu("_npu_paged_attention", "npu_incre_flash_attention")
    assert isinstance(select_npu_decode_kernel(both), PagedAttentionKernel)


def test_kernel_selection_uses_incre_flash_attention_on_older_torch_npu() -> None:
    kernel = select_npu_decode_kernel(_fake_torch_npu("npu_incre_flash_attention"))
    assert isinstance(kernel, IncreFlashAttentionKernel)


def test_kernel_selection_is_none_when_torch_npu_has_neither_function() -> None:
    assert select_npu_decode_kernel(_fake_torch_npu("npu_rotary_mul")) is None


def test_make_kernel_imports_torch_npu_and_checks_the_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu("_npu_paged_attention"))
    assert isinstance(make_npu_decode_kernel(), PagedAttentionKernel)
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu())
    assert make_npu_decode_kernel() is None


def _naive_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, context_lens: list[int], scale: float) -> torch.Tensor:
    """Oracle, one sequence and head at a time: query [B, H, D]; caches [num_blocks, block_size, KV, D]."""
    batch, num_heads, head_dim = query.shape
    group = num_heads // key_cache.shape[2]
    out = torch.empty(batch, num_heads, head_dim)
    for b in range(batch):
        n = context_lens[b]
        keys = key_cache[block_table[b].long()].flatten(0, 1)[:n].float()  # [n, KV, D]
        values = value_cache[block_table[b].long()].flatten(0, 1)[:n].float()
        for h in range(num_heads):
            weights = torch.softmax(keys[:, h // group] @ query[b, h].float() * scale, dim=0)
            out[b, h] = weights @ values[:, h // group]
    return out.to(query.dtype)


def _decode_case(dtype: torch.dtype, cache_class: type[KVCacheStore] = KVCacheStore):
    """Two sequences (context 5 and 11) over block_size 4, 4 query heads sharing 2 kv heads."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 8, 4
    cache = cache_class(8, block_size, num_kv_heads, head_dim, dtype=dtype, device=torch.device("cpu"))
    block_tables = torch.tensor([[6, 1, 0], [2, 7, 3]], dtype=torch.int64)  # seq 0 pads with block 0
    context_lens = torch.tensor([5, 11], dtype=torch.int64)
    for b in range(2):
        n = int(context_lens[b])
        slots = torch.tensor([int(block_tables[b, i // block_size]) * block_size + i % block_size
                              for i in range(n)])
        cache.write(torch.randn(n, num_kv_heads, head_dim), torch.randn(n, num_kv_heads, head_dim), slots)
    query = torch.randn(2, num_heads, head_dim).to(dtype)
    return query, cache, block_tables, context_lens, head_dim**-0.5


def test_reference_decode_matches_the_engine_decode_path() -> None:
    query, cache, block_tables, context_lens, scale = _decode_case(torch.float32)
    layer = Attention(num_heads=4, head_dim=8, num_kv_heads=2, scale=scale)
    layer.cache = cache
    width = block_tables.shape[1] * cache.block_size
    mask = (torch.arange(width).unsqueeze(0) < context_lens.unsqueeze(1))[:, None, None, :]
    group = DecodeGroup(0, 2, block_tables, context_lens, mask, score_bias(mask, torch.float32))
    ctx = AttentionContext(slot_mapping=torch.empty(0, dtype=torch.int64), prefills=[], decodes=[group])
    with attention_context(ctx):
        engine = layer._decode(query, group)
    got = reference_decode(query, cache, block_tables, context_lens, scale)
    torch.testing.assert_close(got, engine)
    oracle = _naive_paged_attention(query, cache.k, cache.v, block_tables, context_lens.tolist(), scale)
    torch.testing.assert_close(got, oracle, atol=1e-5, rtol=1e-5)


def test_paged_attention_kernel_passes_vllm_ascend_layout() -> None:
    calls = []

    def fake_paged_attention(*, query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                             block_table, context_lens, out):  # type: ignore[no-untyped-def]
        assert block_table.dtype == torch.int32
        assert context_lens.dtype == torch.int32 and context_lens.device.type == "cpu"
        assert key_cache.shape[2] == num_kv_heads and query.shape[1] == num_heads
        out.copy_(_naive_paged_attention(query, key_cache, value_cache, block_table, context_lens.tolist(),
                                         scale_value))
        calls.append(num_heads)

    module = _fake_torch_npu()
    module._npu_paged_attention = fake_paged_attention
    query, cache, block_tables, context_lens, scale = _decode_case(torch.bfloat16)
    got = PagedAttentionKernel(module)(query, cache, block_tables, context_lens, scale)
    assert calls == [4]
    assert got.shape == query.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, reference_decode(query, cache, block_tables, context_lens, scale),
                               atol=2e-2, rtol=2e-2)


def test_incre_flash_attention_kernel_passes_bsh_page_attention_layout() -> None:
    def fake_incre_flash_attention(query, key, value, *, actual_seq_lengths, block_table, num_heads,
                                   num_key_value_heads, scale_value, input_layout,
                                   block_size):  # type: ignore[no-untyped-def]
        assert input_layout == "BSH" and block_table.dtype == torch.int32
        assert isinstance(actual_seq_lengths, list)
        batch, head_dim = query.shape[0], query.shape[2] // num_heads
        assert key.shape == (key.shape[0], block_size, num_key_value_heads * head_dim)
        out = _naive_paged_attention(query.view(batch, num_heads, head_dim),
                                     key.view(*key.shape[:2], num_key_value_heads, head_dim),
                                     value.view(*value.shape[:2], num_key_value_heads, head_dim),
                                     block_table, actual_seq_lengths, scale_value)
        return out.view(batch, 1, num_heads * head_dim)

    module = _fake_torch_npu()
    module.npu_incre_flash_attention = fake_incre_flash_attention
    query, cache, block_tables, context_lens, scale = _decode_case(torch.float16)
    got = IncreFlashAttentionKernel(module)(query, cache, block_tables, context_lens, scale)
    torch.testing.assert_close(got, reference_decode(query, cache, block_tables, context_lens, scale),
                               atol=2e-3, rtol=2e-3)


def test_int8_cache_bypasses_the_fused_kernel() -> None:
    def must_not_run(**kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the fused kernel cannot read per-block INT8 scales")

    module = _fake_torch_npu()
    module._npu_paged_attention = must_not_run
    query, cache, block_tables, context_lens, scale = _decode_case(torch.bfloat16, Int8KVCacheStore)
    got = PagedAttentionKernel(module)(query, cache, block_tables, context_lens, scale)
    torch.testing.assert_close(got, reference_decode(query, cache, block_tables, context_lens, scale))
