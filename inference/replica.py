"""``python -m inference serve``: wire one replica together and run it until SIGTERM has drained it.

SIGTERM starts a drain (readiness 503, new requests 503, in-flight requests finish within the drain
timeout) and the process then exits 0; a second signal, or SIGINT, stops at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from types import FrameType

import uvicorn

from inference.async_engine import AsyncEngine
from inference.config import EngineConfig, TracingConfig
from inference.engine import LLMEngine
from inference.faults import ReplicaFaults
from inference.metrics import CacheConfigInfo, EngineInfo, ReplicaMetrics
from inference.server import Replica, ServerConfig, crash_now, create_app, engine_gauges

logger = logging.getLogger(__name__)


def build_replica(model: str, engine_config: EngineConfig, server_config: ServerConfig,
                  tracing: TracingConfig | None = None) -> Replica:
    engine = LLMEngine(model, engine_config)
    aengine = AsyncEngine(engine)
    faults = ReplicaFaults(crash=crash_now)
    name = server_config.served_model_name or engine.model_name
    info = CacheConfigInfo(engine.block_manager.block_size, engine.block_manager.num_blocks,
                           engine_config.kv_cache_dtype, engine_config.enable_prefix_caching,
                           engine.runner.layout.bytes_per_token)
    how = EngineInfo(engine.device.kind, str(engine.dtype).removeprefix("torch."),
                     EngineInfo.kernel_state(engine.cpu_decode_kernel),
                     EngineInfo.kernel_state(engine.packed_weights))
    metrics = ReplicaMetrics(model_name=name, replica=server_config.replica_id, zone=server_config.zone,
                             max_model_len=engine.max_model_len, engine_info=how,
                             read_engine=engine_gauges(aengine, engine.device), cache_info=info)
    aengine.before_step.append(faults.apply_before_step)
    aengine.after_step.append(metrics.after_step)
    replica = Replica(aengine, server_config, faults, metrics, name, device_kind=engine.device.kind)
    if tracing is not None and tracing.is_enabled:
        from inference.tracing import ReplicaTracing, start_provider

        provider = start_provider(tracing, service_name="llm-sre-replica", attributes={
            "service.instance.id": server_config.replica_id, "cloud.availability_zone": server_config.zone})
        replica.tracing = ReplicaTracing(provider, clock=engine.clock)
        engine.record_prefill_chunks = True
    return replica


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM drains the replica and then exits cleanly (status 0)."""

    def __init__(self, config: uvicorn.Config, replica: Replica) -> None:
        super().__init__(config)
        self.replica = replica
        self.drain_task: asyncio.Task[int] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.drain_task is None:
            loop = asyncio.get_event_loop()
            self.drain_task = loop.create_task(self._drain())
            return
        super().handle_exit(sig, frame)

    async def _drain(self) -> int:
        aborted = await self.replica.drain()
        self.should_exit = True
        return aborted


# The engine thread and the event loop share the GIL. With CPython's default 5 ms switch interval, a
# request that arrives while the engine thread runs Python code waits up to 5 ms for the loop to parse
# it; 0.5 ms keeps that hand-off small against a ~50 ms TTFT.
GIL_SWITCH_INTERVAL_S = 0.0005


def run(model: str, engine_config: EngineConfig, server_config: ServerConfig,
        tracing: TracingConfig | None = None) -> int:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    replica = build_replica(model, engine_config, server_config, tracing)
    replica.engine.start()
    app = create_app(replica)
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=5, lifespan="off")
    server = DrainingServer(config, replica)
    # Everything built so far (model, tokenizer, KV block tables, the app) lives as long as the process:
    # out of the collector's reach, a full collection scans only what requests allocate, instead of
    # pausing the engine and the event loop for 100 ms or more every half minute under load.
    gc.freeze()
    engine = replica.engine.engine  # its kernel and packed weights: "on", "unavailable: ..."; None: off
    kernel, packed = engine.cpu_decode_kernel, engine.packed_weights
    logger.warning("[%s] serving %s on http://%s:%d (zone %s, device %s%s%s)", server_config.replica_id,
                   replica.model_name, server_config.host, server_config.port, server_config.zone,
                   replica.device_kind, "" if kernel is None else f", CPU decode kernel {kernel}",
                   "" if packed is None else f", packed weights {packed}")
    try:
        server.run()
    finally:
        replica.engine.stop()
        if replica.tracing is not None:
            replica.tracing.shutdown()  # the spans still buffered go out before the process exits
    return 0
