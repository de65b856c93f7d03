"""The run delay a thread reads of itself: the seconds it waited for a core, which a replica's engine counts
within its steps to tell waiting for a core from waiting for the interpreter lock."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from inference import run_delay as rd
from inference.metrics import ReplicaMetrics
from tests.inference.test_replica_metrics import _metrics

SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass"


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


# Where the kernel does not count run delays (no CONFIG_SCHED_INFO), what a replica does instead is the
# last test's; these read a real one.
needs_run_delays = pytest.mark.skipif(rd.unavailable_reason() is not None,
                                      reason=f"unavailable: {rd.unavailable_reason()}")


@needs_run_delays
def test_this_kernel_counts_run_delays_and_a_replica_exports_them() -> None:
    assert rd.run_delay() is not None
    assert _metrics().engine_step_runqueue is not None


@needs_run_delays
def test_a_thread_reads_its_own_wait_for_a_core_and_sleep_is_not_one() -> None:
    waited: list[float] = []

    def spin_beside_the_hogs() -> None:
        before = rd.run_delay()
        assert before is not None
        _spin(0.6)
        after = rd.run_delay()
        assert after is not None
        waited.append(after - before)

    # one more spinning process than the host has cores, and a thread of this process spinning beside them:
    # of cores + 2 runnable, cores run at a time, so it waits about 2 / (cores + 2) of its 0.6 s (on 2 cores,
    # half); judged against half of that
    cores = os.cpu_count() or 1
    hogs = [subprocess.Popen([sys.executable, "-c", SPIN.format(s=2.0)])
            for _ in range(cores + 1)]
    try:
        time.sleep(0.2)  # the hogs have started spinning
        mine = rd.run_delay()  # this thread's own, from here to the end of the worker's spin
        worker = threading.Thread(target=spin_beside_the_hogs)
        worker.start()
        worker.join()  # this thread sleeps meanwhile
        after = rd.run_delay()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert mine is not None and after is not None
    assert 0.6 / (cores + 2) < waited[0] < 1.5, waited  # the worker read its own wait
    assert after - mine < waited[0] / 2  # and this thread, asleep in join, waited little: not the worker's


def test_where_the_kernel_does_not_count_them_nothing_is_read_or_exported(
        monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]) -> None:
    monkeypatch.setattr(rd, "SCHEDSTAT", f"{tmp_path}/schedstat")
    assert "schedstat" in (rd.unavailable_reason() or "")
    outcome: list[float | None] = []
    thread = threading.Thread(target=lambda: outcome.append(rd.run_delay()))  # a thread with no descriptor
    thread.start()
    thread.join()
    assert outcome == [None]
    metrics: ReplicaMetrics = _metrics()
    assert metrics.engine_step_runqueue is None
    names = {m.name for m in metrics.registry.collect()}
    assert "llmsre_engine_step_runqueue_seconds" not in names and "llmsre_engine_step_cpu_seconds" in names


@needs_run_delays
def test_a_thread_that_ends_closes_its_descriptor_and_a_forked_child_reads_its_own() -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    rd.run_delay()
    before = open_fds()
    for _ in range(5):
        worker = threading.Thread(target=rd.run_delay)
        worker.start()
        worker.join()
    assert open_fds() == before

    # a child forked from this thread reads through a descriptor of its own: the one it inherited names
    # this thread
    assert rd.run_delay() is not None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once, running nothing of the parent's
        os.close(read)
        try:
            value = rd.run_delay()
            descriptor = rd._local.descriptor
            target = "" if descriptor is None else os.readlink(f"/proc/self/fd/{descriptor.fd}")
            os.write(write, f"{value!r} {target}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        value, target = pipe.read().split(" ", 1)
    os.waitpid(pid, 0)
    assert value != "None"
    assert target == f"/proc/{pid}/task/{pid}/schedstat", target
