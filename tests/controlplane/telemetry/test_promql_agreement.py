"""The scraper's numbers are Prometheus' numbers: the same samples, the same PromQL, the same results.

Series with counter resets, late starts and histogram buckets are fed to :class:`ScraperSource` (fake
clock, fake /metrics pages) and, as ``input_series``, to ``promtool test rules``; the queries are the
exact PromQL that :class:`PrometheusSource` sends. promtool passes only if Prometheus' own engine gets
what the scraper got.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.telemetry.base import Group
from controlplane.telemetry.promql import (
    RATE_OF_LABEL,
    gauge_query,
    quantile_query,
    rate_query,
    rates_query,
    ratio_query,
)
from controlplane.telemetry.scraper import ScraperSource

STEP_S = 10
NUM_STEPS = 7  # samples at 0, 10, ..., 60 s
WINDOW_S = 60.0
Values = list[float | None]  # one per step; None: no sample then


def histogram(replica: str, buckets: dict[str, Values]) -> list[tuple[str, dict[str, str], Values]]:
    return [("h_bucket", {"replica": replica, "le": le}, counts) for le, counts in buckets.items()]


SERIES: list[tuple[str, dict[str, str], Values]] = [  # (series name, labels, values)
    ("c_total", {"replica": "a"}, [0, 10, 20, 5, 15, 25, 35]),  # a restart at 20 s
    ("c_total", {"replica": "b"}, [None, None, 100, 110, 120, 130, 140]),  # joined late, counter not at 0
    ("c_total", {"replica": "c"}, [3, 4, 1, 9, 2, 2, 7]),  # two resets
    # tokens counted as requests finish, in bursts, 48 each: their ratio is 48 whatever the extrapolation
    ("tok_total", {"replica": "a"}, [0, 48, 48, 144, 192, 192, 288]),
    ("done_total", {"replica": "a"}, [0, 1, 1, 3, 4, 4, 6]),
    ("tok_total", {"replica": "b"}, [None, None, 96, 96, 144, 240, 240]),
    ("done_total", {"replica": "b"}, [None, None, 2, 2, 3, 5, 5]),
    ("g", {"replica": "a"}, [1, 2, 3, 4, 5, 6, 0.25]),
    ("g", {"replica": "b"}, [None, None, 0.5, 0.5, 0.5, 0.5, 0.75]),
    *histogram("a", {
        "0.1": [0, 1, 2, 2, 3, 3, 4],
        "0.5": [0, 3, 6, 8, 9, 9, 12],
        "1": [0, 4, 8, 12, 14, 15, 18],
        "+Inf": [0, 5, 10, 14, 17, 18, 22],  # ranks above 18/22 land in +Inf
    }),
    *histogram("b", {
        "0.1": [0, 0, 0, 0, 0, 0, 0],  # empty low bucket
        "0.5": [0, 2, 4, 1, 3, 5, 7],  # restarted at 30 s
        "1": [0, 2, 5, 1, 4, 6, 9],
        "+Inf": [0, 2, 5, 1, 4, 7, 10],
    }),
]
EVAL_TIMES_S = (60, 65)  # samples reaching the window's end, and stopping 5 s short of it
Answer = Callable[[ScraperSource], dict[Group, float]]
RATIO = ratio_query("tok_total", "done_total", window_s=WINDOW_S, match=None)  # 48 tokens per finish
QUERIES: list[tuple[str, Answer]] = [  # (PromQL as PrometheusSource sends it, how the scraper answers it)
    (rate_query("c_total", window_s=WINDOW_S, by=("replica",), match=None),
     lambda s: s.rate("c_total", window_s=WINDOW_S, by=("replica",))),
    (rate_query("c_total", window_s=WINDOW_S, by=(), match=None),
     lambda s: s.rate("c_total", window_s=WINDOW_S, by=())),
    (gauge_query("g", by=("replica",), match=None, agg="max"), lambda s: s.gauge("g", agg="max")),
    (gauge_query("g", by=(), match=None, agg="avg"), lambda s: s.gauge("g", by=(), agg="avg")),
    (RATIO,
     lambda s: {(): value} if (value := s.ratio("tok_total", "done_total", window_s=WINDOW_S)) else {}),
    # several counters in one read: each result labelled with its counter
    (rates_query(("c_total", "tok_total"), window_s=WINDOW_S, by=("replica",), match=None),
     lambda s: {(metric, *group): value
                for metric, groups in s.rates(("c_total", "tok_total"), window_s=WINDOW_S).items()
                for group, value in groups.items()}),
    *[(quantile_query("h", q, window_s=WINDOW_S, by=by, match=None),
       lambda s, q=q, by=by: s.quantile("h", q, window_s=WINDOW_S, by=by))
      for q in (0.5, 0.9, 0.99) for by in (("replica",), ())],
]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def page(step: int, replica: str) -> str:
    """What ``replica`` exports at ``step`` (its own series: the target's labels are authoritative)."""
    lines = []
    for name, labels, values in SERIES:
        if values[step] is not None and labels["replica"] == replica:
            body = ",".join(f'{k}="{v}"' for k, v in labels.items())
            lines.append(f"{name}{{{body}}} {values[step]}")
    return "\n".join(lines) + "\n"


def scraper_answers(eval_time: float) -> list[dict[Group, float]]:
    clock = Clock()
    step = 0
    endpoints = [ReplicaEndpoint(rid, "az-a", "127.0.0.1", port, ReplicaState.READY, "default")
                 for port, rid in enumerate("abc", start=1)]
    source = ScraperSource(lambda: endpoints, interval_s=STEP_S, ring_size=100, clock=clock,
                           wall_clock=clock, fetch=lambda e: page(step, e.replica_id))
    try:
        for step in range(NUM_STEPS):
            clock.now = step * STEP_S
            source.scrape_once()
        clock.now = eval_time
        return [answer(source) for _, answer in QUERIES]
    finally:
        source.stop()


def promtool_case(promql: str, eval_time: int, answer: dict[Group, float],
                  by: tuple[str, ...]) -> dict[str, object]:
    samples = [{"labels": "{" + ",".join(f'{k}="{v}"' for k, v in zip(by, group)) + "}", "value": value}
               for group, value in sorted(answer.items())]
    return {"expr": promql, "eval_time": f"{eval_time}s", "exp_samples": samples}


def by_of(promql: str) -> tuple[str, ...]:
    inner = promql.split("by (", 1)[1].split(")", 1)[0]
    names = tuple(name for name in (n.strip() for n in inner.split(",")) if name and name != "le")
    return ((RATE_OF_LABEL,) if RATE_OF_LABEL in promql else ()) + names


def input_series() -> list[dict[str, str]]:
    out = []
    for name, labels, values in SERIES:
        body = ",".join(f'{k}="{v}"' for k, v in labels.items())
        out.append({"series": f"{name}{{{body}}}", "values": " ".join("_" if v is None else repr(float(v))
                                                                      for v in values)})
    return out


@pytest.mark.usefixtures("promtool_binary")
def test_scraper_agrees_with_prometheus_engine(tmp_path: Path) -> None:
    cases = []
    for eval_time in EVAL_TIMES_S:
        for (promql, _), answer in zip(QUERIES, scraper_answers(eval_time)):
            assert answer, f"the scraper answered nothing for {promql} at {eval_time}s"
            if promql == RATIO:
                assert answer == {(): pytest.approx(48.0)}, answer
            cases.append(promtool_case(promql, eval_time, answer, by_of(promql)))
    (tmp_path / "rules.yml").write_text("groups: []\n")
    test_file = tmp_path / "agreement_test.yml"
    # JSON is YAML: no YAML writer needed.
    test_file.write_text(json.dumps({
        "rule_files": [str(tmp_path / "rules.yml")],
        "evaluation_interval": f"{STEP_S}s",
        "tests": [{"interval": f"{STEP_S}s", "input_series": input_series(), "promql_expr_test": cases}],
    }, indent=1))
    done = subprocess.run(["promtool", "test", "rules", str(test_file)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
