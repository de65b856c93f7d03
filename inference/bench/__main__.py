"""``python -m inference.bench``: one subcommand per benchmark, each module's ``main(args)``."""

from __future__ import annotations

import argparse
import sys

from inference.bench import offline, replica, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    offline_parser = sub.add_parser("offline", help="offline throughput: engine vs Hugging Face transformers")
    offline.add_arguments(offline_parser)
    offline_parser.set_defaults(func=offline.main)
    serve_parser = sub.add_parser("serve",
                                  help="drive an OpenAI-compatible server on loopback and measure it")
    serve.add_arguments(serve_parser)
    serve_parser.set_defaults(func=serve.main)
    replica_parser = sub.add_parser("replica", help="one real replica at three request rates, with the "
                                    "server's overhead against the engine alone")
    replica.add_arguments(replica_parser)
    replica_parser.set_defaults(func=replica.main)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
