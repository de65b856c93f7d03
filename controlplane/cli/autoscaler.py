"""``controlplane autoscaler status|decisions|observe-only on|off|pause|resume|windows [--set FILE.json]``:
the decision loop and its schedule (cron windows) from the command line, through the REST API."""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path
from typing import Any

from controlplane.cli.exits import UsageError
from controlplane.cli.options import add_json_option, client, show
from controlplane.client import AutoscalerStatus, Decision, Windows, as_json

SUMMARY = "autoscaler: status, decision records, observe-only on|off, pause, resume, schedule windows"


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    actions = cmd.add_subparsers(dest="action", required=True)
    add_json_option(actions.add_parser("status", help="mode, active window and the last decision"))
    decisions = actions.add_parser("decisions", help="decision records, newest first")
    decisions.add_argument("--limit", type=int, default=20)
    decisions.add_argument("--since", type=float, default=None, help="POSIX seconds")
    decisions.add_argument("--json", action="store_true", help="one JSON record per line")
    observe = actions.add_parser("observe-only", help="record decisions without applying them (operator)")
    observe.add_argument("state", choices=["on", "off"])
    actions.add_parser("pause", help="stop deciding until resume (operator)")
    actions.add_parser("resume", help="decide again (operator)")
    windows = actions.add_parser("windows", help="the schedule's cron windows with their next start and end")
    windows.add_argument("--set", metavar="FILE.json", default=None,
                         help="replace every window (operator) with the JSON list in FILE (or {\"windows\": "
                              "[...]}); [] removes them all")
    add_json_option(windows)


def run(args: argparse.Namespace) -> int:
    new_windows = _read_windows(args.set) if args.action == "windows" and args.set is not None else None
    with client(args) as api:
        if args.action == "status":
            show(args, api.autoscaler_status(), _print_status)
        elif args.action == "decisions":
            for record in reversed(api.autoscaler_decisions(since=args.since, limit=args.limit)):
                print(json.dumps(as_json(record), sort_keys=True) if args.json else describe(record))
        elif args.action == "observe-only":
            status = api.autoscaler_configure(observe_only=args.state == "on")
            print(f"autoscaler mode: {status.mode}")
        elif args.action == "windows":
            view = (api.autoscaler_windows() if new_windows is None
                    else api.autoscaler_set_windows(new_windows))
            show(args, view, lambda v: print(describe_windows(v)))
        elif args.action == "pause":
            print(f"autoscaler mode: {api.autoscaler_pause()}")
        else:
            print(f"autoscaler mode: {api.autoscaler_resume()}")
    return 0


def _print_status(status: AutoscalerStatus) -> None:
    cfg, window, last = status.config, status.window, status.last_decision
    print(f"mode {status.mode}; desired replicas {status.desired_replicas}; bounds "
          f"{cfg.min_replicas}..{cfg.max_replicas}; tick {cfg.tick_s:g}s; {status.ticks} ticks since start")
    print(f"window: {window.name} ({window.schedule})" if window else "window: none active")
    print(f"last decision: {describe(last)}" if last else "last decision: none yet")


def describe(record: Decision) -> str:
    """One decision on one line: when, the outcome, and every proposal and clamp that made the number."""
    when = dt.datetime.fromtimestamp(record.at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    proposals = "; ".join(f"{p.source} {p.replicas}: {p.reason}" for p in record.proposals)
    clamps = f" | clamps: {'; '.join(record.clamps)}" if record.clamps else ""
    return f"{when} {record.outcome} (final {record.final}) | {proposals}{clamps}"


def _read_windows(name: str) -> list[dict[str, Any]]:
    """The windows of a JSON file: a list of windows, or an object with a "windows" list."""
    try:
        raw = json.loads(Path(name).read_text())
    except OSError as exc:
        raise UsageError(f"{name}: cannot read: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise UsageError(f"{name}: not JSON: {exc}") from exc
    if isinstance(raw, dict) and set(raw) == {"windows"}:
        raw = raw["windows"]
    if not isinstance(raw, list) or not all(isinstance(w, dict) for w in raw):
        raise UsageError(f'{name}: want a JSON list of windows (objects), or {{"windows": [...]}}')
    return raw


def describe_windows(view: Windows) -> str:
    """One line per window: name, schedule, bounds, active now, next start and end (UTC)."""
    def at(ts: float | None) -> str:
        return "never" if ts is None else dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")

    def bound(value: int | None) -> str:
        return "-" if value is None else str(value)

    source = "set through the API" if view.source == "api" else "from the config file"
    lines = [f"{len(view.windows)} window(s), {source}; active now: {view.active or 'none'}"]
    for w in view.windows:
        state = "ACTIVE" if w.active else "idle"
        bounds = f"{bound(w.min_replicas)}..{bound(w.max_replicas)}"
        lines.append(f"{w.name}: {state}; {w.schedule}; replicas {bounds}; "
                     f"next start {at(w.next_start)}, {'ends' if w.active else 'next end'} {at(w.next_end)}")
    return "\n".join(lines)
