"""The first drill on a fresh state folder, started the moment ``controlplane up`` answers, as a new user
runs it: it waits for the steady state (the replicas are still starting), says what it waited for, and
passes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from chaos.drills import LOAD_GRACE_S, LOAD_START_TIMEOUT_S, STREAM_WAIT_S
from chaos.scenarios import SCENARIOS

from .conftest import START_TIMEOUT_S, shutdown, start, write_config

# exclusive: the drill judges a 1 s RTO, which a second test worker on the same cores can push past
pytestmark = [pytest.mark.exclusive, pytest.mark.slow, pytest.mark.timeout(900)]

TOKEN = "admin-token-for-the-first-drill"
SCENARIO = SCENARIOS["replica-crash"]
LOAD = ["--rate", "4", "--duration", "10", "--fault-at", "3", "--max-tokens", "16"]
# The drill's own bounds: its steady-state wait, the load's start, the load, the wait for a stream, the
# observation and the load's grace; and the API's own start before it.
DRILL_BOUND_S = (START_TIMEOUT_S + SCENARIO.steady_state_timeout_s + LOAD_START_TIMEOUT_S + 10 + STREAM_WAIT_S
                 + SCENARIO.capacity_deadline_s + LOAD_GRACE_S + 60)


def test_a_drill_started_right_after_up_waits_for_the_steady_state_and_passes(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp("first")  # a fresh state folder: the model is built by `up` itself
    running = start(write_config(tmp, replicas=2), tmp, TOKEN)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # the API answers before any replica is ready
            assert running.process.poll() is None, running.log.read_text()[-3000:]
            try:
                if httpx.get(f"{running.api}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the API never answered"
            time.sleep(0.1)
        with running.client() as client:
            ready_at_start = client.fleet().ready_replicas
        drill = subprocess.run([sys.executable, "-m", "controlplane", "--url", running.api, "--token", TOKEN,
                                "drill", "run", SCENARIO.id, "--wait", *LOAD], capture_output=True, text=True,
                               timeout=DRILL_BOUND_S)
    finally:
        shutdown(running)
    print(drill.stdout[-3000:])
    assert drill.returncode == 0, drill.stdout[-3000:] + drill.stderr[-3000:]
    assert "- status: **passed**" in drill.stdout
    if ready_at_start < 2:  # it had to wait, and says what for
        waited = next(line for line in drill.stdout.splitlines() if line.startswith("- steady state reached"))
        assert "waited for: fleet:" in waited, waited
    assert "IndexError" not in drill.stdout + drill.stderr
    assert Path(running.state_dir / "controlplane.db").exists()
