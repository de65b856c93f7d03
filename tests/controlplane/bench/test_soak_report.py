"""The soak's targets on synthetic samples: a leak is caught, load that comes and goes is not."""

from __future__ import annotations

import math
from pathlib import Path

from controlplane.bench.soak_report import (
    FaultWindow,
    ProcessSample,
    Sample,
    SoakResult,
    format_report,
    judge,
    write_html,
)
from inference.bench.report import BAD, CANCEL, STREAM, RequestRecord

START = 1_800_000_000.0


def sample(t: float, *, rss: float, fds: int, tasks: int, kv: int = 0, pid: int = 100,
           connections: int | None = None) -> Sample:
    process = ProcessSample("replica r1", pid, int(rss), fds, tasks, connections=connections)
    return Sample(t=t, wall=START + t, processes=(process,),
                  kv_blocks_in_use={"r1": kv}, requests_running={"r1": 0}, store_bytes=4096,
                  store_rows={"events": int(t)}, prometheus_series=100, ready=2, desired=2)


def run(samples: list[Sample], records: list[RequestRecord] | None = None,
        windows: list[FaultWindow] | None = None,
        kv_after: dict[str, int | None] | None = None) -> SoakResult:
    result = SoakResult({"minutes": 10, "replicas": 2, "load_fraction": 0.7, "mix": "stream=1",
                         "fault_every_s": 60.0, "sample_s": 10.0}, 10.0, 7.0, START, samples, windows or [],
                        records if records is not None else [ok(5.0)], kv_after or {"r1": 0})
    result.verdicts = judge(result, min_span_s=200.0)
    return result


def ok(at: float, kind: str = STREAM) -> RequestRecord:
    return RequestRecord(index=0, request_id=f"x-{at}", prompt_len=4, output_len=2, send_time=at,
                         send_wall=START + at, first_token_time=at + 0.1, token_times=[at + 0.1, at + 0.2],
                         end_time=at + 0.3, status=200, completion_tokens=2, kind=kind)


def failed(at: float) -> RequestRecord:
    return RequestRecord(index=1, request_id=f"y-{at}", prompt_len=4, output_len=2, send_time=at,
                         send_wall=START + at, end_time=at + 0.5, status=503, error_kind="http_503")


def outcomes(result: SoakResult) -> dict[str, str]:
    return {v.name.split(" ")[0]: v.outcome for v in result.verdicts}


def steady(t: float, i: int) -> Sample:
    """A healthy process under load: counts swing with the traffic, and come back down."""
    return sample(t, rss=600e6 + 1e6 * math.sin(i), fds=20 + (i % 5), tasks=4 + (i * 7 % 6))


def test_a_healthy_run_meets_every_target() -> None:
    result = run([steady(10.0 * i, i) for i in range(60)])
    assert set(outcomes(result).values()) == {"pass"} and result.outcome == "pass"
    assert format_report(result).splitlines()[-1] == "overall: PASS"


def test_memory_that_keeps_growing_fails_but_warm_up_in_the_first_third_does_not() -> None:
    warm_then_flat = [sample(10.0 * i, rss=(300e6 if i < 15 else 600e6), fds=20, tasks=4) for i in range(60)]
    assert outcomes(run(warm_then_flat))["rss_growth"] == "pass"
    leaking = [sample(10.0 * i, rss=600e6 * (1 + 0.004 * i), fds=20, tasks=4) for i in range(60)]
    verdict = next(v for v in run(leaking).verdicts if v.name.startswith("rss_growth"))
    assert verdict.outcome == "fail" and verdict.detail.startswith("+13.7% over 390 s")


def test_a_process_with_a_warm_up_of_its_own_is_judged_after_it() -> None:
    """Prometheus' head grows until its first chunks are cut: 30% over the first 350 s of the run, flat
    after. Judged from the end of its own warm-up it passes; judged from the first third alone, it fails."""
    def prometheus(i: int, warm_from: float) -> Sample:
        s = sample(10.0 * i, rss=1, fds=18, tasks=0)
        rss = 60e6 * (1 + 0.3 * min(i, 35) / 35)
        return Sample(**{**{f: getattr(s, f) for f in s.__dataclass_fields__},
                         "processes": (ProcessSample("prometheus", 300, int(rss), 18, None, warm_from),)})

    def rss_verdict(warm_from: float) -> tuple[str, str]:
        verdict = next(v for v in run([prometheus(i, warm_from) for i in range(60)]).verdicts
                       if v.name.startswith("rss_growth"))
        return verdict.outcome, verdict.detail

    assert rss_verdict(350.0) == ("pass", "+0.0% over 240 s (74 -> 74 MiB; target < 10%)")
    assert rss_verdict(-100.0)[0] == "fail"  # a warm-up long over: the first third alone is excused
    outcome, detail = rss_verdict(450.0)
    assert outcome == "not judged" and "its warm-up ran to t=450 s" in detail


