"""The gateway's active health checks: asking a replica between requests instead of waiting for one to fail.

Passive checks need traffic: a stall is found by a stream that goes silent, ejection by failed requests.
A replica that hangs or is cut off while nothing is in flight there would only be found by the next
request routed to it, which then waits out the stall timeout. So every ``probe_interval_s`` the gateway
sends ``GET /ready`` (a one-token forward pass on the replica) to

- each **ejected** replica: a pass re-admits it;
- each **stalled** replica (see :mod:`controlplane.gateway.liveness`): a pass means its engine steps again, so
  it is routed to again (it is sent no request while another replica is left, so no token would clear it);
- each **idle** replica (routable, nothing in flight through this gateway): no answer within the stall
  timeout marks it stalled, like a silent stream. A replica that stops while idle is routed around within
  ``probe_interval_s + stall_timeout_s``, and the requests that reached it meanwhile move at once. An
  answer other than 200 (the replica says it cannot serve: a failed device) or a refused connection
  ejects it at once, where requests would have had to fail there a few times first.

A busy replica is not probed: its streams and first-token waits watch it already, and a forward pass
there would only queue behind them. At most one probe per replica is out at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable

import httpx

from controlplane.gateway.admission import OutlierDetector
from controlplane.gateway.liveness import Liveness
from controlplane.replicas import ReplicaEndpoint

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0  # an ejected or stalled replica's /ready must answer within this (a forward pass)


class Outcome(enum.Enum):
    PASSED = "passed"  # 200: the replica completed a forward pass
    FAILED = "failed"  # an answer other than 200, or the connection refused: it cannot serve
    SILENT = "silent"  # no answer within the timeout: hung, stopped or cut off
    UNKNOWN = "unknown"  # the probe could not be sent (this gateway's own connection limit)


class ActiveChecks:
    """The probe loop and what each answer means (see the module docstring); the gateway keeps the
    bookkeeping of ejections and re-admissions (``ejected``, ``readmit``: metrics and events)."""

    def __init__(self, *, client: httpx.AsyncClient, endpoints: Callable[[], list[ReplicaEndpoint]],
                 outliers: OutlierDetector, liveness: Liveness, inflight: Callable[[str], int],
                 interval_s: float, silence_s: float, probe_idle: bool,
                 readmit: Callable[[str, str], None], ejected: Callable[[str, str], None]) -> None:
        self._client, self._endpoints, self._inflight = client, endpoints, inflight
        self._outliers, self._liveness = outliers, liveness
        self._readmit, self._ejected = readmit, ejected  # the gateway's bookkeeping (metrics, events)
        self.interval_s, self.silence_s, self.probe_idle = interval_s, silence_s, probe_idle
        self._probing: set[str] = set()  # replicas with a probe out
        self._task: asyncio.Task[None] | None = None
        self._rounds: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Probe every ``interval_s`` from now on (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="gateway-health-checks")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._rounds) if t is not None]
        self._task = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def run_once(self) -> None:
        """One round: probe each replica that is due and has no probe out, and act on the answers."""
        known = {e.replica_id: e for e in self._endpoints()}
        for rid in sorted(self._outliers.ejected - known.keys()):
            self._readmit(rid, "left the fleet")
        due = [e for rid, e in sorted(known.items()) if rid not in self._probing and self._is_due(e)]
        await asyncio.gather(*(self._check(e) for e in due))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            # A round does not hold up the next one: a silent replica takes a whole timeout to answer.
            task = asyncio.create_task(self._round())
            self._rounds.add(task)
            task.add_done_callback(self._rounds.discard)

    async def _round(self) -> None:
        try:
            await self.run_once()
        except Exception:
            logger.exception("active health checks failed")

    def _is_due(self, endpoint: ReplicaEndpoint) -> bool:
        rid = endpoint.replica_id
        if rid in self._outliers.ejected:
            return endpoint.state.is_routable  # the fleet sees it ready: time to see if it serves
        if rid in self._liveness.suspects:
            return True
        return self.probe_idle and endpoint.state.is_routable and self._inflight(rid) == 0

    async def _check(self, endpoint: ReplicaEndpoint) -> None:
        rid = endpoint.replica_id
        ejected, stalled = rid in self._outliers.ejected, rid in self._liveness.suspects
        sent = time.monotonic()
        self._probing.add(rid)
        try:
            outcome, detail = await self._probe(endpoint,
                                                PROBE_TIMEOUT_S if ejected or stalled else self.silence_s)
        finally:
            self._probing.discard(rid)
        if outcome is Outcome.PASSED:
            if ejected:
                self._readmit(rid, "passed /ready")
            self._liveness.answered(rid)
        elif ejected:
            return
        elif outcome is Outcome.SILENT:
            self._liveness.silent_since(rid, sent)
        elif outcome is Outcome.FAILED and self._outliers.eject(rid):
            self._ejected(rid, f"/ready failed: {detail}")

    async def _probe(self, endpoint: ReplicaEndpoint, timeout: float) -> tuple[Outcome, str]:
        try:
            async with asyncio.timeout(timeout):  # the whole answer, not each read, within the timeout
                response = await self._client.get(f"{endpoint.base_url}/ready", timeout=timeout)
        except httpx.PoolTimeout:
            return Outcome.UNKNOWN, "no connection free"
        except (TimeoutError, httpx.TimeoutException):
            return Outcome.SILENT, f"no answer within {timeout:g}s"
        except httpx.HTTPError as exc:
            return Outcome.FAILED, f"{type(exc).__name__}: {exc}"
        if response.status_code == 200:
            return Outcome.PASSED, "200"
        return Outcome.FAILED, f"HTTP {response.status_code} {_reason(response)}".strip()


def _reason(response: httpx.Response) -> str:
    """The replica's own words for a refusal (``/ready`` answers ``{"reason": ...}``), if any."""
    try:
        body = response.json()
    except ValueError:
        return ""
    return str(body.get("reason", "")) if isinstance(body, dict) else ""
