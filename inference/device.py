"""Which accelerator a replica runs on: an Ascend NPU through torch-npu, else CUDA, else the CPU.

Where it sits: the CLI passes ``--device`` to :func:`select_device` once at start-up; the model runner
places weights and KV cache on ``Device.torch_device`` and the server reads ``memory_stats()`` and
``utilization()`` for ``/metrics``. Selection is observe (probe each backend), decide (a pure function of
the request and the probes), apply (build one :class:`Device`).

torch-npu is imported only when installed and only inside a guard: a missing or broken torch-npu (no CANN
libraries, a version mismatch) becomes a recorded reason, never an exception on the CPU path. torch >= 2.5
also imports out-of-tree backends such as torch_npu at ``import torch`` through the ``torch.backends``
entry points, which fails the same way; that autoload is switched off below, before torch is imported.
"""

from __future__ import annotations

import os

# Must run before the first ``import torch`` of the process to have an effect; setdefault keeps an explicit
# TORCH_DEVICE_BACKEND_AUTOLOAD=1 from the operator. torch_npu is then loaded by import_torch_npu() instead.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import importlib
import importlib.util
import logging
import platform
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import torch

logger = logging.getLogger(__name__)

AUTO = "auto"
ACCELERATOR_KINDS = ("npu", "cuda")  # in order of preference for "auto"
DEVICE_KINDS = ("cpu", *ACCELERATOR_KINDS)
VISIBLE_DEVICES_ENV = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}
PROC_CPUINFO = Path("/proc/cpuinfo")  # the CPU's model name: psutil does not report it


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """Memory of one device as this process sees it.

    ``used_bytes`` is what this process holds: resident set size on the CPU, bytes in live tensors on an
    accelerator. ``reserved_bytes`` (the caching allocator's reserve) and ``peak_bytes`` (high-water mark
    of ``used_bytes``) are None where the backend does not report them.
    """

    used_bytes: int
    total_bytes: int
    reserved_bytes: int | None = None
    peak_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("used_bytes", "total_bytes", "reserved_bytes", "peak_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")

    @property
    def used_fraction(self) -> float:
        return self.used_bytes / self.total_bytes if self.total_bytes else 0.0


@dataclass(frozen=True, slots=True)
class DeviceRequest:
    """A parsed ``--device`` value: kind is 'auto', 'cpu', 'cuda' or 'npu'; index None means "the first"."""

    kind: str
    index: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in (AUTO, *DEVICE_KINDS):
            raise ValueError(f"device kind must be one of auto, cpu, cuda, npu; got {self.kind!r}")
        if self.index is not None and (self.index < 0 or self.kind in (AUTO, "cpu")):
            raise ValueError(f"device index {self.index} is not valid for kind {self.kind!r}")

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


@dataclass(frozen=True, slots=True)
class BackendProbe:
    """What one accelerator backend offers in this process; ``reason`` says why it cannot be used."""

    kind: str
    device_count: int
    reason: str | None = None

    @property
    def is_available(self) -> bool:
        return self.reason is None and self.device_count > 0


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """The decision: which device to build, and why the preferred accelerators were passed over."""

    kind: str
    index: int
    fallback_reason: str | None


def parse_device(requested: str) -> DeviceRequest:
    """``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``npu`` or ``npu:N`` (case and surrounding space ignored)."""
    text = requested.strip().lower()
    kind, sep, index_text = text.partition(":")
    if kind not in (AUTO, *DEVICE_KINDS) or (sep and not index_text.isdigit()):
        raise ValueError(f"invalid device {requested!r}: expected auto, cpu, cuda, cuda:N, npu or npu:N")
    if sep and kind in (AUTO, "cpu"):
        raise ValueError(f"invalid device {requested!r}: {kind} takes no index")
    return DeviceRequest(kind, int(index_text) if sep else None)


def plan_device(request: DeviceRequest, probes: Mapping[str, BackendProbe]) -> DevicePlan:
    """Pure decision: the device to use for ``request`` given the probes of the accelerator backends.

    ``auto`` takes the first available of npu, cuda, and falls back to cpu, recording each backend's reason.
    An explicit accelerator that is unavailable, or an index past its device count, raises ``ValueError``.
    """
    if request.kind == "cpu":
        return DevicePlan("cpu", 0, None)
    if request.kind == AUTO:
        reasons: list[str] = []
        for kind in ACCELERATOR_KINDS:
            probe = probes[kind]
            if probe.is_available:
                return DevicePlan(kind, 0, "; ".join(reasons) or None)
            reasons.append(f"{kind}: {_unavailable_reason(probe)}")
        return DevicePlan("cpu", 0, "; ".join(reasons))
    probe = probes[request.kind]
    if not probe.is_available:
        raise ValueError(f"device '{request}' requested but {_unavailable_reason(probe)}")
    index = request.index or 0
    if index >= probe.device_count:
        raise ValueError(f"device '{request}' requested but torch.{probe.kind}.device_count() is "
                         f"{probe.device_count}")
    return DevicePlan(request.kind, index, None)