def test_tasks_or_descriptors_whose_floor_rises_every_quarter_fail() -> None:
    leaking = [sample(10.0 * i, rss=600e6, fds=20 + i // 5, tasks=4 + (i * 7 % 6) + i // 4)
               for i in range(60)]
    got = outcomes(run(leaking))
    assert got["fd_growth"] == "fail" and got["task_growth"] == "fail"


def test_connections_a_peer_keeps_open_are_not_a_descriptor_leak() -> None:
    """A replica that takes over a killed one's traffic holds more of the gateway's connections from then
    on: its descriptors' floors rise every quarter, all of it established connections. A descriptor that
    is not an established connection (a file, a socket left in CLOSE_WAIT) still fails."""
    pooled = [sample(10.0 * i, rss=600e6, fds=19 + i // 10 + i % 3, tasks=4,
                     connections=5 + i // 10 + i % 3)
              for i in range(60)]
    assert outcomes(run(pooled))["fd_growth"] == "pass"
    uncounted = [sample(s.t, rss=600e6, fds=s.processes[0].num_fds, tasks=4) for s in pooled]
    verdict = next(v for v in run(uncounted).verdicts if v.name.startswith("fd_growth"))
    assert verdict.outcome == "fail" and "rise every quarter" in verdict.detail
    leaking = [sample(10.0 * i, rss=600e6, fds=19 + i // 10 + i % 3, tasks=4, connections=5 + i % 3)
               for i in range(60)]
    verdict = next(v for v in run(leaking).verdicts if v.name.startswith("fd_growth"))
    assert verdict.outcome == "fail"
    assert verdict.detail == ("floors per quarter of descriptors less established connections "
                              "16, 17, 18, 19 rise every quarter")


def test_a_process_restarted_late_is_not_judged_and_says_why() -> None:
    late = [sample(10.0 * i, rss=600e6, fds=20, tasks=4, pid=200) for i in range(50, 60)]
    verdicts = run([steady(10.0 * i, i) for i in range(60)] + late).verdicts
    young = [v for v in verdicts if "(pid 200)" in v.name]
    assert young and all(v.outcome == "not judged" and "needs 200 s" in v.detail for v in young)


def test_kv_blocks_held_after_the_drain_fail() -> None:
    result = run([steady(10.0 * i, i) for i in range(60)], kv_after={"r1": 3, "r2": None})
    assert outcomes(result)["kv_blocks_after_drain"] == "fail"
    assert "r1 3" in result.verdicts[0].detail and "r2 no answer" in result.verdicts[0].detail


def test_failures_count_only_outside_the_fault_windows() -> None:
    window = FaultWindow("kill", "r1", START + 100.0, START + 130.0)
    inside = [failed(120.0), failed(99.8)]  # the second was still in flight when the window opened
    result = run([steady(10.0 * i, i) for i in range(60)], [ok(1.0), *inside], [window])
    assert outcomes(result)["failed_outside_faults"] == "pass"
    result = run([steady(10.0 * i, i) for i in range(60)], [ok(1.0), *inside, failed(300.0)], [window])
    verdict = result.verdicts[-1]
    assert verdict.outcome == "fail" and verdict.detail.startswith("1 failed outside the 1 fault windows")


def test_a_bad_request_refused_and_a_stream_left_on_purpose_are_requests_as_intended() -> None:
    refused = RequestRecord(index=2, request_id="b", prompt_len=4, output_len=2, send_wall=START, status=400,
                            error_kind="http_400", error_type="invalid_request_error", end_time=0.1, kind=BAD)
    served = RequestRecord(index=3, request_id="c", prompt_len=4, output_len=2, send_wall=START, status=200,
                           end_time=0.1, kind=BAD)
    left = ok(2.0, CANCEL)
    assert refused.is_success and not served.is_success and left.is_success


def test_the_html_report_has_a_panel_per_quantity_and_the_fault_windows(tmp_path: Path) -> None:
    window = FaultWindow("pause", "r1", START + 100.0, START + 130.0)
    result = run([steady(10.0 * i, i) for i in range(60)], [ok(float(i)) for i in range(50)], [window])
    write_html(result, tmp_path / "soak.html", bin_s=30.0)
    page = (tmp_path / "soak.html").read_text()
    assert "plotly" in page and "KV blocks in use" in page and "Prometheus head series" in page
    assert '"text":"pause"' in page.replace(" ", "")
