"""The multi-host lab as an operator uses it: ``python -m controlplane.lab up|status|down``, host events, and
a teardown that leaves nothing behind (no namespace, link, qdisc, process or folder), also when run twice.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from controlplane.lab import network
from controlplane.lab.lab import Lab
from controlplane.lab.topology import CLIENT_PORT, GCS_PORT, PREFIX, LabConfig
from tests.controlplane.ray.conftest import is_ray_process, lab_unavailable, root_listeners

pytestmark = [pytest.mark.exclusive, pytest.mark.slow, pytest.mark.timeout(240)]


def lab_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "controlplane.lab", *args], capture_output=True, text=True,
                          timeout=180)


def leftovers() -> list[str]:
    """Whatever of a lab is on this machine: namespaces, links, qdiscs on lab links, Ray processes."""
    found = [f"namespace {n}" for n in network.namespaces(f"{PREFIX}-")]
    found += [f"link {n}" for n in network.links(f"{PREFIX}-")]
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
    found += [f"qdisc {line}" for line in qdiscs.splitlines() if f" dev {PREFIX}-" in line]
    found += [f"process {p.pid} {p.name()}" for p in psutil.process_iter() if is_ray_process(p.pid)]
    if Path(LabConfig().workdir).exists():
        found.append(f"folder {LabConfig().workdir}")
    return found


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    reason = lab_unavailable()
    if reason:
        pytest.skip(f"unavailable: {reason}")
    built = Lab()
    try:
        yield built
    finally:
        built.down()


def test_up_builds_a_host_per_zone_with_a_ray_node_reachable_only_on_the_lab(lab: Lab) -> None:
    up = lab_cli("up")
    assert up.returncode == 0, up.stderr
    assert "(up)" in up.stdout
    status = json.loads(lab_cli("status", "--json").stdout)
    assert status["is_up"] and status["ray_address"] == "ray://10.199.0.2:10001"
    hosts = {h["name"]: h for h in status["hosts"]}
    assert set(hosts) == {"head", "az-a", "az-b", "az-c"}
    assert [hosts[n]["address"] for n in ("head", "az-a", "az-b", "az-c")] == \
        ["10.199.0.2", "10.199.0.3", "10.199.0.4", "10.199.0.5"]
    assert all(h["namespace"] and h["link_up"] and h["raylet"] for h in hosts.values())
    print(f"\nlab: Ray's processes hold {status['rss_bytes'] / 2**20:.0f} MiB resident ("
          + ", ".join(f"{n} {h['rss_bytes'] / 2**20:.0f}" for n, h in hosts.items()) + ")")
    # The head answers on the lab's bridge (GCS and Ray Client); no Ray process listens in this namespace.
    for port in (GCS_PORT, CLIENT_PORT):
        with socket.create_connection(("10.199.0.2", port), timeout=5):
            pass
    assert [a for a, pid in root_listeners() if pid is not None and is_ray_process(pid)] == []
    # Ray's own view: every zone's node registered with its label (asked from inside the head's host).
    nodes = subprocess.run(
        ["ip", "netns", "exec", "llmsre-head", sys.executable, "-c",
         "import json, ray; ray.init(address='auto', logging_level='ERROR');"
         "print(json.dumps(sorted([n['NodeManagerAddress'], n['Labels'].get('ray.io/availability-zone')] "
         "for n in ray.nodes() if n['Alive'])))"], capture_output=True, text=True, timeout=120)
    assert json.loads(nodes.stdout.strip().splitlines()[-1]) == [
        ["10.199.0.2", None], ["10.199.0.3", "az-a"], ["10.199.0.4", "az-b"], ["10.199.0.5", "az-c"]]


def test_a_stopped_host_loses_every_process_and_starts_its_node_again(lab: Lab) -> None:
    assert lab.stop_host("az-b") > 0
    az_b = next(h for h in lab.status().hosts if h.name == "az-b")
    assert az_b.namespace and az_b.processes == 0 and not az_b.raylet
    lab.start_host("az-b")
    assert next(h for h in lab.status().hosts if h.name == "az-b").raylet
    assert lab.status().is_up


def test_a_cut_link_isolates_its_host_until_it_is_restored(lab: Lab) -> None:
    lab.set_link("az-c", up=False)
    with pytest.raises(OSError):
        socket.create_connection(("10.199.0.5", 1), timeout=1.0)
    lab.set_link("az-c", up=True)
    with pytest.raises(ConnectionRefusedError):  # reachable again: a closed port answers with a refusal
        socket.create_connection(("10.199.0.5", 1), timeout=5.0)


def test_down_leaves_nothing_and_can_run_again(lab: Lab) -> None:
    down = lab_cli("down")
    assert down.returncode == 0, down.stderr
    assert leftovers() == []
    again = lab_cli("down")
    assert again.returncode == 0 and "no lab here" in again.stdout
    assert leftovers() == []
