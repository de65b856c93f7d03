"""A replica killed or frozen mid-stream costs the client nothing: every stream ends as if undisturbed.

Fifty greedy streams (completions and chats, ``ignore_eos``) run through the gateway at once; once they
flow, one replica is ``kill -9``-ed, or SIGSTOPped and later continued. The reference is the same fifty
requests sent straight to the replicas beforehand. The resume arithmetic is checked from every break point
of a real stream, logprobs and penalties included, and those pass through the gateway unchanged.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from controlplane.gateway.assembly import PATHS, RequestParams, StreamAssembly
from inference.logprobs import LogprobEntry, read_chat_logprobs, read_completion_logprobs

from .conftest import (
    Fleet,
    GatewayServer,
    ServeGateway,
    StreamResult,
    chat,
    completion,
    run_streams,
    sse_payloads,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

NUM_STREAMS = 50
MAX_TOKENS = 48
# The gateway's stall timeout and the slack for a resume are derived from the undisturbed run on the same
# machine at the same moment (``Timing``): on a quiet machine the longest gap between two events of a
# stream is about 0.1 s and these are their floors; on a loaded one (two CPU burners beside the suite)
# gaps of 1.5 s were seen, and a fixed 1 s stall timeout then called every replica stalled. The load can
# also come after the measurement: in a clean-clone run beside other work, 0.19 s measured gave a 1 s
# timeout, and both survivors, re-prefilling the stopped replica's streams, went 1 s without a token.
MIN_STALL_TIMEOUT_S = 2.0
MIN_RESUME_SLACK_S = 2.0
GAP_FACTOR = 4.0  # survivors carry half as many streams again and re-prefill the moved ones
READMIT_DEADLINE_S = 15.0
TOPICS = ("rivers", "engines", "maps", "clocks", "bridges", "gardens", "stars", "ships", "songs", "stones")


def requests() -> list[StreamResult]:
    """The same fifty requests every time: half completions, half chats, all greedy."""
    out = []
    for i in range(NUM_STREAMS):
        fields: dict[str, Any] = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "return_token_ids": True,
                                  "stream_options": {"include_usage": True}}
        text = f"Request {i} is about {TOPICS[i % len(TOPICS)]} and {TOPICS[(3 * i) % len(TOPICS)]}"
        if i % 2:
            out.append(StreamResult("/v1/chat/completions", chat(text, **fields)))
        else:
            out.append(StreamResult("/v1/completions", completion(text, **fields)))
    return out


@pytest.fixture(scope="module")
def reference(fleet: Fleet) -> list[StreamResult]:
    """The undisturbed outputs, straight from the replicas (spread over the three)."""
    results = requests()
    urls = [r.base_url for r in fleet.replicas.values()]

    async def main() -> None:
        await asyncio.gather(*(run_streams(url, results[i::len(urls)]) for i, url in enumerate(urls)))

    asyncio.run(main())
    assert all(r.status == 200 and r.is_done for r in results), [r.error for r in results]
    return results


@dataclass(frozen=True)
class Timing:
    """What the undisturbed run measured: its longest gap between two events of one stream."""

    max_gap_s: float

    @property
    def stall_timeout_s(self) -> float:
        return max(MIN_STALL_TIMEOUT_S, GAP_FACTOR * self.max_gap_s)

    @property
    def resume_slack_s(self) -> float:
        return max(MIN_RESUME_SLACK_S, GAP_FACTOR * self.max_gap_s)


@pytest.fixture(scope="module")
def timing(reference: list[StreamResult]) -> Timing:
    measured = Timing(max(r.max_gap() for r in reference))
    print(f"\nundisturbed: longest gap {measured.max_gap_s:.3f} s; stall timeout "
          f"{measured.stall_timeout_s:.2f} s, resume slack {measured.resume_slack_s:.2f} s")
    return measured


def flowing_on(results: list[StreamResult], fleet: Fleet, replica_id: str, *, min_streams: int = 5) -> bool:
    """Streams that started on ``replica_id`` have tokens at the client, and the replica is still
    generating for several requests. The replica's own count decides: the gateway reads a stream ahead of
    a client that lags (on a loaded machine the test's client, sharing a process with the gateway, lags
    by seconds), and a replica killed after it finished generating breaks nothing."""
    mid_way = [r for r in results if r.replica == replica_id and r.chunks and not r.is_done]
    if not mid_way:
        return False
    page = httpx.get(f"{fleet.replicas[replica_id].base_url}/metrics", timeout=5, trust_env=False).text
    running = sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                  if line.startswith("vllm:num_requests_running"))
    return running >= min_streams


ROUNDS = 3
FLOWING_TIMEOUT_S = 60.0


def act_once_flowing(results: list[StreamResult], fleet: Fleet, victim: str,
                     act: Callable[[], None]) -> float | None:
    """Polls until ``victim`` is generating for five of ``results``, then runs ``act()`` at once: when it
    ran; None when every stream ended first."""
    deadline = time.monotonic() + FLOWING_TIMEOUT_S
    while time.monotonic() < deadline:
        if flowing_on(results, fleet, victim):
            act()
            return time.monotonic()
        if all(r.is_done or r.error is not None for r in results):
            return None
        time.sleep(0.01)
    raise AssertionError(f"{FLOWING_TIMEOUT_S:g} s without 5 streams mid-way on {victim}")


def disturb_once_flowing(gw: GatewayServer, fleet: Fleet, victim: str, act: Callable[[], None],
                         undo: Callable[[], None]) -> tuple[list[StreamResult], float]:
    """The fifty streams through the gateway ``gw``, and ``act()`` at once, in the polling thread, when
    ``victim`` is generating for at least five of them (:func:`flowing_on`); that round's results and when
    ``act`` ran. A round that disturbed nothing is run again, up to ``ROUNDS`` times: one whose streams all
    end before the poll sees that moment (a quick replica, a client lagging on a loaded machine: the
    replica's count and the client's view never overlap), where waiting on its finished streams could only
    time out; and one where ``act`` landed after the victim's last token (the replica's count read five
    running, then it finished them before the signal came: no stream moved), which ``undo()`` puts back
    before the victim is wanted serving again."""
    for _ in range(ROUNDS):
        results, seen = requests(), len(gw.traces)
        acted: list[float] = []

        async def during(results: list[StreamResult], acted: list[float] = acted) -> None:
            at = await asyncio.to_thread(act_once_flowing, results, fleet, victim, act)
            acted.extend([] if at is None else [at])

        asyncio.run(run_streams(gw.url, results, during=during))
        if not acted:
            continue
        wait_until(lambda wanted=seen + NUM_STREAMS: len(gw.traces) >= wanted, timeout=10,
                   what="every stream's trace")
        if any(t.resumes or t.retries for t in gw.traces[seen:]):
            return results, acted[0]
        undo()
        wait_until(lambda: victim not in gw.gateway.ejected(), timeout=READMIT_DEADLINE_S,
                   what=f"{victim} serving again after a round that moved nothing")
    pytest.fail(f"{ROUNDS} rounds of {NUM_STREAMS} streams ended before {victim} was caught generating five")


def mismatches(results: list[StreamResult], reference: list[StreamResult]) -> list[str]:
    """What differs from the undisturbed run, per stream (empty: nothing lost, nothing duplicated)."""
    problems = []
    for i, (got, want) in enumerate(zip(results, reference)):
        usage = [p["usage"] for p in got.payloads if isinstance(p, dict) and p.get("usage")]
        if got.status != 200 or got.error or not got.is_done:
            problems.append(f"#{i} on {got.replica}: status {got.status}, error {got.error}, "
                            f"last {got.payloads[-1:]}")
        elif got.token_ids() != want.token_ids() or got.text() != want.text():
            problems.append(f"#{i} on {got.replica}: {len(got.token_ids())} tokens, differs from reference")
        elif usage[-1]["completion_tokens"] != MAX_TOKENS:
            problems.append(f"#{i}: usage {usage[-1]}")
    return problems


def report(gw: GatewayServer, what: str) -> tuple[int, int]:
    resumed = [t for t in gw.traces if t.resumes]
    total = sum(t.resumes for t in gw.traces)
    print(f"\n{what}: {len(gw.traces)} requests, {len(resumed)} resumed ({total} resumes), "
          f"{sum(t.retries for t in gw.traces)} retries, ejected now: {sorted(gw.gateway.ejected())}")
    return len(resumed), total


def test_killed_replica_loses_no_stream(fleet: Fleet, serve_gateway: ServeGateway,
                                        reference: list[StreamResult], timing: Timing) -> None:
    # On a loaded machine a third of the fifty streams may still wait in the victim's queue, without a
    # first byte, when it dies: each is retried elsewhere, and retries after a reset spend the retry
    # budget (20% of recent requests: 10 of these 50), by design (a request that kills replicas must not
    # be carried to all of them). This test is about the resume and the retry themselves: no budget cap.
    gw = serve_gateway(stall_timeout_s=timing.stall_timeout_s, first_byte_timeout_s=5.0,
                       retry_budget_ratio=1.0)
    victim = "r0"
    try:
        # killed in the polling thread, at once: the client's busy loop would resume it too late
        results, _ = disturb_once_flowing(gw, fleet, victim, lambda: fleet.kill(victim),
                                          lambda: fleet.restart(victim))
    finally:
        fleet.restart(victim)

    report(gw, "kill -9")
    moved = sum(1 for t in gw.traces if t.resumes or t.retries)
    assert mismatches(results, reference) == []
    # The replica was generating for at least 5 of them when it died: each moved, mid-stream (a resume)
    # or, on a loaded machine where some had no token out yet, before its first byte (a retry).
    assert moved >= 5
    assert all(t.status == 200 and t.error is None for t in gw.traces)
    assert all(t.replica_id != victim for t in gw.traces if t.resumes)


def test_stopped_replica_is_resumed_around_ejected_and_readmitted(fleet: Fleet, serve_gateway: ServeGateway,
                                                                  reference: list[StreamResult],
                                                                  timing: Timing) -> None:
    stall_s = timing.stall_timeout_s
    gw = serve_gateway(stall_timeout_s=stall_s, first_byte_timeout_s=3.0, probe_interval_s=0.5,
                       eject_after_failures=3)
    victim = "r1"
    try:
        results, stopped_at = disturb_once_flowing(gw, fleet, victim,
                                                   lambda: fleet.signal(victim, signal.SIGSTOP),
                                                   lambda: fleet.signal(victim, signal.SIGCONT))
        ejected_while_stopped = gw.gateway.ejected()
    finally:
        fleet.signal(victim, signal.SIGCONT)
    continued_at = time.monotonic()

    wait_until(lambda: victim not in gw.gateway.ejected(), timeout=READMIT_DEADLINE_S,
               what=f"{victim} re-admitted after SIGCONT")
    num_resumed, _ = report(gw, "SIGSTOP")
    # (a round that moved nothing may have had the victim ejected and re-admitted before this one)
    [(ejected_at, *_)] = [e for e in gw.events_of("ejected", victim) if e[0] >= stopped_at]
    [(readmitted_at, *_)] = [e for e in gw.events_of("readmitted", victim) if e[0] >= stopped_at]
    stalled = [r for r in results if r.replica == victim]
    gaps = sorted(r.max_gap() for r in stalled)
    print(f"ejected {ejected_at - stopped_at:.2f}s after SIGSTOP, re-admitted "
          f"{readmitted_at - continued_at:.2f}s after SIGCONT; largest client gaps: {gaps[-3:]}")
    assert mismatches(results, reference) == []
    assert ejected_while_stopped == {victim}
    # The victim was running >= 5 requests when it stopped: each moved to another replica, resumed after
    # its stall if the gateway had its first byte, retried after the first-byte timeout if not (on a loaded
    # machine the gateway may not have read a first byte of most of them yet).
    moved = [t for t in gw.traces if t.resumes or t.retries]
    assert num_resumed >= 1 and len(moved) >= 5, (num_resumed, len(moved))
    assert ejected_at - stopped_at < stall_s + timing.resume_slack_s
    assert gaps and gaps[-1] < stall_s + timing.resume_slack_s
    assert readmitted_at > continued_at


# ---- the resume arithmetic against a real replica's detokenizer and stop-string hold-back -------
RESUME_MAX_TOKENS = 16
LOGPROB_TOLERANCE = 1e-4  # a prefill and a decode compute the same logits in another order


async def _events(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        return [json.loads(line[6:]) for line in [x async for x in response.aiter_lines()]
                if line.startswith("data: ") and line != "data: [DONE]"]


def _assembled(params: RequestParams, events: list[dict[str, Any]]) -> StreamAssembly:
    assembly = StreamAssembly(params)
    for event in events:
        assembly.accept(event)
    return assembly


def _close(a: LogprobEntry, b: LogprobEntry) -> bool:
    """The same logprobs up to rounding (alternatives within rounding of each other may swap places)."""
    values = [v for _, v in a.top] + [a.logprob]
    return len(a.top) == len(b.top) and all(abs(x - y) < LOGPROB_TOLERANCE
                                            for x, y in zip(values, [v for _, v in b.top] + [b.logprob]))


def _variant(kind: str, sampling: str, fleet: Fleet) -> dict[str, Any]:
    make = chat if kind == "chat" else completion
    body = make("The river bends near the old mill", max_tokens=RESUME_MAX_TOKENS, ignore_eos=True)
    if sampling == "greedy":
        return body
    if sampling == "penalties-logprobs":  # greedy; the continuation must count the tokens sent as output
        logprobs = {"logprobs": True, "top_logprobs": 2} if kind == "chat" else {"logprobs": 2}
        return {**body, "presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3,
                "stop": ["@never@matches@"], **logprobs}
    body = {**body, "temperature": 1.0, "seed": 11, "stop": ["@never@matches@"]}  # held back: 14 chars
    if sampling == "seeded-stop":  # a stop string that ends the undisturbed text part of the way
        answer = httpx.post(f"{fleet.replicas['r2'].base_url}{PATHS[kind]}", json=body, timeout=30).json()
        choice = answer["choices"][0]
        full = choice.get("text") or choice["message"]["content"]
        at = next(i for i in range(len(full) // 3, len(full) - 3) if full.find(full[i:i + 3]) == i)
        body["stop"] = [full[at:at + 3]]
    return body


@pytest.mark.parametrize("sampling", ["greedy", "seeded", "seeded-stop", "penalties-logprobs"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_resuming_a_real_stream_after_any_chunk_reproduces_it(fleet: Fleet, kind: str, sampling: str) -> None:
    """What the gateway does after a break, from every possible break point, checked exactly."""
    body = _variant(kind, sampling, fleet)
    params = RequestParams.parse(kind, body)

    async def main() -> tuple[StreamAssembly, list[StreamAssembly]]:
        async with httpx.AsyncClient(base_url=fleet.replicas["r2"].base_url, timeout=60) as client:
            events = await _events(client, params.path, params.upstream_body(1))
            whole = _assembled(params, events)
            token_events = [i for i, e in enumerate(events) if e.get("choices")]
            cuts = [_assembled(params, events[:i]) for i in token_events[1:]]
            plans = [cut.continuation(priority=1) for cut in cuts]
            # All continuations at once: seeded ones share batches with prefills and decodes.
            continued = await asyncio.gather(*(_events(client, path, b) for path, b in plans))
            for cut, more in zip(cuts, continued):
                for event in more:
                    cut.accept(event)
            return whole, cuts

    whole, cuts = asyncio.run(main())

    text = "".join(whole.text)
    assert whole.is_finished and len(cuts) >= 2 and text
    assert whole.finish_reason == ("stop" if sampling == "seeded-stop" else "length")
    for i, cut in enumerate(cuts):
        assert ("".join(cut.text), cut.token_ids, cut.finish_reason) == (text, whole.token_ids,
                                                                         whole.finish_reason), f"cut {i}"
        assert cut.usage()["completion_tokens"] == len(whole.token_ids)
        assert cut.usage()["prompt_tokens"] == len(whole.prompt_ids or [])
        # Every token's logprobs exactly once; a resumed token's computed again on another replica.
        assert [e.token for e in cut.logprobs] == [e.token for e in whole.logprobs], f"cut {i}"
        assert all(_close(a, b) for a, b in zip(cut.logprobs, whole.logprobs)), f"cut {i}"
    if sampling == "penalties-logprobs":
        assert len(whole.logprobs) == len(whole.token_ids) and all(len(e.top) == 2 for e in whole.logprobs)


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_penalties_and_logprobs_pass_through_the_gateway(fleet: Fleet, serve_gateway: ServeGateway, kind: str,
                                                         streaming: bool) -> None:
    """The gateway forwards what it does not read itself: its answer is a replica's, logprobs included."""
    body = _variant(kind, "penalties-logprobs", fleet)
    body.update(stream=streaming)
    gw = serve_gateway()

    def logprobs(url: str) -> list[LogprobEntry]:
        response = httpx.post(f"{url}{PATHS[kind]}", json=body, timeout=30)
        assert response.status_code == 200, response.text
        events = [e for e in sse_payloads(response.text) if isinstance(e, dict)] if streaming else [
            response.json()]
        params = RequestParams.parse(kind, body)
        choices = [e["choices"][0] for e in events if e.get("choices")]
        shown = [c["logprobs"] for c in choices]
        if kind == "chat":
            return [e for lp in shown for e in read_chat_logprobs(lp)]
        return [e for lp in shown for e in read_completion_logprobs(lp, params.num_logprobs or 0)]

    through, direct = logprobs(gw.url), logprobs(fleet.replicas["r0"].base_url)
    assert len(through) == RESUME_MAX_TOKENS
    assert [e.token for e in through] == [e.token for e in direct]
    assert all(_close(a, b) for a, b in zip(through, direct))
