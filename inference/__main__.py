"""``python -m inference``: run one replica's engine from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from inference.config import EngineConfig, TracingConfig
from inference.sampling_params import SamplingParams
from inference.secret_options import secret_option
from inference.server import ServerConfig

API_KEY_ENV = "INFERENCE_API_KEY"
ADMIN_TOKEN_ENV = "INFERENCE_ADMIN_TOKEN"


def _default(cls: type, name: str) -> object:
    """A dataclass field's default (slots dataclasses hide it behind a descriptor on the class)."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (built on first use) or a Hugging Face folder")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda[:N] or npu[:N]")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    p.add_argument("--max-num-seqs", type=int, default=_default(EngineConfig, "max_num_seqs"))
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=_default(EngineConfig, "max_num_batched_tokens"))
    p.add_argument("--decode-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay pure-decode steps as CUDA graphs, captured at start (default: on with CUDA)")
    p.add_argument("--cpu-decode-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="on a CPU, decode attention by the C++ paged kernel, built once per machine on first "
                        "use (20-40 s); where it cannot run, a logged reason and the torch path (default: "
                        "on where it applies)")
    p.add_argument("--packed-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="on a CPU, the linear weights laid out once at load, in the C++ kernel's blocks "
                        "where it runs the dtype, else for oneDNN (float32 or bfloat16); where they cannot "
                        "be, a logged reason and torch's linear (default: on where it applies)")


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        num_threads=getattr(args, "num_threads", 0), decode_graphs=args.decode_graphs,
                        cpu_decode_kernel=args.cpu_decode_kernel, pack_linear_weights=args.packed_weights)


def _generate(args: argparse.Namespace) -> int:
    from inference.engine import LLMEngine

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    engine = LLMEngine(args.model, _engine_config(args))
    prompt = args.prompt
    if not args.raw:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    engine.add_request("cli", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            final = out
    sys.stdout.write("\n")
    if final is not None:
        m = final.metrics
        print(f"[{len(final.output_token_ids)} tokens, finish_reason={final.finish_reason}, "
              f"ttft={m.ttft * 1000:.1f} ms, decode={m.decode_time * 1000:.1f} ms, "
              f"device={engine.device.torch_device}]", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.cpus:  # before torch starts a thread: every thread inherits the main thread's CPUs
        os.sched_setaffinity(0, args.cpus)
    limit = None
    if args.cpu_limit is not None:  # likewise: a thread started before joining would run unlimited
        from inference.cpu_limit import CpuLimitUnavailable, join
        try:
            limit = join(args.cpu_limit)
        except CpuLimitUnavailable as exc:
            print(f"error: --cpu-limit: unavailable: {exc}", file=sys.stderr)
            return 2
    try:
        return _run_replica(args)
    finally:
        if limit is not None:
            limit.leave()


def _run_replica(args: argparse.Namespace) -> int:
    from inference.replica import run
    api_key = secret_option(value=args.api_key, file=args.api_key_file, env=os.environ,
                            env_name=API_KEY_ENV, option="--api-key")
    admin_token = secret_option(value=args.admin_token, file=args.admin_token_file, env=os.environ,
                                env_name=ADMIN_TOKEN_ENV, option="--admin-token")
    server = ServerConfig(replica_id=args.replica_id, zone=args.zone, host=args.host, port=args.port,
                          served_model_name=args.served_model_name or "", api_key=api_key,
                          admin_token=admin_token, max_waiting_requests=args.max_waiting_requests,
                          max_waiting_tokens=args.max_waiting_tokens, max_body_bytes=args.max_body_bytes,
                          drain_timeout_s=args.drain_timeout,
                          ready_deadline_s=args.ready_deadline, stall_seconds=args.stall_seconds)
    tracing = TracingConfig(args.otlp_traces_endpoint, args.otlp_sample_ratio)
    return run(args.model, _engine_config(args), server, tracing)


def _kernel(_args: argparse.Namespace) -> int:
    """Exit 0 with "CPU decode kernel: on", or 0 with "unavailable: <why>" (replicas then run the torch
    path, so the machine is still usable): a build step must not fail a machine without a compiler."""
    from inference.cpu_attention import load_cpu_decode_kernel

    print("CPU decode kernel: building or loading (the first build on a machine takes 20-40 s)", flush=True)
    kernel, why = load_cpu_decode_kernel()
    print(f"CPU decode kernel: {'on' if kernel is not None else f'unavailable: {why}'}")
    return 0


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8101)
    p.add_argument("--replica-id", default="replica-0")
    p.add_argument("--zone", default="local")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None,
                   help=f"require this bearer key on /v1 (visible in ps: prefer --api-key-file or "
                        f"${API_KEY_ENV}; default: none)")
    p.add_argument("--api-key-file", default=None, help="read the API key from this file's first line")
    p.add_argument("--admin-token", default=None,
                   help=f"enables /admin/faults with this bearer token (visible in ps: prefer "
                        f"--admin-token-file or ${ADMIN_TOKEN_ENV})")
    p.add_argument("--admin-token-file", default=None,
                   help="read the admin token from this file's first line")
    p.add_argument("--max-waiting-requests", type=int, default=_default(ServerConfig, "max_waiting_requests"))
    p.add_argument("--max-waiting-tokens", type=int, default=_default(ServerConfig, "max_waiting_tokens"))
    p.add_argument("--max-body-bytes", type=int, default=_default(ServerConfig, "max_body_bytes"),
                   help="larger request bodies get 413, refused from Content-Length before reading")
    p.add_argument("--drain-timeout", type=float, default=_default(ServerConfig, "drain_timeout_s"))
    p.add_argument("--ready-deadline", type=float, default=_default(ServerConfig, "ready_deadline_s"))
    p.add_argument("--stall-seconds", type=float, default=_default(ServerConfig, "stall_seconds"))
    p.add_argument("--num-threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--otlp-traces-endpoint", default="", metavar="URL",
                   help="export OpenTelemetry spans of every request over OTLP/HTTP to this URL, e.g. "
                        "http://127.0.0.1:4318/v1/traces (default: off)")
    p.add_argument("--otlp-sample-ratio", type=float, default=_default(TracingConfig, "sample_ratio"),
                   help="share of new traces sampled; a request with a traceparent follows its parent")
    p.add_argument("--cpus", type=cpu_list, default=None,
                   help="run on these CPUs only, e.g. 2-3 or 0,4 (default: wherever the scheduler puts it)")
    p.add_argument("--cpu-limit", type=float, default=None, metavar="CORES",
                   help="at most this much CPU time per second, e.g. 0.75 (a cgroup's CFS quota, as a "
                        "container's CPU limit; needs root or a delegated cgroup; default: no limit)")


def cpu_list(text: str) -> set[int]:
    """``0,2-3`` -> {0, 2, 3}: CPUs this machine lets the process use."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CPUs like 0,2-3, got {text!r}") from None
    usable = os.sched_getaffinity(0)
    if not cpus or not cpus <= usable:
        raise argparse.ArgumentTypeError(f"CPUs {text!r} are not among the usable {sorted(usable)}")
    return cpus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt and print it")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    _engine_args(gen)
    gen.set_defaults(func=_generate)
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API as one replica")
    _engine_args(srv)
    _serve_args(srv)
    srv.set_defaults(func=_serve)
    ker = sub.add_parser("kernel", help="build the CPU decode kernel for this machine now (replicas build it "
                                        "on first use otherwise) and say whether it runs")
    ker.set_defaults(func=_kernel)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
