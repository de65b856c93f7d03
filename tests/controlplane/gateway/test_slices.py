"""Traffic slices: a version's share of requests is its weight whatever its replica count, a conversation
stays on one version, colours cut across versions, and each slice keeps what it saw."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.gateway.slices import (
    STABLE,
    VERSION_LABEL,
    Assignment,
    Outcome,
    Share,
    SlicePlan,
    SliceSamples,
    assign,
    conversation_key,
)


def _shares(plan: SlicePlan, n: int = 20_000) -> tuple[dict[str, float], dict[str | None, float]]:
    versions: dict[str, float] = {}
    colours: dict[str | None, float] = {}
    for i in range(n):
        a = assign(plan, f"request:{i}")
        versions[a.version] = versions.get(a.version, 0) + 1 / n
        colours[a.colour] = colours.get(a.colour, 0) + 1 / n
    return versions, colours


def test_each_version_gets_its_share_and_the_rest_stays_stable() -> None:
    plan = SlicePlan(split=(Share("v2", 0.05),))
    versions, colours = _shares(plan)
    assert versions["v2"] == pytest.approx(0.05, abs=0.006)
    assert versions[STABLE] == pytest.approx(0.95, abs=0.006)
    assert colours == {None: pytest.approx(1.0)}
    assert plan.share_of(STABLE) == pytest.approx(0.95)


def test_colours_cut_across_versions_independently() -> None:
    plan = SlicePlan(split=(Share("v2", 0.5),), colours=(Share("chaos", 0.1), Share("control", 0.1)))
    n = 20_000
    both = sum(1 for i in range(n) if (a := assign(plan, f"k{i}")).version == "v2" and a.colour == "chaos")
    _, colours = _shares(plan, n)
    assert colours["chaos"] == pytest.approx(0.1, abs=0.01)
    assert colours["control"] == pytest.approx(0.1, abs=0.01)
    assert both / n == pytest.approx(0.05, abs=0.008)  # independent: 0.5 x 0.1


def test_a_conversation_keeps_its_version_as_it_grows() -> None:
    plan = SlicePlan(split=(Share("v2", 0.3),))
    first_turn = conversation_key({}, [111], "a")
    later_turn = conversation_key({}, [111, 222, 333], "b")  # the same first block: the same conversation
    assert assign(plan, first_turn) == assign(plan, later_turn)
    assert conversation_key({"x-session-id": "s1"}, [111], "a") == "session:s1"
    assert conversation_key({}, [], "r9") == "request:r9"


def test_raising_a_share_only_moves_conversations_onto_the_new_version() -> None:
    """Shares grow from the bottom of [0, 1): a step from 5% to 20% keeps the 5% where they were."""
    small, large = SlicePlan(split=(Share("v2", 0.05),)), SlicePlan(split=(Share("v2", 0.2),))
    keys = [f"k{i}" for i in range(5_000)]
    assert all(assign(large, k).version == "v2" for k in keys if assign(small, k).version == "v2")


def test_assignment_headers_name_the_colour_for_the_replica() -> None:
    assert Assignment().upstream_headers() == {}
    headers = Assignment("v2", "chaos").upstream_headers()
    assert headers == {"x-llmsre-colour": "chaos", "baggage": "llmsre.colour=chaos"}
    assert Assignment("v2", "chaos").slices() == ["version:v2", "colour:chaos"]
    assert Assignment().slices() == ["version:stable"]


@pytest.mark.parametrize(("raw", "message"), [
    ({"split": {"v2": 0.7, "v3": 0.4}}, "add up to more than 1"),
    ({"split": {"v2": 1.5}}, "must be in [0, 1]"),
    ({"split": {"Bad Name": 0.1}}, "name"),
    ({"colours": {"chaos.1": 0.1}}, "colour 'chaos.1'"),
])
def test_a_bad_plan_is_refused(raw: dict[str, dict[str, float]], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SlicePlan.from_json(raw)


def test_plan_round_trips_through_json() -> None:
    plan = SlicePlan(split=(Share("v2", 0.2),), colours=(Share("chaos", 0.1),))
    assert SlicePlan.from_json(plan.to_json()) == plan
    assert SlicePlan.from_json(None) == SlicePlan()


def test_samples_are_kept_per_slice_bounded_and_read_since_a_time() -> None:
    samples = SliceSamples(capacity=3)
    for i in range(5):
        samples.record(Assignment("v2", "chaos"), Outcome(float(i), i % 2 == 0, 0.1 * i, 0.01))
    samples.record(Assignment(), Outcome(10.0, False, None, None))
    recent = samples.since(3.0)
    assert [o.at for o in recent["version:v2"]] == [3.0, 4.0]
    assert [o.at for o in recent["colour:chaos"]] == [3.0, 4.0]
    assert [o.ok for o in recent["version:stable"]] == [False]
    assert len(samples.since(0.0)["version:v2"]) == 3  # bounded
    raw = samples.to_json(4.0)
    assert [Outcome.from_json(r) for r in raw["version:v2"]] == [Outcome(4.0, True, 0.4, 0.01)]


# ---- through the gateway, against in-process fake replicas ------------------------------------
def test_the_gateway_sends_each_version_its_share_and_colours_its_slices() -> None:
    """1,000 requests: the canary version (one replica of three) gets its 20%, not a third; the chaos and
    control colours 10% each, on both versions; every request is recorded in its slices."""
    from .fakes import MODEL, FakeFleet
    from .test_fake_replicas import Harness

    fleet = FakeFleet()
    fleet["r2"].labels = ((VERSION_LABEL, "v2"),)
    plan = SlicePlan(split=(Share("v2", 0.2),), colours=(Share("chaos", 0.1), Share("control", 0.1)))
    n = 1_000

    async def main() -> None:
        harness = Harness(fleet, slices=lambda: plan)
        try:
            for i in range(n):
                body = {"model": MODEL, "prompt": f"q{i}", "max_tokens": 2, "temperature": 0.0}
                response = await harness.post("/v1/completions", body)
                assert response.status_code == 200, response.text
            samples = harness.gateway.ledger.samples.since(0.0)
        finally:
            await harness.close()
        canary = len(fleet["r2"].requests) / n
        headers = [h for r in fleet.replicas.values() for h in r.headers]
        chaos = sum(h.get("x-llmsre-colour") == "chaos" for h in headers) / n
        control = sum(h.get("x-llmsre-colour") == "control" for h in headers) / n
        print(f"split over {n} requests: canary {canary:.1%} (target 20%), chaos {chaos:.1%}, "
              f"control {control:.1%} (targets 10%)")
        assert abs(canary - 0.2) < 0.04  # binomial sd at n=1,000: 1.3 points
        assert abs(chaos - 0.1) < 0.03 and abs(control - 0.1) < 0.03
        assert all(h.get("baggage") == f"llmsre.colour={h['x-llmsre-colour']}" for h in headers
                   if "x-llmsre-colour" in h)
        assert len(samples["version:v2"]) == len(fleet["r2"].requests)
        assert len(samples["version:stable"]) == n - len(fleet["r2"].requests)
        assert all(o.ok and o.ttft_s is not None for o in samples["colour:chaos"])

    asyncio.run(main())


def test_a_canary_without_a_ready_replica_sends_its_share_to_the_stable_fleet() -> None:
    from controlplane.replicas import ReplicaState

    from .fakes import MODEL, FakeFleet
    from .test_fake_replicas import Harness

    fleet = FakeFleet()
    fleet["r2"].labels = ((VERSION_LABEL, "v2"),)
    fleet["r2"].state = ReplicaState.STARTING
    plan = SlicePlan(split=(Share("v2", 0.5),))

    async def main() -> None:
        harness = Harness(fleet, slices=lambda: plan)
        try:
            for i in range(40):
                body = {"model": MODEL, "prompt": f"q{i}", "max_tokens": 2, "temperature": 0.0}
                assert (await harness.post("/v1/completions", body)).status_code == 200
        finally:
            await harness.close()
        assert fleet["r2"].requests == []
        assert len(fleet["r0"].requests) + len(fleet["r1"].requests) == 40

    asyncio.run(main())


def test_the_gateway_counts_requests_by_version_and_colour() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from .fakes import MODEL, FakeFleet
    from .test_fake_replicas import Harness

    fleet = FakeFleet()
    fleet["r2"].labels = ((VERSION_LABEL, "v2"),)
    plan = SlicePlan(split=(Share("v2", 0.5),), colours=(Share("chaos", 0.5),))

    async def main() -> dict[tuple[str, str, str], float]:
        harness = Harness(fleet, slices=lambda: plan)
        try:
            for i in range(40):
                body = {"model": MODEL, "prompt": f"q{i}", "max_tokens": 2, "temperature": 0.0}
                assert (await harness.post("/v1/completions", body)).status_code == 200
            page = harness.gateway.metrics.page().decode()
        finally:
            await harness.close()
        return {(s.name, s.labels.get("version", s.labels.get("colour", "")), s.labels["outcome"]): s.value
                for f in text_string_to_metric_families(page) for s in f.samples
                if s.name.endswith(("version_requests_total", "colour_requests_total"))}

    counts = asyncio.run(main())
    by_version = {k[1]: v for k, v in counts.items() if k[0].endswith("version_requests_total")}
    assert by_version["v2"] == len(fleet["r2"].requests) and by_version["stable"] == 40 - by_version["v2"]
    assert 0 < counts[("llmsre_gateway_colour_requests_total", "chaos", "ok")] < 40


def test_a_coloured_requests_failures_eject_no_replica_so_the_uncoloured_keep_the_fleet() -> None:
    """Every replica fails the chaos colour's requests (a slice experiment's error_rate fault). Those
    failures are the experiment's measurement, not evidence against the replicas: were they counted, three
    of them in a row would eject every replica and the uncoloured requests would be refused (503) too,
    which is the blast radius the experiment promises to keep."""
    from .fakes import MODEL, FakeFleet
    from .test_fake_replicas import Harness

    fleet = FakeFleet()
    for replica in fleet.replicas.values():
        replica.behaviour.refuse_colour = "chaos"
    plan = SlicePlan(colours=(Share("chaos", 0.5),))
    sessions = [f"s{i}" for i in range(200)]
    chaos = [s for s in sessions if assign(plan, f"session:{s}").colour == "chaos"][:10]
    plain = [s for s in sessions if assign(plan, f"session:{s}").colour is None][:10]

    async def main() -> tuple[list[int], list[int], set[str]]:
        harness = Harness(fleet, slices=lambda: plan)
        try:
            body = {"model": MODEL, "prompt": "q", "max_tokens": 2, "temperature": 0.0}
            failed = [(await harness.post("/v1/completions", body, **{"x-session-id": s})).status_code
                      for s in chaos]
            served = [(await harness.post("/v1/completions", body, **{"x-session-id": s})).status_code
                      for s in plain]
            return failed, served, set(harness.gateway.outliers.ejected)
        finally:
            await harness.close()

    failed, served, ejected = asyncio.run(main())
    assert len(chaos) == len(plain) == 10
    assert all(code >= 500 for code in failed), failed  # the colour's requests felt the fault...
    assert ejected == set()  # ...and no replica was ejected for it
    assert served == [200] * 10, served  # the uncoloured requests were served by the whole fleet


def test_a_colour_spends_retries_from_a_budget_of_its_own() -> None:
    """r0 fails every request; r1 and r2 fail the chaos colour's. The colour's requests spend its own
    budget (ratio 0: the floor of 3 retries per window) and then fail without retrying; the uncoloured
    requests that meet r0 after that still retry, on their own budget, and are served."""
    from .fakes import MODEL, FakeFleet
    from .test_fake_replicas import Harness

    fleet = FakeFleet()
    fleet["r0"].behaviour.refuse_status = 500
    for rid in ("r1", "r2"):
        fleet[rid].behaviour.refuse_colour = "chaos"
    plan = SlicePlan(colours=(Share("chaos", 0.5),))
    sessions = [f"s{i}" for i in range(200)]
    chaos = [s for s in sessions if assign(plan, f"session:{s}").colour == "chaos"][:6]
    plain = [s for s in sessions if assign(plan, f"session:{s}").colour is None][:3]

    async def main() -> tuple[list[int], list[int], int]:
        harness = Harness(fleet, slices=lambda: plan, routing="least-request", retry_budget_ratio=0.0,
                          eject_after_failures=100)
        try:
            body = {"model": MODEL, "prompt": "q", "max_tokens": 2, "temperature": 0.0}
            failed = [(await harness.post("/v1/completions", body, **{"x-session-id": s})).status_code
                      for s in chaos]
            tried = len(fleet["r0"].requests) + len(fleet["r1"].requests) + len(fleet["r2"].requests)
            served = [(await harness.post("/v1/completions", body, **{"x-session-id": s})).status_code
                      for s in plain]
            return failed, served, tried
        finally:
            await harness.close()

    failed, served, tried = asyncio.run(main())
    assert failed == [500] * 6
    assert tried == 6 + 3  # six first attempts and the colour's three retries, then no more
    assert served == [200] * 3, served  # each retried off r0 although the colour had spent its retries
