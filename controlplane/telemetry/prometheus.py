"""The real Prometheus: run it as a child process that follows the fleet, and query it in PromQL.

:class:`PrometheusServer` writes ``prometheus.yml`` (a ``replicas`` job fed by file-based service
discovery, plus static jobs for the control plane's and the gateway's own metrics), rewrites
``targets/replicas.json`` atomically whenever the fleet changes (Prometheus picks the change up within
seconds), starts the binary, waits for ``/-/ready`` and always stops it again. Its state folder holds::

    prometheus.yml  targets/replicas.json  data/ (TSDB)  prometheus.log  prometheus.pid

:class:`PrometheusSource` is the :class:`~controlplane.telemetry.base.Telemetry` source backed by it, through
``prometheus_api_client``; every failure of that client becomes one :class:`TelemetryError`.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import requests
from prometheus_api_client.exceptions import PrometheusApiClientException
from prometheus_api_client.prometheus_connect import PrometheusConnect
from urllib3.util.retry import Retry

from controlplane.replicas import ReplicaEndpoint, ReplicaState
from controlplane.telemetry.base import (
    DEFAULT_WINDOW_S,
    Aggregation,
    Group,
    Matchers,
    RangeKind,
    Regex,
    Series,
    Telemetry,
    TelemetryError,
    check_quantile,
    check_query,
    check_range,
    histogram_base,
)
from controlplane.telemetry.config import PrometheusConfig

logger = logging.getLogger(__name__)

UNAVAILABLE = "unavailable: prometheus binary not found"
REPLICAS_JOB = "replicas"
FILE_SD_REFRESH = "1s"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
QUERY_TIMEOUT_S = 5.0
POLL_S = 0.1
LOG_TAIL_LINES = 20

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
T = TypeVar("T")


class PrometheusError(TelemetryError):
    """Prometheus could not be configured, started or queried."""


class PrometheusUnavailable(PrometheusError):
    """The binary is not installed."""

    def __init__(self) -> None:
        super().__init__(UNAVAILABLE)


# ---- the server ---------------------------------------------------------------------------------------
class PrometheusServer:
    """One Prometheus child process with a generated configuration, following the fleet by file SD.

    ``static_jobs`` maps a job name to ``host:port`` targets scraped at ``/metrics`` (the control plane,
    the gateway); ``rule_files`` are loaded as recording/alerting rules.
    """

    def __init__(self, config: PrometheusConfig, state_dir: Path, *,
                 static_jobs: Mapping[str, Sequence[str]] | None = None,
                 rule_files: Sequence[Path] = (), alertmanagers: Sequence[str] = (),
                 ready_timeout_s: float = READY_TIMEOUT_S,
                 stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
        if config.scrape_interval_s <= 0:
            raise ValueError(f"prometheus.scrape_interval_s must be > 0, got {config.scrape_interval_s}")
        self.config = config
        self.state_dir = Path(state_dir)
        self.static_jobs = {name: list(targets) for name, targets in (static_jobs or {}).items()}
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
            lines += ["rule_files:", *(f"  - {_quote(str(p))}" for p in self.rule_files)]
        if self.alertmanagers:
            lines += ["alerting:", "  alertmanagers:"]
            for scheme, target, prefix in self.alertmanagers:
                lines += [f"    - scheme: {scheme}", f"      path_prefix: {_quote(prefix)}",
                          "      static_configs:", f"        - targets: [{_quote(target)}]"]
        lines += [
            "scrape_configs:",
            f"  - job_name: {_quote(REPLICAS_JOB)}",
            "    honor_labels: true  # the replica's own replica/zone labels win over the target's",
            "    file_sd_configs:",
            f"      - files: [{_quote(str(self.targets_path))}]",
            f"        refresh_interval: {FILE_SD_REFRESH}",
        ]
        for name, targets in sorted(self.static_jobs.items()):
            lines += [
                f"  - job_name: {_quote(name)}",
                "    static_configs:",
                f"      - targets: [{', '.join(_quote(t) for t in targets)}]",
            ]
        return "\n".join(lines) + "\n"

    def update_targets(self, endpoints: Sequence[ReplicaEndpoint]) -> None:
        """Point the ``replicas`` job at every replica that is not STOPPED (atomic rewrite)."""
        live = sorted((e for e in endpoints if e.state is not ReplicaState.STOPPED),
                      key=lambda e: e.replica_id)
        groups = [{"targets": [f"{e.host}:{e.port}"],
                   "labels": {"replica": e.replica_id, "zone": e.zone, "model": e.model}} for e in live]
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
                              text=True, timeout=30, check=False)
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
               f"--storage.tsdb.retention.time={self.config.retention}", "--web.enable-lifecycle"]
        with self.log_path.open("ab") as log:
            # Its own session: a Ctrl-C in the terminal reaches the control plane, which stops it in order.
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
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
        """Re-read the configuration (``/-/reload``), e.g. after the static jobs changed."""
        self.write_config()
        try:
            httpx.post(f"{self.url}/-/reload", timeout=10.0, trust_env=False).raise_for_status()
        except httpx.HTTPError as exc:
            raise PrometheusError(f"prometheus reload failed: {exc}") from exc

    def _stop_leftover(self) -> None:
        """A control plane killed without cleanup may have left its Prometheus running: stop that one."""
        try:
            pid = int(self.pid_path.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            self.pid_path.unlink(missing_ok=True)
            return
        if f"--config.file={self.config_path}" not in cmdline.split("\0"):
            self.pid_path.unlink(missing_ok=True)
            return  # the pid was reused by something else
        logger.warning("stopping a leftover prometheus (pid %s) from an earlier run", pid)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        while _pid_exists(pid) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if _pid_exists(pid):
            os.kill(pid, signal.SIGKILL)
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
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


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


def _quote(text: str) -> str:
    """A double-quoted scalar valid in both YAML and PromQL (JSON string syntax)."""
    return json.dumps(text, ensure_ascii=False)


def _alertmanager_target(url: str) -> tuple[str, str, str]:
    """``http://host:port/prefix`` as Prometheus' ``alertmanagers`` entry: (scheme, host:port, path)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"an Alertmanager address must be http(s)://host:port, got {url!r}")
    return parts.scheme, f"{parts.hostname}:{parts.port}", parts.path or "/"


