"""The real Prometheus, run as a child process that follows the fleet.

Where it sits: ``controlplane up`` (``app.py``) starts one :class:`PrometheusServer` beside the replicas
when ``[telemetry] source = "prometheus"``; the fleet's changes reach it as targets, and the control plane
reads it back through :class:`~controlplane.telemetry.prometheus.PrometheusSource` (in PromQL). It writes
``prometheus.yml`` (a ``replicas`` job fed by file-based service discovery, plus static jobs for the control
plane's and the gateway's own metrics; a target's labels win over what its page says of itself), rewrites
``targets/replicas.json`` atomically whenever the fleet changes (Prometheus picks the change up within
seconds), starts the binary, waits for ``/-/ready`` and always stops it again. The lifecycle API
(``/-/reload``, ``/-/quit``) stays off, so that no local process can stop or reconfigure it over HTTP;
:meth:`PrometheusServer.reload` sends SIGHUP and waits for Prometheus' reload metrics to confirm. It
starts with none of the control plane's secrets in its environment: a job whose page needs a token (the
control plane's ``/metrics/state``, a :class:`GuardedPage`) names a 0600 file holding it, which Prometheus
reads at each scrape. Its state folder holds::

    prometheus.yml  targets/replicas.json  data/ (TSDB)  prometheus.log  prometheus.pid  scrape.token
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.telemetry.base import TelemetryError
from controlplane.telemetry.config import PrometheusConfig
from controlplane.telemetry.promql import duration, quote
from inference.environment import child_environment

logger = logging.getLogger(__name__)

UNAVAILABLE = "unavailable: prometheus binary not found"
REPLICAS_JOB = "replicas"
FILE_SD_REFRESH = "1s"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.1
RELOAD_TIMEOUT_S = 10.0
RELOADED_AT = "prometheus_config_last_reload_success_timestamp_seconds"
RELOAD_OK = "prometheus_config_last_reload_successful"
LOG_TAIL_LINES = 20
# What a replica's page repeats of its target's labels; Prometheus renames those to exported_<name>.
ECHOED_LABELS = "exported_(replica|zone)"


class PrometheusError(TelemetryError):
    """Prometheus could not be configured, started or queried."""


class PrometheusUnavailable(PrometheusError):
    """The binary is not installed."""

    def __init__(self) -> None:
        super().__init__(UNAVAILABLE)


@dataclass(frozen=True, slots=True)
class GuardedPage:
    """A static job's page that needs a bearer token: its path, and the file (0600, written by whoever
    holds the token) that Prometheus reads the token from at each scrape; the token is never in the config."""

    metrics_path: str
    credentials_file: Path


class PrometheusServer:
    """One Prometheus child process with a generated configuration, following the fleet by file SD.

    ``static_jobs`` maps a job name to ``host:port`` targets scraped at ``/metrics`` (the control plane,
    the gateway), or at the page ``guarded_pages`` names for that job, with its token; ``rule_files`` are
    loaded as recording/alerting rules.
    """

    def __init__(self, config: PrometheusConfig, state_dir: Path, *,
                 static_jobs: Mapping[str, Sequence[str]] | None = None,
                 guarded_pages: Mapping[str, GuardedPage] | None = None,
                 rule_files: Sequence[Path] = (), alertmanagers: Sequence[str] = (),
                 ready_timeout_s: float = READY_TIMEOUT_S,
                 stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
        if config.scrape_interval_s <= 0:
            raise ValueError(f"prometheus.scrape_interval_s must be > 0, got {config.scrape_interval_s}")
        self.config = config
        self.state_dir = Path(state_dir)
        self.static_jobs = {name: list(targets) for name, targets in (static_jobs or {}).items()}
        self.guarded_pages = dict(guarded_pages or {})
        self.rule_files = [Path(p) for p in rule_files]
        self.alertmanagers = [_alertmanager_target(url) for url in alertmanagers]  # (scheme, host:port, path)
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    # -- paths and addresses
    @property
    def config_path(self) -> Path:
        return self.state_dir / "prometheus.yml"

    @property
    def targets_path(self) -> Path:
        return self.state_dir / "targets" / "replicas.json"

    @property
    def data_path(self) -> Path:
        return self.state_dir / "data"

    @property
    def log_path(self) -> Path:
        return self.state_dir / "prometheus.log"

    @property
    def pid_path(self) -> Path:
        return self.state_dir / "prometheus.pid"

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.config.port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    # -- availability and configuration
    def binary_path(self) -> str | None:
        return shutil.which(self.config.binary)

    def is_available(self) -> bool:
        return self.binary_path() is not None

    def write_config(self) -> Path:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.targets_path.parent.mkdir(parents=True, exist_ok=True)
        if not self.targets_path.exists():
            _write_atomic(self.targets_path, "[]\n")
        _write_atomic(self.config_path, self.render_config())
        return self.config_path

    def render_config(self) -> str:
        interval = duration(self.config.scrape_interval_s)
        lines = [
            "# Written by the control plane at every start; edits are lost.",
            "global:",
            f"  scrape_interval: {interval}",
            f"  scrape_timeout: {interval}",
            f"  evaluation_interval: {interval}",
        ]
        if self.rule_files:
            lines += ["rule_files:", *(f"  - {quote(str(p))}" for p in self.rule_files)]
        if self.alertmanagers:
            lines += ["alerting:", "  alertmanagers:"]
            for scheme, target, prefix in self.alertmanagers:
                lines += [f"    - scheme: {scheme}", f"      path_prefix: {quote(prefix)}",
                          "      static_configs:", f"        - targets: [{quote(target)}]"]
        lines += [
            "scrape_configs:",
            f"  - job_name: {quote(REPLICAS_JOB)}",
            "    # The fleet's view of a target (replica, zone, model) is the authority. A replica echoes",
            "    # replica and zone on its page for scrapers without discovery; Prometheus renames those",
            "    # to exported_*, dropped here, so each series carries each label once.",
            "    honor_labels: false",
            "    file_sd_configs:",
            f"      - files: [{quote(str(self.targets_path))}]",
            f"        refresh_interval: {FILE_SD_REFRESH}",
            "    metric_relabel_configs:",
            "      - action: labeldrop",
            f"        regex: {quote(ECHOED_LABELS)}",
        ]
        for name, targets in sorted(self.static_jobs.items()):
            lines += [
                f"  - job_name: {quote(name)}",
                "    static_configs:",
                f"      - targets: [{', '.join(quote(t) for t in targets)}]",
            ]
            page = self.guarded_pages.get(name)
            if page is not None:
                lines += [
                    f"    metrics_path: {quote(page.metrics_path)}",
                    "    authorization:",
                    "      type: Bearer",
                    f"      credentials_file: {quote(str(page.credentials_file))}",
                ]
        return "\n".join(lines) + "\n"

    def update_targets(self, endpoints: Sequence[ReplicaEndpoint]) -> None:
        """Point the ``replicas`` job at every replica that is not STOPPED and has an address (a replica a
        cluster has not placed yet has none) (atomic rewrite)."""
        live = sorted((e for e in endpoints if e.state is not ReplicaState.STOPPED and e.host),
                      key=lambda e: e.replica_id)
        groups = [{"targets": [f"{e.host}:{e.port}"],
                   "labels": {"replica": e.replica_id, "zone": e.zone, "model": e.model,
                              **{k: v for k, v in e.labels if k == "node"}}} for e in live]
        self.targets_path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.targets_path, json.dumps(groups, indent=2) + "\n")
        logger.debug("prometheus targets: %s", [e.replica_id for e in live])

    def validate_config(self) -> bool:
        """``promtool check config``; False when promtool is not installed, PrometheusError when invalid."""
        promtool = shutil.which("promtool")
        if promtool is None:
            return False
        if not self.config_path.exists():
            self.write_config()
        done = subprocess.run([promtool, "check", "config", str(self.config_path)], capture_output=True,
                              text=True, timeout=30, check=False, env=child_environment())
        if done.returncode != 0:
            raise PrometheusError(f"{self.config_path}: promtool check config failed: "
                                  f"{(done.stdout + done.stderr).strip()}")
        return True

    # -- lifecycle
    def start(self, endpoints: Sequence[ReplicaEndpoint] | None = None) -> None:
        """Write the configuration (and targets, when given), start the binary, wait for ``/-/ready``."""
        if self.is_running:
            return
        binary = self.binary_path()
        if binary is None:
            raise PrometheusUnavailable()
        self._stop_leftover()
        self.write_config()
        if endpoints is not None:
            self.update_targets(endpoints)
        self.data_path.mkdir(parents=True, exist_ok=True)
        cmd = [binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.data_path}",
               f"--web.listen-address={self.config.host}:{self.config.port}",
               f"--storage.tsdb.retention.time={self.config.retention}"]
        with self.log_path.open("ab") as log:
            # Its own session: a Ctrl-C in the terminal reaches the control plane, which stops it in order.
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            env=child_environment())
        self.pid_path.write_text(f"{self.process.pid}\n")
        atexit.register(self.stop)
        logger.info("prometheus started (pid %s) at %s", self.process.pid, self.url)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as http:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    raise PrometheusError(f"prometheus exited with {self.process.returncode} before it was "
                                          f"ready{self.log_tail()}")
                try:
                    if http.get(f"{self.url}/-/ready").status_code == 200 and self._answers_as_ours(http):
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise PrometheusError(f"prometheus not ready after {self.ready_timeout_s:g}s"
                                          f"{self.log_tail()}")
                time.sleep(POLL_S)

    def _answers_as_ours(self, http: httpx.Client) -> bool:
        """Whether the Prometheus at our address runs our configuration (and is not some other one)."""
        try:
            flags = http.get(f"{self.url}/api/v1/status/flags").json().get("data", {})
        except ValueError as exc:
            raise PrometheusError(f"{self.config.host}:{self.config.port} is answered by something other "
                                  f"than Prometheus") from exc
        if flags.get("config.file") == str(self.config_path):
            return True
        raise PrometheusError(f"{self.config.host}:{self.config.port} is answered by another Prometheus "
                              f"(config {flags.get('config.file')!r})")

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``; returns the exit status (None: never started)."""
        process, self.process = self.process, None
        atexit.unregister(self.stop)
        if process is None:
            return None
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("prometheus (pid %s) ignored SIGTERM for %gs: killing it", process.pid,
                               self.stop_timeout_s)
                process.kill()
                process.wait()
        self.pid_path.unlink(missing_ok=True)
        logger.info("prometheus (pid %s) stopped with %s", process.pid, process.returncode)
        return process.returncode

    def reload(self) -> None:
        """Re-read the configuration and the rule files (after the static jobs or the rules changed):
        SIGHUP, then wait until Prometheus' reload metrics say it reloaded; PrometheusError when it is not
        running, rejected the files, or did not confirm within ``RELOAD_TIMEOUT_S``."""
        self.write_config()
        process = self.process
        if process is None or process.poll() is not None:
            raise PrometheusError("prometheus reload failed: it is not running")
        was_ok, reloaded_at = self._reload_state()
        process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + RELOAD_TIMEOUT_S
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            ok, at = self._reload_state()
            if at != reloaded_at:
                return
            if was_ok and not ok:
                raise PrometheusError(f"prometheus rejected the reloaded configuration{self.log_tail()}")
        raise PrometheusError(f"prometheus did not confirm a reload within {RELOAD_TIMEOUT_S:g}s"
                              f"{self.log_tail()}")

    def _reload_state(self) -> tuple[bool, float]:
        """(whether the last reload succeeded, when the last successful one happened) from its /metrics."""
        try:
            page = httpx.get(f"{self.url}/metrics", timeout=5.0, trust_env=False).text
        except httpx.HTTPError as exc:
            raise PrometheusError(f"prometheus reload failed: {exc}") from exc
        values: dict[str, float] = {}
        for line in page.splitlines():
            name, _, value = line.partition(" ")
            if name in (RELOAD_OK, RELOADED_AT):
                values[name] = float(value)
        return values.get(RELOAD_OK) == 1.0, values.get(RELOADED_AT, 0.0)

    def _stop_leftover(self) -> None:
        """A control plane killed without cleanup may have left its Prometheus running: stop that one."""
        try:
            pid = int(self.pid_path.read_text().strip())
            leftover = psutil.Process(pid)
            cmdline = leftover.cmdline()
        except (OSError, ValueError, psutil.Error):
            self.pid_path.unlink(missing_ok=True)
            return
        if f"--config.file={self.config_path}" not in cmdline:
            self.pid_path.unlink(missing_ok=True)
            return  # the pid was reused by something else
        logger.warning("stopping a leftover prometheus (pid %s) from an earlier run", pid)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        while _pid_exists(pid) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if _pid_exists(pid):
            # psutil signals only while the pid is still that process (its start time): once the leftover
            # exits, this machine may give its pid to anything (pid_max is 32,768 here)
            with contextlib.suppress(psutil.NoSuchProcess):
                leftover.kill()
        self.pid_path.unlink(missing_ok=True)

    def log_tail(self) -> str:
        """The last lines of its log, each on a new line (empty when there is no log): for error messages."""
        if not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        return "\n" + "\n".join(lines)

    def __enter__(self) -> PrometheusServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _pid_exists(pid: int) -> bool:
    """Whether ``pid`` is alive; an exited child nobody reaped yet (a zombie) does not count."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _write_atomic(path: Path, text: str) -> None:
    """Readers (Prometheus' file watcher) see the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _alertmanager_target(url: str) -> tuple[str, str, str]:
    """``http://host:port/prefix`` as Prometheus' ``alertmanagers`` entry: (scheme, host:port, path)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"an Alertmanager address must be http(s)://host:port, got {url!r}")
    return parts.scheme, f"{parts.hostname}:{parts.port}", parts.path or "/"
