"""The lab's shape as values: which hosts, on which addresses, in which namespaces. No I/O.

One bridge in the root namespace holds the gateway address of the lab's subnet (``10.199.0.1/24``); each
host is a network namespace joined to the bridge by a veth pair, with the next address. The first host
runs the Ray head and no replica (``num_cpus = 0``), so that losing any zone leaves the cluster up; each
zone has one host that runs a Ray worker labelled with its zone.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

ZONE_LABEL = "ray.io/availability-zone"
PREFIX = "llmsre"  # names of namespaces, veths and the bridge start with it: teardown finds its own
HEAD = "head"
GCS_PORT = 6379
CLIENT_PORT = 10001


@dataclass(slots=True, frozen=True)
class LabHost:
    """One host of the lab: a namespace with an address, running one Ray node."""

    name: str  # "head" or the zone name
    address: str
    zone: str | None  # None for the head host

    @property
    def namespace(self) -> str:
        return f"{PREFIX}-{self.name}"

    @property
    def veth(self) -> str:
        """The root namespace's end of the host's link (on the bridge); at most 15 characters."""
        return f"{PREFIX}-{self.name}"[:15]

    @property
    def is_head(self) -> bool:
        return self.zone is None


@dataclass(slots=True, frozen=True)
class LabConfig:
    zones: tuple[str, ...] = ("az-a", "az-b", "az-c")
    subnet: str = "10.199.0.0/24"
    bridge: str = f"{PREFIX}-br0"
    worker_cpus: int = 8  # logical CPUs a zone's Ray worker offers: replicas ask for one each
    object_store_bytes: int = 80 * 1024 * 1024  # the replicas pass no objects; Ray's minimum is ~75 MB
    workdir: str = f"/tmp/{PREFIX}-lab"  # Ray's session folders (short: Ray's socket paths must fit)
    # The head notices a lost node after this many missed health checks of this period (Ray's defaults
    # take ~30 s); each check waits at most the period.
    health_check_period_ms: int = 1000
    health_check_failures: int = 3
    hosts: tuple[LabHost, ...] = field(init=False)

    def __post_init__(self) -> None:
        net = ipaddress.ip_network(self.subnet)
        if len(self.zones) + 3 > net.num_addresses:
            raise ValueError(f"subnet: {self.subnet} is too small for {len(self.zones)} zones")
        if len(set(self.zones)) != len(self.zones) or HEAD in self.zones:
            raise ValueError(f"zones: must be distinct and not {HEAD!r}, got {self.zones!r}")
        names = (HEAD, *self.zones)
        hosts = tuple(LabHost(name, str(net[i + 2]), None if name == HEAD else name)
                      for i, name in enumerate(names))
        object.__setattr__(self, "hosts", hosts)

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge."""
        return str(ipaddress.ip_network(self.subnet)[1])

    @property
    def prefix_len(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    @property
    def head(self) -> LabHost:
        return self.hosts[0]

    @property
    def ray_address(self) -> str:
        """How the control plane reaches the lab: a Ray Client on the head."""
        return f"ray://{self.head.address}:{CLIENT_PORT}"

    @property
    def gcs_address(self) -> str:
        return f"{self.head.address}:{GCS_PORT}"

    def host(self, name: str) -> LabHost:
        """The host named ``name`` (``head`` or a zone); ValueError naming the hosts that exist."""
        for host in self.hosts:
            if host.name == name:
                return host
        raise ValueError(f"host: no lab host {name!r} (hosts: {', '.join(h.name for h in self.hosts)})")

    def host_at(self, address: str) -> LabHost | None:
        return next((h for h in self.hosts if h.address == address), None)
