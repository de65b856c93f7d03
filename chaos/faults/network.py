"""Network partition of one TCP port, as an eBPF classifier on the interface that reaches it (``lo`` for a
replica on this machine's loopback; the lab's bridge for a replica on a lab host).

Where it sits: the chaos layer's fault kinds wrap :class:`PortPartition` (it imports nothing from the
rest of the project). It compiles a small ``BPF.SCHED_CLS`` program with bcc and attaches it with
pyroute2 as a direct-action ``bpf`` filter on the ``clsact`` qdisc of the interface; the program drops TCP
segments whose source or destination port is the partitioned one, so new connections time out and open
ones stall, as if the wire were cut.

The kernel is the only state. Each filter is named ``chaos.port_partition port=<p> qdisc=<owned|shared>``
and sits at a fixed place (priority = port, a fixed handle), so a record can be rebuilt from the kernel:
:meth:`PortPartition.active` finds what a crashed process left behind, and ``revert`` removes exactly
that filter, then the ``clsact`` qdisc when chaos created it and no filter is left on it.

Only ingress is hooked: on ``lo`` every packet leaves through egress and comes back through ingress of the
same device, so one hook already drops both directions. On the way to another host (a bridge or a NIC)
ingress sees what that host sends back: its answers from the partitioned port are dropped, and a TCP
connection without answers is as cut as one without requests. :func:`route_interface` finds the interface
from the kernel's route to the host.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from chaos.ebpf import availability, import_system
from chaos.errors import ChaosError

__all__ = ["MARKER", "PartitionError", "PartitionRecord", "PortPartition", "availability", "route_interface"]

log = logging.getLogger(__name__)

MARKER = "chaos.port_partition"
INTERFACE = "lo"
CLSACT_HANDLE = 0xFFFF0000  # "ffff:"
INGRESS_PARENT = 0xFFFFFFF2  # "ffff:fff2", clsact's ingress hook
EGRESS_PARENT = 0xFFFFFFF3  # "ffff:fff3", clsact's egress hook
FILTER_HANDLE = 0xC4A05  # one filter per priority; the priority is the port
ETH_P_ALL = 0x0003
ENOENT = 2
EINVAL = 22

_NAME = re.compile(re.escape(MARKER) + r" port=(\d+) qdisc=(owned|shared)$")
_IFNAME = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")

_PROGRAM = r"""
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/in.h>

/* PORT_BE (the port in network byte order) is set with -D when the program is compiled. */
static __always_inline int touches_port(struct __sk_buff *skb, int l4_offset) {
    __be16 ports[2];  /* TCP source and destination port */
    if (bpf_skb_load_bytes(skb, l4_offset, ports, sizeof(ports)) < 0)
        return 0;
    return ports[0] == PORT_BE || ports[1] == PORT_BE;
}

/* Packets of other ports go on to the next filter (TC_ACT_UNSPEC): TC_ACT_OK would end the chain, so
   with two partitions on lo only the first filter would ever drop anything. */
int drop_port(struct __sk_buff *skb) {
    if (skb->protocol == bpf_htons(ETH_P_IP)) {
        struct iphdr ip;
        if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)) < 0 || ip.protocol != IPPROTO_TCP)
            return TC_ACT_UNSPEC;
        return touches_port(skb, ETH_HLEN + ip.ihl * 4) ? TC_ACT_SHOT : TC_ACT_UNSPEC;
    }
    if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr ip6;
        if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip6, sizeof(ip6)) < 0 || ip6.nexthdr != IPPROTO_TCP)
            return TC_ACT_UNSPEC;
        return touches_port(skb, ETH_HLEN + sizeof(ip6)) ? TC_ACT_SHOT : TC_ACT_UNSPEC;
    }
    return TC_ACT_UNSPEC;
}
"""


class PartitionError(ChaosError, RuntimeError):
    """A partition could not be injected or reverted; the netlink or bcc error is the ``__cause__``."""


@dataclass(slots=True, frozen=True)
class PartitionRecord:
    """Everything needed to find and remove one partition filter, in any process."""

    port: int
    owns_qdisc: bool
    interface: str = INTERFACE
    qdisc_handle: str = "ffff:"
    parent: str = "ffff:fff2"
    priority: int = 0
    handle: int = FILTER_HANDLE
    marker: str = MARKER

    def __post_init__(self) -> None:
        validate(self.port)
        if self.marker != MARKER:
            raise ValueError(f"marker: expected {MARKER!r}, got {self.marker!r}")
        if not isinstance(self.interface, str) or not _IFNAME.match(self.interface):
            raise ValueError(f"interface: not an interface name: {self.interface!r}")
        if self.priority != self.port or self.handle != FILTER_HANDLE:
            raise ValueError(f"priority/handle: expected {self.port}/{FILTER_HANDLE}, "
                             f"got {self.priority}/{self.handle}")

    @classmethod
    def for_port(cls, port: int, *, owns_qdisc: bool, interface: str = INTERFACE) -> PartitionRecord:
        return cls(port=port, owns_qdisc=owns_qdisc, interface=interface, priority=port)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> PartitionRecord:
        try:
            return cls(**record)
        except TypeError as exc:  # a missing or unknown field
            raise ValueError(f"not a port partition record: {exc}") from exc

    @classmethod
    def from_filter_name(cls, name: str, interface: str = INTERFACE) -> PartitionRecord | None:
        match = _NAME.match(name)
        if match is None:
            return None
        return cls.for_port(int(match[1]), owns_qdisc=match[2] == "owned", interface=interface)

    @property
    def filter_name(self) -> str:
        return f"{MARKER} port={self.port} qdisc={'owned' if self.owns_qdisc else 'shared'}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def validate(port: int) -> None:
    """Raise ValueError unless ``port`` is a TCP port that can be partitioned."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port: expected an integer in 1..65535, got {port!r}")


