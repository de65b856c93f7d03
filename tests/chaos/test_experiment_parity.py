"""What ``chaos run`` runs, our runner runs too, or refuses with the reason before anything runs:
hypothesis-only experiments, ``process`` providers (real commands, a timeout that kills the command and
what it started, refused where a server runs experiments for callers) and ``background`` activities
(concurrent, joined before the steady state after and before the rollbacks)."""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from chaos.experiment import (
    ABORT_DRAIN_S,
    ActivityFailed,
    Context,
    ExperimentRunner,
    InvalidExperiment,
    run_experiment,
    run_process,
)
from chaos.experiment_format import check_python_modules
from chaos.experiment_rules import chaoslib_problem, check_format
from chaos.safety import error_rate_above
from tests.polling import wait_until

MOD = __name__
ROOT = Path(__file__).resolve().parents[2]
# A command that starts a child of its own, writes both pids to argv[1] (whole, by a rename), then hangs.
HANG = ("import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "with open(sys.argv[1] + '.tmp', 'w') as out:\n"
        "    out.write(f'{os.getpid()} {child.pid}')\n"
        "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
        "time.sleep(60)\n")
CALLS: list[str] = []
RELEASED = threading.Event()
WAIT_S = 20.0  # how long a background activity waits for the foreground one to release it


def ready() -> int:
    CALLS.append("ready")
    return 3


def wait_for_release() -> bool:
    """A background activity: it returns True only if an activity after it ran while it was waiting."""
    CALLS.append("waiting")
    released = RELEASED.wait(WAIT_S)
    CALLS.append("released" if released else "never released")
    return released


def release() -> str:
    CALLS.append("release")
    RELEASED.set()
    return "released"


def undo() -> str:
    CALLS.append("undo")
    return "undone"


def inject_in_background() -> dict[str, Any]:
    """A background fault injection that finishes only once released (by the stop condition below)."""
    CALLS.append("injecting")
    RELEASED.wait(WAIT_S)
    return {"faults": [{"id": 7, "kind": "kill"}]}


def at_least(value: Any = None, floor: int = 3) -> bool:
    """A probe tolerance: Chaos Toolkit hands it the probe's output as ``value``."""
    CALLS.append(f"judged {value!r}")
    return isinstance(value, int) and value >= floor


def py(name: str, func: str, kind: str = "action", **extra: Any) -> dict[str, Any]:
    return {"type": kind, "name": name, "provider": {"type": "python", "module": MOD, "func": func}, **extra}


def process(name: str, code: str, kind: str = "action", **extra: Any) -> dict[str, Any]:
    provider = {"type": "process", "path": sys.executable, "arguments": ["-c", code],
                **extra.pop("provider", {})}
    return {"type": kind, "name": name, "provider": provider, **extra}


def experiment(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "title": "parity with chaos run", "description": "what Chaos Toolkit runs, we run",
        "steady-state-hypothesis": {"title": "ready", "probes": [py("ready", "ready", "probe", tolerance=3)]},
        "method": [], "rollbacks": [py("undo", "undo")],
    }
    body.update(overrides)
    return body


@pytest.fixture(autouse=True)
def _reset() -> None:
    CALLS.clear()
    RELEASED.clear()


def test_a_hypothesis_only_experiment_checks_the_steady_state_twice() -> None:
    journal = run_experiment(experiment())
    assert journal["status"] == "completed" and journal["run"] == []
    assert journal["steady_states"]["before"]["steady_state_met"]
    assert journal["steady_states"]["after"]["steady_state_met"]
    assert CALLS == ["ready", "ready", "undo"]


