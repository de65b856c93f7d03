"""Alert rules: the pending / firing / resolved state machine, actions, audit, persistence and the receiver.

The state machine runs on a simulated clock and a fake telemetry source whose values the test sets (a
rule's ``for`` of minutes takes no time); the built-in queries are checked once on the real in-process
scraper fed with /metrics pages. Actions run against ``RecordingFleet``, a stand-in that records what an
alert asked the fleet to do: the point here is the decision (once per firing, cooldowns, rate limits),
not replica processes. The receiver is the real REST API over ASGI. The notify webhook (a real HTTP server
on 127.0.0.1) and the live test with a real ``controlplane up`` are in ``test_alerts_live``, which imports
the fakes from here.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.alerts.config import AlertRuleConfig, AlertsConfig
from controlplane.alerts.engine import (
    AlertEngine,
    ExternalAlert,
    Observation,
    Rule,
    alert_delegation,
    build_engine,
    default_rules,
    rule_switches,
    rules_from_config,
    step,
)
from controlplane.api.factory import Services, create_api
from controlplane.auth import Auditor, Role, TokenAuthority
from controlplane.config import Config, ConfigError, load_config
from controlplane.fleet.reconcile import Fleet
from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.store.database import Store
from controlplane.telemetry.base import KV_USAGE, NUM_WAITING, TTFT, Group, Matchers, Series, Telemetry
from controlplane.telemetry.scraper import ScraperSource
from tests.controlplane.conftest import FakeClock
from tests.controlplane.fleet.test_reconcile import SimBackend


# ---- fakes ----------------------------------------------------------------------------------------
class FakeTelemetry(Telemetry):
    """Answers the built-in queries from values the test sets (None: no data)."""

    name = "fake"
    window_s = 30.0

    def __init__(self) -> None:
        self.ttft_p95: float | None = None
        self.kv: float | None = None
        self.waiting: float | None = None
        self.up: dict[str, float] = {}
        self.failing = False

    def _check(self) -> None:
        if self.failing:
            from controlplane.telemetry.base import TelemetryError

            raise TelemetryError("prometheus at http://127.0.0.1:9: connection refused")

    def gauge(self, metric: str, *, by: tuple[str, ...] = ("replica",), match: Matchers | None = None,
              agg: str = "sum") -> dict[Group, float]:
        self._check()
        if metric == "up":
            return {(rid,): v for rid, v in self.up.items()}
        value = {KV_USAGE: self.kv, NUM_WAITING: self.waiting}.get(metric)
        return {} if value is None else {(): value}

    def rate(self, metric: str, *, window_s: float | None = None, by: tuple[str, ...] = ("replica",),
             match: Matchers | None = None) -> dict[Group, float]:
        self._check()
        return {}

    def quantile(self, histogram: str, q: float, *, window_s: float | None = None,
                 by: tuple[str, ...] = ("replica",), match: Matchers | None = None) -> dict[Group, float]:
        self._check()
        return {(): self.ttft_p95} if histogram == TTFT and self.ttft_p95 is not None else {}

    def range(self, *args: Any, **kwargs: Any) -> list[Series]:
        return []


@dataclass
class RecordingFleet:
    """Records the scale and restart requests an alert makes (see the module docstring)."""

    desired_total: int = 2
    states: dict[str, ReplicaState] = field(default_factory=lambda: {"az-a-1": ReplicaState.READY,
                                                                     "az-b-1": ReplicaState.READY})
    restarted: list[str] = field(default_factory=list)

    def scale(self, replicas: int) -> None:
        self.desired_total = replicas

    def restart(self, replica_id: str) -> None:
        self.restarted.append(replica_id)

    def endpoints(self) -> list[ReplicaEndpoint]:
        return [ReplicaEndpoint(rid, rid[:4], "127.0.0.1", 8101 + i, state, "default")
                for i, (rid, state) in enumerate(sorted(self.states.items()))]


@dataclass
class Harness:
    engine: AlertEngine
    telemetry: FakeTelemetry
    fleet: RecordingFleet
    clock: FakeClock
    store: Store
    posts: list[tuple[str, dict[str, Any]]]

    def tick(self, seconds: float = 0.0) -> list[str]:
        """Advance the clock, evaluate once; the transitions as ``key state``."""
        self.clock.now += seconds
        return [f"{t.key} {t.state}" for t in asyncio.run(self.engine.evaluate_once())]

    def history(self, rule: str | None = None) -> list[dict[str, Any]]:
        return list(reversed(self.engine.history(rule=rule)))

    def audit(self) -> list[tuple[str, str, str, str]]:
        return [(a.actor, a.action, a.target, a.outcome) for a in reversed(self.store.audit())]


def make(store: Store, clock: FakeClock, config: AlertsConfig | None = None,
         telemetry: FakeTelemetry | None = None, fleet: RecordingFleet | None = None) -> Harness:
    config = config or AlertsConfig()
    telemetry = telemetry or FakeTelemetry()
    fleet = fleet or RecordingFleet()
    posts: list[tuple[str, dict[str, Any]]] = []

    def post(url: str, body: Any, timeout_s: float) -> int:
        posts.append((url, dict(body)))
        return 200

    engine = build_engine(config, store=store, auditor=Auditor(store), telemetry=telemetry, fleet=fleet,
                          clock=clock, post=post)
    return Harness(engine, telemetry, fleet, clock, store, posts)


@pytest.fixture
def h(store: Store, clock: FakeClock) -> Harness:
    return make(store, clock)


TTFT_KEY = "SlowTimeToFirstToken{}"


# ---- the state machine ----------------------------------------------------------------------------
def test_breach_is_pending_first_then_firing_after_for_then_resolved(h: Harness) -> None:
    h.telemetry.ttft_p95 = 7.5
    assert h.tick() == [f"{TTFT_KEY} pending"]
    assert h.tick(60) == []  # still pending: for is 120 s
    assert h.engine.active_alerts()[0]["state"] == "pending"
    assert h.tick(60) == [f"{TTFT_KEY} firing"]
    assert h.fleet.desired_total == 3  # the rule's action: scale_up by one
    h.telemetry.ttft_p95 = 1.0
    assert h.tick(5) == [f"{TTFT_KEY} resolved"]
    assert h.engine.active_alerts() == []
    states = [(r["state"], r["at"] - 1000.0) for r in h.history("SlowTimeToFirstToken")]
    assert states == [("pending", 0.0), ("firing", 120.0), ("resolved", 125.0)]
    firing = h.history("SlowTimeToFirstToken")[1]
    assert firing["result"]["outcome"] == "ok"
    assert firing["result"]["detail"] == "desired replicas 2 -> 3"


def test_flapping_breach_never_fires_and_each_breach_restarts_the_for_timer(h: Harness) -> None:
    for _ in range(4):
        h.telemetry.ttft_p95 = 9.0
        assert h.tick(50) == [f"{TTFT_KEY} pending"]
        assert h.tick(100) == []  # 100 s < 120 s
        h.telemetry.ttft_p95 = 2.0
        assert h.tick(10) == [f"{TTFT_KEY} resolved"]
    assert h.fleet.desired_total == 2
    resolved = [r for r in h.history() if r["state"] == "resolved"]
    assert {(r["fired"], r["reason"]) for r in resolved} == {(False, "cleared before it fired")}


def test_no_data_resolves_and_a_telemetry_error_keeps_the_state(h: Harness) -> None:
    h.telemetry.ttft_p95 = 9.0
    h.tick()
    h.telemetry.failing = True
    assert h.tick(200) == []  # unknown is not resolved, and not firing either
    assert h.engine.active_alerts()[0]["state"] == "pending"
    rule = next(r for r in h.engine.rules_json() if r["name"] == "SlowTimeToFirstToken")
    assert "connection refused" in rule["last_error"]
    h.telemetry.failing = False
    assert h.tick(1) == [f"{TTFT_KEY} firing"]
    h.telemetry.ttft_p95 = None  # no request in the window: nothing to compare, as in Prometheus
    assert h.tick(1) == [f"{TTFT_KEY} resolved"]


def test_per_replica_rule_tracks_each_replica_separately(h: Harness) -> None:
    h.telemetry.up = {"az-a-1": 0.0, "az-b-1": 1.0}
    assert h.tick() == ['ReplicaDown{replica="az-a-1"} pending']
    h.telemetry.up = {"az-a-1": 0.0, "az-b-1": 0.0}
    assert h.tick(20) == ['ReplicaDown{replica="az-b-1"} pending']
    assert h.tick(10) == ['ReplicaDown{replica="az-a-1"} firing']
    assert h.fleet.restarted == ["az-a-1"]
    assert h.tick(20) == ['ReplicaDown{replica="az-b-1"} firing']
    assert h.fleet.restarted == ["az-a-1", "az-b-1"]


def test_step_is_pure_and_fires_at_once_without_for() -> None:
    rule = Rule("Now", "vllm:num_requests_waiting", ">", 1.0, 0.0, action="none")
    (t,) = step(rule, {(): 5.0}, {}, 10.0)
    assert (t.key, t.state, t.since, t.value) == ("Now{}", "firing", 10.0, 5.0)
    assert step(rule, {(): 0.5}, {}, 11.0) == []


# ---- actions --------------------------------------------------------------------------------------
def test_a_firing_alert_acts_once_per_firing(h: Harness) -> None:
    h.telemetry.waiting = 900
    h.tick()
    for _ in range(10):
        h.tick(30)  # firing after 60 s, then stays firing
    assert h.fleet.desired_total == 3
    h.telemetry.waiting = 0
    h.tick(5)
    h.telemetry.waiting = 900
    h.tick(700)  # a new firing, after the rate-limit window
    h.tick(60)
    assert h.fleet.desired_total == 4
    scale_audits = [a for a in h.audit() if a[1] == "alerts.scale_up"]
    assert scale_audits == [("alerts", "alerts.scale_up", "fleet", "ok")] * 2


def test_restart_of_a_replica_is_not_repeated_within_the_cooldown(store: Store, clock: FakeClock) -> None:
    h = make(store, clock, AlertsConfig(restart_cooldown_s=300, action_retry_s=30))
    h.telemetry.up = {"az-a-1": 0.0}
    h.tick()
    h.tick(30)
    assert h.fleet.restarted == ["az-a-1"]
    h.telemetry.up = {"az-a-1": 1.0}
    h.tick(10)
    h.telemetry.up = {"az-a-1": 0.0}
    h.tick(10)
    h.tick(30)  # fires again 50 s after the restart: within the cooldown
    assert h.fleet.restarted == ["az-a-1"]
    firing = [r for r in h.history() if r["state"] == "firing"]
    assert firing[-1]["result"]["outcome"] == "cooldown"
    assert ("alerts", "alerts.restart_replica", "az-a-1", "denied") in h.audit()
    for _ in range(8):  # still down: tried again every 30 s, refused until the cooldown is over
        h.tick(30)
    assert h.fleet.restarted == ["az-a-1"]
    h.tick(30)  # 320 s after the restart
    assert h.fleet.restarted == ["az-a-1", "az-a-1"]
    result = h.history()[-1]["result"]
    assert (result["outcome"], result["attempts"]) == ("ok", 10)
    h.tick(30)
    h.tick(30)
    assert h.fleet.restarted == ["az-a-1", "az-a-1"]  # done for this firing: no more retries


def test_restart_waits_for_a_replica_the_fleet_is_bringing_up(store: Store, clock: FakeClock) -> None:
    fleet = RecordingFleet(states={"az-a-1": ReplicaState.STARTING})
    h = make(store, clock, AlertsConfig(action_retry_s=30), fleet=fleet)
    h.telemetry.up = {"az-a-1": 0.0}
    h.tick()
    h.tick(30)
    assert fleet.restarted == []
    result = h.history()[-1]["result"]
    assert (result["outcome"], result["detail"]) == ("deferred", "az-a-1 is starting: the fleet is already "
                                                                 "handling it")
    h.tick(20)
    fleet.states["az-a-1"] = ReplicaState.READY  # ready, yet its metrics still do not answer
    assert fleet.restarted == []
    h.tick(10)
    assert fleet.restarted == ["az-a-1"]


def test_an_alertmanager_restart_deferred_while_starting_is_retried_on_its_next_notification(
        store: Store, clock: FakeClock) -> None:
    fleet = RecordingFleet(states={"az-a-1": ReplicaState.STARTING})
    h = make(store, clock, AlertsConfig(action_retry_s=30), fleet=fleet)
    alert = ExternalAlert("firing", {"alertname": "ReplicaDown", "action": "restart_replica",
                                     "replica": "az-a-1"}, {}, "2026-11-30T10:00:00+00:00", "", "f00d")
    (first,) = asyncio.run(h.engine.receive([alert]))
    assert first["action"]["outcome"] == "deferred"
    clock.now += 10
    assert asyncio.run(h.engine.receive([alert]))[0]["outcome"] == "already acted on this firing"
    fleet.states["az-a-1"] = ReplicaState.UNREADY
    clock.now += 20
    (retried,) = asyncio.run(h.engine.receive([alert]))
    assert (retried["outcome"], retried["action"]["outcome"]) == ("retried", "ok")
    assert fleet.restarted == ["az-a-1"]


def test_a_switched_rule_reaches_the_prometheus_rule_file_and_its_late_firings_do_nothing(
        store: Store, clock: FakeClock, tmp_path: Path) -> None:
    fleet = RecordingFleet(states={"az-a-1": ReplicaState.READY})
    h = make(store, clock, fleet=fleet)
    files: list[str] = []
    h.engine.on_rules_changed = files.append  # the Prometheus that evaluates them for Alertmanager
    h.engine.set_enabled("ReplicaDown", False)
    assert '"ReplicaDown"' not in files[-1] and '"HighErrorRate"' in files[-1]
    # Alertmanager may still send what Prometheus fired before it re-read the file.
    alert = ExternalAlert("firing", {"alertname": "ReplicaDown", "action": "restart_replica",
                                     "replica": "az-a-1"}, {}, "2026-11-30T10:00:00+00:00", "", "beef")
    (out,) = asyncio.run(h.engine.receive([alert]))
    assert out["outcome"] == "ignored: the rule is disabled" and fleet.restarted == []
    h.engine.set_enabled("ReplicaDown", True)
    assert '"ReplicaDown"' in files[-1]
    # After a restart, the file written for Prometheus before anything runs keeps the operators' switch.
    h.engine.set_enabled("ReplicaDown", False)
    config = Config(state_dir=str(tmp_path / "cp"), alerts=AlertsConfig(alertmanager_url="http://127.0.0.1:9"))
    [path] = alert_delegation(config.alerts, config.state_path, rule_switches(store))["rule_files"]
    assert '"ReplicaDown"' not in path.read_text() and '"HighErrorRate"' in path.read_text()


def test_actions_of_one_kind_are_rate_limited(store: Store, clock: FakeClock) -> None:
    config = AlertsConfig(action_rate_limit=2, action_rate_window_s=600, max_replicas=10)
    h = make(store, clock, config)
    h.telemetry.waiting, h.telemetry.kv, h.telemetry.ttft_p95 = 900, 0.99, 9.0
    h.tick()
    h.tick(300)  # all three scale_up rules fire in this tick
    assert h.fleet.desired_total == 4  # 2 + 1 + 1; the third is refused
    outcomes = sorted(r["result"]["outcome"] for r in h.history() if r["state"] == "firing")
    assert outcomes == ["ok", "ok", "rate_limited"]
    assert [a[3] for a in h.audit() if a[1] == "alerts.scale_up"] == ["ok", "ok", "denied"]


def test_scale_up_stops_at_max_replicas(store: Store, clock: FakeClock) -> None:
    h = make(store, clock, AlertsConfig(max_replicas=2))
    h.telemetry.waiting = 900
    h.tick()
    h.tick(60)
    assert h.fleet.desired_total == 2
    assert h.history()[-1]["result"]["detail"] == "already at max_replicas (2)"


def test_abort_drill_calls_the_hook(store: Store, clock: FakeClock) -> None:
    calls: list[str] = []
    config = AlertsConfig(default_rules=False, rules=[AlertRuleConfig(
        name="DrillHurts", query="ttft_p95", threshold=3.0, for_s=0, action="abort_drill")])
    engine = build_engine(config, store=store, auditor=Auditor(store), telemetry=(t := FakeTelemetry()),
                          fleet=None, clock=clock, abort_drill=lambda reason: calls.append(reason))
    t.ttft_p95 = 4.0
    asyncio.run(engine.evaluate_once())
    assert calls == ["alert DrillHurts"]
    assert engine.history()[0]["result"]["outcome"] == "ok"


# ---- persistence ----------------------------------------------------------------------------------
def test_states_are_rebuilt_from_the_store_after_a_restart(tmp_path: Path, clock: FakeClock) -> None:
    with Store(tmp_path / "a.db", clock=clock) as store:
        first = make(store, clock)
        first.telemetry.ttft_p95 = 9.0
        first.telemetry.waiting = 900
        first.tick()
        first.tick(60)  # LongQueue fires (and scales); TTFT is pending since t0
        assert first.fleet.desired_total == 3
    with Store(tmp_path / "a.db", clock=clock) as store:
        fleet = RecordingFleet(desired_total=3)
        second = make(store, clock, fleet=fleet)
        assert {a["key"]: a["state"] for a in second.engine.active_alerts()} == {
            "LongQueue{}": "firing", TTFT_KEY: "pending"}
        second.telemetry.ttft_p95 = 9.0
        second.telemetry.waiting = 900
        assert second.tick(60) == [f"{TTFT_KEY} firing"]  # for counted from the first start
        # LongQueue acted before the restart: not again. TTFT's own firing scales once.
        assert fleet.desired_total == 4


def test_disabling_a_rule_resolves_its_alerts_and_survives_a_restart(h: Harness) -> None:
    h.telemetry.ttft_p95 = 9.0
    h.tick()
    resolved = h.engine.set_enabled("SlowTimeToFirstToken", False)
    assert [t.key for t in resolved] == [TTFT_KEY]
    assert h.tick(300) == []
    again = make(h.store, h.clock)
    assert not next(r for r in again.engine.rules_json() if r["name"] == "SlowTimeToFirstToken")["enabled"]


# ---- configuration --------------------------------------------------------------------------------
def test_rules_come_from_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("""
[alerts]
disabled_rules = ["KVCacheFull"]
[[alerts.rules]]
name = "SlowTimeToFirstToken"
query = "ttft_p95"
threshold = 2.5
for_s = 30
action = "notify"
[[alerts.rules]]
name = "ManyPreemptions"
expr = "sum(rate(vllm:num_preemptions_total[1m]))"
threshold = 1
severity = "critical"
action = "scale_up"
""")
    rules = {r.name: r for r in rules_from_config(load_config(path).alerts)}
    assert (rules["SlowTimeToFirstToken"].threshold, rules["SlowTimeToFirstToken"].action) == (2.5, "notify")
    assert not rules["KVCacheFull"].enabled
    assert rules["ManyPreemptions"].expr == "sum(rate(vllm:num_preemptions_total[1m]))"
    assert len(rules) == len(default_rules()) + 1


def test_a_bad_rule_fails_at_load_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[[alerts.rules]]\nname = "X"\nquery = "ttft_p95"\ncomparison = "=>"\n')
    with pytest.raises(ConfigError, match=r"c.toml: alerts.rules\[0\]: comparison must be one of"):
        load_config(path)


def test_a_promql_rule_without_prometheus_reports_why(store: Store, clock: FakeClock) -> None:
    config = AlertsConfig(default_rules=False, rules=[AlertRuleConfig(name="Custom", expr="vector(1)",
                                                                      threshold=0)])
    h = make(store, clock, config)
    assert h.tick() == []
    assert "needs Prometheus" in h.engine.rules_json()[0]["last_error"]


def test_builtin_queries_on_the_in_process_scraper(clock: FakeClock) -> None:
    """The scraper answers the built-in queries the way the PromQL would (the values the rules compare)."""
    pages = iter([_page(100, 0, 0.5, 3), _page(200, 4, 0.97, 40), _page(300, 8, 0.99, 700)])
    endpoint = ReplicaEndpoint("az-a-1", "az-a", "127.0.0.1", 8101, ReplicaState.READY, "default")
    source = ScraperSource(lambda: [endpoint], interval_s=1.0, ring_size=50, clock=clock,
                           fetch=lambda _: next(pages), window_s=60.0)
    for _ in range(3):
        source.scrape_once()
        clock.now += 20
    rules = {r.name: r for r in default_rules()}
    engine = AlertEngine(list(rules.values()), AlertsConfig(), store=None,  # type: ignore[arg-type]
                         actions=None, telemetry=source)  # type: ignore[arg-type]
    values = {name: dict(obs.values) for name, obs in engine.observe().items()}
    # 8 of 208 new requests answered 5xx; the 8 refused with 429 count in the total, not as errors
    assert values["HighErrorRate"][()] == pytest.approx(8 / 208)
    assert values["KVCacheFull"] == {(): 0.99}
    assert values["LongQueue"] == {(): 700.0}
    assert values["ReplicaDown"] == {("az-a-1",): 1.0}
    assert all(isinstance(obs, Observation) and not obs.error for obs in engine.observe().values())


def _page(requests: int, errors: int, kv: float, waiting: int) -> str:
    ok = requests - errors
    return (f'llmsre_http_requests_total{{path="/v1/completions",status_code="200"}} {ok}\n'
            f'llmsre_http_requests_total{{path="/v1/completions",status_code="500"}} {errors}\n'
            f'llmsre_http_requests_total{{path="/v1/completions",status_code="429"}} {errors}\n'
            f'llmsre_http_requests_total{{path="/metrics",status_code="200"}} {requests * 3}\n'
            f"vllm:kv_cache_usage_perc {kv}\nvllm:num_requests_waiting {waiting}\n")


# ---- the REST API and the webhook receiver --------------------------------------------------------
@dataclass
class Api:
    http: httpx.AsyncClient
    fleet: Fleet
    store: Store
    operator: str
    viewer: str


def _api(store: Store, clock: FakeClock) -> tuple[Any, Fleet, TokenAuthority]:
    fleet = Fleet(load_config().fleet, SimBackend(), store, secret=b"k" * 32)
    fleet.desired_total = 2
    tokens = TokenAuthority(store)
    auditor = Auditor(store)
    engine = build_engine(AlertsConfig(), store=store, auditor=auditor, telemetry=None, fleet=fleet,
                          clock=clock)
    return create_api(Services(fleet, store, tokens, auditor, alerts=engine)), fleet, tokens


def _call(store: Store, clock: FakeClock, method: str, path: str, *, role: str | None = "operator",
          **kwargs: Any) -> httpx.Response:
    app, _, tokens = _api(store, clock)
    headers = {"Authorization": f"Bearer {tokens.issue(f'{role}-x', Role(role))}"} if role else {}

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://cp") as http:
            return await http.request(method, path, headers=headers, **kwargs)

    return asyncio.run(go())


def payload(status: str = "firing", *, action: str = "scale_up", starts: str = "2026-11-30T10:00:00Z",
            fingerprint: str = "c0ffee0123456789", **labels: str) -> dict[str, Any]:
    alert = {"status": status, "labels": {"alertname": "SlowTimeToFirstToken", "action": action, **labels},
             "annotations": {"summary": "slow"}, "startsAt": starts,
             "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://prometheus/graph",
             "fingerprint": fingerprint}
    return {"version": "4", "groupKey": "{}:{alertname=\"SlowTimeToFirstToken\"}", "truncatedAlerts": 0,
            "status": status, "receiver": "controlplane", "groupLabels": {}, "commonLabels": {},
            "commonAnnotations": {}, "externalURL": "http://alertmanager", "alerts": [alert]}


@pytest.mark.parametrize(("body", "param"), [
    ({**payload(), "version": "3"}, "version"),
    ({k: v for k, v in payload().items() if k != "alerts"}, "alerts"),
    ({**payload(), "alerts": "many"}, "alerts"),
    ({**payload(), "alerts": [{**payload()["alerts"][0], "startsAt": "yesterday"}]}, "alerts.0.startsAt"),
    ({**payload(), "alerts": [{**payload()["alerts"][0], "status": "burning"}]}, "alerts.0.status"),
    ({**payload(), "alerts": [{**payload()["alerts"][0], "labels": {"x": 1.5}}]}, "alerts.0.labels.x"),
])
def test_bad_webhook_payloads_get_400_in_the_openai_shape(store: Store, clock: FakeClock,
                                                          body: dict[str, Any], param: str) -> None:
    response = _call(store, clock, "POST", "/api/v1/alerts/webhook", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


def test_webhook_that_is_not_json_gets_400(store: Store, clock: FakeClock) -> None:
    response = _call(store, clock, "POST", "/api/v1/alerts/webhook", content=b"{not json")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("role", "status"), [(None, 401), ("viewer", 403)])
def test_webhook_needs_an_operator_token(store: Store, clock: FakeClock, role: str | None,
                                         status: int) -> None:
    response = _call(store, clock, "POST", "/api/v1/alerts/webhook", role=role, json=payload())
    assert response.status_code == status
    assert response.json()["error"]["code"] in ("invalid_token", "insufficient_role")
    if role == "viewer":
        assert [(a.action, a.outcome) for a in store.audit()] == [
            ("POST /api/v1/alerts/webhook", "denied")]


def test_webhook_maps_labels_to_actions_once_per_firing(store: Store, clock: FakeClock) -> None:
    app, fleet, tokens = _api(store, clock)
    headers = {"Authorization": f"Bearer {tokens.issue('alertmanager', Role.OPERATOR)}"}

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://cp",
                                     headers=headers) as http:
            post = "/api/v1/alerts/webhook"
            return [await http.post(post, json=payload()),
                    await http.post(post, json=payload()),  # Alertmanager repeats a firing group
                    await http.get("/api/v1/alerts/active"),
                    await http.post(post, json=payload("resolved")),
                    await http.post(post, json=payload(starts="2026-11-30T11:00:00Z")),  # fires again
                    await http.post(post, json=payload(action="restart_replica", replica="nope",
                                                       fingerprint="5ca1ab1e")),
                    await http.get("/api/v1/alerts/history")]

    first, repeat, active, resolved, again, restart, history = asyncio.run(go())
    assert first.status_code == 200, first.text
    assert first.json()["results"][0]["action"]["outcome"] == "ok"
    assert repeat.json()["results"][0]["outcome"] == "already acted on this firing"
    assert [a["state"] for a in active.json()] == ["firing"]
    assert resolved.json()["results"][0]["outcome"] == "resolved"
    assert again.json()["results"][0]["outcome"] == "fired"
    assert fleet.desired_total == 4  # 2, then +1 per firing (not per notification)
    assert restart.json()["results"][0]["action"]["detail"] == "no replica 'nope' in the fleet"
    states = [r["state"] for r in reversed(history.json())]
    assert states == ["firing", "resolved", "firing", "firing"]
    audit = [(a.actor, a.action, a.outcome) for a in reversed(store.audit())]
    assert audit.count(("alerts", "alerts.scale_up", "ok")) == 2
    assert audit.count(("alertmanager", "alerts.webhook", "ok")) == 5
    assert ("alerts", "alerts.restart_replica", "error") in audit


def test_rule_switch_and_export_over_the_api(store: Store, clock: FakeClock) -> None:
    app, _, tokens = _api(store, clock)
    op = {"Authorization": f"Bearer {tokens.issue('op', Role.OPERATOR)}"}
    view = {"Authorization": f"Bearer {tokens.issue('view', Role.VIEWER)}"}

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://cp") as http:
            return [await http.put("/api/v1/alerts/rules/KVCacheFull", json={"enabled": False}, headers=op),
                    await http.put("/api/v1/alerts/rules/Nope", json={"enabled": False}, headers=op),
                    await http.put("/api/v1/alerts/rules/LongQueue", json={"enabled": False}, headers=view),
                    await http.get("/api/v1/alerts/rules", headers=view),
                    await http.get("/api/v1/alerts/rules.yml", headers=view)]

    ok, missing, denied, rules, yml = asyncio.run(go())
    assert ok.json() == {"name": "KVCacheFull", "enabled": False, "resolved": []}
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "name"
    assert denied.status_code == 403
    assert {r["name"]: r["enabled"] for r in rules.json()}["KVCacheFull"] is False
    assert yml.headers["content-type"].startswith("application/yaml")
    assert 'alert: "LongQueue"' in yml.text and "KVCacheFull" not in yml.text
    assert [(a.actor, a.action, a.target, a.outcome) for a in reversed(store.audit())] == [
        ("op", "alerts.disable", "KVCacheFull", "ok"), ("op", "alerts.disable", "Nope", "error"),
        ("view", "PUT /api/v1/alerts/rules/{name}", "/api/v1/alerts/rules/LongQueue", "denied")]
