"""One request's answer: the engine's outputs written out as a server-sent event stream or one JSON body.

Where it sits: :func:`inference.server.create_app`'s completion routes admit a request, start it in the
engine and hand its outputs to a :class:`ResponseWriter`, which writes them in the OpenAI shapes of
:mod:`inference.protocol`. Streamed (:meth:`~ResponseWriter.sse`): a chunk per piece of new text, with the
token ids a gateway needs to resume the stream elsewhere when ``return_token_ids`` asks, a usage chunk
when ``include_usage`` asks, then ``data: [DONE]``; a failure once the stream has started is an error
frame in it. Otherwise (:meth:`~ResponseWriter.collect`) one JSON body when the request finishes, or an
:class:`~inference.http_errors.HTTPError`. On the way it observes each token in the replica's metrics
(TTFT, inter-token latency), feeds the request's spans when traces are exported, sleeps the delays of a
coloured fault, and times its own serialization, which the ``timings`` extension field reports with the
engine's stage timings.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse

from inference.async_engine import EngineDeadError
from inference.http_errors import HTTPError
from inference.metrics import ReplicaMetrics
from inference.output import RequestOutput
from inference.protocol import (
    LogprobsView,
    ParsedRequest,
    ResponseContext,
    error_body,
    full_response,
    stream_chunk,
    usage_chunk,
)

if TYPE_CHECKING:  # the SDK is imported only when traces are exported (inference.replica)
    from inference.tracing import RequestTrace


@dataclass
class ResponseWriter:
    """One request's response: observes metrics per token and times serialization."""

    metrics: ReplicaMetrics
    replica_id: str
    zone: str
    ctx: ResponseContext
    parsed: ParsedRequest
    logprobs: LogprobsView
    serialize_seconds: float = 0.0
    previous_token_time: float | None = None
    trace: RequestTrace | None = None  # while traces are exported
    delays: tuple[float, float] = (0.0, 0.0)  # coloured faults: before the first token, before each later one

    def observe(self, out: RequestOutput) -> None:
        m = out.metrics
        if out.new_token_ids and m.last_token_time is not None:
            if self.previous_token_time is None:
                self.metrics.observe_token(True, m.ttft)
            else:
                self.metrics.observe_token(False, m.last_token_time - self.previous_token_time)
            self.previous_token_time = m.last_token_time
        if out.finished and out.error is None:
            self.metrics.observe_finished(out, max_tokens=self.parsed.params.max_tokens)
        if self.trace is not None:
            self.trace.seen(out)

    def timings(self, out: RequestOutput) -> dict[str, Any]:
        m = out.metrics
        return {"replica": self.replica_id, "zone": self.zone,
                "queue": m.queue_time, "prefill": m.prefill_time, "decode": m.decode_time,
                "detokenize": m.detokenize_seconds, "serialize": self.serialize_seconds, "ttft": m.ttft,
                "e2e": m.e2e_time, "cached_tokens": m.num_cached_tokens, "preemptions": m.num_preemptions}

    @staticmethod
    def add_token_ids(chunk: dict[str, Any], out: RequestOutput, *, first: bool) -> None:
        """The ``return_token_ids`` extension: what a gateway needs to resume this stream elsewhere."""
        chunk["choices"][0]["token_ids"] = out.new_token_ids
        if first:
            chunk["prompt_token_ids"] = out.prompt_token_ids

    def encode(self, payload: dict[str, Any]) -> str:
        started = time.perf_counter()
        text = f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"
        self.serialize_seconds += time.perf_counter() - started
        return text

    async def collect(self, stream: AsyncIterator[RequestOutput]) -> JSONResponse:
        final = None
        try:
            async for out in stream:
                self.observe(out)
                final = out
        except EngineDeadError as exc:
            raise HTTPError(503, str(exc), type_="service_unavailable", code="engine_dead") from exc
        finally:  # the spans are written however it ends: finished, engine dead, cancelled by a disconnect
            if self.trace is not None:
                self.trace.end()
        assert final is not None
        if final.error:
            raise HTTPError(500, final.error, type_="server_error", code="device_failure")
        first, per_token = self.delays
        if first or per_token:
            await asyncio.sleep(first + per_token * max(len(final.output_token_ids) - 1, 0))
        started = time.perf_counter()
        body = full_response(self.ctx, final, logprobs=self.logprobs(final.logprobs))
        if self.parsed.return_token_ids:
            body["choices"][0]["token_ids"] = final.output_token_ids
            body["prompt_token_ids"] = final.prompt_token_ids
        self.serialize_seconds += time.perf_counter() - started
        body["timings"] = self.timings(final)
        return JSONResponse(body)

    async def sse(self, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        first = True
        try:
            async for out in stream:
                self.observe(out)
                if out.error:
                    yield self.encode(error_body(out.error, type_="server_error", code="device_failure"))
                    return
                if (out.delta_text or out.finished or first or out.new_logprobs
                        or self.parsed.return_token_ids):
                    pause = self.delays[0] if first else self.delays[1]
                    if pause:
                        await asyncio.sleep(pause)
                    reason = out.finish_reason if out.finished else None
                    chunk = stream_chunk(self.ctx, out.delta_text, reason, first=first,
                                         logprobs=self.logprobs(out.new_logprobs))
                    if self.parsed.return_token_ids:
                        self.add_token_ids(chunk, out, first=first)
                    first = False
                    if out.finished and not self.parsed.include_usage:
                        chunk["usage"] = None
                        chunk["timings"] = self.timings(out)
                    yield self.encode(chunk)
                if out.finished and self.parsed.include_usage:
                    chunk = usage_chunk(self.ctx, out)
                    chunk["timings"] = self.timings(out)
                    yield self.encode(chunk)
        except EngineDeadError as exc:
            yield self.encode(error_body(str(exc), type_="service_unavailable", code="engine_dead"))
            return
        yield "data: [DONE]\n\n"
