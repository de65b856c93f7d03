"""Runtime gauges every long-running process of the project exposes on its ``/metrics``: asyncio tasks,
and a process under a CPU limit (:mod:`inference.cpu_limit`) its limit and the time it waited for quota.

A leak of tasks (a stream whose reader never ends, a timer never cancelled) shows only over hours; the
soak benchmark (``python -m controlplane.bench soak``) samples this gauge (``llmsre_asyncio_tasks``) on
the replicas, the gateways and the control plane. Memory and file descriptors it reads from ``/proc``
itself, so they need no gauge here. Counting tasks is cheap (one pass over the loop's weak set) and
happens only when ``/metrics`` is read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inference.cpu_limit import current

# The project's own metrics (everything not named by vLLM) carry this prefix, so that they never collide
# with another exporter's names in a shared Prometheus (vLLM's own ``http_requests_total``, for one).
NAMESPACE = "llmsre_"
ASYNCIO_TASKS = f"{NAMESPACE}asyncio_tasks"
CPU_LIMIT = f"{NAMESPACE}cpu_limit_cores"
CPU_THROTTLED = f"{NAMESPACE}cpu_throttled_seconds"  # _total on the wire
CPU_THROTTLED_PERIODS = f"{NAMESPACE}cpu_throttled_periods"


class AsyncioTasks(Collector):
    """``llmsre_asyncio_tasks``: tasks not yet done on the event loop that serves ``/metrics`` (collected
    on that loop, where ``asyncio.all_tasks`` is safe to call); absent when collected off any loop."""

    def collect(self) -> Iterable[Metric]:
        try:
            tasks = asyncio.all_tasks()
        except RuntimeError:  # no running loop in this thread: nothing to say
            return
        yield GaugeMetricFamily(ASYNCIO_TASKS, "asyncio tasks not yet done on the loop serving /metrics",
                                value=len(tasks))


class CpuLimitMetrics(Collector):
    """``llmsre_cpu_limit_cores``, ``llmsre_cpu_throttled_seconds_total`` and
    ``llmsre_cpu_throttled_periods_total`` of the CPU limit this process runs under; nothing without one.
    Throttled time that grows with load says the limit, not the host, sets the replica's speed."""

    def collect(self) -> Iterable[Metric]:
        limit = current()
        if limit is None:
            return
        yield GaugeMetricFamily(CPU_LIMIT, "CPU time per second this process may use (its cgroup's quota)",
                                value=limit.cores)
        stat = limit.throttling()
        if stat is not None:
            yield CounterMetricFamily(CPU_THROTTLED, "Time this process's threads waited for CPU quota",
                                      value=stat.throttled_s)
            yield CounterMetricFamily(CPU_THROTTLED_PERIODS, "Quota periods this process ran out of quota in",
                                      value=stat.throttled_periods)


def register_runtime_metrics(registry: CollectorRegistry) -> None:
    registry.register(AsyncioTasks())
    registry.register(CpuLimitMetrics())