def _unavailable_reason(probe: BackendProbe) -> str:
    return probe.reason or f"torch.{probe.kind}.device_count() is 0"


def import_torch_npu() -> tuple[ModuleType | None, str | None]:
    """The torch_npu module, or None and the reason it cannot be used. Never raises.

    The import is tried only when the package is installed; any exception from it (ImportError, OSError
    from missing CANN libraries, RuntimeError from a torch version mismatch) becomes the reason.
    """
    try:
        if importlib.util.find_spec("torch_npu") is None:
            return None, "torch_npu is not installed"
    except (ImportError, ValueError) as exc:  # a broken parent package or a sys.modules entry without spec
        return None, f"torch_npu lookup failed: {type(exc).__name__}: {exc}"
    try:
        return importlib.import_module("torch_npu"), None
    except Exception as exc:
        return None, f"torch_npu import failed: {type(exc).__name__}: {exc}"


def probe_npu() -> BackendProbe:
    module, reason = import_torch_npu()
    if module is None:
        return BackendProbe("npu", 0, reason)
    api = getattr(torch, "npu", None)  # registered by torch_npu at import
    if api is None:
        return BackendProbe("npu", 0, "torch_npu imported but torch.npu is missing")
    return _probe_api("npu", api)


def probe_cuda() -> BackendProbe:
    return _probe_api("cuda", torch.cuda)


def _probe_api(kind: str, api: Any) -> BackendProbe:
    try:
        if not api.is_available():
            return BackendProbe(kind, 0, f"torch.{kind}.is_available() is False")
        return BackendProbe(kind, int(api.device_count()))
    except Exception as exc:  # a driver that fails while probing means "not available", not a crash
        return BackendProbe(kind, 0, f"torch.{kind} probe failed: {type(exc).__name__}: {exc}")


_PROBES: dict[str, Callable[[], BackendProbe]] = {"npu": probe_npu, "cuda": probe_cuda}


def select_device(requested: str = AUTO) -> Device:
    """The device for ``--device requested``; ``ValueError`` with a one-line message when it cannot be had."""
    request = parse_device(requested)
    needed = ACCELERATOR_KINDS if request.kind == AUTO else (request.kind,)
    probes = {kind: _PROBES[kind]() for kind in needed if kind != "cpu"}
    plan = plan_device(request, probes)
    device = _build_device(plan)
    logger.info("device %s (%s) for --device %s%s%s", device.torch_device, device.name, request,
                f"; {device.visible_devices_env}={device.visible_devices}" if device.visible_devices else "",
                f"; not using accelerators: {plan.fallback_reason}" if plan.fallback_reason else "")
    return device


def _build_device(plan: DevicePlan) -> Device:
    if plan.kind == "cpu":
        return CpuDevice(fallback_reason=plan.fallback_reason)
    return AcceleratorDevice(plan.kind, plan.index, fallback_reason=plan.fallback_reason)


class Device(ABC):
    """One interface over CPU, CUDA and NPU: where tensors go, and the device's memory and load."""

    __slots__ = ("fallback_reason", "kind", "name", "torch_device", "visible_devices")

    def __init__(self, *, kind: str, torch_device: torch.device, name: str,
                 fallback_reason: str | None = None) -> None:
        self.kind = kind
        self.torch_device = torch_device
        self.name = name
        self.fallback_reason = fallback_reason  # why npu/cuda were not picked; None when nothing was skipped
        # Reported only: torch-npu and CUDA apply their *_VISIBLE_DEVICES themselves, so index 0 is the
        # first *visible* device.
        self.visible_devices = os.environ.get(self.visible_devices_env) if self.visible_devices_env else None

    @property
    def visible_devices_env(self) -> str | None:
        return VISIBLE_DEVICES_ENV.get(self.kind)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.torch_device}, name={self.name!r})"

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all queued work on the device (for honest timings)."""

    @abstractmethod
    def empty_cache(self) -> None:
        """Return cached, unused memory to the device."""

    @abstractmethod
    def memory_stats(self) -> MemoryStats: ...

    @abstractmethod
    def utilization(self) -> float | None:
        """Busy fraction: 0..1 for an accelerator; on the CPU, cores' worth of this process (0..num CPUs)."""

    @abstractmethod
    def default_dtype(self) -> torch.dtype: ...


