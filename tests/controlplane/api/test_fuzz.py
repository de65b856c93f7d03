"""Schemathesis against the whole REST API's ``/openapi.json``, served over a real socket: as an admin (every
operation, with bodies and parameters generated from the spec, boundary values and wrong types), as a
caller with no token, and as a gateway (its two routes). Not one response is a 5xx, and every status,
content type, header and body is one the spec declares for that operation.

CI size by default (a few examples per operation; about a minute here); ``make fuzz`` sets
``FUZZ_EXAMPLES``, ``FUZZ_MAX_TIME_S`` and ``FUZZ_PHASES`` (stateful too) for a longer run. The counts of
each run are printed (``-s``)."""

from __future__ import annotations

import os

import pytest

from tests.fuzz import FuzzRun, fuzz, listening

from .conftest import Served

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "3"))
MAX_TIME_S = int(os.environ.get("FUZZ_MAX_TIME_S", "0")) or None
SEED = int(os.environ.get("FUZZ_SEED", "0"))
PHASES = os.environ.get("FUZZ_PHASES", "examples,coverage,fuzzing")


def run(served: Served, label: str, role: str | None, *, paths: str | None = None,
        examples: int = EXAMPLES) -> FuzzRun:
    headers = {"Authorization": f"Bearer {served.token(role)}"} if role else {}
    with listening(served.app) as url:
        found = fuzz(f"{url}/openapi.json", label=label, headers=headers, max_examples=examples, seed=SEED,
                     include_path_regex=paths, max_time_s=MAX_TIME_S, phases=PHASES)
    print(found.summary())
    return found


def test_as_an_admin_no_answer_is_a_5xx_or_off_the_spec(served: Served) -> None:
    found = run(served, "REST API, admin token", "admin")
    assert found.cases > 500 and found.responses >= found.cases
    assert (found.server_errors, found.spec_violations) == (0, 0), found.explain()


def test_without_a_token_no_answer_is_a_5xx_or_off_the_spec(served: Served) -> None:
    found = run(served, "REST API, no token", None, examples=min(EXAMPLES, 2))
    assert found.statuses.get(401, 0) > 0
    assert (found.server_errors, found.spec_violations) == (0, 0), found.explain()


def test_as_a_gateway_no_answer_is_a_5xx_or_off_the_spec(served: Served) -> None:
    found = run(served, "REST API, gateway token", "gateway", paths="^/api/v1/gateway/")
    assert found.statuses.get(200, 0) > 0
    assert (found.server_errors, found.spec_violations) == (0, 0), found.explain()
