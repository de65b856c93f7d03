"""Schemathesis against a live server's own ``/openapi.json``, bounded in cases and time, with what it found
as counts: the fuzz tests of the REST API, the gateway and a replica, and ``make fuzz``, use it.

:func:`fuzz` runs ``schemathesis run`` as a child process (the same CLI a person would run) with the
checks that hold a server to its spec: no 5xx (``not_a_server_error``), every status, content type, header
and body as the spec declares, and 405 with the right ``Allow`` for a method a path does not take. It
reads back schemathesis's JSON report and the status of every response (:mod:`tests.fuzz_hooks`).

Schemathesis's two input checks (a request the schema forbids must be refused, one it allows accepted)
are left out: the spec cannot say that a cron expression must parse or a scenario must exist, and the
fuzz is about what the servers answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from inference.launcher import free_port

CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_headers_conformance", "response_schema_conformance", "unsupported_method",
          "allow_header_conformance")
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class FuzzRun:
    """What one schemathesis run found."""

    label: str
    cases: int
    statuses: dict[int, int]
    failures: dict[str, int]  # "ST101 Server error" -> how many distinct failures
    operations: list[str] = field(default_factory=list)  # the operations that failed
    output: str = ""

    @property
    def responses(self) -> int:
        return sum(self.statuses.values())

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    @property
    def spec_violations(self) -> int:
        """Distinct failures of any check but the 5xx one (a 5xx counts in ``server_errors``)."""
        return sum(n for name, n in self.failures.items() if not name.startswith("ST101"))

    def summary(self) -> str:
        return (f"{self.label}: {self.cases} cases, {self.responses} responses, {self.server_errors} with "
                f"status 5xx, {self.spec_violations} spec violations; statuses {self.statuses}")

    def explain(self) -> str:
        return f"{self.summary()}\nfailures: {self.failures} in {self.operations}\n{self.output[-6000:]}"


def fuzz(spec_url: str, *, label: str, headers: Mapping[str, str] | None = None, max_examples: int = 5,
         seed: int = 0, include_path_regex: str | None = None, phases: str = "examples,coverage,fuzzing",
         max_time_s: int | None = None, workers: int = 1, timeout_s: float = 600.0,
         extra: Sequence[str] = ()) -> FuzzRun:
    """Run schemathesis against the spec at ``spec_url`` (``max_time_s``: keep fuzzing until it is spent)."""
    with tempfile.TemporaryDirectory(prefix="fuzz-") as folder:
        report, statuses = Path(folder) / "report.json", Path(folder) / "statuses.json"
        command = [sys.executable, "-m", "schemathesis.cli", "run", spec_url, "--checks", ",".join(CHECKS),
                   "--max-examples", str(max_examples), "--seed", str(seed), "--phases", phases,
                   "--workers", str(workers), "--report", "json", "--report-json-path", str(report),
                   "--request-timeout", "60", "--no-color", *extra]
        for name, value in (headers or {}).items():
            command += ["--header", f"{name}: {value}"]
        if include_path_regex:
            command += ["--include-path-regex", include_path_regex]
        if max_time_s:
            command += ["--max-time", str(max_time_s)]
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.fuzz_hooks", "FUZZ_STATUS_FILE": str(statuses),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        # run in the temporary folder: schemathesis keeps its cache (.schemathesis/) in its working folder
        done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout_s)
        output = done.stdout + done.stderr
        if not report.exists() or not statuses.exists():
            raise RuntimeError(f"schemathesis wrote no report (exit {done.returncode}):\n{output[-4000:]}")
        return _parse(label, json.loads(report.read_text()), json.loads(statuses.read_text()), output)


def _parse(label: str, report: dict[str, Any], statuses: dict[str, int], output: str) -> FuzzRun:
    failures = {f"{f['code']} {f['title']}": int(f["count"]) for f in report.get("failures", [])}
    operations = sorted({op for f in report.get("failures", []) for op in f.get("operations", [])})
    for error in report.get("errors", []):  # a case that could not run is a failure too
        name = f"error {error.get('title', error) if isinstance(error, dict) else error}"
        failures[name] = failures.get(name, 0) + 1
    return FuzzRun(label, int(report["test_cases"]["generated"]), {int(k): v for k, v in statuses.items()},
                   failures, operations, output)


@contextmanager
def listening(app: Any, *, lifespan: str = "off") -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port in a thread of this process; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan=lifespan,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"the server on port {port} did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