# ---- PromQL -----------------------------------------------------------------------------------------
def duration(seconds: float) -> str:
    """A Prometheus duration: ``30s``, or ``1500ms`` when not a whole number of seconds."""
    if not seconds > 0:
        raise ValueError(f"a duration must be > 0, got {seconds}")
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{max(1, round(seconds * 1000))}ms"


def selector(metric: str, match: Matchers | None = None) -> str:
    """``metric{a="x",b=~"y"}``; names are checked, values quoted."""
    if not _METRIC_NAME.fullmatch(metric):
        raise ValueError(f"not a metric name: {metric!r}")
    parts = []
    for name, want in sorted((match or {}).items()):
        if not _LABEL_NAME.fullmatch(name):
            raise ValueError(f"not a label name: {name!r}")
        if isinstance(want, Regex):
            parts.append(f"{name}=~{_quote(want.pattern)}")
        else:
            parts.append(f"{name}={_quote(want)}")
    return f"{metric}{{{','.join(parts)}}}" if parts else metric


def _by(by: Sequence[str]) -> str:
    for name in by:
        if not _LABEL_NAME.fullmatch(name):
            raise ValueError(f"not a label name: {name!r}")
    return f"by ({', '.join(by)})"


def gauge_query(metric: str, *, by: Sequence[str], match: Matchers | None, agg: Aggregation) -> str:
    check_query(agg=agg)
    return f"{agg} {_by(by)} ({selector(metric, match)})"


def rate_query(metric: str, *, window_s: float, by: Sequence[str], match: Matchers | None) -> str:
    return f"sum {_by(by)} (rate({selector(metric, match)}[{duration(window_s)}]))"