class PortPartition:
    """Drops TCP traffic to and from one port, on one interface (``lo`` by default), until reverted."""

    def validate(self, port: int) -> None:
        validate(port)

    def describe(self, record: dict[str, Any]) -> str:
        parsed = PartitionRecord.from_dict(record)
        return f"TCP port {parsed.port} partitioned on {parsed.interface} (eBPF filter prio {parsed.port})"

    def prepare(self, port: int, interface: str = INTERFACE) -> dict[str, Any]:
        """The record ``inject(port)`` will return, for a ledger written before the fault goes in."""
        validate(port)
        with _netlink("inspect " + interface) as ipr:
            index = _index(ipr, interface)
            return PartitionRecord.for_port(port, owns_qdisc=_chaos_owns_qdisc(ipr, index, interface),
                                            interface=interface).as_dict()

    def inject(self, port: int, interface: str = INTERFACE) -> dict[str, Any]:
        """Attach the drop filter for ``port``; returns the JSON-serialisable revert record."""
        validate(port)
        ok, reason = availability()
        if not ok:
            raise PartitionError(f"cannot partition port {port}: {reason}")
        with _netlink(f"partition port {port} on {interface}") as ipr:
            index = _index(ipr, interface)
            if _find_filter(ipr, index, port, interface) is not None:
                raise PartitionError(f"port {port} is already partitioned on {interface}")
            record = PartitionRecord.for_port(port, owns_qdisc=_ensure_clsact(ipr, index, interface),
                                              interface=interface)
            try:
                _attach(ipr, index, record)
            except BaseException:
                _remove_qdisc_if_unused(ipr, index, record)
                raise
        log.info("port %d: partitioned on %s (%s)", port, interface, record.filter_name)
        return record.as_dict()

    def revert(self, record: dict[str, Any]) -> None:
        """Remove the filter ``record`` names, and the qdisc if chaos made it; already gone (the filter, or
        the whole interface) is success."""
        parsed = PartitionRecord.from_dict(record)
        with _netlink(f"revert partition of port {parsed.port} on {parsed.interface}") as ipr:
            indices = ipr.link_lookup(ifname=parsed.interface)
            if not indices:
                return  # the interface is gone, and its filters with it
            index = int(indices[0])
            if _find_filter(ipr, index, parsed.port, parsed.interface) is not None:
                _ignoring(ENOENT, ipr.tc, "del-filter", "bpf", index, FILTER_HANDLE,
                          parent=INGRESS_PARENT, prio=parsed.port, protocol=ETH_P_ALL)
            _remove_qdisc_if_unused(ipr, index, parsed)
        log.info("port %d: partition on %s reverted", parsed.port, parsed.interface)

    def active(self, interface: str = INTERFACE) -> list[dict[str, Any]]:
        """Records of every partition filter on ``interface``, including those a crashed process left."""
        with _netlink("inspect " + interface) as ipr:
            return [r.as_dict() for r in _chaos_filters(ipr, _index(ipr, interface), interface)]


