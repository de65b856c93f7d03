"""The Latency page's slowest-requests table names each request's OpenTelemetry trace, so that an SRE can
open it in a tracing backend; a request whose spans were not exported shows a dash."""

from __future__ import annotations

from typing import Any

from controlplane.client import Trace
from dashboards.app import ConsoleConfig, create_console

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def trace(request_id: str, trace_id: str | None) -> Trace:
    return Trace(request_id=request_id, started_at=1_700_000_000.0, endpoint="/v1/completions",
                 model="default", status=200, replica_id="r1", zone="az-a", priority="standard",
                 prompt_tokens=10, output_tokens=20, ttft_s=0.05, e2e_s=2.0, gateway_s=0.001, queue_s=0.01,
                 prefill_s=0.02, decode_s=1.9, detokenize_s=None, serialize_s=0.001, trace_id=trace_id)


def text(component: Any) -> str:
    """The text a browser would show for a Dash component tree."""
    children = getattr(component, "children", component)
    if isinstance(children, (list, tuple)):
        return " | ".join(text(c) for c in children)
    return str(children) if children is not None else ""


def test_the_slowest_requests_table_shows_the_trace_id() -> None:
    create_console("http://127.0.0.1:1", ConsoleConfig(secret="s" * 32))  # registers the pages
    from dashboards.pages.latency import _slowest

    head, traced, untraced = _slowest((trace("req-1", TRACE_ID), trace("req-2", None)))
    assert text(head).endswith("trace id")
    assert text(traced).endswith(TRACE_ID)
    assert "req-1" in text(traced) and text(untraced).endswith("–")
