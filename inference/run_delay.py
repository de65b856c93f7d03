"""The seconds the calling thread has waited for a core: runnable, on a run queue, not running.

A step's wall time that its thread did not run on a CPU (its own CPU clock, ``time.thread_time``) went
one of two ways: waiting for a core, held by other processes or replicas on the same cores, or asleep,
which in a replica means the interpreter lock, held by its HTTP server's thread (streaming tokens, taking
in requests). More cores help the first, not the second. Linux counts the first per thread as its run
delay, the second field of ``/proc/thread-self/schedstat`` (``CONFIG_SCHED_INFO``, on in the common
distributions' kernels). Each thread reads its own, through a descriptor it opens once (closed when the
thread ends): a read is one ``pread`` (about a microsecond). A forked child opens its own: the descriptor
it would inherit names its parent's thread.
"""

from __future__ import annotations

import os
import threading

SCHEDSTAT = "/proc/thread-self/schedstat"


class _Descriptor:
    """One thread's open ``schedstat``, closed with the thread's locals (when the thread ends)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __del__(self) -> None:
        os.close(self.fd)


class _PerThread(threading.local):
    descriptor: _Descriptor | None = None
    failed = False


_local = _PerThread()


def _forget_after_fork() -> None:
    global _local
    _local = _PerThread()  # the forking thread's descriptor is dropped, and closed, in the child


os.register_at_fork(after_in_child=_forget_after_fork)


def run_delay() -> float | None:
    """The calling thread's run delay so far, in seconds; None where the kernel does not count it."""
    if _local.descriptor is None:
        if _local.failed:
            return None
        try:
            _local.descriptor = _Descriptor(os.open(SCHEDSTAT, os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            _local.failed = True
            return None
    try:
        return int(os.pread(_local.descriptor.fd, 64, 0).split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def unavailable_reason() -> str | None:
    """Why run delays cannot be read on this host; None when they can."""
    try:
        with open(SCHEDSTAT, "rb") as f:
            fields = f.read().split()
        int(fields[1])
    except OSError as exc:
        return f"{SCHEDSTAT}: {exc.strerror or exc}"
    except (IndexError, ValueError):
        return f"{SCHEDSTAT}: no run delay field"
    return None
