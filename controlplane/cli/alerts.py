"""``controlplane alerts list|active|history|export|enable|disable``: the alert rules from the command line.

``export`` prints the rules as a Prometheus rule file (``controlplane alerts export > rules.yml``): from the
running control plane, or with ``--config FILE`` (or ``--defaults``) from a configuration, offline.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys

from controlplane.cli.options import add_json_option, client, show
from controlplane.client import ActiveAlert, AlertRule, AlertTransition
from controlplane.config import ConfigError, load_config

SUMMARY = "alert rules, active alerts, their history, enable/disable, export as a Prometheus rule file"


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    actions = cmd.add_subparsers(dest="action", required=True)
    add_json_option(actions.add_parser("list", help="the rules, their state counts and last evaluation "
                                                    "error"))
    add_json_option(actions.add_parser("active", help="pending and firing alerts"))
    history = actions.add_parser("history", help="state transitions, newest first")
    add_json_option(history)
    history.add_argument("--rule", default=None, help="only this rule")
    history.add_argument("--limit", type=int, default=50)
    export = actions.add_parser("export", help="the rules as a Prometheus rule file on stdout")
    source = export.add_mutually_exclusive_group()
    source.add_argument("--config", default=None, help="from this TOML file instead of the running API")
    source.add_argument("--defaults", action="store_true", help="the default rules, without a running API")
    for name in ("enable", "disable"):
        switch = actions.add_parser(name, help=f"{name} a rule (operator)")
        switch.add_argument("rule")


def run(args: argparse.Namespace) -> int:
    if args.action == "export" and (args.config or args.defaults):
        from controlplane.alerts.engine import rule_file, rules_from_config

        config = load_config(args.config).alerts
        try:
            sys.stdout.write(rule_file(rules_from_config(config), interval_s=config.eval_interval_s))
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        return 0
    with client(args) as api:
        if args.action == "export":
            sys.stdout.write(api.alert_rules_yml())
        elif args.action == "list":
            show(args, api.alert_rules(), _print_rules)
        elif args.action == "active":
            show(args, api.active_alerts(), _print_active)
        elif args.action == "history":
            show(args, api.alert_history(limit=args.limit, rule=args.rule), _print_history)
        else:
            result = api.set_alert_rule(args.rule, enabled=args.action == "enable")
            resolved = f"; resolved {', '.join(result.resolved)}" if result.resolved else ""
            print(f"{args.rule}: {'enabled' if result.enabled else 'disabled'}{resolved}")
    return 0


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _print_rules(rules: list[AlertRule]) -> None:
    print(f"{'RULE':<24} {'ON':<3} {'CONDITION':<14} {'FOR':>6} {'SEVERITY':<9} {'ACTION':<16} "
          f"{'PEND':>4} {'FIRE':>4}  LAST ERROR")
    for r in rules:
        condition = f"{r.comparison} {r.threshold:g}"
        print(f"{r.name:<24} {'yes' if r.enabled else 'no':<3} {condition:<14} {r.for_s:>5g}s "
              f"{r.severity:<9} {r.action:<16} {r.pending:>4} {r.firing:>4}  {r.last_error or '-'}")


def _print_active(alerts: list[ActiveAlert]) -> None:
    if not alerts:
        print("no active alerts")
        return
    print(f"{'STATE':<8} {'SINCE':<20} {'VALUE':>10}  ALERT")
    for a in alerts:
        value = "-" if a.value is None else f"{a.value:.4g}"
        print(f"{a.state:<8} {_when(a.since):<20} {value:>10}  {a.key}")


def _print_history(records: list[AlertTransition]) -> None:
    print(f"{'AT':<20} {'STATE':<9} {'ACTION':<32}  ALERT")
    for r in records:
        action = f"{r.result.kind}: {r.result.outcome}" if r.result else "-"
        print(f"{_when(r.at):<20} {r.state:<9} {action:<32}  {r.key}")
