"""The lab's kernel objects through iproute2: a bridge, namespaces, veth pairs, and the processes in them.

Every call runs ``ip`` (as root) and every failure leaves as :class:`LabError` with ``ip``'s own words.
Deleting is idempotent: what is already gone counts as deleted, so a teardown after a half-built lab (or a
failed test) removes whatever is there and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

import psutil

from controlplane.errors import Unavailable
from inference.environment import child_environment

IP_TIMEOUT_S = 10.0
KILL_WAIT_S = 10.0


class LabError(Unavailable):
    """The lab could not be built, changed or torn down here; the message says what ``ip`` or Ray said."""


def unavailable_reason() -> str | None:
    """Why no lab can be built on this machine (None: it can)."""
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, a bridge and veth pairs)"
    if shutil.which("ip") is None:
        return "iproute2's ip command is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=IP_TIMEOUT_S,
                           env=child_environment())
    if probe.returncode != 0:
        return f"ip netns does not work here: {probe.stderr.strip()}"
    return None


def ip(*args: str, namespace: str | None = None, check: bool = True) -> str:
    """Run ``ip ARGS`` (inside ``namespace`` when given); its stdout, or LabError with its stderr."""
    command = ["ip", *(["-n", namespace] if namespace else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=IP_TIMEOUT_S,
                          env=child_environment())
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(command)}: {done.stderr.strip() or f'exit status {done.returncode}'}")
    return done.stdout


def namespaces(prefix: str) -> list[str]:
    return sorted(line.split()[0] for line in ip("netns", "list").splitlines()
                  if line.split() and line.split()[0].startswith(prefix))


def links(prefix: str) -> list[str]:
    """Links of the root namespace whose names start with ``prefix`` (the bridge and host veths)."""
    return sorted(link["ifname"] for link in json.loads(ip("-j", "link", "show") or "[]")
                  if str(link.get("ifname", "")).startswith(prefix))


def link_is_up(name: str) -> bool:
    shown = json.loads(ip("-j", "link", "show", "dev", name) or "[]")
    return bool(shown) and "UP" in shown[0].get("flags", ())


def create_bridge(name: str, address: str) -> None:
    """A bridge in the root namespace with ``address`` (CIDR), up."""
    ip("link", "add", name, "type", "bridge")
    ip("addr", "add", address, "dev", name)
    ip("link", "set", name, "up")


def create_host(*, namespace: str, veth: str, bridge: str, address: str) -> None:
    """A namespace joined to ``bridge`` by a veth pair: ``veth`` in the root namespace, ``eth0`` inside
    with ``address`` (CIDR); loopback up inside, so that a node's own processes reach each other."""
    ip("netns", "add", namespace)
    ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
    ip("link", "set", veth, "master", bridge, "up")
    ip("addr", "add", address, "dev", "eth0", namespace=namespace)
    ip("link", "set", "eth0", "up", namespace=namespace)
    ip("link", "set", "lo", "up", namespace=namespace)


def set_link(name: str, *, up: bool) -> None:
    ip("link", "set", name, "up" if up else "down")


def delete_link(name: str) -> None:
    """Delete a link of the root namespace; one already gone is deleted."""
    if name in links(name):
        ip("link", "del", name, check=False)


def namespace_pids(namespace: str) -> list[int]:
    """Every process whose network namespace is ``namespace`` (they share this machine's pid space)."""
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True,
                          timeout=IP_TIMEOUT_S, env=child_environment())
    return [int(pid) for pid in done.stdout.split()] if done.returncode == 0 else []


def kill_namespace(namespace: str, *, wait_s: float = KILL_WAIT_S) -> int:
    """SIGKILL every process in ``namespace`` (a host losing power) and wait until they are gone; how
    many there were. Processes exited but not yet reaped by their parent no longer count."""
    pids = namespace_pids(namespace)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and _alive(namespace_pids(namespace)):
        time.sleep(0.05)
    left = _alive(namespace_pids(namespace))
    if left:
        raise LabError(f"{namespace}: processes {left} survived SIGKILL for {wait_s:g}s")
    return len(pids)


def delete_namespace(namespace: str) -> None:
    """Kill what runs in ``namespace`` and delete it (with the veth end inside); already gone is fine."""
    if namespace not in namespaces(namespace):
        return
    kill_namespace(namespace)
    ip("netns", "del", namespace, check=False)


def resident_bytes(pids: Sequence[int]) -> int:
    """The summed resident memory of ``pids`` (those still running)."""
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return total


def _alive(pids: Sequence[int]) -> list[int]:
    """The pids that still run (a zombie has exited: it holds no memory, no socket, no namespace)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive
