"""The Latency page's numbers: the tail is attributed from per-request traces (mean stage times of the
requests at and above the quantile), the stages add up, and failed requests are left out."""

from __future__ import annotations

import pytest

from controlplane.api.factory import STAGES, stage_times, tail_attribution
from controlplane.traces import TraceRecord


def trace(rid: str, *, queue: float, prefill: float, decode: float, gateway: float = 0.01,
          error: str | None = None, replica: str = "az-a-1") -> TraceRecord:
    e2e = gateway + queue + prefill + decode + 0.002
    return TraceRecord(request_id=rid, started_at=1000.0, endpoint="/v1/completions", model="m", status=200,
                       replica_id=replica, zone=replica[:4], priority="standard", prompt_tokens=10,
                       output_tokens=5, ttft_s=queue + prefill, e2e_s=e2e, gateway_s=gateway, queue_s=queue,
                       prefill_s=prefill, decode_s=decode, detokenize_s=0.001, serialize_s=0.001, error=error)


def test_stage_times_add_up_to_the_end_to_end_latency() -> None:
    t = trace("a", queue=0.1, prefill=0.2, decode=0.3)
    assert sum(stage_times(t).values()) == pytest.approx(t.e2e_s)
    assert set(stage_times(t)) == set(STAGES)


def test_the_tail_is_the_slow_requests_and_their_dominant_stage_shows() -> None:
    # 99 typical requests dominated by decode, one queued for 2 s: the P99 tail is the queued one
    traces = [trace(f"r{i}", queue=0.01, prefill=0.05, decode=0.3) for i in range(99)]
    traces.append(trace("slow", queue=2.0, prefill=0.05, decode=0.3))
    result = tail_attribution(traces, 0.99)
    assert result["num_traces"] == 100
    assert result["threshold_s"] == pytest.approx(traces[0].e2e_s)  # nearest rank: the 99th of 100
    tail = tail_attribution(traces, 0.995)["tail"]
    assert tail["count"] == 1 and tail["stages_s"]["queue"] == pytest.approx(2.0)
    assert max(tail["shares"], key=tail["shares"].get) == "queue"
    median = result["median"]
    assert max(median["shares"], key=median["shares"].get) == "decode"
    assert sum(median["shares"].values()) == pytest.approx(1.0)


def test_failed_requests_are_not_attributed() -> None:
    traces = [trace("ok", queue=0.1, prefill=0.1, decode=0.1),
              trace("broken", queue=5.0, prefill=0.1, decode=0.1, error="replica died")]
    result = tail_attribution(traces, 0.99)
    assert result["num_traces"] == 1 and result["tail"]["stages_s"]["queue"] == pytest.approx(0.1)


def test_each_replica_gets_its_own_tail() -> None:
    traces = [trace(f"a{i}", queue=0.01, prefill=0.1, decode=0.1, replica="az-a-1") for i in range(10)]
    traces += [trace(f"b{i}", queue=0.5, prefill=0.1, decode=0.1, replica="az-b-1") for i in range(10)]
    by_replica = tail_attribution(traces, 0.9)["by_replica"]
    assert set(by_replica) == {"az-a-1", "az-b-1"}
    assert by_replica["az-b-1"]["tail"]["stages_s"]["queue"] == pytest.approx(0.5)
    assert by_replica["az-a-1"]["tail"]["stages_s"]["queue"] == pytest.approx(0.01)


def test_no_traces_is_no_data_not_zero() -> None:
    result = tail_attribution([], 0.99)
    assert result["num_traces"] == 0 and result["tail"] is None and result["threshold_s"] is None