class CpuDevice(Device):
    __slots__ = ("_meter",)

    def __init__(self, *, fallback_reason: str | None = None, meter: CpuUsageMeter | None = None) -> None:
        super().__init__(kind="cpu", torch_device=torch.device("cpu"), name=cpu_model_name(),
                         fallback_reason=fallback_reason)
        self._meter = meter or CpuUsageMeter()

    def synchronize(self) -> None:
        pass  # CPU ops run synchronously

    def empty_cache(self) -> None:
        pass  # the CPU allocator returns memory itself

    def memory_stats(self) -> MemoryStats:
        return cpu_memory_stats()

    def utilization(self) -> float:
        return self._meter.read()

    def default_dtype(self) -> torch.dtype:
        return torch.float32  # bf16 matmuls on most CPUs are slower than fp32 and lose precision


class AcceleratorDevice(Device):
    """CUDA or NPU: torch.npu mirrors the torch.cuda API, so one class drives both through ``_api``."""

    __slots__ = ("_api", "_index")

    def __init__(self, kind: str, index: int, *, fallback_reason: str | None = None) -> None:
        api = getattr(torch, kind)
        self._api = api
        self._index = index
        super().__init__(kind=kind, torch_device=torch.device(kind, index),
                         name=_call_or(api, "get_device_name", kind, index), fallback_reason=fallback_reason)
        if hasattr(api, "set_device"):
            api.set_device(self.torch_device)  # kernels without an explicit device use the current one

    def synchronize(self) -> None:
        self._api.synchronize(self.torch_device)

    def empty_cache(self) -> None:
        self._api.empty_cache()

    def memory_stats(self) -> MemoryStats:
        api, index = self._api, self._index
        return MemoryStats(used_bytes=int(_call_or(api, "memory_allocated", 0, index)),
                           total_bytes=self._total_bytes(),
                           reserved_bytes=_optional_int(_call_or(api, "memory_reserved", None, index)),
                           peak_bytes=_optional_int(_call_or(api, "max_memory_allocated", None, index)))

    def _total_bytes(self) -> int:
        info = _call_or(self._api, "mem_get_info", None, self._index)
        if info is not None:
            return int(info[1])
        props = _call_or(self._api, "get_device_properties", None, self._index)
        return int(getattr(props, "total_memory", 0))

    def utilization(self) -> float | None:
        # torch.cuda.utilization reads NVML through pynvml (None here when pynvml is not installed) and maps
        # CUDA_VISIBLE_DEVICES to NVML indices; torch_npu offers the same call on some versions only.
        percent = _call_or(self._api, "utilization", None, self._index)
        return None if percent is None else float(percent) / 100.0

    def default_dtype(self) -> torch.dtype:
        bf16 = _call_or(self._api, "is_bf16_supported", True)
        return torch.bfloat16 if bf16 else torch.float16


def _call_or(api: Any, name: str, default: Any, *args: Any) -> Any:
    """``api.name(*args)``, or ``default`` when the backend lacks the call or it fails."""
    fn = getattr(api, name, None)
    if not callable(fn):
        return default
    try:
        return fn(*args)
    except Exception as exc:
        logger.debug("%s.%s failed: %s", getattr(api, "__name__", api), name, exc)
        return default


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


class CpuUsageMeter:
    """CPU seconds this process used per wall-clock second since the previous reading (1.0 = one core).

    Each reading starts a new window, so one reader (the metrics collector) should own the device's meter.
    """

    __slots__ = ("_clock", "_cpu_seconds", "_last", "_max")

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 cpu_seconds: Callable[[], float] | None = None, num_cpus: int | None = None) -> None:
        self._clock = clock
        self._cpu_seconds = cpu_seconds or process_cpu_seconds
        self._max = float(num_cpus or available_cpu_count())
        self._last = (clock(), self._cpu_seconds())

    def read(self) -> float:
        now, cpu = self._clock(), self._cpu_seconds()
        (then, cpu_then), self._last = self._last, (now, cpu)
        wall = now - then
        if wall <= 0:
            return 0.0
        return min(max((cpu - cpu_then) / wall, 0.0), self._max)


def process_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def available_cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_model_name(cpuinfo: Path = PROC_CPUINFO) -> str:
    for key, value in _read_key_values(cpuinfo):
        if key in ("model name", "Hardware", "Processor"):  # x86 / some ARM kernels
            return value
    return platform.processor() or platform.machine() or "cpu"


def cpu_memory_stats() -> MemoryStats:
    """This process's resident memory and its peak against the machine's memory (psutil)."""
    used = psutil.Process().memory_info().rss
    peak = _peak_rss_bytes()
    return MemoryStats(used_bytes=used, total_bytes=psutil.virtual_memory().total,
                       peak_bytes=None if peak is None else max(peak, used))


def _peak_rss_bytes() -> int | None:
    """The process's peak resident memory (getrusage: psutil does not report it); None off Unix."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _read_key_values(path: Path) -> list[tuple[str, str]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    pairs = (line.partition(":") for line in lines)
    return [(key.strip(), value.strip()) for key, sep, value in pairs if sep]
