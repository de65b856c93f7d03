"""The cluster fault kinds' contract without a cluster: listed, with the reason they cannot run here, and
their specs checked before anything is touched. They run for real on Ray in ``tests/controlplane/ray/``."""

from __future__ import annotations

import asyncio

import pytest

from chaos.catalogue import default_catalogue
from chaos.faults.base import FaultError, FaultSpec, FaultUnavailable, RevertToken
from chaos.faults.cluster import NodeLossFault
from chaos.faults.zone import ZoneOutageFault


@pytest.mark.parametrize("kind", ["node-loss", "node-partition", "actor-kill"])
def test_without_a_cluster_each_kind_is_listed_unavailable_with_its_reason(kind: str) -> None:
    catalogue = default_catalogue(optional_modules=())
    info = catalogue.info(kind)
    assert info.family == "node" and info.takes_down and not info.available
    assert info.unavailable_reason is not None and 'fleet.backend = "ray"' in info.unavailable_reason
    with pytest.raises(FaultUnavailable):
        catalogue.get(kind)


def test_a_bad_scope_is_refused_naming_the_parameter() -> None:
    with pytest.raises(ValueError, match=r"params\.scope: must be one of node, zone"):
        NodeLossFault(None).validate(FaultSpec("node-loss", {"scope": "rack"}))
    with pytest.raises(ValueError, match=r"params\.node: unknown parameter"):
        NodeLossFault(None).validate(FaultSpec("node-loss", {"node": "10.0.0.1"}))


def test_the_zone_outages_cluster_modes_need_a_cluster() -> None:
    outage = ZoneOutageFault()
    for mode in ("node-loss", "link-down"):
        with pytest.raises(FaultUnavailable, match=f"params.mode: {mode} needs a cluster"):
            outage.validate(FaultSpec("zone-outage", {"zone": "az-b", "mode": mode}))
    assert "node-loss and link-down need a cluster" in outage.describe().description


def test_a_node_restart_without_a_cluster_fails_so_that_it_is_retried_where_one_is() -> None:
    """The expiry guard (a process with no cluster) cannot restart a node: it fails, retryable, and the
    control plane (its timer, or the next one's revert of leftovers) restarts it."""
    token = RevertToken("node-loss", "az-b-1", "restart_nodes", {"nodes": '[["n1", "10.199.0.4", "az-b"]]'})
    with pytest.raises(FaultError, match="no cluster in this process") as caught:
        asyncio.run(NodeLossFault(None).revert(token))
    assert getattr(caught.value, "retryable", False)
    asyncio.run(NodeLossFault(None).revert(RevertToken("node-loss", "az-b-1", "none", {})))  # nothing to do