def test_process_providers_run_commands_and_their_exit_status_meets_a_tolerance() -> None:
    probe = process("exit-0", "print('ok')", "probe", tolerance=0)
    failing = process("exit-3", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)")
    echo = process("echo", "import sys; print(' '.join(sys.argv[1:]))")
    echo["provider"]["arguments"] += ["${zone}", 5]
    exp = experiment(method=[failing, echo], configuration={"zone": "az-b"},
                     **{"steady-state-hypothesis": {"title": "a command succeeds", "probes": [probe]}})
    journal = run_experiment(exp)
    assert journal["status"] == "completed"
    assert journal["steady_states"]["before"]["probes"][0]["output"] == {"status": 0, "stdout": "ok\n",
                                                                         "stderr": ""}
    exit3, said = journal["run"]
    assert exit3["status"] == "succeeded"  # a non-zero exit is an output, as in Chaos Toolkit
    assert exit3["output"] == {"status": 3, "stdout": "out\n", "stderr": "err\n"}
    assert said["output"]["stdout"] == "az-b 5\n"
    assert journal["plan"][1]["provider"] == f"process: {sys.executable}"


def hanging(name: str, pid_file: Path, **provider: Any) -> dict[str, Any]:
    """A process action running :data:`HANG` (its pids to ``pid_file``); ``provider``: e.g. its timeout."""
    hang = process(name, HANG, provider=provider)
    hang["provider"]["arguments"].append(str(pid_file))
    return hang


def pids(pid_file: Path) -> list[int]:
    return [int(pid) for pid in pid_file.read_text().split()]


def wait_all_gone(processes: list[int]) -> None:
    for pid in processes:
        wait_until(functools.partial(_gone, pid), timeout=10, what=f"process {pid} killed")


def test_a_process_past_its_timeout_is_killed_with_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    # 5 s: time for one interpreter to start and write the pids even on a loaded machine (the grandchild's
    # pid is known once it is exec'd, before its own interpreter starts).
    journal = run_experiment(experiment(method=[hanging("hang", pid_file, timeout=5)]))
    record = journal["run"][0]
    assert record["status"] == "failed" and "still running after 5s, killed" in record["exception"][-1]
    assert record["duration"] < 30
    assert pid_file.exists(), "the command was killed before it started its child: nothing was checked"
    wait_all_gone(pids(pid_file))


