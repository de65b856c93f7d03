"""A replica's CPU limit: CFS bandwidth control on a cgroup of its own, as a container's CPU limit is
(Kubernetes ``resources.limits.cpu``, ``docker run --cpus``).

``inference serve --cpu-limit 0.75`` puts the process, before torch starts a thread, into
``<cpu controller>/llmsre/replica-<pid>`` with a quota of 0.75 of a core per period, and takes it out and
removes the group when it exits. A replica so limited runs at the same speed whatever else the host runs,
as long as the limits and the host's other work fit its cores: the speed a profile measured under the same
limit (``controlplane calibrate --cpu-limit``) promises, instead of whatever share of the cores a busy
host leaves. The period is 10 ms, not the kernel's default 100 ms, so that a throttled replica waits at
most a quarter of a 10 ms period at 0.75 of a core (a decode step takes a few ms), not 25 ms.

Both cgroup versions: v2 where the unified hierarchy has the ``cpu`` controller (``cpu.max``), else v1's
``cpu`` hierarchy (``cpu.cfs_quota_us``). Where neither is writable (not root, no controller), joining
raises :class:`CpuLimitUnavailable` with the reason; the replica then refuses to start rather than run
unlimited behind a flag that says it is limited. A replica killed with SIGKILL leaves its empty group;
:func:`sweep` (run by every join, by the control plane's local backend when a replica exits, and by the
tests) removes the groups of processes that are gone.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

PERIOD_US = 10_000
MIN_QUOTA_US = 1_000  # the kernel refuses a smaller quota
GROUP = "llmsre"
PREFIX = "replica-"
MOUNTS = Path("/proc/self/mounts")


class CpuLimitUnavailable(RuntimeError):
    """No CPU controller this process may write; the message says why."""


@dataclass(slots=True, frozen=True)
class Hierarchy:
    root: Path  # the cpu controller's mount
    version: int  # 1 or 2

    @property
    def group(self) -> Path:
        return self.root / GROUP


@dataclass(slots=True, frozen=True)
class Throttling:
    periods: int  # CFS periods in which the group ran
    throttled_periods: int  # of those, periods it ran out of quota in
    throttled_s: float  # time its threads waited for the next period


@dataclass(slots=True)
class CpuLimit:
    """This process's limit: its group, and what it costs it (:meth:`throttling`)."""

    cores: float
    path: Path
    hierarchy: Hierarchy

    def throttling(self) -> Throttling | None:
        """The group's ``cpu.stat``; None once it is gone."""
        try:
            stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines()
                        if len(line.split()) == 2)
        except OSError:
            return None
        if self.hierarchy.version == 2:
            throttled_s = int(stat.get("throttled_usec", 0)) / 1e6
        else:
            throttled_s = int(stat.get("throttled_time", 0)) / 1e9
        return Throttling(int(stat.get("nr_periods", 0)), int(stat.get("nr_throttled", 0)), throttled_s)

    def leave(self) -> None:
        """Back to the hierarchy's root, and the group removed (this process's last act under it)."""
        global _current
        with contextlib.suppress(OSError):
            (self.hierarchy.root / "cgroup.procs").write_text(str(os.getpid()))
        with contextlib.suppress(OSError):
            self.path.rmdir()
        with contextlib.suppress(OSError):
            self.hierarchy.group.rmdir()  # fails while another replica's group is in it
        if _current is self:
            _current = None


_current: CpuLimit | None = None


def current() -> CpuLimit | None:
    """The limit this process joined, if any (the replica's ``/metrics`` reports it)."""
    return _current


def quota_us(cores: float) -> int:
    """CPU time per :data:`PERIOD_US` that ``cores`` allows."""
    if not cores > 0:
        raise ValueError(f"cpu limit: must be > 0 cores, got {cores!r}")
    quota = round(cores * PERIOD_US)
    if quota < MIN_QUOTA_US:
        raise ValueError(f"cpu limit: at least {MIN_QUOTA_US / PERIOD_US:g} of a core, got {cores:g}")
    return quota


def find_hierarchy(mounts: Path = MOUNTS) -> Hierarchy:
    """The writable cpu controller: v2's unified hierarchy when it has ``cpu``, else v1's ``cpu``."""
    try:
        lines = mounts.read_text().splitlines()
    except OSError as exc:
        raise CpuLimitUnavailable(f"cannot read {mounts}: {exc.strerror}") from None
    v1 = None
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        where, kind, options = Path(fields[1]), fields[2], fields[3].split(",")
        if kind == "cgroup2":
            try:
                controllers = (where / "cgroup.controllers").read_text().split()
            except OSError:
                continue
            if "cpu" in controllers:
                return _writable(Hierarchy(where, 2))
        elif kind == "cgroup" and "cpu" in options and v1 is None:
            v1 = Hierarchy(where, 1)
    if v1 is None:
        raise CpuLimitUnavailable("no cgroup hierarchy with the cpu controller is mounted")
    return _writable(v1)


def _writable(h: Hierarchy) -> Hierarchy:
    if not os.access(h.root / "cgroup.procs", os.W_OK):
        raise CpuLimitUnavailable(f"{h.root} is not writable by this user (a CPU limit needs root or a "
                                  "delegated cgroup)")
    return h


def join(cores: float, *, hierarchy: Hierarchy | None = None) -> CpuLimit:
    """Put this process (all its threads) under a limit of ``cores``; before it starts threads, so that
    none escapes. Raises :class:`CpuLimitUnavailable` (why) or ValueError (a limit the kernel refuses)."""
    global _current
    quota = quota_us(cores)
    h = hierarchy or find_hierarchy()
    sweep(h)
    path = h.group / f"{PREFIX}{os.getpid()}"
    try:
        for attempt in range(3):  # another replica's sweep may remove the empty parent between the two
            try:
                h.group.mkdir(exist_ok=True)
                if h.version == 2:
                    _enable_cpu(h.root)
                    _enable_cpu(h.group)
                path.mkdir(exist_ok=True)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        if h.version == 2:
            (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota))
        (path / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        with contextlib.suppress(OSError):
            path.rmdir()
        raise CpuLimitUnavailable(f"cannot set a CPU limit under {h.group}: {exc.strerror or exc}") from None
    _current = CpuLimit(cores, path, h)
    return _current


def _enable_cpu(group: Path) -> None:
    """v2: let the children of ``group`` have the cpu controller."""
    control = group / "cgroup.subtree_control"
    if "cpu" not in control.read_text().split():
        control.write_text("+cpu")


def sweep(hierarchy: Hierarchy | None = None) -> int:
    """Remove the groups of replicas that are gone (a SIGKILL leaves one behind); how many went. Never
    raises: a host without the controller has nothing to sweep."""
    try:
        h = hierarchy or find_hierarchy()
        groups = list(h.group.glob(f"{PREFIX}*"))
    except (CpuLimitUnavailable, OSError):
        return 0
    removed = 0
    for path in groups:
        pid = path.name.removeprefix(PREFIX)
        if pid.isdigit() and Path(f"/proc/{pid}").exists():
            continue  # its replica runs (or is still joining it)
        with contextlib.suppress(OSError):
            path.rmdir()  # fails while a process is still in it
            removed += 1
    with contextlib.suppress(OSError):
        h.group.rmdir()  # the parent too once no replica is limited: nothing left on the host
    return removed

