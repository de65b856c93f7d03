"""Replica processes for the behaviour tests.

``replica`` is one replica per test module, shared by tests that leave it as they found it (its faults are
removed after each test); ``start_fresh`` starts replicas of a test's own, for tests that drain, crash,
hang or break one. All replicas share one state folder in which the default model is built once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.models.default import ensure_default_model

from .harness import ReplicaProcess, StartFresh, start_replica


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("replica-state")
    ensure_default_model(folder)  # once, before any replica would race to build it
    return folder


@pytest.fixture(scope="module")
def shared_replica(state_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                   request: pytest.FixtureRequest) -> Iterator[ReplicaProcess]:
    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-")
    replica = start_replica(state_dir=state_dir, log_dir=tmp_path_factory.mktemp("logs"),
                            replica_id=f"shared-{module}", zone="zone-a")
    try:
        yield replica
    finally:
        replica.stop()


@pytest.fixture
def replica(shared_replica: ReplicaProcess) -> Iterator[ReplicaProcess]:
    """The module's shared replica; whatever faults a test injected are removed after it."""
    yield shared_replica
    if shared_replica.is_running:
        shared_replica.admin.delete("/admin/faults")


@pytest.fixture
def start_fresh(state_dir: Path, tmp_path: Path) -> Iterator[StartFresh]:
    """Start replicas owned by one test: ``start_fresh("--max-num-seqs", "1", replica_id="r")``."""
    started: list[ReplicaProcess] = []

    def start(*flags: str, replica_id: str = "fresh", zone: str = "zone-b") -> ReplicaProcess:
        replica = start_replica(state_dir=state_dir, log_dir=tmp_path, replica_id=replica_id, zone=zone,
                                flags=flags)
        started.append(replica)
        return replica

    yield start
    for replica in started:
        replica.stop()
