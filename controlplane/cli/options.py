"""What every ``controlplane`` command shares: ``--url`` and ``--token`` / ``--token-file`` (before the
command or after any sub-command), the API client they make, and ``--json`` output.

The token comes from ``--token-file PATH``, ``$CONTROLPLANE_TOKEN``, or ``--token`` (which every user of the
machine can read in ``ps``: it works, with a warning on stderr); :func:`resolve_token` picks it once.

``main`` puts an injectable transport on the parsed arguments (``args.transport``), so that tests drive the
CLI against an in-process API.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from controlplane.cli.exits import UsageError
from controlplane.client import DEFAULT_URL, TOKEN_ENV, ControlPlaneClient, as_json
from inference.secret_options import SecretFileError, argument_warning, read_secret_file

URL_ENV = "CONTROLPLANE_URL"
ARGV_WARNING = argument_warning("--token", TOKEN_ENV)
T = TypeVar("T")


def add_connection_options(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """``--url`` and ``--token``; with ``defaults`` False (on sub-commands) an option left out keeps the
    value given before the command, or the default."""
    url_default: Any = os.environ.get(URL_ENV, DEFAULT_URL) if defaults else argparse.SUPPRESS
    token_default: Any = None if defaults else argparse.SUPPRESS
    parser.add_argument("--url", default=url_default,
                        help=f"REST API address (default: ${URL_ENV} or {DEFAULT_URL})")
    parser.add_argument("--token", default=token_default, action=_Token,
                        help=f"API token; visible to every user in ps: prefer --token-file or ${TOKEN_ENV} "
                             "(--token=VALUE when it starts with '-')")
    parser.add_argument("--token-file", default=token_default, metavar="PATH", action=_TokenFile,
                        help=f"read the API token from this file's first line (default: ${TOKEN_ENV})")


class _Token(argparse.Action):
    """``--token VALUE``: replaces a ``--token-file`` given before it, and is remembered for the warning."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        namespace.token, namespace.token_file, namespace.token_on_argv = values, None, True


class _TokenFile(argparse.Action):
    """``--token-file PATH``: replaces a ``--token`` given before it (read once the line is parsed)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        namespace.token, namespace.token_file = None, values


def sub_commands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every sub-command below ``parser``, at any depth, as (its name, its parser)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from sub_commands(sub)


def add_connection_options_below(parser: argparse.ArgumentParser, *, skip: frozenset[str] = frozenset()
                                 ) -> None:
    """``--url`` and ``--token`` on every sub-command below ``parser`` (at any depth), except below the
    top-level commands named in ``skip`` (those that never talk to the API)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if name not in skip:
                    add_connection_options(sub, defaults=False)
                    for _, below in sub_commands(sub):
                        add_connection_options(below, defaults=False)


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the same data as JSON")


def resolve_token(args: argparse.Namespace) -> None:
    """Put the token the command line names into ``args.token``: the last of ``--token`` and
    ``--token-file`` given (after the command wins over before it), read from its file; the client falls
    back to ``$CONTROLPLANE_TOKEN`` when neither is given. A ``--token`` anywhere on the line is warned
    about on stderr: ``ps`` shows it, whichever token is used."""
    if getattr(args, "token_on_argv", False):
        print(ARGV_WARNING, file=sys.stderr)
    file = getattr(args, "token_file", None)
    if file is None:
        return
    try:
        args.token = read_secret_file(file, warn=sys.stderr)
    except SecretFileError as exc:
        raise UsageError(str(exc)) from exc


def client(args: argparse.Namespace) -> ControlPlaneClient:
    return ControlPlaneClient(args.url, args.token, transport=getattr(args, "transport", None))


def print_json(value: Any) -> None:
    """Typed records (or lists of them) as indented JSON on stdout."""
    json.dump(as_json(value), sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def show(args: argparse.Namespace, value: T, table: Callable[[T], object]) -> None:
    """``value`` as JSON with ``--json``, else as ``table`` prints it."""
    if getattr(args, "json", False):
        print_json(value)
    else:
        table(value)
