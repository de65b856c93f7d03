"""``python -m inference.bench``: one subcommand per benchmark, each module's ``main(args)``.

Only the chosen subcommand's module is imported: ``serve`` (the load client the drills and the soak start
beside a busy fleet) needs no torch, and importing it took 1.4 s of CPU on a quiet machine, tens of
seconds on a cold, loaded one.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "offline": ("inference.bench.offline", "offline throughput: engine vs Hugging Face transformers"),
    "serve": ("inference.bench.serve", "drive an OpenAI-compatible server on loopback and measure it"),
    "replica": ("inference.bench.replica", "one real replica at three request rates, with the server's "
                "overhead against the engine alone"),
}


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in args_in if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="python -m inference.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(command)
            command.set_defaults(func=module.main)
    args = parser.parse_args(args_in)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
