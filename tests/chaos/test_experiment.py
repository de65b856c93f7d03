"""The native experiment runner on Chaos Toolkit-format experiments: python providers (functions in this
module), http providers against a real local HTTP server, tolerances, deviation, rollbacks, dry run, stop
conditions, and the journal's shape."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from chaos.egress import HostAllowList
from chaos.experiment import (
    MAX_HTTP_BODY_BYTES,
    ExperimentRunner,
    InvalidExperiment,
    check_python_modules,
    load_experiment,
    run_experiment,
    within_tolerance,
)
from chaos.safety import StopCondition, error_rate_above

MOD = __name__
STATE: dict[str, Any] = {}


# ---- python providers used by the experiments below ----------------------------------------------
def reset() -> None:
    STATE.clear()
    STATE.update(calls=[], ready=3, errors=0.0, seen_config=None, seen_secrets=None, next_id=42)


def ready_replicas() -> int:
    STATE["calls"].append("ready_replicas")
    return int(STATE["ready"])


def kill_one(label: str = "") -> dict[str, Any]:
    STATE["calls"].append(f"kill_one{label}")
    STATE["ready"] -= 1
    STATE["next_id"] += 1
    return {"faults": [{"id": STATE["next_id"] - 1, "kind": "kill"}]}


def restore() -> str:
    STATE["calls"].append("restore")
    STATE["ready"] = 3
    return "restored"


def boom() -> None:
    STATE["calls"].append("boom")
    raise RuntimeError("provider exploded")


def spike_errors() -> str:
    STATE["calls"].append("spike_errors")
    STATE["errors"] = 0.5
    return "spiked"


def remember(url: str, configuration: dict[str, Any] | None = None,
             secrets: dict[str, Any] | None = None) -> str:
    STATE["calls"].append("remember")
    STATE["seen_config"], STATE["seen_secrets"] = configuration, secrets
    return url


def py(name: str, func: str, kind: str = "action", **extra: Any) -> dict[str, Any]:
    arguments = extra.pop("arguments", {})
    return {"type": kind, "name": name, "provider": {"type": "python", "module": MOD, "func": func,
                                                     "arguments": arguments}, **extra}


def experiment(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "title": "one replica dies, the fleet heals",
        "description": "kill a replica and check three are ready again",
        "steady-state-hypothesis": {"title": "three ready",
                                    "probes": [py("ready", "ready_replicas", "probe", tolerance=3)]},
        "method": [py("kill", "kill_one"), py("heal", "restore", pauses={"after": 0.05})],
        "rollbacks": [py("restore-all", "restore")],
    }
    body.update(overrides)
    return body


@pytest.fixture(autouse=True)
def _state() -> Iterator[None]:
    reset()
    yield
    reset()


# ---- a real local HTTP server for the http provider ----------------------------------------------
class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        code = 503 if self.path.startswith("/down") else 200
        body = json.dumps({"path": self.path, "status": "ok" if code == 200 else "down"}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def http_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def http_probe(name: str, url: str, tolerance: Any, **provider: Any) -> dict[str, Any]:
    return {"type": "probe", "name": name, "tolerance": tolerance,
            "provider": {"type": "http", "url": url, "timeout": 2, **provider}}


# ---- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("tolerance", "value", "ok"), [
    (3, 3, True), (3, 2, False), (True, True, True), (True, 1, False), ("up", "up", True),
    ([0, 0.1], 0.05, True), ([0, 0.1], 0.2, False), (["a", "b", "c"], "b", True),
    (200, {"status": 200}, True),
    ([200, 204], {"status": 503}, False),
    ({"type": "range", "range": [1, 3]}, 2.5, True), ({"type": "range", "range": [1, 3]}, None, False),
    ({"type": "range", "range": [0, 1], "target": "error_rate"}, {"error_rate": 0.2}, True),
    ({"type": "regex", "pattern": "^ok"}, "ok then", True),
    ({"type": "regex", "pattern": "^ok"}, "not ok", False),
    ({"type": "regex", "pattern": "down", "target": "body"}, {"body": {"status": "down"}}, True),
])
def test_tolerances_follow_chaos_toolkits_rules(tolerance: Any, value: Any, ok: bool) -> None:
    assert within_tolerance(tolerance, value) is ok


def test_completed_run_has_chaos_toolkits_journal_and_ours(http_url: str) -> None:
    exp = experiment()
    exp["steady-state-hypothesis"]["probes"].append(http_probe("api-up", f"{http_url}/health", 200))
    journal = run_experiment(exp)
    assert journal["status"] == "completed" and journal["deviated"] is False and journal["dry"] is False
    for key in ("start", "end", "duration", "experiment", "platform", "node", "steady_states", "run",
                "rollbacks", "fault_ids", "stop_condition", "plan"):
        assert key in journal, key
    before, after = journal["steady_states"]["before"], journal["steady_states"]["after"]
    assert before["steady_state_met"] and after["steady_state_met"]
    assert before["probes"][0]["output"] == 3
    assert before["probes"][1]["output"]["status"] == 200 and before["probes"][1]["tolerance_met"]
    assert [r["activity"]["name"] for r in journal["run"]] == ["kill", "heal"]
    assert all(r["status"] == "succeeded" and r["duration"] >= 0 for r in journal["run"])
    assert journal["run"][1]["output"] == "restored"
    assert [r["activity"]["name"] for r in journal["rollbacks"]] == ["restore-all"]
    assert journal["fault_ids"] == [42]
    assert STATE["calls"] == ["ready_replicas", "kill_one", "restore", "ready_replicas", "restore"]
    json.dumps(journal)  # the journal is plain JSON


def test_steady_state_after_not_met_is_a_deviation_and_rollbacks_still_run() -> None:
    exp = experiment(method=[py("kill", "kill_one")])
    journal = run_experiment(exp)
    assert journal["status"] == "failed" and journal["deviated"] is True
    after = journal["steady_states"]["after"]
    assert not after["steady_state_met"] and after["probes"][0]["output"] == 2
    assert not after["probes"][0]["tolerance_met"]
    assert [r["status"] for r in journal["rollbacks"]] == ["succeeded"] and STATE["ready"] == 3


def test_steady_state_before_not_met_skips_the_method() -> None:
    STATE["ready"] = 1
    journal = run_experiment(experiment())
    assert journal["status"] == "failed" and journal["deviated"] is False
    assert journal["run"] == [] and journal["steady_states"]["after"] is None
    assert "kill_one" not in STATE["calls"] and len(journal["rollbacks"]) == 1  # rollbacks: always
    STATE["ready"] = 1
    chaos_toolkit_default = run_experiment(experiment(), rollback_strategy="default")
    assert chaos_toolkit_default["rollbacks"] == []


def test_failed_activity_is_a_journal_record_not_an_exception(http_url: str) -> None:
    exp = experiment(method=[py("explode", "boom"), py("kill", "kill_one"), py("heal", "restore"),
                             http_probe("down", f"{http_url}/down", None, expected_status=200)])
    journal = run_experiment(exp)
    explode, kill, heal, down = journal["run"]
    assert explode["status"] == "failed" and "RuntimeError: provider exploded" in explode["exception"][-1]
    assert kill["status"] == heal["status"] == "succeeded"
    assert down["status"] == "failed" and "HTTP 503, expected [200]" in down["exception"][-1]
    assert journal["status"] == "completed"


def test_dry_run_calls_nothing_and_prints_the_plan() -> None:
    guard = error_rate_above(lambda: 0.0, 0.1)
    journal = run_experiment(experiment(), dry_run=True, stop_conditions=[guard])
    assert journal["dry"] and journal["status"] == "completed" and STATE["calls"] == []
    assert all(r["output"] is None for r in journal["run"] + journal["rollbacks"])
    phases = [(s["phase"], s["name"]) for s in journal["plan"]]
    assert phases == [("steady-state-before", "ready"), ("method", "kill"), ("method", "heal"),
                      ("steady-state-after", "ready"), ("rollbacks", "restore-all"),
                      ("stop-condition", "error_rate")]
    assert journal["plan"][1]["provider"] == f"python: {MOD}.kill_one"


def test_stop_condition_aborts_the_method_and_reverts_the_faults_it_injected() -> None:
    reverted: list[list[int]] = []

    async def revert(ids: Sequence[int]) -> list[dict[str, Any]]:
        reverted.append(list(ids))
        return [{"fault_id": i, "ok": True} for i in ids]

    exp = experiment(method=[py("kill", "kill_one", pauses={"after": 0.2}),
                             py("spike", "spike_errors", pauses={"after": 30}),
                             py("never", "kill_one", arguments={"label": "-late"})])
    condition = error_rate_above(lambda: STATE["errors"], 0.1)
    started = time.monotonic()
    runner = ExperimentRunner(revert_faults=revert)
    journal = __import__("asyncio").run(runner.run(exp, stop_conditions=[condition], check_interval_s=0.05))
    assert time.monotonic() - started < 10  # did not sit out the 30 s pause
    assert journal["status"] == "aborted"
    assert journal["stop_condition"]["name"] == "error_rate" and journal["stop_condition"]["value"] == 0.5
    assert journal["stop_condition"]["description"] == "error_rate 0.5 > 0.1"
    assert reverted == [[42]] and journal["abort_reverts"] == [{"fault_id": 42, "ok": True}]
    assert "kill_one-late" not in STATE["calls"] and journal["steady_states"]["after"] is None
    assert [r["activity"]["name"] for r in journal["rollbacks"]] == ["restore-all"]


def test_configuration_env_and_secrets_are_substituted_and_secrets_never_journaled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXP_TEST_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("EXP_TEST_TOKEN", "s3cret-value")
    action = py("remember", "remember", arguments={"url": "${base}/api"})
    action["provider"]["secrets"] = ["cp"]
    exp = experiment(method=[action], configuration={"base": {"type": "env", "key": "EXP_TEST_URL"},
                                                     "plain": 5},
                     secrets={"cp": {"controlplane_token": {"type": "env", "key": "EXP_TEST_TOKEN"}}})
    journal = run_experiment(exp)
    assert journal["run"][0]["output"] == "http://127.0.0.1:9/api"
    assert STATE["seen_config"] == {"base": "http://127.0.0.1:9", "plain": 5}
    assert STATE["seen_secrets"] == {"controlplane_token": "s3cret-value"}
    assert "s3cret-value" not in json.dumps(journal)


@pytest.mark.parametrize(("patch", "message"), [
    ({"title": ""}, "title: required"),
    ({"description": ""}, "description: required"),
    ({"method": None}, "method: required"),
    ({"steady-state-hypothesis": {"probes": []}}, "steady-state-hypothesis.title: required"),
    ({"method": [{"type": "action", "name": "x", "provider": {"type": "python", "module": "no.such.mod",
                                                                "func": "f"}}]}, "method[0].provider.module"),
    ({"method": [py("x", "kill_one", arguments={"nope": 1})]}, "method[0].provider.arguments"),
    ({"method": [{"ref": "missing"}]}, "method[0].ref: no activity named 'missing'"),
    ({"method": [{"type": "action", "name": "x", "provider": {"type": "shell", "path": "ls"}}]},
     "method[0].provider.type: one of python, process, http"),
    ({"method": [{"type": "action", "name": "x", "provider": {"type": "process", "path": "ls",
                                                                "arguments": "-l /"}}]},
     "method[0].provider.arguments: a command line would run through a shell"),
    ({"steady-state-hypothesis": {"title": "t", "probes": [py("p", "ready_replicas", "probe")]}},
     "steady-state-hypothesis.probes[0].tolerance: required"),
    ({"steady-state-hypothesis": {"title": "t", "probes": [py("p", "ready_replicas", "probe",
                                                              tolerance={"type": "range", "range": [1]})]}},
     "tolerance.range: two numbers"),
    ({"controls": [{"name": "log", "provider": {"type": "python", "module": MOD}}]},
     "controls: not run by this runner"),
    ({"method": [py("x", "kill_one", pauses={"after": "${wait}"})], "configuration": {"wait": "soon"}},
     "method[0].pauses.after: 'soon' is not a number of seconds"),
])
def test_malformed_experiments_are_refused_naming_the_place(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidExperiment, match=message.replace("[", r"\[").replace("]", r"\]")):
        run_experiment(experiment(**patch))
    assert STATE["calls"] == []


def test_refs_run_the_named_activity_and_yaml_files_load(tmp_path: Path) -> None:
    import yaml  # type: ignore[import-untyped]

    exp = experiment(method=[py("kill", "kill_one"), {"ref": "ready"}, py("heal", "restore")])
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    journal = run_experiment(load_experiment(path))
    assert [r["activity"]["name"] for r in journal["run"]] == ["kill", "ready", "heal"]
    assert journal["run"][1]["output"] == 2
    with pytest.raises(InvalidExperiment, match="not valid JSON"):
        bad = tmp_path / "bad.json"
        bad.write_text("{nope")
        load_experiment(bad)


def test_probe_errors_and_stop_conditions_with_no_data_do_not_abort() -> None:
    silent = StopCondition("ttft", lambda: None, ">", 1.0)
    journal = run_experiment(experiment(), stop_conditions=[silent], check_interval_s=0.01)
    assert journal["status"] == "completed" and journal["stop_condition"] is None


def test_a_server_refuses_foreign_modules_and_environment_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidExperiment, match=r"probes\[0\]\.provider\.module: only chaos\.ctk may run"):
        check_python_modules(experiment(), ["chaos.ctk"])
    check_python_modules(experiment(), [MOD])
    monkeypatch.setenv("EXP_TEST_TOKEN", "server-secret")
    exp = experiment(secrets={"cp": {"controlplane_token": {"type": "env", "key": "EXP_TEST_TOKEN"}}})
    with pytest.raises(InvalidExperiment, match=r"secrets\.cp\.controlplane_token: environment lookups"):
        run_experiment(exp, allow_env=False)
    assert STATE["calls"] == []


@pytest.mark.parametrize("block", ["secrets", "configuration"])
def test_a_server_refuses_environment_lookups_at_any_depth_whether_the_variable_is_set_or_not(
        monkeypatch: pytest.MonkeyPatch, block: str) -> None:
    exp = experiment(**{block: {"a": {"b": {"c": {"type": "env", "key": "EXP_TEST_PROBED"}}}}})
    answers = []
    for present in (False, True):  # the answer must not tell a caller whether the server has the variable
        if present:
            monkeypatch.setenv("EXP_TEST_PROBED", "here")
        else:
            monkeypatch.delenv("EXP_TEST_PROBED", raising=False)
        with pytest.raises(InvalidExperiment) as refused:
            check_python_modules(exp, [MOD])
        answers.append(str(refused.value))
        with pytest.raises(InvalidExperiment, match="environment lookups are not allowed here"):
            run_experiment(exp, allow_env=False)
    assert answers == [f"{block}.a.b.c: environment lookups are not allowed here"] * 2
    assert STATE["calls"] == []


def test_base_secrets_win_over_the_experiments_and_are_not_journaled() -> None:
    action = py("remember", "remember", arguments={"url": "${controlplane_url}"})
    action["provider"]["secrets"] = ["cp"]
    exp = experiment(method=[action], secrets={"cp": {"controlplane_token": "from-the-file"}})
    journal = run_experiment(exp, base_secrets={"controlplane_token": "callers-own"},
                             base_configuration={"controlplane_url": "http://127.0.0.1:8080"})
    assert STATE["seen_secrets"] == {"controlplane_token": "callers-own"}
    assert journal["run"][0]["output"] == "http://127.0.0.1:8080"
    assert "callers-own" not in json.dumps(journal) and "from-the-file" not in json.dumps(journal)


# ---- what a run may reach, and what it may write -------------------------------------------------
SECRET = "tok-3f9a2c71-operator"


def echo_secret(secrets: dict[str, Any] | None = None) -> dict[str, Any]:
    """A provider that (wrongly) returns the token it was handed, whole and inside a longer string."""
    token = str((secrets or {}).get("controlplane_token"))
    return {"token": token, "header": f"Bearer {token}", "list": [token]}


def leak_in_error(secrets: dict[str, Any] | None = None) -> None:
    raise RuntimeError(f"upstream refused Authorization: Bearer {(secrets or {}).get('controlplane_token')}")


def _private_helper() -> str:
    return "never callable from an experiment"


def with_secrets(name: str, func: str, kind: str = "action", **extra: Any) -> dict[str, Any]:
    activity = py(name, func, kind, **extra)
    activity["provider"]["secrets"] = ["cp"]
    return activity


@pytest.mark.parametrize(("module", "func"), [
    ("chaos.ctk", "settings"), ("chaos.ctk", "_settings"), ("chaos.ctk", "_call"), ("chaos.ctk", "_flatten"),
    ("chaos.ctk", "ControlPlaneError"), ("chaos.ctk", "httpx"), (MOD, "_private_helper"),
])
def test_only_a_modules_listed_public_functions_are_providers(module: str, func: str) -> None:
    probe = {"type": "probe", "name": "peek", "tolerance": True,
             "provider": {"type": "python", "module": module, "func": func, "secrets": ["cp"]}}
    refused = r"method\[0\]\.provider\.func: .* is not a provider function"
    with pytest.raises(InvalidExperiment, match=refused):
        run_experiment(experiment(method=[probe]), base_secrets={"controlplane_token": SECRET})
    assert STATE["calls"] == []


def test_every_documented_ctk_provider_is_listed_and_nothing_else() -> None:
    from chaos import ctk

    documented = {"inject_fault", "revert_fault", "revert_active_faults", "halt_all", "release", "scale",
                  "ready_replicas", "wait_for_ready_replicas", "fleet_summary", "error_rate", "p99_ttft",
                  "active_faults"}
    assert set(ctk.PROVIDERS) == documented
    assert all(callable(getattr(ctk, name)) for name in ctk.PROVIDERS)


def test_secrets_are_redacted_from_outputs_exceptions_journal_and_log(
        caplog: pytest.LogCaptureFixture) -> None:
    exp = experiment(method=[with_secrets("echo", "echo_secret"), with_secrets("leak", "leak_in_error")],
                     secrets={"cp": {"controlplane_token": "from-the-experiment-file"}})
    with caplog.at_level("DEBUG"):
        journal = run_experiment(exp, base_secrets={"controlplane_token": SECRET})
    echo, leak = journal["run"]
    assert echo["output"] == {"token": "***", "header": "Bearer ***", "list": ["***"]}
    assert leak["status"] == "failed" and "Authorization: Bearer ***" in leak["exception"][-1]
    text = json.dumps(journal)
    assert SECRET not in text and "from-the-experiment-file" not in text
    assert SECRET not in caplog.text and "Bearer ***" in caplog.text


class Recorder(BaseHTTPRequestHandler):
    """A host experiments must not reach: it records every request that arrives anyway."""

    seen: ClassVar[list[tuple[str, str, dict[str, str]]]] = []

    def do_GET(self) -> None:
        type(self).seen.append(("GET", self.path, dict(self.headers)))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    do_POST = do_GET

    def log_message(self, *args: Any) -> None:
        pass


class Big(BaseHTTPRequestHandler):
    """An allowed host: /big answers 1 MiB, /away redirects to the ``Location`` in the query."""

    def do_GET(self) -> None:
        if self.path.startswith("/away?to="):
            self.send_response(302)
            self.send_header("Location", self.path.split("=", 1)[1])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = b"x" * (1 << 20)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    Recorder.seen = []
    with serve(Recorder) as url:
        yield url


@pytest.fixture
def big() -> Iterator[str]:
    with serve(Big) as url:
        yield url


@contextmanager
def serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_http_providers_reach_only_allowed_hosts_and_never_follow_a_redirect_away(
        big: str, recorder: str) -> None:
    allowed = HostAllowList([big.removeprefix("http://")])
    exp = experiment(method=[
        http_probe("outside", f"{recorder}/steal", None, headers={"Authorization": "Bearer ${token}"}),
        http_probe("outside-by-name", recorder.replace("127.0.0.1", "localhost") + "/steal", None),
        http_probe("redirected", f"{big}/away?to={recorder}/steal", None),
    ], secrets={"cp": {"token": SECRET}})
    journal = run_experiment(exp, egress=allowed)
    outside, by_name, redirected = journal["run"]
    for record in (outside, by_name):
        assert record["status"] == "failed"
        assert "is not an allowed host for experiments" in record["exception"][-1]
    assert redirected["status"] == "succeeded" and redirected["output"]["status"] == 302
    assert Recorder.seen == []  # nothing reached the host that is not allowed
    assert SECRET not in json.dumps(journal)


def test_http_provider_keeps_only_a_bounded_body(big: str) -> None:
    journal = run_experiment(experiment(method=[http_probe("big", f"{big}/big", None)]))
    output = journal["run"][0]["output"]
    assert output["status"] == 200 and output["truncated"] is True
    assert len(output["body"]) == MAX_HTTP_BODY_BYTES