def quantile_query(histogram: str, q: float, *, window_s: float, by: Sequence[str],
                   match: Matchers | None) -> str:
    check_quantile(q)
    bucket = f"{histogram_base(histogram)}_bucket"
    return (f"histogram_quantile({float(q)!r}, "
            f"{rate_query(bucket, window_s=window_s, by=('le', *by), match=match)})")


# ---- the source -------------------------------------------------------------------------------------
class PrometheusSource(Telemetry):
    """Telemetry answered by a running Prometheus at ``url``."""

    name = "prometheus"

    def __init__(self, url: str, *, window_s: float = DEFAULT_WINDOW_S,
                 timeout_s: float = QUERY_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self.window_s = window_s
        session = requests.Session()
        session.trust_env = False  # loopback: no proxy from the environment
        # No retries inside the client: a telemetry read that fails is reported at once, the caller retries.
        self._client = PrometheusConnect(url=self.url, disable_ssl=True, session=session,
                                         retry=Retry(total=0),
                                         timeout=timeout_s)  # type: ignore[arg-type]  # requests takes floats

    def stop(self) -> None:
        self._client.close()

    def gauge(self, metric: str, *, by: tuple[str, ...] = ("replica",), match: Matchers | None = None,
              agg: Aggregation = "sum") -> dict[Group, float]:
        return self.instant(gauge_query(metric, by=by, match=match, agg=agg), by)

    def rate(self, metric: str, *, window_s: float | None = None, by: tuple[str, ...] = ("replica",),
             match: Matchers | None = None) -> dict[Group, float]:
        return self.instant(rate_query(metric, window_s=self._window(window_s), by=by, match=match), by)

    def quantile(self, histogram: str, q: float, *, window_s: float | None = None,
                 by: tuple[str, ...] = ("replica",), match: Matchers | None = None) -> dict[Group, float]:
        promql = quantile_query(histogram, q, window_s=self._window(window_s), by=by, match=match)
        return self.instant(promql, by)

    def range(self, kind: RangeKind, metric: str, *, start: float, end: float, step: float,
              q: float | None = None, window_s: float | None = None, by: tuple[str, ...] = ("replica",),
              match: Matchers | None = None, agg: Aggregation = "sum") -> list[Series]:
        check_range(agg=agg, kind=kind, start=start, end=end, step=step)
        window = self._window(window_s)
        if kind == "gauge":
            promql = gauge_query(metric, by=by, match=match, agg=agg)
        elif kind == "rate":
            promql = rate_query(metric, window_s=window, by=by, match=match)
        elif q is None:
            raise ValueError("a quantile range needs q")
        else:
            promql = quantile_query(metric, q, window_s=window, by=by, match=match)
        result = self._call(promql, lambda: self._client.custom_query_range(
            promql, start_time=datetime.fromtimestamp(start, UTC), end_time=datetime.fromtimestamp(end, UTC),
            step=f"{step:g}"))
        lines = []
        for item in result:
            points = tuple((float(t), float(v)) for t, v in item["values"] if not math.isnan(float(v)))
            if points:
                lines.append(Series(by, _group(item["metric"], by), points))
        return sorted(lines, key=lambda s: s.group)

    def instant(self, promql: str, by: Sequence[str]) -> dict[Group, float]:
        """Run an instant query; NaN results (no observation in the window) are left out."""
        result = self._call(promql, lambda: self._client.custom_query(promql))
        out: dict[Group, float] = {}
        for item in result:
            value = float(item["value"][1])
            if not math.isnan(value):
                out[_group(item["metric"], by)] = value
        return out

    def _call(self, promql: str, query: Callable[[], T]) -> T:
        """The one place where the client's failures become TelemetryError."""
        try:
            return query()
        except (PrometheusApiClientException, requests.RequestException, ValueError, KeyError) as exc:
            raise TelemetryError(f"prometheus at {self.url}: {promql}: {exc}") from exc


def _group(metric: Mapping[str, Any], by: Sequence[str]) -> Group:
    return tuple(str(metric.get(name, "")) for name in by)
