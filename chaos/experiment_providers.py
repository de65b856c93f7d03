"""What an experiment's activities run with: configuration and secrets, ``${name}`` substitution,
redaction, and the providers (``python``, ``http``, ``process``).

Where it sits: :mod:`chaos.experiment` (the runner) resolves an experiment's configuration and secrets
here into a :class:`Context`, and runs each activity's provider through :data:`PROVIDERS` in a worker
thread; a provider's exception becomes a failed record there, never an exception out of the run. What a
run may reach is limited here: python functions only where :func:`~chaos.experiment_format.provider_function`
allows, http hosts only on the context's ``egress`` allow-list, and process providers only when the
runner allows local commands (on an operator's own machine, not for a server's callers).

A process provider runs ``path`` (found on the PATH as validation finds it: ``~`` is not expanded, since
Chaos Toolkit's validation refuses such a path) with ``arguments`` as a list, never
through a shell, in its own session, killed with its children after ``timeout`` seconds (default
``DEFAULT_PROCESS_TIMEOUT_S``; Chaos Toolkit has none). Its output is Chaos Toolkit's: ``status`` (the exit
code), ``stdout`` and ``stderr`` (at most ``MAX_OUTPUT_BYTES`` of each, decoded). The command inherits this
process's environment without its secrets (:func:`~inference.environment.child_environment`, then
:func:`without_keys`: no token, password, secret or key, the operator's ``CONTROLPLANE_TOKEN`` included), and
is registered on the run's :class:`Commands`, so a run that is aborted, cancelled (Ctrl-C) or over kills it
with what it started: no command outlives its run.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import httpx

from chaos.egress import HostAllowList
from chaos.experiment_format import PLACEHOLDER, InvalidExperiment, provider_function
from chaos.experiment_rules import convert_env_value
from inference.environment import child_environment

DEFAULT_HTTP_TIMEOUT_S = 30.0
DEFAULT_PROCESS_TIMEOUT_S = 300.0  # a process provider without a timeout of its own is killed after this
MAX_HTTP_BODY_BYTES = 64 * 1024  # of an http provider's answer, kept in the journal (the rest is cut)
MAX_OUTPUT_BYTES = 64 * 1024  # of a process provider's stdout and of its stderr, kept in the journal
REDACTED = "***"
MIN_SECRET_CHARS = 4  # shorter secrets are redacted where a whole value equals them, not inside strings


class ActivityFailed(Exception):
    """An activity did not succeed (a provider error, an unexpected HTTP status)."""


class InterruptExecution(Exception):
    """Raised by an activity to stop the run at once (journal status ``interrupted``)."""


# ---- configuration and secrets -------------------------------------------------------------------
def resolve_values(block: Mapping[str, Any] | None, where: str, *, allow_env: bool = True) -> dict[str, Any]:
    """Configuration values, with ``{"type": "env", "key": K[, "default": D][, "env_var_type": T]}`` read
    from the environment and converted as Chaos Toolkit does (refused with ``allow_env=False``: a server
    never hands its environment to a request)."""
    out: dict[str, Any] = {}
    for name, value in (block or {}).items():
        if isinstance(value, Mapping) and value.get("type") == "env" and not allow_env:
            raise InvalidExperiment(f"{where}.{name}: environment lookups are not allowed here")
        if isinstance(value, Mapping) and value.get("type") == "env":
            key = str(value.get("key", ""))
            if key not in os.environ and "default" not in value:
                raise InvalidExperiment(f"{where}.{name}: environment variable {key!r} is not set")
            try:
                raw = os.environ.get(key, value.get("default"))
                out[name] = convert_env_value(value.get("env_var_type"), raw)
            except (TypeError, ValueError, AttributeError) as exc:
                raise InvalidExperiment(f"{where}.{name}.env_var_type: {exc}") from exc
        else:
            out[name] = value
    return out


def resolve_secrets(block: Mapping[str, Any] | None, *, allow_env: bool = True) -> dict[str, dict[str, Any]]:
    return {name: resolve_values(values, f"secrets.{name}", allow_env=allow_env)
            for name, values in (block or {}).items() if isinstance(values, Mapping)}


def substitute(value: Any, names: Mapping[str, Any]) -> Any:
    """``${name}`` placeholders replaced in strings, recursively; a string that is one placeholder keeps
    the value's type."""
    if isinstance(value, str):
        whole = PLACEHOLDER.fullmatch(value)
        if whole and whole[1] in names:
            return names[whole[1]]
        return PLACEHOLDER.sub(lambda m: str(names.get(m[1], m[0])), value)
    if isinstance(value, list):
        return [substitute(v, names) for v in value]
    if isinstance(value, Mapping):
        return {k: substitute(v, names) for k, v in value.items()}
    return value


