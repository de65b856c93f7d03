"""The control plane's batch work (what-if simulations) runs in worker processes the data plane preempts at
once: ``SCHED_IDLE`` and a raised nice value (``controlplane.sim.batch``), never on a thread of the
control plane, where it would hold the interpreter lock (``test_simulator.py`` holds the API to that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from controlplane.sim import batch
from controlplane.sim.batch import BATCH_NICE, as_batch_work, close_idle_workers, run_batch_process
from controlplane.sim.what_if import WORKER, SimulateRequest, run_what_if_process

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="per-thread SCHED_IDLE is Linux's")

# A worker as run_batch_process expects one: it reports its own priority, what it was asked, its pid and
# whether a secret of the caller's environment reached it.
PROBE = textwrap.dedent("""
    import os, sys
    from controlplane.sim.batch import serve_batch_work

    def handle(request, progress):
        progress({"step": 1})
        if request["do"] == "refuse":
            raise ValueError("no such policy: kpa")
        if request["do"] == "crash":
            return 1 / 0
        if request["do"] == "die":
            os._exit(3)
        if request["do"] == "chatty":
            print("a library's stray print", flush=True)
            return {"said": "anyway"}
        return {"policy": os.sched_getscheduler(0), "nice": os.getpriority(os.PRIO_PROCESS, 0),
                "asked": request, "secret": os.environ.get("CONTROLPLANE_ADMIN_TOKEN"), "pid": os.getpid()}

    sys.exit(serve_batch_work(handle))
""")


def priority() -> tuple[int, int]:
    tid = threading.get_native_id()
    return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "batch_probe.py").write_text(PROBE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.getcwd()]))
    return "batch_probe"


def test_batch_work_runs_on_an_idle_thread_and_leaves_the_others_as_they_were() -> None:
    before = priority()
    seen: list[tuple[int, int]] = []

    def work() -> None:
        as_batch_work()
        seen.append(priority())

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert seen == [(os.SCHED_IDLE, max(before[1], BATCH_NICE))]
    assert priority() == before  # the calling thread (the event loop's, in the control plane) is untouched


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"


def test_a_worker_runs_at_idle_priority_without_the_callers_secrets_and_serves_the_next_request(
        probe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTROLPLANE_ADMIN_TOKEN", "s3cret")
    before = priority()
    progress: list[dict[str, Any]] = []
    try:
        result = run_batch_process(probe, {"do": "answer", "n": 7}, progress.append)
        assert result["policy"] == os.SCHED_IDLE and result["nice"] >= BATCH_NICE
        assert result["asked"] == {"do": "answer", "n": 7} and progress == [{"step": 1}]
        assert result["secret"] is None
        assert priority() == before  # the caller's own thread keeps its priority
        again = run_batch_process(probe, {"do": "answer", "n": 8})
        assert again["pid"] == result["pid"] and again["asked"]["n"] == 8  # kept, not started again
        other = run_batch_process(probe, {"do": "answer"}, priority="low")
        assert other["pid"] != result["pid"]  # a worker serves one priority only: it cannot leave SCHED_IDLE
    finally:
        close_idle_workers()
    assert gone(result["pid"]) and gone(other["pid"])


def test_an_idle_worker_is_closed_after_its_idle_time_and_the_next_request_starts_another(
        probe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch, "WORKER_IDLE_S", 0.2)
    first = run_batch_process(probe, {"do": "answer"})["pid"]
    deadline = time.monotonic() + 30
    while not gone(first) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(first)
    second = run_batch_process(probe, {"do": "answer"})["pid"]
    assert second != first
    close_idle_workers()
    assert gone(second)


def test_a_kept_worker_that_died_while_idle_is_replaced_without_the_caller_seeing_it(probe: str) -> None:
    first = run_batch_process(probe, {"do": "answer"})["pid"]
    psutil.Process(first).kill()  # not waited for: it may still look alive when the next request comes
    try:
        assert run_batch_process(probe, {"do": "answer"})["pid"] != first
    finally:
        close_idle_workers()


def test_a_refusal_is_a_value_error_and_a_crash_or_death_a_runtime_error(probe: str) -> None:
    try:
        with pytest.raises(ValueError, match="no such policy: kpa"):
            run_batch_process(probe, {"do": "refuse"})
        kept = run_batch_process(probe, {"do": "answer"})["pid"]  # a refusal leaves the worker serving
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            run_batch_process(probe, {"do": "crash"})
        assert gone(kept)  # a worker that failed is not trusted with the next request
        with pytest.raises(RuntimeError, match="exited with status 3 and no answer"):
            run_batch_process(probe, {"do": "die"})
        assert run_batch_process(probe, {"do": "chatty"}) == {"said": "anyway"}  # a stray line is no answer
    finally:
        close_idle_workers()


def test_a_caller_that_gives_up_mid_run_stops_its_worker(probe: str) -> None:
    running: list[int] = []

    def give_up(message: dict[str, Any]) -> None:
        running.extend(p.pid for p in psutil.Process().children() if probe in " ".join(p.cmdline()))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_batch_process(probe, {"do": "answer"}, give_up)
    assert len(running) == 1 and gone(running[0])
    try:
        assert run_batch_process(probe, {"do": "answer"})["pid"] != running[0]
    finally:
        close_idle_workers()


@pytest.mark.parametrize(("cpu_priority", "policy"), [("idle", "SCHED_IDLE"), ("low", "SCHED_OTHER")])
def test_the_what_if_worker_runs_at_the_configured_priority_and_exits_when_the_control_plane_is_gone(
        cpu_priority: str, policy: str) -> None:
    """``[simulator] cpu_priority``: idle (SCHED_IDLE and nice 10) or low (nice 10 alone). Its stdin closes
    when the control plane stops (by kill -9 too): the worker stops mid-run with it."""
    request = {"body": {"trace": "synthetic-bursty", "duration_s": 3600, "compress": 1,
                        "policies": ["ours", "hpa"], "seed": 3},
               "profile_path": "", "cpu_priority": cpu_priority}
    with subprocess.Popen([sys.executable, "-m", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as worker:
        assert worker.stdin is not None and worker.stdout is not None
        worker.stdin.write(json.dumps(request) + "\n")
        worker.stdin.flush()
        first = json.loads(worker.stdout.readline())
        assert 0.0 <= first["progress"]["fraction"] < 1.0, first  # running, not done
        assert os.sched_getscheduler(worker.pid) == getattr(os, policy)
        assert psutil.Process(worker.pid).nice() >= BATCH_NICE
        worker.stdin.close()
        assert worker.wait(timeout=30) == 1


def test_a_bad_priority_is_refused_before_any_worker_starts() -> None:
    body = SimulateRequest.model_validate({"trace": "synthetic-bursty", "duration_s": 60})
    with pytest.raises(ValueError, match="cpu_priority: one of idle, low, got 'high'"):
        run_what_if_process(body, cpu_priority="high")
