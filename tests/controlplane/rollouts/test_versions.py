"""The version registry in a real store: versions and releases survive a reopen, names are checked, a
duplicate is a conflict."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.rollouts.versions import (
    UnknownVersion,
    VersionError,
    VersionExists,
    VersionRegistry,
)
from controlplane.store.database import Store


def test_versions_and_releases_survive_reopening_the_store(tmp_path: Path) -> None:
    registry = VersionRegistry(Store(tmp_path / "state.db"), clock=lambda: 100.0)
    registry.add("v1", "default", notes="first")
    registry.add("v2", "/models/v2")
    registry.set_current("v1")
    release = registry.begin_release("v2", "v1", "canary")
    release.steps.append({"share": 0.05, "decision": "next"})
    registry.save_release(release)
    registry.set_analysis("v2", {"verdict": "pass"})

    reopened = VersionRegistry(Store(tmp_path / "state.db"))
    assert [v.name for v in reopened.all()] == ["v1", "v2"]
    assert reopened.get("v1").notes == "first" and reopened.get("v1").created == 100.0
    assert reopened.get("v2").last_analysis == {"verdict": "pass"}
    assert reopened.current() == "v1"
    [saved] = reopened.releases()
    assert (saved.id, saved.version, saved.from_version, saved.outcome) == (release.id, "v2", "v1", "running")
    assert saved.steps == [{"share": 0.05, "decision": "next"}]


def test_bad_and_duplicate_names_are_refused(tmp_path: Path) -> None:
    registry = VersionRegistry(Store(tmp_path / "state.db"))
    registry.add("v1", "default")
    with pytest.raises(VersionExists):
        registry.add("v1", "default")
    with pytest.raises(VersionError, match="name"):
        registry.add("V 1", "default")
    with pytest.raises(VersionError, match="model"):
        registry.add("v3", "  ")
    with pytest.raises(UnknownVersion):
        registry.set_current("v9")
    with pytest.raises(UnknownVersion):
        registry.begin_release("v9", "v1", "canary")
    with pytest.raises(VersionError, match="kind"):
        registry.begin_release("v1", "v1", "big-bang")
