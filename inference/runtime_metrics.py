"""Runtime gauges every long-running process of the project exposes on its ``/metrics``: asyncio tasks.

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
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# The project's own metrics (everything not named by vLLM) carry this prefix, so that they never collide
# with another exporter's names in a shared Prometheus (vLLM's own ``http_requests_total``, for one).
NAMESPACE = "llmsre_"
ASYNCIO_TASKS = f"{NAMESPACE}asyncio_tasks"


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


def register_runtime_metrics(registry: CollectorRegistry) -> None:
    registry.register(AsyncioTasks())