def route_interface(host: str) -> str:
    """The interface this machine reaches ``host`` through (``lo`` for a loopback address), from the
    kernel's routing table; PartitionError when there is no route or ``host`` is not an IP address."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError as exc:
        raise PartitionError(f"host: {host!r} is not an IP address") from exc
    if address.is_loopback:
        return INTERFACE
    with _netlink(f"route to {host}") as ipr:
        routes = ipr.route("get", dst=str(address))
        index = routes[0].get_attr("RTA_OIF") if routes else None
        links = ipr.get_links(index) if index is not None else []
        if not links:
            raise PartitionError(f"no route to {host}")
        return str(links[0].get_attr("IFLA_IFNAME"))


@contextmanager
def _netlink(action: str) -> Iterator[Any]:
    """An rtnetlink socket; netlink and OS errors leave as PartitionError (the one translation point)."""
    pyroute2 = import_system("pyroute2")
    try:
        with pyroute2.IPRoute() as ipr:
            yield ipr
    except (pyroute2.NetlinkError, OSError) as exc:
        raise PartitionError(f"{action}: {exc}") from exc


def _index(ipr: Any, interface: str) -> int:
    indices = ipr.link_lookup(ifname=interface)
    if not indices:
        raise PartitionError(f"no interface {interface!r}")
    return int(indices[0])


def _has_clsact(ipr: Any, index: int) -> bool:
    return any(q.get_attr("TCA_KIND") == "clsact" for q in ipr.get_qdiscs(index=index))


def _filters(ipr: Any, index: int, parent: int) -> list[Any]:
    if not _has_clsact(ipr, index):
        return []
    return list(ipr.get_filters(index=index, parent=parent))


def _chaos_filters(ipr: Any, index: int, interface: str) -> list[PartitionRecord]:
    records = []
    for message in _filters(ipr, index, INGRESS_PARENT):
        options = message.get_attr("TCA_OPTIONS")
        name = options.get_attr("TCA_BPF_NAME") if options is not None else None
        record = PartitionRecord.from_filter_name(name, interface) if name else None
        if record is not None and message["handle"] == FILTER_HANDLE:
            records.append(record)
    return records


def _find_filter(ipr: Any, index: int, port: int, interface: str) -> PartitionRecord | None:
    return next((r for r in _chaos_filters(ipr, index, interface) if r.port == port), None)


def _chaos_owns_qdisc(ipr: Any, index: int, interface: str) -> bool:
    """Whether a partition would own the clsact: absent now, or created by an earlier partition."""
    if not _has_clsact(ipr, index):
        return True
    return any(r.owns_qdisc for r in _chaos_filters(ipr, index, interface))


def _ensure_clsact(ipr: Any, index: int, interface: str) -> bool:
    """Make sure the interface has a clsact qdisc; True when chaos owns it (ownership passes between
    filters)."""
    owned = _chaos_owns_qdisc(ipr, index, interface)
    if not _has_clsact(ipr, index):
        ipr.tc("add", "clsact", index)
    return owned


def _attach(ipr: Any, index: int, record: PartitionRecord) -> None:
    bcc = import_system("bcc")
    try:
        program = bcc.BPF(text=_PROGRAM.encode(), cflags=[f"-DPORT_BE={socket.htons(record.port)}"])
    except Exception as exc:  # bcc raises bare Exception when clang fails
        raise PartitionError(f"port {record.port}: compiling the classifier failed: {exc}") from exc
    try:
        function = program.load_func(b"drop_port", bcc.BPF.SCHED_CLS)
        ipr.tc("add-filter", "bpf", index, FILTER_HANDLE, fd=function.fd, name=record.filter_name,
               parent=INGRESS_PARENT, prio=record.port, protocol=ETH_P_ALL, direct_action=True)
    finally:
        program.cleanup()  # the filter holds its own reference to the loaded program


def _remove_qdisc_if_unused(ipr: Any, index: int, record: PartitionRecord) -> None:
    if not record.owns_qdisc or not _has_clsact(ipr, index):
        return
    if _filters(ipr, index, INGRESS_PARENT) or _filters(ipr, index, EGRESS_PARENT):
        return
    _ignoring(EINVAL, ipr.tc, "del", "clsact", index)  # EINVAL: deleted concurrently
    log.info("%s: removed the clsact qdisc chaos had created", record.interface)


def _ignoring(code: int, call: Any, *args: Any, **kwargs: Any) -> None:
    """Run a netlink request, treating error ``code`` (already gone) as success."""
    pyroute2 = import_system("pyroute2")
    try:
        call(*args, **kwargs)
    except pyroute2.NetlinkError as exc:
        if exc.code != code:
            raise
