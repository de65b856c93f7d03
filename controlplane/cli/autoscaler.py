"""``controlplane autoscaler status|decisions|observe-only on|off|pause|resume|windows [--set FILE.json]``:
the decision loop and its schedule (cron windows) from the command line, through the REST API."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

from controlplane.client import ControlPlaneClient

SUMMARY = "autoscaler: status, decision records, observe-only on|off, pause, resume, schedule windows"


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    actions = cmd.add_subparsers(dest="action", required=True)
    actions.add_parser("status", help="mode, active window and the last decision")
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
    windows.add_argument("--json", action="store_true", help="the API's answer as JSON")


def run(args: argparse.Namespace) -> int:
    if args.action == "windows" and args.set is not None:
        try:
            new_windows = _read_windows(Path(args.set))
        except ValueError as exc:
            print(f"controlplane: {args.set}: {exc}", file=sys.stderr)
            return 2
    with ControlPlaneClient(args.url, args.token) as client:
        if args.action == "status":
            _print_status(client.autoscaler_status())
        elif args.action == "decisions":
            for record in reversed(client.autoscaler_decisions(since=args.since, limit=args.limit)):
                print(json.dumps(record, sort_keys=True) if args.json else describe(record))
        elif args.action == "observe-only":
            status = client.autoscaler_configure(observe_only=args.state == "on")
            print(f"autoscaler mode: {status['mode']}")
        elif args.action == "windows":
            view = client.autoscaler_set_windows(new_windows) if args.set else client.autoscaler_windows()
            print(json.dumps(view, indent=2, sort_keys=True) if args.json else describe_windows(view))
        elif args.action == "pause":
            print(f"autoscaler mode: {client.autoscaler_pause()['mode']}")
        else:
            print(f"autoscaler mode: {client.autoscaler_resume()['mode']}")
    return 0


def _print_status(status: dict[str, Any]) -> None:
    cfg = status["config"]
    window = status["window"]
    print(f"mode {status['mode']}; desired replicas {status['desired_replicas']}; bounds "
          f"{cfg['min_replicas']}..{cfg['max_replicas']}; tick {cfg['tick_s']:g}s; "
          f"{status['ticks']} ticks since start")
    print(f"window: {window['name']} ({window['schedule']})" if window else "window: none active")
    last = status["last_decision"]
    print(f"last decision: {describe(last)}" if last else "last decision: none yet")


def describe(record: dict[str, Any]) -> str:
    """One decision on one line: when, the outcome, and every proposal and clamp that made the number."""
    when = dt.datetime.fromtimestamp(record["at"], dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    proposals = "; ".join(f"{p['source']} {p['replicas']}: {p['reason']}" for p in record["proposals"])
    clamps = f" | clamps: {'; '.join(record['clamps'])}" if record["clamps"] else ""
    return f"{when} {record['outcome']} (final {record['final']}) | {proposals}{clamps}"


def _read_windows(path: Path) -> list[dict[str, Any]]:
    """The windows of a JSON file: a list of windows, or an object with a "windows" list."""
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if isinstance(raw, dict) and set(raw) == {"windows"}:
        raw = raw["windows"]
    if not isinstance(raw, list) or not all(isinstance(w, dict) for w in raw):
        raise ValueError('want a JSON list of windows (objects), or {"windows": [...]}')
    return raw


def describe_windows(view: dict[str, Any]) -> str:
    """One line per window: name, schedule, bounds, active now, next start and end (UTC)."""
    def at(ts: float | None) -> str:
        return "never" if ts is None else dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")

    source = "set through the API" if view.get("source") == "api" else "from the config file"
    lines = [f"{len(view['windows'])} window(s), {source}; active now: {view.get('active') or 'none'}"]
    for w in view["windows"]:
        bounds = f"{'-' if w['min_replicas'] is None else w['min_replicas']}.." \
                 f"{'-' if w['max_replicas'] is None else w['max_replicas']}"
        state = "ACTIVE" if w["active"] else "idle"
        lines.append(f"{w['name']}: {state}; {w['schedule']}; replicas {bounds}; next start "
                     f"{at(w['next_start'])}, {'ends' if w['active'] else 'next end'} {at(w['next_end'])}")
    return "\n".join(lines)
