"""Schemathesis against the OpenAI endpoints' own specs (``/openapi.json``): a replica's, called directly
with its API key and without, and a gateway's in front of another replica, with its client key and
without. The specs publish the real request and response bodies, so the fuzzer sends completions and
chats built from them (and breaks them: wrong types, boundary values, missing fields); not one answer is
a 5xx, and every status, content type and body is one the spec declares.

Generated requests are capped at a few new tokens (:mod:`tests.fuzz_hooks`). CI size by default;
``make fuzz`` sets ``FUZZ_EXAMPLES``, ``FUZZ_MAX_TIME_S`` and ``FUZZ_PHASES``. The counts are printed
(``-s``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.handler import Gateway
from controlplane.gateway.server import create_gateway_app
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from tests.fuzz import FuzzRun, fuzz, listening
from tests.replica.harness import ReplicaProcess, start_replica

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "3"))
MAX_TIME_S = int(os.environ.get("FUZZ_MAX_TIME_S", "0")) or None
SEED = int(os.environ.get("FUZZ_SEED", "0"))
PHASES = os.environ.get("FUZZ_PHASES", "examples,coverage,fuzzing")
REPLICA_KEY = "fuzz-replica-key"
GATEWAY_KEY = "fuzz-gateway-key"
OPENAI = "^/v1/"


@pytest.fixture(scope="module")
def keyed_replica(state_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaProcess]:
    replica = start_replica(state_dir=state_dir, log_dir=tmp_path_factory.mktemp("logs"),
                            replica_id="fuzz-keyed", api_key=REPLICA_KEY, admin_token=None)
    yield replica
    replica.stop()


@pytest.fixture(scope="module")
def gateway_url(state_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway that wants ``GATEWAY_KEY``, in front of a replica of its own (which wants no key)."""
    replica = start_replica(state_dir=state_dir, log_dir=tmp_path_factory.mktemp("logs"),
                            replica_id="fuzz-behind", api_key=None, admin_token=None)
    endpoint = ReplicaEndpoint(replica.replica_id, replica.zone, "127.0.0.1", replica.port,
                               ReplicaState.READY, "default", pid=replica.proc.pid)
    gateway = Gateway(GatewayConfig(api_keys=[GATEWAY_KEY]), endpoints=lambda: [endpoint])
    try:
        with listening(create_gateway_app(gateway), lifespan="on") as url:
            yield url
    finally:
        replica.stop()


def run(url: str, label: str, key: str | None) -> FuzzRun:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    found = fuzz(f"{url}/openapi.json", label=label, headers=headers, max_examples=EXAMPLES, seed=SEED,
                 include_path_regex=OPENAI, max_time_s=MAX_TIME_S, phases=PHASES)
    print(found.summary())
    return found


def test_a_replica_with_its_key_answers_as_its_spec_says(keyed_replica: ReplicaProcess) -> None:
    found = run(keyed_replica.base_url, "replica, API key", REPLICA_KEY)
    assert found.statuses.get(200, 0) > 0 and found.statuses.get(400, 0) > 0
    assert (found.server_errors, found.spec_violations) == (0, 0), found.explain()


def test_a_replica_without_its_key_answers_as_its_spec_says(keyed_replica: ReplicaProcess) -> None:
    found = run(keyed_replica.base_url, "replica, no key", None)
    assert found.statuses.get(401, 0) > 0
    assert (found.server_errors, found.spec_violations) == (0, 0), found.explain()


def test_a_gateway_with_its_key_answers_as_its_spec_says(gateway_url: str) -> None:
    found = run(gateway_url, "gateway, client key", GATEWAY_KEY)
    assert found.statuses.get(200, 0) > 0 and found.statuses.get(400, 0) > 0
    assert (found.server_errors, found.spec_violations) == (0, 0), found.explain()


def test_a_gateway_without_its_key_answers_as_its_spec_says(gateway_url: str) -> None:
    found = run(gateway_url, "gateway, no key", None)
    assert found.statuses.get(401, 0) > 0
    assert (found.server_errors, found.spec_violations) == (0, 0), found.explain()
