"""Bad links and hung replicas, against in-process fake replicas: a refused link (a Toxiproxy-like toxic)
is retried elsewhere and ejects the replica, a reset link resumes the stream elsewhere without losing a
token, a slow link delays only the requests that go through it, removing a toxic restores the link; and
requests waiting on a replica that stalls move before their first-byte timeout."""

from __future__ import annotations

import asyncio
import time

import pytest

from chaos.faults.base import FaultSpec
from chaos.faults.link import LinkAbortFault, LinkDelayFault
from chaos.targets import Selector
from controlplane.gateway.toxics import LinkToxics, LocalLinks

from .fakes import expected_completion, sse_payloads, stream_token_ids
from .test_fake_replicas import Harness, body_of, path_of, run


class Replica:
    def __init__(self, replica_id: str) -> None:
        self.replica_id, self.zone, self.pid, self.port, self.admin_url = replica_id, "az-a", None, 1, ""


def test_refused_link_is_retried_elsewhere_and_ejects_the_replica() -> None:
    async def body(h: Harness) -> None:
        toxic = h.gateway.toxics.add("r0", {"kind": "refuse"})
        tried = []
        for _ in range(3):
            response = await h.post(path_of("completion"), body_of("completion", stream=True))
            assert response.status_code == 200 and response.headers["x-replica-id"] != "r0"
            tried.append(response.headers.get("x-gateway-tried"))
        assert tried == ["r0", None, None]  # the client is told which replica failed it first
        assert "r0" in h.gateway.ejected()
        assert not h.fleet["r0"].requests  # nothing reached the replica itself
        assert h.gateway.toxics.remove(toxic) and not h.gateway.toxics
    run(body, eject_after_failures=1, routing="round-robin")


def test_reset_link_cuts_streams_and_the_gateway_resumes_them_elsewhere() -> None:
    async def body(h: Harness) -> None:
        h.gateway.toxics.add("r0", {"kind": "reset", "after_s": 0.0})
        request = body_of("completion", stream=True, return_token_ids=True)
        response = await h.post(path_of("completion"), request)
        tokens, _ = expected_completion("completion", body_of("completion"))
        events = sse_payloads(response.text)
        assert events[-1] == "[DONE]" and stream_token_ids(events) == tokens
        [trace] = h.traces
        assert trace.replica_id != "r0" and trace.error is None
        assert trace.resumes + trace.retries == 1
    run(body, routing="round-robin")


def test_slow_link_delays_requests_through_it_only() -> None:
    async def body(h: Harness) -> None:
        h.gateway.toxics.add("r0", {"kind": "latency", "latency_s": 0.3})
        timed: dict[str, float] = {}
        for _ in range(3):
            started = time.monotonic()
            response = await h.post(path_of("completion"), body_of("completion", max_tokens=2))
            timed[response.headers["x-replica-id"]] = time.monotonic() - started
        assert timed["r0"] >= 0.3 and timed["r1"] < 0.3 and timed["r2"] < 0.3
    run(body, routing="round-robin")


def test_toxics_validate_their_kind_and_values() -> None:
    toxics = LinkToxics()
    with pytest.raises(ValueError, match="kind"):
        toxics.add("r0", {"kind": "bandwidth"})
    with pytest.raises(ValueError, match=">= 0"):
        toxics.add("r0", {"kind": "latency", "latency_s": -1})
    assert not toxics.remove("toxic-404")


def test_link_faults_inject_into_and_revert_from_the_gateway_toxics() -> None:
    toxics = LinkToxics()
    delay, abort = LinkDelayFault(LocalLinks(toxics)), LinkAbortFault(LocalLinks(toxics))
    slow = FaultSpec("link-delay", {"latency_ms": 250, "jitter_ms": 0}, 10, Selector())
    cut = FaultSpec("link-abort", {"mode": "reset", "after_ms": 500}, 10, Selector())

    async def scenario() -> None:
        delay.validate(slow)
        abort.validate(cut)
        tokens = [await delay.inject(slow, Replica("r0")), await abort.inject(cut, Replica("r1"))]
        assert toxics.request_delay("r0") == pytest.approx(0.25) and toxics.request_delay("r1") == 0
        assert [t.kind for t in toxics.active("r1")] == ["reset"]
        for token in tokens:
            await (delay if token.kind == "link-delay" else abort).revert(token)
            await (delay if token.kind == "link-delay" else abort).revert(token)  # idempotent
        assert not toxics

    asyncio.run(scenario())
    with pytest.raises(ValueError, match=r"params\.mode"):
        abort.validate(FaultSpec("link-abort", {"mode": "drop"}, 10, Selector()))
    with pytest.raises(ValueError, match=r"params\.latency_ms"):
        delay.validate(FaultSpec("link-delay", {"latency_ms": 0}, 10, Selector()))


def test_without_a_gateway_the_link_kinds_are_listed_unavailable() -> None:
    info = LinkDelayFault(None).describe()
    assert not info.available and "no gateway" in (info.unavailable_reason or "")
    assert LinkAbortFault(LocalLinks(toxics := LinkToxics())).describe().available and not toxics


