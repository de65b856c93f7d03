"""``python -m chaos.drill_bench``: the zone-outage drill at two load levels, N runs each, with RTO and RPO.

It drives a control plane through its REST API only (chaos never imports the control plane): the one at
``--url`` with ``--token``, or, without ``--url``, one it starts itself (``python -m controlplane up`` on free
loopback ports with a fresh state folder, autoscaler and alerts off, stopped at the end). Between runs it
waits until the fleet is fully ready again, so every run starts from the steady state.

Reported per load level: RTO_service p99 over every affected request's own outage pooled across the runs
(and the worst run's RTO_service), RTO_capacity (median and worst), and the RPO sums: requests failed,
requests resumed, tokens lost and duplicated, acknowledged writes lost. A figure a run did not measure is
shown as "not measured", never as 0.

Judged against the scenario's own targets (``chaos.scenarios``, the ones each drill's verdict uses): every
run passed, the worst run's RTO_service and RTO_capacity and the sums of what was lost within them. Exit
status: 0 when every level meets every target, 1 when one is missed or not measured, 2 when the benchmark
could not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from chaos.drill_figures import NOT_MEASURED, Check, check_outcome, percentile
from chaos.errors import ChaosError
from chaos.scenarios import SCENARIOS, Targets
from inference.launcher import free_port

FINISHED = ("passed", "failed", "aborted", "error", "interrupted")
START_TIMEOUT_S = 240.0


class BenchError(ChaosError):
    """The drill benchmark could not run to the end (a process did not start, a drill did not finish)."""


def quiet_base_port(count: int, *, low: int = 20000, high: int = 30000) -> int:
    """A base port with ``count`` free ports above it, below the kernel's ephemeral range (32768+), so a
    replica restarted on its old port does not collide with some client's outgoing connection."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, high - count)
        if all(_is_free(base + i) for i in range(count)):
            return base
    raise BenchError(f"no {count} consecutive free ports in [{low}, {high})")


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Api:
    def __init__(self, url: str, token: str) -> None:
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30,
                                 trust_env=False)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        resp = self.http.request(method, path, **kwargs)
        if resp.status_code >= 400:
            raise BenchError(f"{method} {path}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                fleet = self.call("GET", "/api/v1/fleet")
                if fleet["ready_replicas"] >= fleet["desired_replicas"] > 0 and not fleet["rollout"]:
                    return
            except (httpx.HTTPError, BenchError):
                pass
            time.sleep(1.0)
        raise BenchError(f"the fleet was not ready within {timeout:g}s")

    def drill(self, scenario: str, overrides: dict[str, Any]) -> dict[str, Any]:
        started = self.call("POST", "/api/v1/drills/run", json={"scenario": scenario, **overrides})
        while True:
            report: dict[str, Any] = self.call("GET", f"/api/v1/drills/{started['id']}")
            if report["status"] in FINISHED:
                return report
            time.sleep(1.0)


@contextmanager
def own_control_plane(replicas: int) -> Iterator[tuple[str, str]]:
    """A control plane of our own on free loopback ports; stopped (and its replicas drained) at the end."""
    tmp = Path(tempfile.mkdtemp(prefix="drill-bench-"))
    api_port = free_port()
    config = tmp / "controlplane.toml"
    config.write_text(f'state_dir = "{tmp / "state"}"\n[api]\nport = {api_port}\n'
                      f"[gateway]\nport = {free_port()}\n[fleet]\nreplicas = {replicas}\n"
                      f"base_port = {quiet_base_port(replicas * 4)}\n"
                      f"[prometheus]\nport = {free_port()}\n[autoscaler]\nenabled = false\n"
                      "[alerts]\nenabled = false\n[console]\nenabled = false\n")
    token = secrets.token_urlsafe(24)
    log = (tmp / "up.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "controlplane", "up", "--config", str(config)],
                               stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "CONTROLPLANE_ADMIN_TOKEN": token})
    try:
        yield f"http://127.0.0.1:{api_port}", token
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
        print(f"control plane log: {tmp / 'up.log'}", file=sys.stderr)


