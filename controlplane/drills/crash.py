"""The control-plane-crash drill: ``kill -9`` of the control plane under load, run from outside it.

Where it sits: the drill service (:mod:`controlplane.drills.service`) cannot run this drill in the process
the drill kills, so it starts ``python -m controlplane.drills.crash`` in a session of its own and hands it
a :class:`CrashOrder` on stdin (the control plane's pid, command line and working folder, an operator token
issued for the drill, the scenario). This runner talks to the control plane through its REST API only:

1. steady state: every replica and every gateway ready;
2. load from the load client (``python -m inference.bench serve``, as every drill), through the gateway;
3. acknowledged writes: a scale, an alert rule switched off, and drill schedules added one after another
   right up to the kill (each one the API answered is acknowledged), plus the runner's own token;
4. t0: a ``pause`` of one replica for ``pause_s`` (a fault that stays until reverted), then ``kill -9`` of
   the control plane; it stays down ``outage_s`` (the load goes on through the gateways);
5. while it is down, the paused replica is checked once the pause has expired: a fault still in effect
   then counts in ``faults_past_expiry``;
6. the control plane is started again with the same command line (in its own session, its output in
   ``logs/controlplane.log`` of its state folder), and ``RTO_api`` is the time from that start to the
   first answer of ``GET /api/v1/fleet`` (the outage itself is the drill's choice, reported as
   ``outage_s``);
7. once the load is over: the figures from the client's records (requests failed, tokens lost or
   duplicated), the acknowledged writes that are missing (``writes_lost``), and the processes of the state
   folder that the new control plane does not own (``orphans``: replicas, gateways, expiry guards);
8. what the drill changed is put back, and the report goes to ``PUT /api/v1/drills/{id}/report``.

Like every drill, a failure becomes a report (status ``error``), never an exception out of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from chaos.drill_figures import client_timeline, derive_figures, timeline_series, verdict
from chaos.drills import (
    DrillError,
    FleetSample,
    LoadFailed,
    LoadNotFlowing,
    describe_load,
    load_command,
    load_not_started,
)
from chaos.faults.process import process_state
from chaos.scenarios import Scenario, scenario
from controlplane.client import ApiError, ControlPlaneClient
from inference.bench.report import read_jsonl
from inference.environment import child_environment

logger = logging.getLogger(__name__)

SCENARIO = "control-plane-crash"
STOPPED = {psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP}
PAUSE_S = 4.0  # the fault injected just before the kill; it must end while the control plane is down
EXPIRY_SLACK_S = 3.0  # a guard's revert on a busy machine
POLL_S = 0.1
LOAD_FLOWING_TIMEOUT_S = 60.0
MAX_BURST_WRITES = 200
KILL_WAIT_S = 10.0


@dataclasses.dataclass(slots=True, frozen=True)
class CrashOrder:
    drill_id: int
    api: str
    gateway: str
    token: str
    overrides: dict[str, Any]
    controlplane_pid: int
    command: list[str]
    cwd: str
    state_dir: str
    workdir: str

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> CrashOrder:
        return cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls)})

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Writes:
    """Mutations the API acknowledged before t0, and the check that each is still there after."""

    def __init__(self, client: ControlPlaneClient, drill_id: int, token: str) -> None:
        self.client, self.drill_id, self.token = client, drill_id, token
        self.schedules: list[str] = []
        self.desired: int | None = None
        self.rule: tuple[str, bool] | None = None  # (name, its state before the drill)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def before(self) -> None:
        fleet = self.client.fleet()
        self.client.scale(fleet.desired_replicas)
        self.desired = fleet.desired_replicas
        rules = [r for r in self.client.alert_rules() if r.enabled]
        if rules:
            self.client.set_alert_rule(rules[0].name, enabled=False)
            self.rule = (rules[0].name, True)

    def start_burst(self) -> None:
        """Add schedules one after another until :meth:`stop_burst` (the kill): the last ones are written
        in the last milliseconds before it."""
        self._thread = threading.Thread(target=self._burst, name="crash-drill-writes", daemon=True)
        self._thread.start()

    def stop_burst(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _burst(self) -> None:
        with ControlPlaneClient(self.client.url, self.token, timeout=5.0) as client:
            for n in range(MAX_BURST_WRITES):
                if self._stop.is_set():
                    return
                name = f"crash-drill-{self.drill_id}-{n}"
                try:
                    added = client.add_drill_schedule(name=name, scenario_id="replica-crash",
                                                      cron="0 3 1 1 *", paused=True)
                except (ApiError, httpx.HTTPError):
                    return  # the control plane is gone: what it acknowledged so far is what counts
                self.schedules.append(added.id)

    def lost(self) -> list[str]:
        """Every acknowledged write that the control plane no longer has."""
        missing: list[str] = []
        fleet = self.client.fleet()
        if self.desired is not None and fleet.desired_replicas != self.desired:
            missing.append(f"scale: desired {self.desired}, now {fleet.desired_replicas}")
        if self.rule is not None:
            state = next((r.enabled for r in self.client.alert_rules() if r.name == self.rule[0]), None)
            if state is not False:
                missing.append(f"alert rule {self.rule[0]} switched off, now enabled={state}")
        listed = {s.id for s in self.client.drill_schedules()}
        missing += [f"schedule {sid}" for sid in self.schedules if sid not in listed]
        return missing

    def count(self) -> int:
        return (self.desired is not None) + (self.rule is not None) + len(self.schedules) + 1  # + the token

    def put_back(self) -> None:
        for sid in self.schedules:
            with contextlib.suppress(ApiError, httpx.HTTPError):
                self.client.delete_drill_schedule(sid)
        if self.rule is not None:
            with contextlib.suppress(ApiError, httpx.HTTPError):
                self.client.set_alert_rule(self.rule[0], enabled=self.rule[1])


class CrashDrill:
    def __init__(self, order: CrashOrder, *, clock: Callable[[], float] = time.time) -> None:
        self.order, self.clock = order, clock
        self.sc: Scenario = scenario(SCENARIO).with_overrides(order.overrides)
        self.workdir = Path(order.workdir)
        self.client = ControlPlaneClient(order.api, order.token, timeout=10.0)
        self.api = _Routes(order.api, order.token)
        self.writes = Writes(self.client, order.drill_id, order.token)
        self.samples: list[FleetSample] = []
        self.desired = 0
        self.load: subprocess.Popen[bytes] | None = None
        self.report: dict[str, Any] = {"id": order.drill_id, "scenario": SCENARIO, "title": self.sc.title,
                                       "status": "running", "runner": "external", "runner_pid": os.getpid(),
                                       "config": self.sc.describe(), "events": []}
        self.restarted: subprocess.Popen[bytes] | None = None

    def note(self, what: str, **detail: Any) -> None:
        logger.info("[drill %d] %s %s", self.order.drill_id, what, detail or "")
        self.report["events"].append({"t": self.clock(), "what": what, **detail})

    def phase(self, name: str, fraction: float) -> None:
        self.report["phase"] = name
        self.report["progress"] = {"phase": name, "fraction": round(fraction, 3)}
        with contextlib.suppress(ApiError, httpx.HTTPError):
            self.api.put_report(self.order.drill_id, self.report)

    # ---- the run ----
    def run(self) -> dict[str, Any]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._drill()
        except Exception as exc:  # a failed drill is a report
            logger.exception("drill %d failed", self.order.drill_id)
            self.report["status"], self.report["error"] = "error", f"{type(exc).__name__}: {exc}"
        finally:
            self._stop_load()
            with contextlib.suppress(Exception):
                self.writes.put_back()
            self.report["finished_at"] = self.clock()
            self.report.pop("progress", None)
        self._deliver()
        return self.report

    def _drill(self) -> None:
        self.phase("steady-state", 0.0)
        self._steady_state()
        self.writes.before()
        self._start_load()
        load_start = self._load_flowing()
        self.phase("load", 0.1)
        self._observe_until(load_start + self.sc.fault_at_s)
        self.writes.start_burst()
        time.sleep(0.5)  # a few schedules in flight when the kill comes
        victim, pause_ends = self._pause_a_replica()
        t0 = self._kill()  # the schedule writes run into the kill on purpose
        self.writes.stop_burst()
        self.report["t0"] = t0
        self.phase("outage", 0.3)
        self.report["faults_past_expiry"] = self._check_expiry(victim, pause_ends)
        self._observe_until(t0 + self.sc.outage_s)
        self.phase("restart", 0.5)
        restarted_at = self.clock()
        api_at = self._restart()
        self.report["rto_api_s"] = round(api_at - restarted_at, 3)
        self.report["outage_s"] = round(restarted_at - t0, 3)
        self._observe_until(t0 + self.sc.capacity_deadline_s, until_load_done=True)
        self.phase("report", 0.9)
        self._conclude(t0)

    def _steady_state(self) -> None:
        deadline = self.clock() + self.sc.steady_state_timeout_s
        reasons: list[str] = []
        while self.clock() < deadline:
            fleet = self.client.fleet()
            gateways = self.api.gateways()
            reasons = []
            if fleet.ready_replicas < fleet.desired_replicas:
                reasons.append(f"fleet: {fleet.ready_replicas} of {fleet.desired_replicas} replicas ready")
            down = [g["name"] for g in gateways if g["state"] != "ready"]
            if down:
                reasons.append(f"gateways not ready: {', '.join(down)}")
            if not reasons:
                self.report["steady_state"] = {"ok": True, "ready": fleet.ready_replicas,
                                               "gateways": len(gateways)}
                return
            time.sleep(0.5)
        raise DrillError("steady state not met: " + "; ".join(reasons), subject=str(self.order.drill_id))

    def _start_load(self) -> None:
        cmd = load_command(self.sc, self.order.gateway, self.workdir)
        with open(self.workdir / "load.log", "wb") as log:
            self.load = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=child_environment())
        self.report["load"] = {**describe_load(self.sc), "command": " ".join(cmd[1:]), "pid": self.load.pid}
        self.note("load started", pid=self.load.pid)

    def _load_flowing(self) -> float:
        deadline = self.clock() + LOAD_FLOWING_TIMEOUT_S
        while self.clock() < deadline:
            if self.load is not None and self.load.poll() is not None:
                raise LoadFailed(f"the load client exited ({self.load.returncode}); see "
                                 f"{self.workdir / 'load.log'}")
            if any(sum(g["inflight"].values()) for g in self.api.gateways()):
                return self.clock()
            time.sleep(POLL_S)
        if self.load is not None:
            self.load.poll()
        why = load_not_started(self.load, self.workdir / "load.log", waited_s=LOAD_FLOWING_TIMEOUT_S)
        self.report.setdefault("load", {})["not_started"] = why
        raise LoadNotFlowing(f"the load never reached the gateways: {why}; see {self.workdir / 'load.log'}")

    def _pause_a_replica(self) -> tuple[Any, float]:
        fleet = self.client.fleet()
        victim = max(fleet.replicas, key=lambda r: r.replica_id)
        self.client.chaos_inject("pause", replicas=[victim.replica_id], duration_s=PAUSE_S)
        ends = self.clock() + PAUSE_S
        self.note("fault injected", kind="pause", target=victim.replica_id, duration_s=PAUSE_S)
        return victim, ends

    def _kill(self) -> float:
        pid = self.order.controlplane_pid
        os.kill(pid, signal.SIGKILL)
        t0 = self.clock()
        deadline = t0 + KILL_WAIT_S
        while _running(pid) and self.clock() < deadline:  # gone, or a zombie its parent has yet to reap
            time.sleep(0.01)
        self.note("control plane killed", pid=pid)
        return t0

    def _check_expiry(self, victim: Any, ends: float) -> int:
        self._observe_until(ends + EXPIRY_SLACK_S)
        state = process_state(victim.pid) if victim.pid else None
        paused = state in STOPPED
        self.note("fault expiry checked", target=victim.replica_id, process_state=state, still_paused=paused)
        return int(paused)

    def _restart(self) -> float:
        log_dir = Path(self.order.state_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / "controlplane.log", "ab") as log:
            self.restarted = subprocess.Popen(self.order.command, cwd=self.order.cwd, stdout=log,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              env=child_environment(), start_new_session=True)
        self.note("control plane started again", pid=self.restarted.pid)
        while True:
            try:
                self.client.fleet()
                return self.clock()
            except (ApiError, httpx.HTTPError):
                if self.restarted.poll() is not None:
                    raise DrillError(f"the control plane exited at start ({self.restarted.returncode}); "
                                     f"see {log_dir / 'controlplane.log'}") from None
                time.sleep(POLL_S)

    def _observe_until(self, until: float, *, until_load_done: bool = False) -> None:
        while self.clock() < until:
            self._sample()
            if until_load_done and self.load is not None and self.load.poll() is not None and \
                    self.samples and self.samples[-1].has_capacity:
                return
            time.sleep(0.5)

    def _sample(self) -> None:
        """Ready replicas from the control plane, or, while it is down, as the gateway routes them."""
        try:
            fleet = self.client.fleet()
            self.desired = fleet.desired_replicas
            self.samples.append(FleetSample(self.clock(), fleet.ready_replicas, fleet.desired_replicas))
            return
        except ApiError:
            pass
        try:
            health = self.api.gateway_health(self.order.gateway)
        except (httpx.HTTPError, ValueError):
            return
        self.samples.append(FleetSample(self.clock(), len(health.get("routable", [])), self.desired))

    def _stop_load(self) -> None:
        if self.load is None or self.load.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.load.pid, signal.SIGTERM)
        try:
            self.load.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.load.pid, signal.SIGKILL)
            self.load.wait(5)

    # ---- the report ----
    def _conclude(self, t0: float) -> None:
        jsonl = self.workdir / "load.jsonl"
        records = read_jsonl(jsonl) if jsonl.exists() else []
        if not records:
            raise LoadFailed(f"the load client wrote no records; see {self.workdir / 'load.log'}")
        requests = client_timeline(records)
        fig = derive_figures(requests, self.samples, t0=t0, slo=self.sc.slo)
        lost = self.writes.lost()
        fig.writes_lost = len(lost)
        fig.rto_api_s = self.report["rto_api_s"]
        fig.faults_past_expiry = self.report["faults_past_expiry"]
        orphans = self._orphans()
        fig.orphans = len(orphans)
        checks = verdict(fig, self.sc.targets)
        self.report.update({"figures": fig.relative(), "checks": [dataclasses.asdict(c) for c in checks],
                            "timeline": timeline_series(requests, self.samples, t0),
                            "writes": {"acknowledged": self.writes.count(), "lost": lost},
                            "orphans": orphans,
                            "controlplane_pid": self.restarted.pid if self.restarted else None,
                            "status": "passed" if all(c.ok for c in checks) else "failed"})
        self.note("report", status=self.report["status"])

    def _orphans(self) -> list[str]:
        """Processes of this state folder that the restarted control plane does not own."""
        owned_replicas = {r.pid for r in self.client.fleet().replicas}
        owned_gateways = {g["pid"] for g in self.api.gateways()}
        state = self.order.state_dir
        found: list[str] = []
        consoles: list[int] = []
        procs = list(psutil.process_iter(["pid", "ppid", "cmdline"]))
        commands = {proc.pid: proc.info["cmdline"] for proc in procs}
        for proc in procs:
            cmd = proc.info["cmdline"] or []
            if commands.get(proc.info["ppid"]) == cmd:
                continue  # a child between its fork and its exec (a replica's ninja, a gateway's ldconfig)
            if "inference" in cmd and "serve" in cmd and proc.pid not in owned_replicas and \
                    _env_of(proc).get("LLMSRE_STATE_DIR") == state:
                found.append(f"replica pid {proc.pid}")
            elif "controlplane.gateway" in cmd and any(a.startswith(f"{state}/gateways/") for a in cmd) and \
                    proc.pid not in owned_gateways:
                found.append(f"gateway pid {proc.pid}")
            elif "chaos.expiry" in cmd and proc.create_time() < self.report["t0"] and \
                    _env_of(proc).get("LLMSRE_STATE_DIR") == state:
                found.append(f"expiry guard pid {proc.pid} (started before t0, its fault long expired)")
            elif "dashboards" in cmd and "--api" in cmd and cmd[cmd.index("--api") + 1] == self.order.api:
                consoles.append(proc.pid)
        # one console at most: the restarted control plane adopts the one the killed one left
        found += [f"console pid {pid}" for pid in sorted(consoles)[1:]]
        return found

    def _deliver(self) -> None:
        for _ in range(3):
            try:
                self.api.put_report(self.order.drill_id, self.report)
                return
            except (ApiError, httpx.HTTPError) as exc:
                logger.warning("drill %d: report not delivered yet: %s", self.order.drill_id, exc)
                time.sleep(1.0)
        (self.workdir / "report.json").write_text(json.dumps(self.report, indent=1))
        logger.error("drill %d: report kept in %s", self.order.drill_id, self.workdir / "report.json")


class _Routes:
    """The two routes this runner needs beyond the typed client: the gateways' state and the report."""

    def __init__(self, api: str, token: str) -> None:
        self._http = httpx.Client(base_url=api, headers={"authorization": f"Bearer {token}"}, timeout=10.0,
                                  trust_env=False)

    def gateways(self) -> list[dict[str, Any]]:
        response = self._http.get("/api/v1/gateways")
        response.raise_for_status()
        return list(response.json())

    def gateway_health(self, gateway: str) -> dict[str, Any]:
        response = httpx.get(f"{gateway}/health", timeout=2.0, trust_env=False)
        response.raise_for_status()
        return dict(response.json())

    def put_report(self, drill_id: int, report: dict[str, Any]) -> None:
        self._http.put(f"/api/v1/drills/{drill_id}/report", json=report).raise_for_status()


def _running(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _env_of(proc: psutil.Process) -> dict[str, str]:
    try:
        return dict(proc.environ())
    except psutil.Error:
        return {}


def spawn(order: CrashOrder, *, log: Path) -> int:
    """Start the runner in a session of its own (it outlives the control plane); its pid."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        child = subprocess.Popen([sys.executable, "-m", "controlplane.drills.crash"], stdin=subprocess.PIPE,
                                 stdout=out, stderr=subprocess.STDOUT, env=child_environment(),
                                 start_new_session=True)
    assert child.stdin is not None
    child.stdin.write(json.dumps(order.to_json()).encode())  # the token: never on a command line
    child.stdin.close()
    return child.pid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controlplane.drills.crash",
                                     description="run by the drill service: reads its order as JSON on stdin")
    parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per poll
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the control plane
    order = CrashOrder.from_json(json.loads(sys.stdin.read()))
    report = CrashDrill(order).run()
    return 0 if report.get("status") == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
