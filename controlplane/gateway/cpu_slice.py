"""The gateway asks the kernel for a short CPU slice, so that it runs as soon as a client's bytes arrive.

Where it sits: :mod:`controlplane.gateway.process` calls :func:`request_slice` once at start, before it
starts any thread, so every thread of the gateway inherits it; the result is logged and shown in the
admin status.

Why: on a shared host the gateway competes for its CPU with whatever else runs there, a control plane's
what-if simulations included. Linux's fair scheduler (EEVDF, 6.6 and later) lets the task that runs keep
the CPU to the end of its slice (about 1-3 ms by default) before a task that woke up may take it, and
each relayed request wakes the gateway a few times. Since 6.12 a task may ask for a shorter slice of its
own (``sched_setattr`` with ``sched_runtime`` under ``SCHED_OTHER``; clamped by the kernel to 0.1-100 ms,
no privilege needed): the kernel then lets it preempt a task with a longer slice on wake-up, and it still
gets no more than its fair share of the CPU. On older kernels and other platforms the gateway says that
it runs with the kernel's default.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

# struct sched_attr (include/uapi/linux/sched/types.h), SCHED_ATTR_SIZE_VER1: size, policy, flags, nice,
# priority, runtime, deadline, period, util_min, util_max.
_SCHED_ATTR = struct.Struct("IIQiIQQQII")
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}  # (sched_setattr, sched_getattr)
SCHED_OTHER = 0
MIN_SLICE_MS = 0.1  # the kernel clamps a requested slice to [0.1, 100] ms
MAX_SLICE_MS = 100.0


def request_slice(slice_ms: float) -> str:
    """Ask for a ``slice_ms`` CPU slice for this thread (and the threads it starts later); 0 keeps the
    kernel's default. Returns what holds, for the log and the status: "0.1 ms", or "kernel default" with
    the reason."""
    if slice_ms <= 0:
        return "kernel default (gateway.cpu_slice_ms = 0)"
    attr = _get_attr()
    if isinstance(attr, str):
        return f"kernel default (unavailable: {attr})"
    _, policy, _, nice, *_ = attr
    if policy != SCHED_OTHER:  # SCHED_BATCH/IDLE/real-time were chosen by whoever started us: keep them
        return f"kernel default (the gateway runs under scheduling policy {policy}, left as it is)"
    runtime_ns = int(min(max(slice_ms, MIN_SLICE_MS), MAX_SLICE_MS) * 1e6)
    libc = ctypes.CDLL(None, use_errno=True)
    setattr_nr = _SYSCALLS[platform.machine()][0]
    request = _SCHED_ATTR.pack(_SCHED_ATTR.size, SCHED_OTHER, 0, nice, 0, runtime_ns, 0, 0, 0, 0)
    if libc.syscall(setattr_nr, 0, ctypes.c_char_p(request), 0) != 0:
        return f"kernel default (unavailable: sched_setattr: {os.strerror(ctypes.get_errno())})"
    got = current_slice_ms()
    if got is None:  # before 6.12 the kernel takes the call and keeps no slice per task
        return "kernel default (unavailable: this kernel keeps no CPU slice per task; 6.12 or later does)"
    return f"{got:g} ms"


def current_slice_ms(tid: int = 0) -> float | None:
    """A thread's CPU slice (ms) as the kernel reports it (``tid`` 0: this one); None where it reports
    none (before 6.12) or the thread cannot be read."""
    attr = _get_attr(tid)
    if isinstance(attr, str) or not attr[5]:
        return None
    return float(attr[5]) / 1e6


def _get_attr(tid: int = 0) -> tuple[int, ...] | str:
    """A thread's struct sched_attr as a tuple (``tid`` 0: this one), or why it cannot be read."""
    if platform.system() != "Linux" or platform.machine() not in _SYSCALLS:
        return f"no sched_setattr on {platform.system()} {platform.machine()}"
    libc = ctypes.CDLL(None, use_errno=True)
    getattr_nr = _SYSCALLS[platform.machine()][1]
    buf = ctypes.create_string_buffer(_SCHED_ATTR.size)
    if libc.syscall(getattr_nr, tid, buf, _SCHED_ATTR.size, 0) != 0:
        return f"sched_getattr: {os.strerror(ctypes.get_errno())}"
    return _SCHED_ATTR.unpack(buf.raw)
