"""The replica set a gateway routes over: watched from the control plane, kept in memory and on disk.

Where it sits: the gateway process asks :meth:`Discovery.endpoints` on every request and
:meth:`Discovery.load` while scoring; a background task keeps both fresh by long-polling the control
plane's endpoints API (``GET /api/v1/gateway/endpoints?epoch=E&after=V&wait_s=W``, answered as soon as the
replica set changes, else after ``W`` seconds with fresh loads). Every new version is written to
``endpoints.json`` in the gateway's state folder.

Static stability: when the control plane cannot be reached, nothing is dropped. The gateway keeps routing
on the last known good set (probing, ejecting and resuming on its own), and a gateway started while the
control plane is down serves from the file. Loads older than ``load_ttl_s`` are forgotten, so routing
falls back to the gateway's own in-flight counts rather than to stale numbers.

The control plane's versions restart with it; each of its starts has an ``epoch``, and a response from
another epoch replaces what the gateway holds whatever its version.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from controlplane.gateway.slices import SlicePlan
from controlplane.replicas import ReplicaEndpoint, ReplicaLoad

logger = logging.getLogger(__name__)

ENDPOINTS_PATH = "/api/v1/gateway/endpoints"
STATE_FILE = "endpoints.json"
DEFAULT_WAIT_S = 10.0  # a long poll is answered at least this often (fresh loads)
DEFAULT_LOAD_TTL_S = 10.0
RETRY_MIN_S, RETRY_MAX_S = 0.25, 5.0  # backoff while the control plane is unreachable
REQUEST_SLACK_S = 5.0  # a long poll's HTTP timeout: wait_s plus this


@dataclass(slots=True, frozen=True)
class Snapshot:
    """One answer of the control plane (or the file): the replica set, the traffic slices, their version."""

    epoch: str
    version: int
    endpoints: tuple[ReplicaEndpoint, ...]
    loads: tuple[ReplicaLoad, ...] = ()
    slices: SlicePlan = field(default_factory=SlicePlan)  # version split and colours (gateway.slices)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], *, observed_at: float) -> Snapshot:
        """``ValueError``/``KeyError``/``TypeError`` for a malformed answer."""
        return cls(epoch=str(raw["epoch"]), version=int(raw["version"]),
                   endpoints=tuple(ReplicaEndpoint.from_json(e) for e in raw["endpoints"]),
                   loads=tuple(ReplicaLoad.from_json(x, observed_at=observed_at)
                               for x in raw.get("loads", ())),
                   slices=SlicePlan.from_json(raw.get("slices")))

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "version": self.version,
                "endpoints": [e.to_json() for e in self.endpoints], "slices": self.slices.to_json()}


class Discovery:
    """Endpoints and loads for one gateway; ``start()`` runs the watch, ``stop()`` ends it."""

    def __init__(self, *, control_plane: str | None, token: str | None, state_dir: Path | None,
                 wait_s: float = DEFAULT_WAIT_S, load_ttl_s: float = DEFAULT_LOAD_TTL_S,
                 clock: Callable[[], float] = time.monotonic,
                 transport: httpx.AsyncBaseTransport | None = None,
                 static: Sequence[ReplicaEndpoint] = ()) -> None:
        self.control_plane = control_plane.rstrip("/") if control_plane else None
        self.wait_s, self.load_ttl_s, self.clock = wait_s, load_ttl_s, clock
        self.state_path = state_dir / STATE_FILE if state_dir is not None else None
        self.snapshot = Snapshot("static", 0, tuple(static))
        self.source = "static"  # "static" | "disk" | "control-plane"
        self.reachable: bool | None = None  # the last request to the control plane got an answer (None: none)
        self.last_contact: float | None = None  # monotonic time of the last answer
        self.on_change: Callable[[Snapshot], None] = lambda _: None
        self._loads: dict[str, ReplicaLoad] = {}
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(transport=transport, trust_env=False)
        self._task: asyncio.Task[None] | None = None

    # ---- what the gateway reads ----
    def endpoints(self) -> list[ReplicaEndpoint]:
        return list(self.snapshot.endpoints)

    def slices(self) -> SlicePlan:
        return self.snapshot.slices

    def load(self, replica_id: str) -> ReplicaLoad | None:
        load = self._loads.get(replica_id)
        if load is None or self.clock() - load.observed_at > self.load_ttl_s:
            return None
        return load

    def status(self) -> dict[str, Any]:
        since = None if self.last_contact is None else round(self.clock() - self.last_contact, 3)
        return {"source": self.source, "epoch": self.snapshot.epoch, "version": self.snapshot.version,
                "replicas": len(self.snapshot.endpoints), "slices": self.snapshot.slices.to_json(),
                "control_plane": self.control_plane,
                "control_plane_reachable": bool(self.reachable), "seconds_since_contact": since}

    # ---- the file ----
    def load_state(self) -> bool:
        """Take the replica set an earlier run kept on disk; False when there is none or it is unreadable."""
        if self.state_path is None or not self.state_path.exists():
            return False
        try:
            raw = json.loads(self.state_path.read_text(encoding="utf-8"))
            snapshot = Snapshot.from_json(raw, observed_at=self.clock())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("%s is unreadable, ignored: %s", self.state_path, exc)
            return False
        self.snapshot, self.source = snapshot, "disk"
        logger.warning("serving the last known replica set from %s (epoch %s, version %d, %d replicas)",
                       self.state_path, snapshot.epoch, snapshot.version, len(snapshot.endpoints))
        return True

    def save_state(self, snapshot: Snapshot) -> None:
        """Replace the file at once (readers never see half of it), readable by the owner only."""
        if self.state_path is None:
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(snapshot.to_json(), f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.state_path)

    # ---- the watch ----
    def start(self) -> None:
        if self.control_plane is not None and self._task is None:
            self._task = asyncio.create_task(self._watch(), name="endpoints-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._client.aclose()

    async def poll_once(self, wait_s: float | None = None) -> bool:
        """One long poll; True when the control plane answered (changed or not)."""
        assert self.control_plane is not None
        wait = self.wait_s if wait_s is None else wait_s
        params = {"epoch": self.snapshot.epoch, "after": str(self.snapshot.version), "wait_s": f"{wait:g}"}
        try:
            response = await self._client.get(self.control_plane + ENDPOINTS_PATH, params=params,
                                               headers=self._headers, timeout=wait + REQUEST_SLACK_S)
            response.raise_for_status()
            snapshot = Snapshot.from_json(response.json(), observed_at=self.clock())
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self._lost(exc)
            return False
        await self._take(snapshot)
        return True

    async def _watch(self) -> None:
        retry = RETRY_MIN_S
        while True:
            if await self.poll_once():
                retry = RETRY_MIN_S
                continue
            await asyncio.sleep(retry)
            retry = min(retry * 2, RETRY_MAX_S)

    async def _take(self, snapshot: Snapshot) -> None:
        if self.reachable is not True:
            logger.warning("control plane %s reachable: replica set epoch %s version %d (%d replicas)",
                           self.control_plane, snapshot.epoch, snapshot.version, len(snapshot.endpoints))
        self.reachable, self.last_contact = True, self.clock()
        self._loads = {load.replica_id: load for load in snapshot.loads}
        changed = (snapshot.epoch, snapshot.version) != (self.snapshot.epoch, self.snapshot.version)
        if not changed and self.source == "control-plane":
            return
        self.snapshot, self.source = snapshot, "control-plane"
        self.on_change(snapshot)
        try:
            await asyncio.to_thread(self.save_state, snapshot)
        except OSError as exc:  # serving goes on; the next version tries again
            logger.error("could not keep the replica set in %s: %s", self.state_path, exc)

    def _lost(self, exc: Exception) -> None:
        if self.reachable is not False:
            logger.warning("control plane %s unreachable (%s): routing on the last known replica set "
                           "(%s, version %d, %d replicas)", self.control_plane, _reason(exc), self.source,
                           self.snapshot.version, len(self.snapshot.endpoints))
        self.reachable = False


def _reason(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