def test_a_toxic_with_a_lifetime_ends_by_itself() -> None:
    """A link fault carries its duration into the gateway, which drops it on time without a revert (the
    control plane that injected it may be down by then)."""
    now = [100.0]
    toxics = LinkToxics(clock=lambda: now[0])
    toxics.add("r0", {"kind": "latency", "latency_s": 0.2}, toxic_id="t1", duration_s=10)
    toxics.add("r0", {"kind": "refuse"}, toxic_id="t2")
    now[0] += 9.9
    assert {t.toxic_id for t in toxics.active("r0")} == {"t1", "t2"}
    now[0] += 0.2
    assert [t.toxic_id for t in toxics.active("r0")] == ["t2"] and toxics.request_delay("r0") == 0
    toxics.add("r0", {"kind": "refuse"}, toxic_id="t2", duration_s=1)  # the same id again replaces it
    now[0] += 1
    assert not toxics



def test_requests_waiting_on_a_replica_that_stalls_go_elsewhere_before_their_first_byte_timeout() -> None:
    """A hung replica: its streaming requests stall (resumed elsewhere after stall_timeout_s), and a
    request still waiting there for its first token moves at that moment, not after the first-byte
    timeout; new requests avoid the replica until it produces a token again."""
    async def body(h: Harness) -> None:
        r0 = h.fleet["r0"]
        r0.behaviour.hang_after = 3
        streaming = asyncio.create_task(h.post(path_of("completion"), body_of("completion", stream=True)))
        await asyncio.sleep(0.05)  # on r0 (round robin starts there), 3 tokens out, then silence
        r0.behaviour.hang_after = 0
        started = time.monotonic()
        later = await asyncio.gather(
            *(h.post(path_of("completion"), body_of("completion", prompt=f"next {i}")) for i in range(3)))
        waited = time.monotonic() - started
        first = await streaming
        assert all(r.status_code == 200 for r in [first, *later])
        assert waited < 2.0  # the first-byte timeout is 5 s: the waiter on r0 moved when r0 stalled
        assert len(r0.requests) == 2  # the streaming one and one waiter; nothing after r0 stalled
        after = [await h.post(path_of("completion"), body_of("completion", max_tokens=2)) for _ in range(3)]
        assert {r.headers["x-replica-id"] for r in after} == {"r1", "r2"}
        assert len(r0.requests) == 2
    run(body, routing="round-robin", stall_timeout_s=0.3, first_byte_timeout_s=5.0, eject_after_failures=10)


def test_a_replica_silent_for_the_stall_timeout_loses_the_requests_waiting_for_a_first_token() -> None:
    """No stream under way to notice the hang: the request waiting there moves once the replica has been
    silent (no token on any stream) for the stall timeout, not after the first-byte timeout."""
    async def body(h: Harness) -> None:
        h.fleet["r0"].behaviour.hang_after = 0
        started = time.monotonic()
        requests = [body_of("completion", prompt=f"p{i}") for i in range(3)]
        responses = await asyncio.gather(*(h.post(path_of("completion"), r) for r in requests))
        waited = time.monotonic() - started
        assert all(r.status_code == 200 for r in responses)
        assert {r.headers["x-replica-id"] for r in responses} == {"r1", "r2"}
        assert [r.headers.get("x-gateway-tried") for r in responses].count("r0") == 1
        assert 0.3 <= waited < 2.0  # stall timeout 0.3 s; first-byte timeout 5 s
    run(body, routing="round-robin", stall_timeout_s=0.3, first_byte_timeout_s=5.0, eject_after_failures=10)


def test_a_coloured_toxic_refuses_only_its_colours_requests() -> None:
    """A slice experiment's link fault: the coloured requests to r0 fail over, the others reach r0."""
    from controlplane.gateway.slices import Share, SlicePlan

    plan = SlicePlan(colours=(Share("chaos", 0.5),))

    async def body(h: Harness) -> None:
        h.gateway.toxics.add("r0", {"kind": "refuse", "colour": "chaos"})
        for i in range(30):
            request = body_of("completion", prompt=f"q{i}", max_tokens=2)
            response = await h.post(path_of("completion"), request)
            assert response.status_code == 200
        chaos = [t for t in h.traces if t.retries]
        assert chaos and all(t.replica_id != "r0" for t in chaos)
        reached = [hd for hd in h.fleet["r0"].headers]
        assert reached and all(hd.get("x-llmsre-colour") != "chaos" for hd in reached)
        with pytest.raises(ValueError, match="colour"):
            h.gateway.toxics.add("r0", {"kind": "refuse", "colour": "Not A Colour"})

    async def main() -> None:
        from .fakes import FakeFleet

        harness = Harness(FakeFleet(), slices=lambda: plan, routing="round-robin", eject_after_failures=100,
                          retry_budget_ratio=1.0)  # every refused coloured request may go elsewhere
        try:
            await body(harness)
        finally:
            await harness.close()
    asyncio.run(main())