def test_an_abort_kills_the_commands_in_flight_with_what_they_started_and_ends_promptly(
        tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    undo = process("undo-command", "print('undone')")
    exp = experiment(method=[hanging("hang", pid_file)], rollbacks=[undo])  # no timeout: 300 s by default
    trip = error_rate_above(lambda: 0.9 if pid_file.exists() else 0.0, 0.1)
    started = time.monotonic()
    journal = run_experiment(exp, stop_conditions=[trip], check_interval_s=0.05)
    assert time.monotonic() - started < ABORT_DRAIN_S / 2  # neither the drain nor the command's own 60 s
    assert journal["status"] == "aborted"
    [hang] = journal["run"]
    assert hang["status"] == "failed" and "killed: the run was aborted by a stop condition" in \
        hang["exception"][-1]
    wait_all_gone(pids(pid_file))
    [rollback] = journal["rollbacks"]  # commands run again once the abort is settled
    assert rollback["status"] == "succeeded" and rollback["output"]["stdout"] == "undone\n"


def test_ctrl_c_ends_a_run_at_once_and_leaves_no_command_behind(tmp_path: Path) -> None:
    pid_file, path = tmp_path / "pids", tmp_path / "experiment.json"
    path.write_text(json.dumps({"title": "hang", "description": "a command that hangs",
                                "method": [hanging("hang", pid_file)]}))
    # Ctrl-C as a terminal delivers it: a suite started in the background (`cmd &` from a script, nohup)
    # hands its children SIGINT ignored, and the run would then never see it.
    script = ("import json, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
              "from chaos.experiment import run_experiment; run_experiment(json.load(open(sys.argv[1])))")
    run = subprocess.Popen([sys.executable, "-c", script, str(path)], cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    try:
        wait_until(pid_file.exists, timeout=60, what="the command to start")
        run.send_signal(signal.SIGINT)  # the command has a session of its own: it does not get it
        _, err = run.communicate(timeout=15)  # not the command's 60 s (nor its 300 s timeout)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert "KeyboardInterrupt" in err
    wait_all_gone(pids(pid_file))


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (a container's init may not reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_a_command_line_string_is_refused_not_run_through_a_shell(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    shell = {"type": "action", "name": "shell", "provider": {"type": "process", "path": "touch",
                                                               "arguments": f"{marker}"}}
    with pytest.raises(InvalidExperiment, match=r"method\[0\]\.provider\.arguments: a command line would"):
        run_experiment(experiment(method=[shell]))
    assert not marker.exists() and CALLS == []


def test_a_server_runs_no_process_providers(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    touch = {"type": "action", "name": "touch", "provider": {"type": "process", "path": "touch",
                                                               "arguments": [str(marker)]}}
    exp = experiment(method=[touch])
    with pytest.raises(InvalidExperiment, match=r"method\[0\]\.provider\.type: process providers"):
        check_python_modules(exp, [MOD])
    with pytest.raises(InvalidExperiment, match=r"process providers \(local commands\) are not allowed here"):
        run_experiment(exp, allow_env=False)  # as the REST API runs them: no env, so no local commands
    with pytest.raises(InvalidExperiment, match="not allowed here"):
        run_experiment(exp, allow_process=False)
    assert not marker.exists() and CALLS == []
    check_python_modules(exp, [MOD], allow_process=True)  # a server may opt in, explicitly


def test_background_activities_run_concurrently_and_are_joined_before_the_steady_state_after() -> None:
    exp = experiment(method=[py("wait", "wait_for_release", background=True), py("release", "release")],
                     rollbacks=[py("bg-undo", "wait_for_release", background=True), py("undo", "undo")])
    plan = run_experiment(exp, dry_run=True)["plan"]
    assert [(s["name"], s["background"]) for s in plan if s["phase"] == "method"] == [("wait", True),
                                                                                      ("release", False)]
    assert CALLS == []  # a dry run calls nothing
    journal = run_experiment(exp)
    assert journal["status"] == "completed"
    waiting, released = journal["run"]
    assert [waiting["activity"]["name"], released["activity"]["name"]] == ["wait", "release"]  # start order
    assert waiting["status"] == "succeeded" and waiting["output"] is True  # released while it waited
    assert CALLS.index("released") < CALLS.index("ready", 1)  # joined before the steady state after
    assert [r["activity"]["name"] for r in journal["rollbacks"]] == ["bg-undo", "undo"]
    assert all(r["status"] == "succeeded" for r in journal["rollbacks"])
    json.dumps(journal)


def test_a_probe_tolerance_is_run_with_the_output_as_its_value() -> None:
    provider = {"type": "python", "module": MOD, "func": "at_least", "arguments": {"floor": 3}}
    judge: dict[str, Any] = {"type": "probe", "name": "at-least", "provider": provider}
    strict = {**judge, "provider": {**judge["provider"], "arguments": {"floor": 4}}}
    met = run_experiment(experiment(**{"steady-state-hypothesis": {"title": "t", "probes": [
        py("ready", "ready", "probe", tolerance=judge)]}}))
    assert met["status"] == "completed" and met["steady_states"]["before"]["probes"][0]["tolerance_met"]
    assert CALLS[:2] == ["ready", "judged 3"]
    unmet = run_experiment(experiment(**{"steady-state-hypothesis": {"title": "t", "probes": [
        py("ready", "ready", "probe", tolerance=strict)]}}))
    assert unmet["status"] == "failed" and unmet["run"] == []
    assert unmet["steady_states"]["before"]["probes"][0]["tolerance_met"] is False


def test_a_process_tolerance_gets_the_output_as_its_last_argument_and_is_met_when_it_exits_0() -> None:
    def judged_by(provider: dict[str, Any]) -> dict[str, Any]:
        judge = {"type": "probe", "name": "judge", "provider": {"type": "process", **provider}}
        probes = [py("ready", "ready", "probe", tolerance=judge)]
        return run_experiment(experiment(**{"steady-state-hypothesis": {"title": "t", "probes": probes}}))

    is_three = {"path": sys.executable, "arguments": ["-c", "import sys; sys.exit(sys.argv[-1] != '3')"]}
    is_four = {"path": sys.executable, "arguments": ["-c", "import sys; sys.exit(sys.argv[-1] != '4')"]}
    cases: list[tuple[dict[str, Any], bool]] = [(is_three, True), (is_four, False), ({"path": "true"}, True),
                                                ({"path": "false"}, False)]
    for provider, met in cases:
        journal = judged_by(provider)
        [probe] = journal["steady_states"]["before"]["probes"]
        assert probe["tolerance_met"] is met, provider
        assert journal["status"] == ("completed" if met else "failed")


def test_a_tolerance_that_cannot_be_judged_fails_its_probe_not_the_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(tolerance: Any, value: Any) -> bool:
        raise TypeError("cannot compare")

    monkeypatch.setattr("chaos.experiment.within_tolerance", broken)
    journal = run_experiment(experiment())
    assert journal["status"] == "failed"
    [probe] = journal["steady_states"]["before"]["probes"]
    assert probe["status"] == "failed" and probe["tolerance_met"] is False
    assert probe["exception"] == ["tolerance: TypeError: cannot compare\n"]
    assert CALLS == ["ready", "undo"]  # the method is skipped, the rollbacks run


def test_a_path_with_a_tilde_is_refused_as_chaos_toolkit_refuses_it_and_never_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = tmp_path / "tool"
    tool.write_text(f"#!/bin/sh\ntouch {tmp_path / 'ran'}\n")
    tool.chmod(0o755)
    monkeypatch.setenv("HOME", str(tmp_path))
    provider = {"type": "process", "path": "~/tool"}
    exp = experiment(method=[{"type": "action", "name": "tool", "provider": provider}])
    assert "cannot be found" in str(chaoslib_problem(exp))
    with pytest.raises(InvalidExperiment, match=r"method\[0\]\.provider\.path: '~/tool' is not an executable "
                                                r"on the PATH \(~ is not expanded"):
        check_format(exp)
    with pytest.raises(ActivityFailed, match="not an executable on the PATH"):  # the runner finds it alike
        run_process(provider, Context({}, {}, allow_process=True))
    assert not (tmp_path / "ran").exists()


def test_an_abort_waits_for_background_activities_and_reverts_their_faults() -> None:
    reverted: list[list[int]] = []

    async def revert(ids: Sequence[int]) -> list[dict[str, Any]]:
        reverted.append(list(ids))
        return [{"fault_id": i, "ok": True} for i in ids]

    def error_rate() -> float:
        if "injecting" in CALLS:
            RELEASED.set()
            return 0.9
        return 0.0

    exp = experiment(method=[py("inject", "inject_in_background", background=True),
                             py("late", "undo", pauses={"before": 30})])
    started = time.monotonic()
    runner = ExperimentRunner(revert_faults=revert)
    journal = asyncio.run(runner.run(exp, stop_conditions=[error_rate_above(error_rate, 0.1)],
                                     check_interval_s=0.05))
    assert time.monotonic() - started < 15  # did not sit out the 30 s pause
    assert journal["status"] == "aborted" and reverted == [[7]] and journal["fault_ids"] == [7]
    [inject] = journal["run"]
    assert inject["status"] == "succeeded" and inject["output"]["faults"][0]["id"] == 7
    assert CALLS.count("undo") == 1  # the rollback, not the method's late activity


@pytest.mark.parametrize(("patch", "reason"), [
    ({"controls": [{"name": "log", "provider": {"type": "python", "module": MOD}}]},
     r"controls: not run by this runner"),
    ({"secrets": {"cp": {"token": {"type": "vault", "path": "sre/cp"}}}},
     r"secrets\.cp\.token: Vault secrets are not supported by this runner"),
    ({"configuration": {"url": {"type": "probe", "name": "p", "provider": {"type": "python", "module": MOD,
                                                                            "func": "ready"}}}},
     r"configuration\.url: probes in the configuration \(dynamic configuration\)"),
    ({"rollbacks": [{"ref": "nowhere"}]}, r"rollbacks\[0\]\.ref: no activity named 'nowhere'"),
])
def test_what_chaos_run_accepts_but_we_do_not_run_is_refused_with_the_reason(
        patch: dict[str, Any], reason: str) -> None:
    with pytest.raises(InvalidExperiment, match=reason):
        run_experiment(experiment(**patch))
    assert CALLS == []
