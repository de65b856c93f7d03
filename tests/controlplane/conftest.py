"""Fixtures shared by the control plane's unit tests: a simulated clock and a store on it; no test leaves an
idle what-if worker (kept for the next run, :mod:`controlplane.sim.batch`) to the next."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.sim.batch import close_idle_workers
from controlplane.store.database import Store


class FakeClock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock) -> Iterator[Store]:
    with Store(tmp_path / "state.db", clock=clock) as opened:
        yield opened


@pytest.fixture(autouse=True)
def _no_idle_worker_left() -> Iterator[None]:
    yield
    close_idle_workers()
