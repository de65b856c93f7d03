"""The lab's verbs: build it (``up``), take it apart (``down``), look at it (``status``), and the host
events chaos needs: a host stops (every process on it killed) and starts again, its link goes down and up.

``up`` tears down any leftover first, then builds the bridge and one namespace per host and starts a Ray
node in each: the head on the first host (no replica runs there), one worker per zone labelled
``ray.io/availability-zone=<zone>``. Ray runs only inside the namespaces, so it binds and advertises the
lab's addresses and never the machine's external interface. The lab's shape is written to
``<workdir>/lab.json``, so ``down``, ``status`` and a control plane started later find it.

``down`` needs no state: it kills every process in every namespace named ``llmsre-*``, deletes those
namespaces and the ``llmsre-*`` links of the root namespace (the veths' qdiscs go with them), and removes
the workdir. It can run any number of times, also after a half-built lab or a failed test.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from controlplane.lab import network
from controlplane.lab.network import LabError
from controlplane.lab.topology import CLIENT_PORT, GCS_PORT, PREFIX, ZONE_LABEL, LabConfig, LabHost
from inference.environment import child_environment

logger = logging.getLogger(__name__)

STATE_FILE = "lab.json"
RAY_START_TIMEOUT_S = 120.0  # `ray start` takes ~3 s on an idle machine; much more on a busy 2-core one
PORT_WAIT_S = 60.0


@dataclass(slots=True, frozen=True)
class HostStatus:
    name: str
    zone: str | None
    address: str
    namespace: bool  # the namespace exists
    link_up: bool
    processes: int
    raylet: bool  # a Ray node runs there
    rss_bytes: int


@dataclass(slots=True, frozen=True)
class LabStatus:
    ray_address: str
    hosts: tuple[HostStatus, ...]

    @property
    def is_up(self) -> bool:
        return bool(self.hosts) and all(h.namespace and h.raylet and h.link_up for h in self.hosts)

    @property
    def rss_bytes(self) -> int:
        return sum(h.rss_bytes for h in self.hosts)

    def to_json(self) -> dict[str, Any]:
        return {"ray_address": self.ray_address, "is_up": self.is_up, "rss_bytes": self.rss_bytes,
                "hosts": [asdict(h) for h in self.hosts]}


class Lab:
    def __init__(self, config: LabConfig | None = None, *, ray: str | None = None) -> None:
        self.config = config or LabConfig()
        self.ray = ray or str(Path(sys.executable).with_name("ray"))
        self.workdir = Path(self.config.workdir)

    @classmethod
    def find(cls, workdir: str | None = None) -> Lab | None:
        """The lab built on this machine, from its state file; None when there is none."""
        path = Path(workdir or LabConfig().workdir) / STATE_FILE
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return cls(LabConfig(zones=tuple(raw["zones"]), subnet=raw["subnet"], workdir=str(path.parent)))

    # ---- build and take apart ------------------------------------------------------------------
    def up(self) -> LabStatus:
        """Build the lab from nothing (leftovers are torn down first); LabError when a step fails, after
        tearing down what was built."""
        reason = network.unavailable_reason() or self._ray_missing()
        if reason:
            raise LabError(f"unavailable: {reason}")
        self.down()
        try:
            self._build_network()
            self._start_nodes([self.config.head])
            _wait_port(self.config.head.address, CLIENT_PORT, PORT_WAIT_S)
            self._start_nodes([h for h in self.config.hosts if not h.is_head])
            self._write_state()
        except BaseException:
            self.down()
            raise
        return self.status()

    def down(self) -> list[str]:
        """Take apart whatever lab is here; what was removed (namespaces and links)."""
        removed = []
        for namespace in network.namespaces(f"{PREFIX}-"):
            network.delete_namespace(namespace)
            removed.append(f"namespace {namespace}")
        for link in network.links(f"{PREFIX}-"):
            network.delete_link(link)
            removed.append(f"link {link}")
        shutil.rmtree(self.workdir, ignore_errors=True)
        return removed

    def status(self) -> LabStatus:
        present = set(network.namespaces(f"{PREFIX}-"))
        links = set(network.links(f"{PREFIX}-"))
        hosts = []
        for host in self.config.hosts:
            pids = network.namespace_pids(host.namespace) if host.namespace in present else []
            hosts.append(HostStatus(
                host.name, host.zone, host.address, host.namespace in present,
                host.veth in links and network.link_is_up(host.veth), len(pids),
                any(_is_raylet(pid) for pid in pids), network.resident_bytes(pids)))
        return LabStatus(self.config.ray_address, tuple(hosts))

    # ---- host events (chaos) -------------------------------------------------------------------
    def stop_host(self, name: str) -> int:
        """Every process on the host killed at once, as when it loses power; how many died."""
        host = self.config.host(name)
        killed = network.kill_namespace(host.namespace)
        logger.warning("lab host %s (%s): stopped, %d processes killed", name, host.address, killed)
        return killed

    def start_host(self, name: str) -> None:
        """The host's Ray node started again (a new Ray node id), after killing whatever is left there."""
        host = self.config.host(name)
        if host.is_head:
            raise LabError("host: the head cannot be restarted alone (the cluster's state went with it); "
                           "run `python -m controlplane.lab up` again")
        network.kill_namespace(host.namespace)
        self._start_nodes([host])
        logger.warning("lab host %s (%s): started again", name, host.address)

    def set_link(self, name: str, *, up: bool) -> None:
        """The host's link on the bridge down (a cut cable: nothing reaches it, nothing leaves) or up."""
        host = self.config.host(name)
        network.set_link(host.veth, up=up)
        logger.warning("lab host %s (%s): link %s", name, host.address, "up" if up else "down")

    # ---- mechanics -----------------------------------------------------------------------------
    def _ray_missing(self) -> str | None:
        if not Path(self.ray).exists():
            return f"Ray is not installed ({self.ray} is missing): pip install '.[ray]'"
        return None

    def _build_network(self) -> None:
        cfg = self.config
        network.create_bridge(cfg.bridge, f"{cfg.gateway}/{cfg.prefix_len}")
        for host in cfg.hosts:
            network.create_host(namespace=host.namespace, veth=host.veth, bridge=cfg.bridge,
                                address=f"{host.address}/{cfg.prefix_len}")

    def _start_nodes(self, hosts: list[LabHost]) -> None:
        """``ray start`` in each host's namespace, all at once; LabError naming the first that failed."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        started = []
        for host in hosts:
            log = open(self.workdir / f"{host.name}.start.log", "ab")  # noqa: SIM115 (closed below)
            command = ["ip", "netns", "exec", host.namespace, *self._ray_start(host)]
            started.append((host, log, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                         stdin=subprocess.DEVNULL,
                                                         env=child_environment(RAY_ENV, base=_no_proxy()))))
        failed = []
        for host, log, process in started:
            try:
                status = process.wait(RAY_START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                status = process.wait()
            log.close()
            if status != 0:
                failed.append(f"{host.name} (exit status {status}; see {log.name})")
        if failed:
            raise LabError(f"ray start failed on {', '.join(failed)}")

    def _ray_start(self, host: LabHost) -> list[str]:
        cfg = self.config
        common = [self.ray, "start", "--node-ip-address", host.address, "--disable-usage-stats",
                  "--temp-dir", str(self.workdir / host.name), "--object-store-memory",
                  str(cfg.object_store_bytes)]
        if host.is_head:
            system = {"health_check_period_ms": cfg.health_check_period_ms,
                      "health_check_timeout_ms": cfg.health_check_period_ms,
                      "health_check_failure_threshold": cfg.health_check_failures}
            return [*common, "--head", "--port", str(GCS_PORT), "--ray-client-server-port", str(CLIENT_PORT),
                    "--num-cpus", "0", "--include-dashboard", "false", "--system-config", json.dumps(system)]
        return [*common, "--address", cfg.gcs_address, "--num-cpus", str(cfg.worker_cpus),
                "--labels", f"{ZONE_LABEL}={host.zone}"]

    def _write_state(self) -> None:
        cfg = self.config
        state = {"zones": list(cfg.zones), "subnet": cfg.subnet, "ray_address": cfg.ray_address,
                 "hosts": [{"name": h.name, "zone": h.zone, "address": h.address, "namespace": h.namespace}
                           for h in cfg.hosts]}
        (self.workdir / STATE_FILE).write_text(json.dumps(state, indent=2))


RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}  # ``ray start`` sends no usage reports (there is no network)


def _no_proxy() -> dict[str, str]:
    """This environment without proxies: the lab's addresses are local."""
    proxies = {"http_proxy", "https_proxy", "all_proxy", "no_proxy"}
    return {k: v for k, v in os.environ.items() if k.lower() not in proxies}


def _is_raylet(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "raylet"
    except OSError:
        return False


def _wait_port(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise LabError(f"{host}:{port} does not answer after {timeout_s:g}s: {exc}") from exc
            time.sleep(0.2)