def summarize(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs of one load level pooled. A figure some run did not measure is None ("not measured"),
    never 0: a sum over runs is None as soon as one run lacks it, and a run without figures (an error, an
    abort) leaves every pooled figure unmeasured."""
    figs = [r["figures"] for r in reports if r.get("figures")]
    complete = len(figs) == len(reports) > 0

    def measured(name: str) -> list[Any] | None:
        values = [f.get(name) for f in figs]
        return values if complete and all(v is not None for v in values) else None

    def total(name: str) -> int | None:
        values = measured(name)
        return None if values is None else sum(int(v) for v in values)

    def worst(name: str) -> float | None:
        values = measured(name)
        return None if values is None else max(values)

    service = measured("rto_service_s")
    outages = [o for f in figs for o in f.get("outages_s") or []]
    capacity = measured("rto_capacity_s")
    return {"runs": len(reports), "measured": len(figs),
            "statuses": [r["status"] for r in reports],
            "errors": [r.get("error") for r in reports if r.get("error")],
            # p99 over every affected request's own outage; with none affected, the worst run's RTO (0)
            "rto_service_p99_s": percentile(outages, 99) if outages else (max(service) if service else None),
            "rto_service_max_s": worst("rto_service_s"),
            "affected_requests": len(outages) if complete else None,
            "rto_capacity_median_s": statistics.median(capacity) if capacity else None,
            "rto_capacity_max_s": worst("rto_capacity_s"),
            "requests_sent": total("requests_total"), "requests_failed": total("requests_failed"),
            "requests_resumed": total("requests_resumed"), "tokens_lost": total("tokens_lost"),
            "tokens_duplicated": total("tokens_duplicated"), "writes_lost": total("writes_lost"),
            "drill_ids": [r.get("id") for r in reports]}


# (pooled figure, the scenario's target it is judged against)
_JUDGED = (("rto_service_max_s", "rto_service_s"), ("rto_capacity_max_s", "rto_capacity_s"),
           ("requests_failed", "max_failed_requests"), ("tokens_lost", "max_tokens_lost"),
           ("tokens_duplicated", "max_tokens_duplicated"), ("writes_lost", "max_writes_lost"))


def judge(summary: dict[str, Any], targets: Targets) -> list[Check]:
    """The level's pooled figures against the scenario's own targets (``chaos.scenarios``: the ones each
    drill's verdict uses): the worst run's RTOs, the sums of what was lost. Every run must also have
    passed its own verdict. A figure not measured fails ("not measured")."""
    checks = [Check(figure, target, summary[figure], check_outcome(summary[figure], target) == "pass")
              for figure, name in _JUDGED if (target := getattr(targets, name)) is not None]
    passed = sum(1 for status in summary["statuses"] if status == "passed")
    checks.append(Check("runs_not_passed", 0, summary["runs"] - passed, passed == summary["runs"]))
    return checks


def verdict_lines(results: dict[str, Any]) -> list[str]:
    lines = []
    for rate, summary in results.items():
        for c in summary["checks"]:
            measured = NOT_MEASURED if c["measured"] is None else _fmt(c["measured"])
            lines.append(f"{rate} req/s: {c['name']} {measured} (target <= {_fmt(c['target'])}): "
                         f"{c['outcome'].upper()}")
    return lines


def is_pass(results: dict[str, Any]) -> bool:
    return bool(results) and all(c["ok"] for s in results.values() for c in s["checks"])


def bench(api: Api, *, scenario: str, rates: list[float], runs: int, duration_s: float,
          max_tokens: int) -> dict[str, Any]:
    from tqdm import tqdm  # type: ignore[import-untyped]

    results: dict[str, Any] = {}
    targets = SCENARIOS[scenario].targets
    bar = tqdm(total=len(rates) * runs, desc=scenario, unit="drill", file=sys.stderr)
    with bar:
        for rate in rates:
            reports = []
            for _ in range(runs):
                api.wait_ready()
                reports.append(api.drill(scenario, {"rate": rate, "duration_s": duration_s,
                                                    "max_tokens": max_tokens}))
                bar.update(1)
            summary = summarize(reports)
            summary["checks"] = [dataclasses.asdict(c) for c in judge(summary, targets)]
            results[f"{rate:g}"] = summary
    return results


def _fmt(v: Any) -> str:
    return NOT_MEASURED if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def format_table(results: dict[str, Any]) -> str:
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
            ("runs (measured, passed)",
             lambda s: f"{s['runs']} ({s['measured']}, {s['statuses'].count('passed')})"),
            ("RTO_service p99 (s)", lambda s: _fmt(s["rto_service_p99_s"])),
            ("RTO_service worst run (s)", lambda s: _fmt(s["rto_service_max_s"])),
            ("RTO_capacity median (s)", lambda s: _fmt(s["rto_capacity_median_s"])),
            ("RTO_capacity worst (s)", lambda s: _fmt(s["rto_capacity_max_s"])),
            ("requests sent", lambda s: _fmt(s["requests_sent"])),
            ("affected requests", lambda s: _fmt(s["affected_requests"])),
            ("requests failed", lambda s: _fmt(s["requests_failed"])),
            ("requests resumed", lambda s: _fmt(s["requests_resumed"])),
            ("tokens lost", lambda s: _fmt(s["tokens_lost"])),
            ("tokens duplicated", lambda s: _fmt(s["tokens_duplicated"])),
            ("acknowledged writes lost", lambda s: _fmt(s["writes_lost"]))]
    rates = list(results)
    lines = [f"| figure | {' | '.join(f'{r} req/s' for r in rates)} |", "|---|" + "---|" * len(rates)]
    lines += [f"| {name} | {' | '.join(get(results[r]) for r in rates)} |" for name, get in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    b = argparse.ArgumentParser(prog="python -m chaos.drill_bench",
                                description="the zone-outage drill at two load levels, N runs each")
    b.add_argument("--url", default=None, help="a running control plane (default: start one)")
    b.add_argument("--token", default=os.environ.get("CONTROLPLANE_TOKEN"), help="operator token")
    b.add_argument("--scenario", default="zone-outage", choices=sorted(
        sid for sid, sc in SCENARIOS.items() if sc.action != "control-plane-crash"))
    b.add_argument("--rates", default="2,6", help="load levels in requests per second (default %(default)s)")
    b.add_argument("--runs", type=int, default=3)
    b.add_argument("--duration", type=float, default=12.0, help="load seconds per drill")
    b.add_argument("--max-tokens", type=int, default=24)
    b.add_argument("--replicas", type=int, default=3, help="fleet size when starting our own")
    b.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = b.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    try:
        if args.url:
            if not args.token:
                raise BenchError("--token (or $CONTROLPLANE_TOKEN) is required with --url")
            results = bench(Api(args.url, args.token), scenario=args.scenario, rates=rates, runs=args.runs,
                            duration_s=args.duration, max_tokens=args.max_tokens)
        else:
            with own_control_plane(args.replicas) as (url, token):
                api = Api(url, token)
                api.wait_ready()
                results = bench(api, scenario=args.scenario, rates=rates, runs=args.runs,
                                duration_s=args.duration, max_tokens=args.max_tokens)
    except (BenchError, httpx.HTTPError) as exc:
        print(f"drill bench: {exc}", file=sys.stderr)
        return 2
    print(f"{args.scenario}: {args.runs} runs per load level, {args.duration:g} s of load each\n")
    print(format_table(results))
    print("\ntargets (chaos/scenarios.py, the drill's own):")
    print("\n".join(verdict_lines(results)))
    for rate, summary in results.items():
        for error in summary["errors"]:
            print(f"{rate} req/s: a run did not finish: {error}")
    passed = is_pass(results)
    print(f"overall: {'PASS' if passed else 'FAIL'}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
