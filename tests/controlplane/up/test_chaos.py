"""Faults through the control plane's API: a pause is reverted by HALT ALL within 2 s, and a pause or an
eBPF partition left active by a control plane killed with -9 is reverted by the next one at start."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import psutil
import pytest

from chaos.faults.network import PortPartition, availability
from chaos.faults.process import STOPPED
from controlplane.client import ApiError

from .conftest import Running, start, wait_ready

pytestmark = [pytest.mark.exclusive, pytest.mark.slow, pytest.mark.timeout(300)]


def process_state(pid: int) -> str:
    """The kernel's one-letter state, as ``ps`` shows it (T: stopped)."""
    return "T" if psutil.Process(pid).status() in STOPPED else "not stopped"


def test_pause_through_the_api_then_halt_all_reverts_within_2s(running: Running) -> None:
    wait_ready(running, 3)
    with running.client() as client:
        catalogue = {k.kind: k for k in client.chaos_catalogue()}
        assert catalogue["pause"].available and "partition" in catalogue
        plan = client.chaos_inject("pause", duration_s=60, selector="ALL", dry_run=True)
        assert plan.dry_run and not plan.plan.allowed  # every replica: refused by blast radius
        assert client.chaos_faults() == []  # the dry run changed nothing
        result = client.chaos_inject("pause", duration_s=60, replicas=["az-b-1"])
        [fault] = result.faults
        pid = next(r.pid for r in client.fleet().replicas if r.replica_id == "az-b-1")
        assert pid is not None and process_state(pid) == "T"
        assert [f.target for f in client.chaos_faults()] == ["az-b-1"]

        started = time.monotonic()
        report = client.chaos_halt()
        elapsed = time.monotonic() - started
        assert report.reverted == (fault.id,) and report.halted and elapsed < 2.0
        assert process_state(pid) != "T"
        with pytest.raises(ApiError) as refused:
            client.chaos_inject("pause", duration_s=5, replicas=["az-a-1"])
        assert refused.value.status == 409 and "halt" in str(refused.value)
        client.chaos_release()
        actions = [a.action for a in client.audit(limit=50)]
    assert {"chaos.inject", "chaos.halt", "chaos.release"} <= set(actions)
    wait_ready(running, 3)


def test_pause_left_by_a_crashed_control_plane_is_reverted_at_the_next_start(model_state: Path,
                                                                             running: Running) -> None:
    wait_ready(running, 3)
    with running.client() as client:
        client.chaos_inject("pause", duration_s=600, replicas=["az-c-1"])
        pid = next(r.pid for r in client.fleet().replicas if r.replica_id == "az-c-1")
    assert pid is not None and process_state(pid) == "T"
    running.process.send_signal(signal.SIGKILL)
    running.process.wait(10)
    assert process_state(pid) == "T"  # nobody reverted it yet

    config = next(model_state.glob("controlplane.toml"))
    again = start(config, model_state, running.token)
    try:
        wait_ready(again, 3)
        assert process_state(pid) != "T"
        with again.client() as client:
            assert client.chaos_faults() == []
    finally:
        again.process.send_signal(signal.SIGTERM)
        assert again.process.wait(90) == 0


def connects(port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


def test_partition_left_by_a_crashed_control_plane_is_removed_at_the_next_start(model_state: Path,
                                                                                running: Running) -> None:
    ok, reason = availability()
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"eBPF network faults must run in CI: {reason}")
        pytest.skip(reason or "eBPF unavailable")
    wait_ready(running, 3)
    with running.client() as client:
        client.chaos_inject("partition", duration_s=600, replicas=["az-b-1"])
        url = next(r.url for r in client.fleet().replicas if r.replica_id == "az-b-1")
    port = int(url.rsplit(":", 1)[1])
    partitions = PortPartition()
    try:
        assert [r["port"] for r in partitions.active()] == [port] and not connects(port)
        running.process.send_signal(signal.SIGKILL)
        running.process.wait(10)
        assert [r["port"] for r in partitions.active()] == [port]  # nobody removed it yet

        config = next(model_state.glob("controlplane.toml"))
        again = start(config, model_state, running.token)
        try:
            wait_ready(again, 3)
            assert partitions.active() == [] and connects(port)
            with again.client() as client:
                assert client.chaos_faults() == []
        finally:
            again.process.send_signal(signal.SIGTERM)
            assert again.process.wait(90) == 0
    finally:
        for record in partitions.active():  # whatever happened, leave lo as it was
            partitions.revert(record)
