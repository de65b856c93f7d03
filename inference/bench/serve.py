"""``python -m inference.bench serve``: drive an OpenAI-compatible server and measure what a client sees.

Data flow: ``datasets.build_requests`` -> an arrival schedule (Poisson, trace timestamps, or a closed loop
of C workers) -> one streaming HTTP request per ``BenchRequest`` -> one ``RequestRecord`` each ->
``report.summarize`` -> table, ``--result-json`` and per-request ``--jsonl``.

This module is the command line only: its arguments become a ``LoadConfig``
(:mod:`inference.bench.load_config`), :func:`inference.bench.load_client.run_load` sends the load, and
:mod:`inference.bench.report` prints and writes the result. A library first: drills call ``run_load`` and
read the records; ``main`` is a thin CLI over it, started by ``python -m inference.bench`` (``__main__``).

Safety: the target must be a loopback address. This tool generates load; it never sends it elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from inference.bench.datasets import (
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_VOCAB_SIZE,
    DatasetConfig,
)
from inference.bench.load_client import run_load
from inference.bench.load_config import (
    COMPLETIONS,
    DEFAULT_BASE_URL,
    ENDPOINTS,
    BenchError,
    LoadConfig,
)
from inference.bench.report import (
    KINDS,
    Slo,
    format_table,
    write_jsonl,
    write_result_json,
)

__all__ = [
    "add_arguments",
    "config_from_args",
    "main",
    "parse_mix",
]


def parse_mix(text: str) -> dict[str, float]:
    """``stream=0.7,plain=0.15,cancel=0.1,bad=0.05`` -> shares by kind (ValueError naming ``--mix``)."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--mix: expected KIND=SHARE, got {part!r}") from None
        if not sep or name.strip() not in KINDS:
            raise ValueError(f"--mix: expected KIND=SHARE with KIND one of {', '.join(KINDS)}, got {part!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("target (loopback only)")
    target.add_argument("--base-url", default=DEFAULT_BASE_URL)
    target.add_argument("--endpoint", default=COMPLETIONS, choices=ENDPOINTS)
    target.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    target.add_argument("--api-key", default=None, help="sent as a Bearer token")

    data = p.add_argument_group("dataset")
    data.add_argument("--dataset", default="random", help="'random' or 'trace:FILE' (Azure LLM trace CSV)")
    data.add_argument("--num-requests", type=int, default=None, help="required for random; a cap for traces")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--input-len", type=int, default=DEFAULT_INPUT_LEN)
    data.add_argument("--output-len", type=int, default=DEFAULT_OUTPUT_LEN)
    data.add_argument("--range-ratio", type=float, default=0.0,
                      help="lengths uniform in len * [1 - r, 1 + r]")
    data.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                      help="random prompt token ids are drawn below this")
    data.add_argument("--time-scale", type=float, default=1.0, help="trace replay speed-up (10: 10x faster)")
    data.add_argument("--token-scale", type=float, default=1.0, help="multiplies trace lengths (min 1 token)")
    data.add_argument("--max-input-len", type=int, default=None)
    data.add_argument("--max-output-len", type=int, default=None)
    data.add_argument("--trace-start", type=float, default=0.0, help="seconds into the trace")
    data.add_argument("--trace-duration", type=float, default=None, help="seconds of the trace to replay")

    load = p.add_argument_group("arrivals and bounds")
    load.add_argument("--request-rate", type=float, default=None,
                      help="Poisson arrivals per second ('inf': all at once); default: trace timestamps "
                           "for traces, all at once for random")
    load.add_argument("--concurrency", type=int, default=None, help="closed loop with C workers")
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    load.add_argument("--duration", type=float, default=None,
                      help="stop sending after S seconds; in-flight requests are cancelled at S + grace")
    load.add_argument("--grace", type=float, default=5.0)
    load.add_argument("--request-timeout", type=float, default=300.0)
    load.add_argument("--mix", type=parse_mix, default=None, metavar="KIND=SHARE,...",
                      help="a mixed load: shares of stream, plain (not streamed), cancel (the client leaves "
                      "after --cancel-after tokens) and bad (invalid on purpose: must get a 4xx), e.g. "
                      "stream=0.7,plain=0.15,cancel=0.1,bad=0.05 (default: streams only)")
    load.add_argument("--cancel-after", type=int, default=1, help="tokens a cancel request reads")
    load.add_argument("--token-ids", action="store_true",
                      help="ask for each chunk's token ids (return_token_ids): every token counts when it "
                      "arrives, also one whose text is still empty (a byte of a character, frequent with "
                      "the bundled random models), so TTFT and TPOT time tokens rather than visible text")

    out = p.add_argument_group("report")
    out.add_argument("--slo", default=None, help="goodput SLOs in ms, as in ttft=500,tpot=100 (also e2el)")
    out.add_argument("--result-json", type=Path, default=None, help="write the summary here")
    out.add_argument("--jsonl", type=Path, default=None, help="write one line per request here")
    out.add_argument("--no-progress", action="store_true")


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    dataset = DatasetConfig(
        name=args.dataset, num_requests=args.num_requests, seed=args.seed, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio, vocab_size=args.vocab_size,
        time_scale=args.time_scale, token_scale=args.token_scale, max_input_len=args.max_input_len,
        max_output_len=args.max_output_len, trace_start=args.trace_start, trace_duration=args.trace_duration)
    return LoadConfig(
        dataset=dataset, base_url=args.base_url, endpoint=args.endpoint, model=args.model,
        api_key=args.api_key, request_rate=args.request_rate, concurrency=args.concurrency,
        max_concurrency=args.max_concurrency, duration=args.duration, grace=args.grace,
        request_timeout=args.request_timeout, slo=None if args.slo is None else Slo.parse(args.slo),
        mix=args.mix, cancel_after=args.cancel_after, token_ids=args.token_ids)


def _say_progress_on_stderr() -> None:
    """The run's milestones (asking for the model, sending, the hard stop) as timestamped lines on
    stderr: a drill that starts this client reads them to say why its load did not start."""
    log = logging.getLogger(run_load.__module__)  # the load client's logger, where run_load writes them
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s load client: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def main(args: argparse.Namespace) -> int:
    """Run the load of ``args`` and print its table; 2 on a bad configuration, 1 when it cannot start."""
    try:
        cfg = config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from tqdm import tqdm  # type: ignore[import-untyped]

    bar = tqdm(desc="requests", unit="req", file=sys.stderr,
               disable=args.no_progress or not sys.stderr.isatty())

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    _say_progress_on_stderr()
    try:
        report = asyncio.run(run_load(cfg, progress=progress))
    except (BenchError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        bar.close()
    print(format_table(report))
    if args.result_json is not None:
        write_result_json(report, args.result_json)
    if args.jsonl is not None:
        write_jsonl(report.records, args.jsonl)
    return 0
