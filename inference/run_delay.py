"""The seconds the calling thread has waited for a core: runnable, on a run queue, not running.

A step's wall time that its thread did not run on a CPU (its own CPU clock, ``time.thread_time``) went
one of two ways: waiting for a core, held by other processes or replicas on the same cores, or asleep,
which in a replica means the interpreter lock, held by its HTTP server's thread (streaming tokens, taking
in requests). More cores help the first, not the second. Linux counts the first per thread as its run
delay, the second field of ``/proc/thread-self/schedstat`` (``CONFIG_SCHED_INFO``, on in the common
distributions' kernels). Each thread reads its own, through a descriptor it opens once: a read is one
``pread`` (about a microsecond).
"""

from __future__ import annotations

import os
import threading

SCHEDSTAT = "/proc/thread-self/schedstat"


class _PerThread(threading.local):
    fd: int | None = None
    failed = False


_local = _PerThread()


def run_delay() -> float | None:
    """The calling thread's run delay so far, in seconds; None where the kernel does not count it."""
    if _local.fd is None:
        if _local.failed:
            return None
        try:
            _local.fd = os.open(SCHEDSTAT, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            _local.failed = True
            return None
    try:
        return int(os.pread(_local.fd, 64, 0).split()[1]) / 1e9
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
