"""The replicas the control plane starts export their spans where the gateway does: ``[gateway]
otlp_traces_endpoint`` and ``otlp_sample_ratio`` become ``inference serve`` flags, on either backend; and
``[fleet] cpu_decode_kernel`` and ``packed_weights`` become the engine's flags the same way."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from controlplane.fleet.backends.base import ReplicaSpec
from controlplane.fleet.backends.local import LocalProcessBackend
from controlplane.fleet.backends.ray import _serve_args
from controlplane.fleet.config import FleetConfig
from controlplane.fleet.reconcile import Fleet
from controlplane.gateway.config import GatewayConfig
from controlplane.store.database import Store
from inference.config import TracingConfig

from .test_reconcile import SimBackend

URL = "http://127.0.0.1:4318/v1/traces"


def spec(tracing: TracingConfig) -> ReplicaSpec:
    return ReplicaSpec("r-1", "az-a", "127.0.0.1", 8101, "default", 1, "token", tracing=tracing)


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def commands(tmp_path: Path, config: FleetConfig) -> list[list[str]]:
    """The command lines both backends would start the replicas of ``config``'s fleet with."""
    tmp_path.mkdir()
    backend = SimBackend()
    with Store(tmp_path / "cp.db") as store:
        fleet = Fleet(config, backend, store, secret=b"s" * 32,  # type: ignore[arg-type]
                      ready_probe=lambda _: asyncio.sleep(0, True))
        asyncio.run(fleet.reconcile())
    assert len(backend.spawned) == config.replicas
    local = LocalProcessBackend(log_dir=tmp_path / "logs", state_dir=tmp_path)
    return [args for spawned in backend.spawned for args in (local.command(spawned), _serve_args(spawned))]


def test_spawned_replicas_carry_the_gateways_trace_settings(tmp_path: Path) -> None:
    gateway = GatewayConfig(otlp_traces_endpoint=URL, otlp_sample_ratio=0.25)
    backend = SimBackend()
    with Store(tmp_path / "cp.db") as store:
        fleet = Fleet(FleetConfig(replicas=2, base_port=18301), backend, store, secret=b"s" * 32,  # type: ignore[arg-type]
                      ready_probe=lambda _: asyncio.sleep(0, True), tracing=gateway.tracing())
        asyncio.run(fleet.reconcile())
    assert len(backend.spawned) == 2
    local = LocalProcessBackend(log_dir=tmp_path / "logs", state_dir=tmp_path)
    for spawned in backend.spawned:
        for args in (local.command(spawned), _serve_args(spawned)):
            assert flag(args, "--otlp-traces-endpoint") == URL and flag(args, "--otlp-sample-ratio") == "0.25"


def test_with_tracing_off_replicas_get_no_trace_flags(tmp_path: Path) -> None:
    local = LocalProcessBackend(log_dir=tmp_path / "logs", state_dir=tmp_path)
    for args in (local.command(spec(TracingConfig())), _serve_args(spec(TracingConfig()))):
        assert not [a for a in args if a.startswith("--otlp")]


@pytest.mark.parametrize(("setting", "flag"), [("cpu_decode_kernel", "--cpu-decode-kernel"),
                                               ("packed_weights", "--packed-weights")])
def test_fleet_engine_switches_reach_every_replica_command_on_either_backend(tmp_path: Path, setting: str,
                                                                            flag: str) -> None:
    """``[fleet] cpu_decode_kernel`` and ``packed_weights``: true and false become the replica's flag and its
    ``--no-`` form; unset, no flag (the replica's default)."""
    for on in (True, False, None):
        config = FleetConfig(replicas=2, base_port=18311, **{setting: on})
        for args in commands(tmp_path / f"{setting}-{on}", config):
            assert (flag in args) == (on is True), args
            assert (f"--no-{flag[2:]}" in args) == (on is False), args


def test_fleet_replica_cpu_limit_reaches_every_replica_command_on_either_backend(tmp_path: Path) -> None:
    for limit in (0.75, None):
        for args in commands(tmp_path / f"limit-{limit}", FleetConfig(replicas=2, base_port=18321,
                                                                      replica_cpu_limit=limit)):
            assert flag(args, "--cpu-limit") == (None if limit is None else "0.75"), args


def test_a_cpu_limit_under_a_tenth_of_a_core_is_a_config_problem() -> None:
    from controlplane.fleet.config import fleet_problems

    assert fleet_problems(FleetConfig(replica_cpu_limit=0.5)) == []
    assert fleet_problems(FleetConfig(replica_cpu_limit=0.05)) == [
        ("fleet.replica_cpu_limit", "must be at least 0.1 (cores) or unset")]
