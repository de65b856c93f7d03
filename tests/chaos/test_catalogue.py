"""The catalogue and the shared vocabulary: kinds, availability, spec and token validation."""

from __future__ import annotations

import sys
import types

import pytest

from chaos.catalogue import Catalogue, default_catalogue
from chaos.faults.base import FaultSpec, FaultUnavailable, RevertToken
from chaos.faults.replica import ReplicaFault

from .fakes import RecordingFault

REPLICA_KINDS = {"token_latency", "prefill_delay", "error_rate", "hang", "device_failure", "kv_pressure",
                 "crash"}
CLUSTER_KINDS = {"node-loss", "node-partition", "actor-kill"}


def test_default_catalogue_lists_process_and_replica_kinds() -> None:
    infos = {i.kind: i for i in default_catalogue(optional_modules=()).describe()}
    assert {"kill", "terminate", "pause", "link-delay", "link-abort"} | REPLICA_KINDS | CLUSTER_KINDS \
        == set(infos)
    assert all(i.available for k, i in infos.items() if not k.startswith("link-") and k not in CLUSTER_KINDS)
    # The link kinds need the gateway's toxics, which only a control plane passes in; the node kinds need
    # a cluster, which only a control plane on Ray passes in.
    assert infos["link-delay"].unavailable_reason == "no gateway in this process to apply link toxics"
    assert all("not on a cluster" in str(infos[k].unavailable_reason) for k in CLUSTER_KINDS)
    assert infos["pause"].takes_down and not infos["token_latency"].takes_down
    assert [p.name for p in infos["error_rate"].params] == ["probability", "status_code", "colour"]


def test_kind_whose_module_reports_itself_unavailable_is_listed_with_its_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("fake_network")
    module.faults = lambda: [RecordingFault(name="drop")]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_network", module)
    catalogue = default_catalogue(optional_modules=("fake_network",))
    assert catalogue.info("drop").available
    catalogue.register(RecordingFault(name="partition", unavailable_reason="bcc not installed"))
    info = catalogue.info("partition")
    assert not info.available and info.unavailable_reason == "bcc not installed"
    with pytest.raises(FaultUnavailable, match=r"^unavailable: bcc not installed$"):
        catalogue.get("partition")


def test_optional_module_that_fails_to_import_is_listed_as_unavailable() -> None:
    catalogue = default_catalogue(optional_modules=("chaos.faults.no_such_family",))
    info = catalogue.info("no_such_family")
    assert not info.available and "No module named" in (info.unavailable_reason or "")
    with pytest.raises(FaultUnavailable, match=r"^unavailable: "):
        catalogue.get("no_such_family")


def test_unknown_kind_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="unknown fault kind 'nope'"):
        Catalogue([RecordingFault()]).get("nope")


@pytest.mark.parametrize("params, message", [
    ({}, "params.seconds: required"), ({"seconds": 0}, "seconds: must be in \\(0, 60\\]"),
    ({"seconds": "x"}, "params.seconds: must be a number"), ({"seconds": 1, "extra": 2}, "params.extra"),
])
def test_replica_fault_validation_names_the_field(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReplicaFault("token_latency").validate(FaultSpec("token_latency", params))  # type: ignore[arg-type]


def test_error_rate_status_code_defaults_and_is_checked() -> None:
    fault = ReplicaFault("error_rate")
    fault.validate(FaultSpec("error_rate", {"probability": 0.5}))
    with pytest.raises(ValueError, match="status_code: must be 500 or 503"):
        fault.validate(FaultSpec("error_rate", {"probability": 0.5, "status_code": 404}))


@pytest.mark.parametrize("duration", [0, -1, float("inf")])
def test_spec_refuses_a_bad_duration(duration: float) -> None:
    with pytest.raises(ValueError, match="duration_s"):
        FaultSpec("pause", duration_s=duration)


def test_revert_token_round_trips_through_json() -> None:
    token = RevertToken("pause", "r0", "signal", {"pid": 12, "start_time": 34, "signal": "SIGCONT"})
    assert RevertToken.from_json(token.to_json()) == token
    with pytest.raises(ValueError, match="action: required"):
        RevertToken.from_json({"kind": "pause", "target": "r0"})
