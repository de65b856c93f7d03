"""The Prometheus that evaluates the alert rules for Alertmanager (``[alerts] alertmanager_url`` set): its
rule file, written before Prometheus starts with the rules operators switched on or off through the API
(kept in the store), and written again, with a reload, whenever one is switched, so that Prometheus never
fires a rule the control plane has disabled."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from controlplane.alerts.config import AlertsConfig
from controlplane.alerts.rules import rule_file, rules_from_config
from controlplane.store.database import Store

logger = logging.getLogger(__name__)

SETTINGS_KEY = "alerts.rule_enabled"  # kv: rule name -> enabled, as operators set it through the API


def rule_switches(store: Store) -> dict[str, bool]:
    """The rules operators enabled or disabled through the API: rule name -> enabled."""
    return {str(k): bool(v) for k, v in dict(store.kv_get(SETTINGS_KEY, {}) or {}).items()}


def delegated_rules_path(state_path: Path) -> Path:
    """Where the rule file for the Prometheus we run is written (with ``[alerts] alertmanager_url``)."""
    return state_path / "prometheus" / "rules" / "alerts.yml"


def write_rule_file(path: Path, text: str) -> None:
    """Replace the file at once: Prometheus never reads half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def alert_delegation(alerts: AlertsConfig, state_path: Path,
                     switches: Mapping[str, bool] | None = None) -> dict[str, Any]:
    """With ``[alerts] alertmanager_url`` set: the rule file written for the Prometheus we run, and the
    Alertmanager it sends to (keyword arguments of ``PrometheusServer``); else nothing. ``switches``: the
    rules operators enabled or disabled through the API (kept in the store), which win over the config."""
    if not alerts.alertmanager_url:
        return {}
    path = delegated_rules_path(state_path)
    rules = [replace(r, enabled=bool((switches or {}).get(r.name, r.enabled)))
             for r in rules_from_config(alerts)]
    write_rule_file(path, rule_file(rules, interval_s=alerts.eval_interval_s))
    return {"rule_files": [path], "alertmanagers": [alerts.alertmanager_url]}


def rule_file_writer(path: Path, reload: Callable[[], None]) -> Callable[[str], None]:
    """``AlertEngine.on_rules_changed`` for the Prometheus we run: write the file, then have Prometheus
    re-read it (``reload`` blocks, so it runs in a worker thread; a failure is logged, and the next switch
    or restart writes the file again)."""
    def reload_logged() -> None:
        try:
            reload()
        except Exception as exc:
            logger.warning("alert rules written to %s, but Prometheus did not reload them: %s", path, exc)

    def changed(text: str) -> None:
        write_rule_file(path, text)
        asyncio.get_running_loop().run_in_executor(None, reload_logged)
    return changed
