"""The replicas the control plane starts export their spans where the gateway does: ``[gateway]
otlp_traces_endpoint`` and ``otlp_sample_ratio`` become ``inference serve`` flags, on either backend; and
``[fleet] cpu_decode_kernel`` becomes the engine's flag the same way."""

from __future__ import annotations

import asyncio
from pathlib import Path

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


def test_fleet_cpu_decode_kernel_reaches_every_replica_command_on_either_backend(tmp_path: Path) -> None:
    local = LocalProcessBackend(log_dir=tmp_path / "logs", state_dir=tmp_path)
    for on in (True, False, None):
        backend = SimBackend()
        with Store(tmp_path / f"cp-{on}.db") as store:
            fleet = Fleet(FleetConfig(replicas=2, base_port=18311, cpu_decode_kernel=on), backend,  # type: ignore[arg-type]
                          store, secret=b"s" * 32, ready_probe=lambda _: asyncio.sleep(0, True))
            asyncio.run(fleet.reconcile())
        assert len(backend.spawned) == 2
        for spawned in backend.spawned:
            for args in (local.command(spawned), _serve_args(spawned)):
                assert ("--cpu-decode-kernel" in args) == (on is True), args
                assert ("--no-cpu-decode-kernel" in args) == (on is False), args
