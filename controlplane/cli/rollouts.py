"""``controlplane versions`` and ``controlplane rollout``: the model-version registry, rolling updates and
canary releases from the command line, through the REST API.

    controlplane versions                              # the registry and the current version
    controlplane versions add v2 --model /models/v2 --notes "retrained"
    controlplane rollout --model /models/v2            # a plain rolling update, one replica at a time
    controlplane rollout --canary v2 --steps 5,20,50,100 --interval 60 --wait
    controlplane rollout --status                      # the split now and the release's step analyses
    controlplane rollout --abort | --promote | --pause | --resume
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from collections.abc import Mapping
from typing import Any

from controlplane.cli.exits import UsageError
from controlplane.cli.options import add_json_option, client, show
from controlplane.client import ControlPlaneClient, ReleaseView, RolloutsView, VersionsView

VERSIONS_SUMMARY = "model versions: list the registry, add a version"
ROLLOUT_SUMMARY = "roll out a model: a rolling update (--model) or a canary release by steps (--canary)"
ACTIONS = ("promote", "abort", "pause", "resume")
WAIT_POLL_S = 1.0


def add_versions_arguments(cmd: argparse.ArgumentParser) -> None:
    actions = cmd.add_subparsers(dest="action")
    add = actions.add_parser("add", help="register a version (operator)")
    add.add_argument("name", help="a-z, 0-9, '.' and '-'")
    add.add_argument("--model", required=True, help="a Hugging Face folder, or 'default' / 'default-moe'")
    add.add_argument("--notes", default="")
    add_json_option(cmd)


def add_rollout_arguments(cmd: argparse.ArgumentParser) -> None:
    what = cmd.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="rolling update to this model: a folder, or 'default' / 'default-moe'")
    what.add_argument("--canary", metavar="VERSION", help="canary release of a registered version")
    what.add_argument("--status", action="store_true", help="the split now and the release's analyses")
    for action in ACTIONS:
        what.add_argument(f"--{action}", action="store_true", help=f"{action} the running release")
    cmd.add_argument("--steps", default="5,20,50,100", help="percent of traffic per step (last: 100)")
    cmd.add_argument("--interval", type=float, default=60.0, help="seconds per step's analysis window")
    cmd.add_argument("--replicas", type=int, default=1, help="the canary's replicas")
    cmd.add_argument("--reason", default="", help="why (kept in the release record)")
    cmd.add_argument("--wait", action="store_true", help="follow the release until it ends")
    add_json_option(cmd)


def run_versions(args: argparse.Namespace) -> int:
    with client(args) as api:
        if args.action == "add":
            version = api.add_version(args.name, args.model, args.notes)
            print(f"version {version.name}: {version.model}")
            return 0
        show(args, api.versions(), _print_versions)
    return 0


def run_rollout(args: argparse.Namespace) -> int:
    steps = _steps(args.steps) if args.canary else []
    with client(args) as api:
        if args.model:
            result = api.rollout(args.model)
            print(f"rolling out {result.model} (generation {result.generation}); follow it with "
                  "`controlplane status` or `controlplane events --kind rollout`")
            return 0
        if args.status:
            show(args, api.rollouts(), _print_rollouts)
            return 0
        if args.canary:
            release = api.start_canary(args.canary, steps=steps, interval_s=args.interval,
                                       replicas=args.replicas)
            print(f"release {release.id}: canary of {release.version}, steps {args.steps}% every "
                  f"{args.interval:g} s")
        else:
            action = next(a for a in ACTIONS if getattr(args, a))
            running = api.rollouts().release
            if running is None or running.outcome not in ("running", "paused"):
                raise UsageError(f"--{action}: no release is running")
            release = api.release_action(running.id, action, args.reason)
            print(f"release {release.id}: {action} asked")
        return _follow(api, release.id) if args.wait else 0


def _follow(api: ControlPlaneClient, release_id: int) -> int:
    """Print each step's decision as it is made; exit 0 when promoted, 1 when aborted."""
    seen = 0
    while True:
        release = api.rollouts().release
        if release is None or release.id != release_id:
            raise UsageError(f"release {release_id} is no longer the control plane's latest")
        for step in release.steps[seen:]:
            print(_describe_step(step), flush=True)
        seen = len(release.steps)
        if release.outcome in ("promoted", "aborted"):
            print(f"release {release.id} {release.outcome}: {release.reason}")
            return 0 if release.outcome == "promoted" else 1
        time.sleep(WAIT_POLL_S)


def _steps(text: str) -> list[float]:
    try:
        steps = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise UsageError(f"--steps: percents separated by commas, e.g. 5,20,50,100; got {text!r}") from exc
    if not steps or steps[-1] != 100 or steps != sorted(set(steps)) or steps[0] <= 0:
        raise UsageError(f"--steps: increasing percents ending at 100, e.g. 5,20,50,100; got {text!r}")
    return steps


def _describe_step(step: Mapping[str, Any]) -> str:
    when = float(step.get("at") or step.get("window", [0, 0])[-1])
    at = dt.datetime.fromtimestamp(when).strftime("%H:%M:%S")
    event = step.get("event")
    if event == "analysis":
        figures = "; ".join(
            f"{m['metric']} {_side(m['candidate'], m['metric'])} vs {_side(m['baseline'], m['metric'])}"
            f" ({m['verdict']})" for m in step.get("metrics", []))
        return f"{at}  {step['share']:.0%}: {step['decision']} - {figures}"
    if event == "step":
        return f"{at}  {step['share']:.0%} of traffic to the canary"
    return f"{at}  {event}" + (f": {step['reason']}" if step.get("reason") else "")


def _side(figures: Mapping[str, Any], metric: str) -> str:
    if metric == "errors":
        return f"{figures['failed']}/{figures['requests']}"
    return "-" if figures.get("p50") is None else f"p50 {figures['p50']:.1f} ms"


def _print_versions(view: VersionsView) -> None:
    for v in view.versions:
        mark = "*" if v.name == view.current else " "
        print(f"{mark} {v.name:<16} {v.model}  {v.notes}")
    if not view.versions:
        print("no versions registered; add one with `controlplane versions add NAME --model M`")


def _print_rollouts(view: RolloutsView) -> None:
    split = dict(view.plan.get("split") or {})
    print(f"current version: {view.current or '-'}; split: "
          + (", ".join(f"{v} {s:.0%}" for v, s in split.items()) or "all traffic to the stable fleet"))
    release: ReleaseView | None = view.release
    if release is None:
        return
    print(f"release {release.id}: {release.kind} of {release.version} from {release.from_version or '-'}, "
          f"{release.outcome}" + (f" ({release.reason})" if release.reason else ""))
    for step in release.steps:
        print("  " + _describe_step(step))
    sys.stdout.flush()
