"""A replica's spans for a non-streaming request are written however the request ends: finished, cut
off by its client (the server cancels the collecting task) or stopped by a dead engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from inference.async_engine import EngineDeadError
from inference.http_errors import HTTPError
from inference.output import RequestMetrics, RequestOutput
from inference.response_writer import ResponseWriter
from inference.sampling_params import SamplingParams
from inference.tracing import ReplicaTracing, RequestTrace, TracedRequest

REQUEST_SPAN = "text_completion default"


def traced_run() -> tuple[ResponseWriter, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = ReplicaTracing(provider, clock=time.monotonic)
    request = TracedRequest("completion", "default", "cmpl-1", SamplingParams(max_tokens=8), stream=False)
    # collect() reaches the metrics, the context and the logprobs only for a finished output
    nothing = cast(Any, None)
    run = ResponseWriter(nothing, "replica-0", "local", nothing, nothing, nothing,
                         trace=RequestTrace(tracing, Context(), request))
    return run, exporter


def first_output() -> RequestOutput:
    now = time.monotonic()
    metrics = RequestMetrics(arrival_time=now, first_scheduled_time=now, first_token_time=now,
                             last_token_time=now)
    return RequestOutput("cmpl-1", [1, 2, 3], [4], [], "", "", False, None, metrics)


def test_a_request_cut_off_by_its_client_still_exports_its_span() -> None:
    run, exporter = traced_run()
    produced = asyncio.Event()

    async def outputs() -> AsyncIterator[RequestOutput]:
        yield first_output()
        produced.set()
        await asyncio.Event().wait()  # the engine is still decoding when the client leaves
        yield first_output()

    async def main() -> None:
        task = asyncio.ensure_future(run.collect(outputs()))
        await asyncio.wait_for(produced.wait(), timeout=5)
        task.cancel()  # what the server does when the client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    (span,) = [s for s in exporter.get_finished_spans() if s.name == REQUEST_SPAN]
    assert span.attributes is not None and span.attributes["gen_ai.response.finish_reasons"] == ("abort",)


def test_a_request_stopped_by_a_dead_engine_still_exports_its_span() -> None:
    run, exporter = traced_run()

    async def outputs() -> AsyncIterator[RequestOutput]:
        yield first_output()
        raise EngineDeadError("the engine loop died")

    with pytest.raises(HTTPError):
        asyncio.run(run.collect(outputs()))
    assert [s.name for s in exporter.get_finished_spans() if s.name == REQUEST_SPAN] == [REQUEST_SPAN]
