"""The lab's hosts by address, as the fleet's :class:`~controlplane.fleet.cluster.HostControl`: a stopped
node's host starts its Ray node again, a host's link goes down and up."""

from __future__ import annotations

from controlplane.lab.lab import Lab


class LabHosts:
    def __init__(self, lab: Lab) -> None:
        self.lab = lab

    @classmethod
    def find(cls) -> LabHosts | None:
        """The lab on this machine, if one was built."""
        lab = Lab.find()
        return None if lab is None else cls(lab)

    def knows(self, address: str) -> bool:
        host = self.lab.config.host_at(address)
        return host is not None and not host.is_head

    def restart(self, address: str) -> None:
        self.lab.start_host(self._name(address))

    def set_link(self, address: str, *, up: bool) -> None:
        self.lab.set_link(self._name(address), up=up)

    def _name(self, address: str) -> str:
        host = self.lab.config.host_at(address)
        if host is None:
            raise ValueError(f"address: {address} is not a host of the lab")
        return host.name