def redact(value: Any, secrets: Iterable[str]) -> Any:
    """``value`` with every secret written ``***``: a string equal to one, and one inside a longer string
    (secrets of ``MIN_SECRET_CHARS`` or more); recursively through lists and mappings, keys included."""
    values = sorted({s for s in secrets if s}, key=len, reverse=True)
    if not values:
        return value
    return _redact(value, frozenset(values), [s for s in values if len(s) >= MIN_SECRET_CHARS])


def _redact(value: Any, whole: frozenset[str], inner: list[str]) -> Any:
    if isinstance(value, str):
        if value in whole:
            return REDACTED
        for secret in inner:
            if secret in value:
                value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, Mapping):
        return {_redact(k, whole, inner): _redact(v, whole, inner) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact(v, whole, inner) for v in value]
    return value


# ---- the commands a run started -----------------------------------------------------------------------
class Commands:
    """The process providers' commands running for one run, so that the run can kill them (each in its own
    session: with what it started) when it is aborted, cancelled or over. While stopped, a command that
    starts is killed at once (a worker thread may start one just after the run stopped)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[subprocess.Popen[bytes], str | None] = {}  # -> why it was killed, if it was
        self._stopped: str | None = None

    def add(self, child: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._running[child] = None
            if self._stopped is not None:
                self._kill(child, self._stopped)

    def remove(self, child: subprocess.Popen[bytes]) -> str | None:
        """Forget a command that ended; why the run killed it (None: it was not killed)."""
        with self._lock:
            return self._running.pop(child, None)

    def stop(self, reason: str) -> None:
        """Kill every command running, and every one that starts until :meth:`resume`."""
        with self._lock:
            self._stopped = reason
            for child in self._running:
                self._kill(child, reason)

    def resume(self) -> None:
        with self._lock:
            self._stopped = None

    def _kill(self, child: subprocess.Popen[bytes], reason: str) -> None:
        if self._running[child] is None and child.poll() is None:
            self._running[child] = reason
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)  # the thread waiting on it reaps it


# ---- providers -----------------------------------------------------------------------------------
@dataclass(slots=True)
class Context:
    """What activities run with; ``base_secrets`` go to every python function taking ``secrets`` and win
    over the experiment's (the caller's own credentials when a server runs it); never journaled.
    ``egress`` limits where http providers go (None: anywhere, for a run on the operator's own machine);
    ``allow_process``: whether process providers (local commands) may run; ``commands``: those running."""

    configuration: dict[str, Any]
    secrets: dict[str, dict[str, Any]]
    transport: httpx.BaseTransport | None = None
    base_secrets: dict[str, Any] = field(default_factory=dict)
    egress: HostAllowList | None = None
    allow_process: bool = False
    commands: Commands = field(default_factory=Commands)

    @property
    def names(self) -> dict[str, Any]:
        merged = dict(self.configuration)
        for block in self.secrets.values():
            merged.update(block)
        return merged

    @property
    def secret_values(self) -> list[str]:
        """Every secret value as text: what :func:`redact` hides."""
        values = [*self.base_secrets.values(), *(v for b in self.secrets.values() for v in b.values())]
        return [str(v) for v in values if isinstance(v, (str, int, float)) and not isinstance(v, bool)]


def run_python(provider: Mapping[str, Any], ctx: Context) -> Any:
    func = provider_function(str(provider["module"]), str(provider["func"]))
    arguments = substitute(dict(provider.get("arguments") or {}), ctx.names)
    params = inspect.signature(func).parameters
    if "configuration" in params:
        arguments["configuration"] = dict(ctx.configuration)
    if "secrets" in params:
        merged: dict[str, Any] = {}
        for block in provider.get("secrets") or []:
            merged.update(ctx.secrets.get(block, {}))
        arguments["secrets"] = {**merged, **ctx.base_secrets}
    return func(**arguments)


def run_http(provider: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    url = str(substitute(provider["url"], ctx.names))
    method = str(provider.get("method", "GET")).upper()
    headers = {str(k): str(v) for k, v in substitute(dict(provider.get("headers") or {}), ctx.names).items()}
    arguments = substitute(provider.get("arguments"), ctx.names)
    timeout = provider.get("timeout", DEFAULT_HTTP_TIMEOUT_S)
    timeout = httpx.Timeout(timeout[1], connect=timeout[0]) if isinstance(timeout, list) else float(timeout)
    kwargs: dict[str, Any] = {"headers": headers}
    if arguments is not None:
        kwargs["params" if method == "GET" else "json"] = arguments
    refusal = ctx.egress.refusal(url) if ctx.egress is not None else None
    if refusal is not None:
        raise ActivityFailed(f"{method} {url}: refused: {refusal}")
    try:
        with httpx.Client(timeout=timeout, trust_env=False, transport=ctx.transport, follow_redirects=False,
                          verify=bool(provider.get("verify_tls", True))) as http, \
                http.stream(method, url, **kwargs) as response:
            raw, truncated = _read_bounded(response, MAX_HTTP_BODY_BYTES)
    except httpx.HTTPError as exc:
        raise ActivityFailed(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
    output = {"status": response.status_code, "headers": dict(response.headers),
              "body": _body(raw, truncated, response.encoding or "utf-8")}
    if truncated:
        output["truncated"] = True  # the body holds the first MAX_HTTP_BODY_BYTES bytes only
    expected = provider.get("expected_status")
    if expected is not None:
        allowed = expected if isinstance(expected, list) else [expected]
        if response.status_code not in allowed:
            raise ActivityFailed(f"{method} {url}: HTTP {response.status_code}, expected {allowed}")
    return output


def _read_bounded(response: httpx.Response, limit: int) -> tuple[bytes, bool]:
    """At most ``limit`` bytes of the body (and whether there was more): a huge answer is never held."""
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return b"".join(chunks)[:limit], True
    return b"".join(chunks), False


def _body(raw: bytes, truncated: bool, encoding: str) -> Any:
    text = raw.decode(encoding, errors="replace")
    if truncated:
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def run_process(provider: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """Run a local command (see the module's docstring); ActivityFailed when it cannot start, times out or
    is killed because the run stopped. A non-zero exit is an output (``status``), judged by a tolerance, as
    Chaos Toolkit does."""
    if not ctx.allow_process:
        raise ActivityFailed("process providers (local commands) are not allowed here")
    path = shutil.which(str(provider["path"]))
    if path is None:
        raise ActivityFailed(f"{provider['path']!r}: not an executable on the PATH")
    arguments = substitute(provider.get("arguments") or [], ctx.names)
    argv = [path, *(str(a) for a in arguments if a not in (None, ""))]
    timeout = float(provider.get("timeout") or DEFAULT_PROCESS_TIMEOUT_S)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                     env=without_keys(child_environment()), start_new_session=True)
        except OSError as exc:
            raise ActivityFailed(f"{path}: cannot start: {exc}") from exc
        ctx.commands.add(child)
        try:
            status = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(child)
            raise ActivityFailed(f"{path}: still running after {timeout:g}s, killed") from None
        except BaseException:
            _kill_session(child)
            raise
        finally:
            killed = ctx.commands.remove(child)
        if killed is not None:
            raise ActivityFailed(f"{path}: killed: {killed}")
        return {"status": status, "stdout": _head(out), "stderr": _head(err)}


def without_keys(environment: dict[str, str]) -> dict[str, str]:
    """What a process provider's command inherits: the project's rule for children
    (:func:`~inference.environment.child_environment`: no token, password, secret, API key or credential)
    and, for a command an experiment names, no other ``*_KEY`` either."""
    return {name: value for name, value in environment.items() if not name.upper().endswith("_KEY")}


def _kill_session(child: subprocess.Popen[bytes]) -> None:
    """Kill the command and whatever it started (its own session), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _head(stream: IO[bytes]) -> str:
    stream.seek(0)
    return stream.read(MAX_OUTPUT_BYTES).decode("utf-8", errors="replace")


PROVIDERS: dict[str, Callable[[Mapping[str, Any], Context], Any]] = {
    "python": run_python, "http": run_http, "process": run_process}


