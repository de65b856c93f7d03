"""A port partition on loopback: connections to the port time out while it is in, other ports keep
working, and reverting (twice, or from another process after a crash) restores it and leaves nothing.

The kernel tests need root, bcc, pyroute2 and kernel headers (scripts/install-ebpf.sh). Without them they
skip, or fail when CI is set, since CI is expected to install them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos import ebpf
from chaos.faults.network import PartitionRecord, PortPartition, availability

pytestmark = pytest.mark.exclusive

ROOT = Path(__file__).resolve().parents[2]
CONNECT_TIMEOUT_S = 0.5


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(1024):
            self.request.sendall(data)


class _EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def _serve_echo() -> Iterator[int]:
    """A TCP echo server on a free loopback port, stopped afterwards."""
    server = _EchoServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def echo_port() -> Iterator[int]:
    yield from _serve_echo()


@pytest.fixture
def other_port() -> Iterator[int]:
    yield from _serve_echo()


def can_echo(port: int) -> bool:
    """Whether a new connection to ``port`` opens and echoes within the short timeout."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=CONNECT_TIMEOUT_S) as conn:
            conn.sendall(b"ping")
            return conn.recv(16) == b"ping"
    except OSError:
        return False


def _qdisc_kinds() -> list[str]:
    pyroute2 = ebpf.import_system("pyroute2")
    with pyroute2.IPRoute() as ipr:
        index = ipr.link_lookup(ifname="lo")[0]
        return [q.get_attr("TCA_KIND") for q in ipr.get_qdiscs(index=index)]


def _tc_clsact(command: str) -> None:
    pyroute2 = ebpf.import_system("pyroute2")
    with pyroute2.IPRoute() as ipr:
        ipr.tc(command, "clsact", ipr.link_lookup(ifname="lo")[0])


def _require_no_foreign_clsact() -> None:
    """Tests that add or delete lo's clsact themselves must not touch one that someone else owns."""
    if "clsact" in _qdisc_kinds():
        pytest.skip("lo already has a clsact qdisc that these tests did not create")


@pytest.fixture(scope="session")
def lo_cleanup() -> Iterator[None]:
    """Session finalizer: revert every partition left on lo and drop a clsact the tests created."""
    ok, reason = availability()
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"eBPF network faults must run in CI: {reason}")
        pytest.skip(reason or "unavailable")
    had_clsact = "clsact" in _qdisc_kinds()
    yield
    partition = PortPartition()
    for record in partition.active():
        partition.revert(record)
    if not had_clsact and "clsact" in _qdisc_kinds():
        _tc_clsact("del")


@pytest.fixture
def partition(lo_cleanup: None) -> Iterator[PortPartition]:
    """The fault under test; whatever a test attached is reverted even when it fails."""
    fault = PortPartition()
    try:
        yield fault
    finally:
        for record in fault.active():
            fault.revert(record)


def test_partitioned_port_times_out_while_another_port_still_works(
        partition: PortPartition, echo_port: int, other_port: int) -> None:
    assert can_echo(echo_port) and can_echo(other_port)
    record = partition.inject(echo_port)
    try:
        assert not can_echo(echo_port)
        assert can_echo(other_port)
    finally:
        partition.revert(record)
    assert can_echo(echo_port)
    assert partition.active() == []


def test_record_is_json_and_matches_what_active_finds(partition: PortPartition, echo_port: int) -> None:
    record = partition.inject(echo_port)
    try:
        assert json.loads(json.dumps(record)) == record
        assert record["port"] == echo_port and record["interface"] == "lo"
        assert partition.active() == [record]
    finally:
        partition.revert(record)


def test_reverting_twice_or_after_the_qdisc_is_gone_succeeds(
        partition: PortPartition, echo_port: int) -> None:
    _require_no_foreign_clsact()
    record = partition.inject(echo_port)
    try:
        partition.revert(record)
        partition.revert(record)
        again = partition.inject(echo_port)
        _tc_clsact("del")  # someone removes the qdisc, and our filter with it
        partition.revert(again)
    finally:
        partition.revert(record)
    assert partition.active() == []
    assert "clsact" not in _qdisc_kinds()
    assert can_echo(echo_port)


def test_revert_keeps_a_clsact_it_did_not_create(partition: PortPartition, echo_port: int) -> None:
    _require_no_foreign_clsact()
    _tc_clsact("add")
    try:
        record = partition.inject(echo_port)
        assert record["owns_qdisc"] is False
        partition.revert(record)
        assert "clsact" in _qdisc_kinds()
        assert can_echo(echo_port)
    finally:
        _tc_clsact("del")


def test_leftover_of_a_killed_process_is_found_and_reverted(partition: PortPartition, echo_port: int) -> None:
    script = ("import json, sys, time\n"
              "from chaos.faults.network import PortPartition\n"
              f"print(json.dumps(PortPartition().inject({echo_port})), flush=True)\n"
              "time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        injected = json.loads(child.stdout.readline())
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert not can_echo(echo_port)  # the filter outlives the process that attached it

        leftovers = partition.active()
        assert leftovers == [injected]
        partition.revert(leftovers[0])
        assert can_echo(echo_port)
        assert partition.active() == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


# Units: no kernel needed.

@pytest.mark.parametrize("port", [0, 65536, -1, True, "80"])
def test_bad_port_is_rejected_before_anything_is_attached(port: Any) -> None:
    with pytest.raises(ValueError, match="port"):
        PortPartition().validate(port)


def test_record_survives_a_round_trip_through_the_filter_name() -> None:
    record = PartitionRecord.for_port(8080, owns_qdisc=True)
    assert PartitionRecord.from_filter_name(record.filter_name) == record
    assert PartitionRecord.from_dict(json.loads(json.dumps(record.as_dict()))) == record
    assert PartitionRecord.from_filter_name("someone else's filter") is None


def test_foreign_record_is_refused() -> None:
    record = PartitionRecord.for_port(8080, owns_qdisc=False).as_dict()
    with pytest.raises(ValueError, match="marker"):
        PortPartition().revert({**record, "marker": "other"})
    with pytest.raises(ValueError, match="not a port partition record"):
        PortPartition().revert({"port": 8080})


def test_not_root_is_reported_as_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ok, reason = availability()
    assert not ok and reason is not None and reason.startswith("unavailable: not root")
