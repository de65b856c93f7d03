"""Secrets on a command line: from a file or the environment, and a warning when one is given as an argument.

Every user of a machine can read every process's arguments (``ps``, ``/proc/<pid>/cmdline``), so a token
passed as ``--token VALUE`` is no longer a secret. Commands that take one (``controlplane --token``,
``python -m inference serve --api-key / --admin-token``) also take ``--*-file PATH`` and an environment
variable, and :func:`secret_option` picks the one given, warning on stderr when it was the argument.
"""

from __future__ import annotations

import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO


class SecretFileError(ValueError):
    """A secret file that cannot be used: missing, unreadable or empty."""


def read_secret_file(path: str | Path, *, warn: TextIO | None = None) -> str:
    """The secret in ``path``: its first line, stripped. A file others may read works, with a warning."""
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
        mode = stat.S_IMODE(file.stat().st_mode)
    except (OSError, UnicodeDecodeError) as exc:
        raise SecretFileError(f"{file}: cannot read the secret: {exc}") from exc
    secret = text.splitlines()[0].strip() if text.strip() else ""
    if not secret:
        raise SecretFileError(f"{file}: the file is empty")
    if mode & 0o077 and warn is not None:
        print(f"warning: {file} may be read by other users (mode {mode:04o}); chmod 600 it", file=warn)
    return secret


def argument_warning(option: str, env_name: str) -> str:
    return (f"warning: {option} on the command line can be read by every user of this machine (ps); "
            f"use {option}-file PATH or ${env_name} instead")


def secret_option(*, value: str | None, file: str | None, env: Mapping[str, str], env_name: str,
                  option: str, warn: TextIO | None = None) -> str | None:
    """The secret from ``option`` (warned about on ``warn``, stderr by default), ``option``-file, or
    ``$env_name``, in that order of precedence; None when none is given. Both the option and its file is a
    :class:`SecretFileError`."""
    warn = warn or sys.stderr
    if value is not None and file is not None:
        raise SecretFileError(f"give {option} or {option}-file, not both")
    if value is not None:
        print(argument_warning(option, env_name), file=warn)
        return value
    if file is not None:
        return read_secret_file(file, warn=warn)
    return env.get(env_name) or None
