"""Drive real replica processes from the tests: start one, wait for readiness, read its SSE and /metrics.

Each replica is ``python -m inference serve`` on a free loopback port, its output in a log file that a
failed start prints. :func:`start_replica` returns only once ``/ready`` answers 200, and kills the process
itself if that never happens, so a failed start leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from inference.launcher import free_port
from tests.polling import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "default"
API_KEY = "replica-test-key"
ADMIN_TOKEN = "replica-admin-token"
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 30.0
DONE = "[DONE]"
# Long enough to keep a request running through a whole check (several seconds on one CPU thread),
# short enough to end on its own well inside a test's time.
LONG_MAX_TOKENS = 1500

T = TypeVar("T")




def sse_events(response: httpx.Response) -> Iterator[Any]:
    """The ``data:`` payloads of a server-sent event stream, parsed; ``[DONE]`` comes as :data:`DONE`."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield DONE if data == DONE else json.loads(data)


def completion(**fields: Any) -> dict[str, Any]:
    """A small /v1/completions body; ``fields`` override the defaults."""
    return {"model": MODEL, "prompt": "The replica answers", "max_tokens": 8, "temperature": 0.0, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    """A small /v1/chat/completions body; ``fields`` override the defaults."""
    messages = [{"role": "user", "content": "Say hello to the replica."}]
    return {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0.0, **fields}


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The error object of an OpenAI-shaped refusal with ``status``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


# ---- /metrics --------------------------------------------------------------------------------
def parse_metrics(text: str) -> list[Sample]:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def metric_value(samples: Sequence[Sample], name: str, **labels: str) -> float | None:
    """The sum of the samples called ``name`` whose labels include ``labels``; None when there is none."""
    found = [s.value for s in samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(found) if found else None


# ---- one replica process ---------------------------------------------------------------------
@dataclass
class ReplicaProcess:
    replica_id: str
    zone: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    api_key: str | None
    admin_token: str | None
    first_metrics: str = ""  # /metrics as scraped right after /ready first said 200, before any test
    _clients: list[httpx.Client] = field(default_factory=list)
    _http: httpx.Client | None = None
    _admin: httpx.Client | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, *, token: str | None = None, timeout: float = REQUEST_TIMEOUT_S) -> httpx.Client:
        """An HTTP client for this replica, with the API key (or ``token``) as bearer; closed at stop."""
        bearer = token or self.api_key
        headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
        c = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self._clients.append(c)
        return c

    @property
    def http(self) -> httpx.Client:
        """The replica's default client (API key as bearer)."""
        if self._http is None:
            self._http = self.client()
        return self._http

    @property
    def admin(self) -> httpx.Client:
        """A client with the admin token as bearer, for /admin/faults."""
        if self._admin is None:
            self._admin = self.client(token=self.admin_token)
        return self._admin

    def add_fault(self, kind: str, duration_s: float, **params: float | str) -> dict[str, Any]:
        response = self.admin.put("/admin/faults", json={"kind": kind, "duration_s": duration_s, **params})
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body

    def active_faults(self) -> list[dict[str, Any]]:
        response = self.admin.get("/admin/faults")
        assert response.status_code == 200, response.text
        faults: list[dict[str, Any]] = response.json()["faults"]
        return faults

    def metrics(self) -> list[Sample]:
        response = self.http.get("/metrics")
        assert response.status_code == 200, response.text
        return parse_metrics(response.text)

    def metric(self, name: str, **labels: str) -> float | None:
        return metric_value(self.metrics(), name, **labels)

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    @property
    def is_running(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_running:
                raise RuntimeError(f"replica {self.replica_id} exited with status {self.proc.returncode} "
                                   f"before it was ready; its log:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/ready", timeout=5.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"replica {self.replica_id} was not ready within {timeout:g}s; "
                           f"its log:\n{self.log()}")

    def terminate(self) -> None:
        """SIGTERM only: the replica drains and exits by itself."""
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait, then SIGKILL: no process outlives its test, whatever state it is in."""
        for c in self._clients:
            c.close()
        self._clients.clear()
        self._http = self._admin = None
        if self.is_running:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        return self.proc.returncode


def start_replica(*, state_dir: Path, log_dir: Path, replica_id: str, zone: str = "zone-a",
                  api_key: str | None = API_KEY, admin_token: str | None = ADMIN_TOKEN,
                  flags: Sequence[str] = ()) -> ReplicaProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "inference", "serve", "--model", MODEL, "--port", str(port),
           "--replica-id", replica_id, "--zone", zone, "--num-threads", "1", *flags]
    if api_key:
        cmd += ["--api-key", api_key]
    if admin_token:
        cmd += ["--admin-token", admin_token]
    env = {k: v for k, v in os.environ.items() if k not in ("INFERENCE_API_KEY", "INFERENCE_ADMIN_TOKEN")}
    env["LLMSRE_STATE_DIR"] = str(state_dir)
    log_path = log_dir / f"{replica_id}-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    replica = ReplicaProcess(replica_id, zone, port, proc, log_path, api_key, admin_token)
    try:
        replica.wait_ready()
        replica.first_metrics = replica.http.get("/metrics").text
    except BaseException:
        replica.proc.kill()
        replica.stop()
        raise
    return replica


StartFresh = Callable[..., ReplicaProcess]  # the ``start_fresh`` fixture: (*flags, replica_id=, zone=)


# ---- a request read on its own thread ----------------------------------------------------------
class BackgroundStream(threading.Thread):
    """One streaming request, read on a thread; each event is kept with its arrival time.

    ``close()`` makes the reader drop the connection at the next event it receives.
    """

    def __init__(self, replica: ReplicaProcess, path: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True, name=f"stream-{path}")
        self.url = f"{replica.base_url}{path}"
        self.headers = replica.auth
        self.body = {**body, "stream": True}
        self.status: int | None = None
        self.events: list[tuple[float, Any]] = []
        self.error: BaseException | None = None
        self.first_event = threading.Event()
        self._closing = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, headers=self.headers,
                              timeout=REQUEST_TIMEOUT_S) as response:
                self.status = response.status_code
                for event in sse_events(response):
                    self.events.append((time.monotonic(), event))
                    self.first_event.set()
                    if self._closing.is_set():
                        return
        except BaseException as exc:  # reported through .error; the test decides whether it matters
            self.error = exc
        finally:
            self.first_event.set()

    def close(self, timeout: float = 10.0) -> None:
        self._closing.set()
        self.join(timeout)

    @property
    def payloads(self) -> list[Any]:
        return [event for _, event in self.events]

    def text(self) -> str:
        """The completion text of every chunk, concatenated."""
        return "".join(p["choices"][0].get("text") or p["choices"][0].get("delta", {}).get("content") or ""
                       for p in self.payloads if isinstance(p, dict) and p.get("choices"))

    def usage(self) -> dict[str, Any] | None:
        found = [p["usage"] for p in self.payloads if isinstance(p, dict) and p.get("usage")]
        return found[-1] if found else None


@contextmanager
def full_queue(replica: ReplicaProcess) -> Iterator[tuple[BackgroundStream, BackgroundStream]]:
    """On a replica with one running slot and one waiting slot: one request running, one waiting."""
    body = completion(max_tokens=LONG_MAX_TOKENS, ignore_eos=True)
    running = BackgroundStream(replica, "/v1/completions", body)
    waiting = BackgroundStream(replica, "/v1/completions", body)
    try:
        running.start()
        assert running.first_event.wait(30) and running.events, running.error
        waiting.start()
        wait_until(lambda: replica.metric("vllm:num_requests_waiting") == 1, timeout=10,
                   what="the second request to wait")
        yield running, waiting
    finally:
        running.close()
        waiting.close()
