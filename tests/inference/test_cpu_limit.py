"""A replica's CPU limit (``inference serve --cpu-limit``, :mod:`inference.cpu_limit`): the kernel holds a
limited process to its quota, the replica reports it on ``/metrics``, and no group outlives its process.

The real tests need a writable cpu controller (root, as CI runs); elsewhere they are skipped with the
reason, which is also what ``inference serve --cpu-limit`` prints there. This host has v1's cpu hierarchy
only, so the cgroup v2 files (``cpu.max``) are checked on a folder laid out as v2's, not by the kernel.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from inference import cpu_limit
from inference.cpu_limit import CpuLimitUnavailable, Hierarchy, find_hierarchy, join, quota_us, sweep
from inference.launcher import ReplicaProcess, free_port
from tests.polling import wait_until

BUSY = """
import sys, time
from inference.cpu_limit import join
limit = join(float(sys.argv[1]))
print(limit.path, flush=True)
started, cpu = time.monotonic(), time.process_time()
while time.monotonic() - started < float(sys.argv[2]):
    pass
share = (time.process_time() - cpu) / (time.monotonic() - started)
print(share, limit.throttling().throttled_periods, flush=True)
if sys.argv[3] == "leave":
    limit.leave()
else:
    time.sleep(60)
"""


@pytest.fixture
def hierarchy() -> Hierarchy:
    try:
        return find_hierarchy()
    except CpuLimitUnavailable as exc:
        pytest.skip(f"unavailable: {exc}")


def _groups(h: Hierarchy) -> list[Path]:
    return sorted(h.group.glob("replica-*")) if h.group.is_dir() else []


@contextlib.contextmanager
def limited_replica(replica_id: str, h: Hierarchy) -> Iterator[tuple[ReplicaProcess, Path]]:
    """A replica under half a core, ready, and its group."""
    replica = ReplicaProcess(free_port(), replica_id=replica_id, extra_args=["--num-threads", "1",
                                                                             "--cpu-limit", "0.5"])
    with replica:
        replica.wait_ready(timeout=180)
        assert replica.process is not None
        group = h.group / f"replica-{replica.process.pid}"
        assert group.is_dir()
        yield replica, group


def _busy(limit: float, seconds: float, then: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", BUSY, str(limit), str(seconds), then],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])


def test_a_limited_process_gets_no_more_than_its_quota_and_its_group_goes(hierarchy: Hierarchy) -> None:
    # unlimited, the busy loop runs a whole core (or what a busy host leaves it); limited, never more than
    # its quota (a share of each 10 ms period), however idle the host
    child = _busy(0.3, 1.5, "leave")
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0
    path, figures = out.splitlines()
    share, throttled = float(figures.split()[0]), int(figures.split()[1])
    assert share <= 0.3 * 1.1, f"ran {share:.2f} of a core under a 0.3-core limit"
    assert throttled > 0 or share < 0.25  # it hit the quota, unless the host gave it less than the quota
    assert not Path(path).exists(), "the group outlived its process"


def test_sweep_removes_the_group_of_a_killed_process_and_only_that(hierarchy: Hierarchy) -> None:
    killed, running = _busy(0.2, 0.1, "stay"), _busy(0.2, 0.1, "stay")
    try:
        paths = [Path(p.stdout.readline().strip()) for p in (killed, running)]  # type: ignore[union-attr]
        assert all(p.is_dir() for p in paths)
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        assert paths[0].is_dir(), "SIGKILL leaves the group (nothing in the process runs)"
        assert sweep() >= 1
        assert not paths[0].exists() and paths[1].is_dir(), "the running process keeps its group"
    finally:
        for p in (killed, running):
            p.kill()
            p.wait(10)
    sweep()
    assert not any(g.name in (f"replica-{killed.pid}", f"replica-{running.pid}") for g in _groups(hierarchy))
    if not _groups(hierarchy):  # (another limited process of this host keeps it)
        assert not hierarchy.group.exists(), "the parent group goes once nothing is limited"


def test_a_replica_under_a_limit_reports_it_and_leaves_no_group(hierarchy: Hierarchy) -> None:
    with limited_replica("limited", hierarchy) as (replica, group):
        assert replica.process is not None
        assert str(replica.process.pid) in (group / "cgroup.procs").read_text().split()
        # every thread of the replica is in it (torch's, uvicorn's): none started before the join
        threads = Path(f"/proc/{replica.process.pid}/task")
        outside = [t.name for t in threads.iterdir() if group.name not in (t / "cgroup").read_text()]
        assert len(list(threads.iterdir())) > 1 and outside == []
        httpx.post(f"{replica.base_url}/v1/completions", json={"model": "default", "prompt": "hello",
                                                              "max_tokens": 8}, timeout=60).raise_for_status()
        metrics = httpx.get(f"{replica.base_url}/metrics", timeout=10).text
        assert "llmsre_cpu_limit_cores 0.5" in metrics
        assert "llmsre_cpu_throttled_seconds_total" in metrics
        assert "llmsre_cpu_throttled_periods_total" in metrics
    wait_until(lambda: not group.exists(), timeout=10, what="the replica's group removed after it stopped")


def test_an_unlimited_replica_reports_no_limit() -> None:
    # the collector is registered on every process; without a limit it says nothing
    assert cpu_limit.current() is None
    from prometheus_client import CollectorRegistry, generate_latest

    from inference.runtime_metrics import register_runtime_metrics

    registry = CollectorRegistry()
    register_runtime_metrics(registry)
    assert b"llmsre_cpu_limit" not in generate_latest(registry)


def test_the_quota_is_a_share_of_a_10_ms_period() -> None:
    assert quota_us(0.75) == 7_500
    assert quota_us(2) == 20_000
    for bad in (0, -1, 0.05, float("nan")):
        with pytest.raises(ValueError, match="cpu limit"):
            quota_us(bad)


def test_no_cpu_controller_is_unavailable_with_the_reason(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("proc /proc proc rw 0 0\ncgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n")
    with pytest.raises(CpuLimitUnavailable, match="no cgroup hierarchy with the cpu controller"):
        find_hierarchy(mounts)
    assert sweep(Hierarchy(tmp_path / "nowhere", 1)) == 0  # nothing to sweep is not an error


def test_serve_refuses_to_start_unlimited_where_the_limit_cannot_be_had() -> None:
    # as a user who may not write the cgroup: the replica says why in one line and exits 2, rather than
    # serving without the limit its flag promises
    if os.geteuid() != 0:
        cmd = [sys.executable, "-m", "inference", "serve", "--cpu-limit", "0.5", "--port", str(free_port())]
    else:
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
               "inference", "serve", "--cpu-limit", "0.5", "--port", str(free_port())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
                          env={**os.environ, "HOME": "/tmp"})
    assert done.returncode == 2, done.stderr
    assert "--cpu-limit: unavailable:" in done.stderr
    assert "not writable" in done.stderr


def test_cgroup_v2_gets_cpu_max_and_the_cpu_controller_for_its_children(tmp_path: Path) -> None:
    # this host's kernel mounts v1's cpu hierarchy; the v2 files are checked on a folder laid out as v2's
    root = tmp_path / "unified"
    (root / "llmsre").mkdir(parents=True)
    for folder in (root, root / "llmsre"):
        (folder / "cgroup.subtree_control").write_text("memory\n")
    (root / "cgroup.procs").write_text("")
    limit = join(1.5, hierarchy=Hierarchy(root, 2))
    try:
        group = root / "llmsre" / f"replica-{os.getpid()}"
        assert limit.path == group
        assert (group / "cpu.max").read_text() == "15000 10000"
        assert (group / "cgroup.procs").read_text() == str(os.getpid())
        assert (root / "cgroup.subtree_control").read_text() == "+cpu"
        assert (root / "llmsre" / "cgroup.subtree_control").read_text() == "+cpu"
        (group / "cpu.stat").write_text("usage_usec 10\nnr_periods 40\nnr_throttled 7\nthrottled_usec 2500\n")
        assert limit.throttling() == cpu_limit.Throttling(40, 7, 0.0025)
    finally:
        limit.leave()
    assert cpu_limit.current() is None
    assert (root / "cgroup.procs").read_text() == str(os.getpid()), "moved back to the root on leaving"


def test_the_launcher_sweeps_the_group_of_a_replica_killed_outright(hierarchy: Hierarchy) -> None:
    # the launcher's exit sweeps: a replica killed outright (SIGKILL) leaves its group only until then
    with limited_replica("killed", hierarchy) as (replica, group):
        assert replica.process is not None
        replica.process.kill()
        replica.process.wait(10)
        assert group.is_dir()
    assert not group.exists()


def test_the_local_backend_sweeps_the_group_of_a_replica_it_killed(hierarchy: Hierarchy,
                                                                   tmp_path: Path) -> None:
    from controlplane.fleet.backends.base import ReplicaSpec
    from controlplane.fleet.backends.local import LocalProcessBackend

    backend = LocalProcessBackend(log_dir=tmp_path / "logs", state_dir=tmp_path)
    port = free_port()
    handle = backend.spawn(ReplicaSpec("az-a-1", "az-a", "127.0.0.1", port, "default", 1, "t" * 32,
                                       cpu_limit=0.5))
    try:
        group = hierarchy.group / f"replica-{handle.pid}"
        wait_until(lambda: group.is_dir(), timeout=60, what="the replica's group")
    finally:
        backend.kill(handle)
    assert not group.exists()
