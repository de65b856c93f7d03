"""The exit codes of ``controlplane``, and the one place where an error becomes one.

=====  ==================================================================================================
code   meaning
=====  ==================================================================================================
0      done
1      refused or failed: the control plane (or a local check) refused the request, or it failed; one
       line on stderr says why (``controlplane: HTTP 409: ...``)
2      usage: the command line is wrong (an unknown option, a bad ``NAME=VALUE``, options that exclude
       each other); nothing was sent
3      the control plane cannot be reached at ``--url``
=====  ==================================================================================================

The kinds of the error tree (``controlplane.errors``, ``chaos.errors``) all refuse with 1; the client's
:class:`~controlplane.client.Unreachable` is 3; :class:`UsageError` (and argparse's own errors) 2.
"""

from __future__ import annotations

from chaos.errors import ChaosError
from controlplane.client import Unreachable
from controlplane.errors import ControlPlaneError, Refused

DONE, FAILED, USAGE, UNREACHABLE = 0, 1, 2, 3
EPILOG = ("exit codes: 0 done; 1 refused or failed (one line on stderr says why); 2 usage: a bad command "
          "line, nothing was sent; 3 the control plane cannot be reached at --url")
FAILURES = (ControlPlaneError, ChaosError, OSError)  # what a command may end with; anything else is a bug


class UsageError(Refused):
    """A bad command line that argparse cannot see (a malformed ``NAME=VALUE``, options that exclude each
    other); nothing was sent."""


def exit_code(exc: Exception) -> int:
    """The exit code of a command that ended with ``exc`` (one of ``FAILURES``)."""
    if isinstance(exc, UsageError):
        return USAGE
    if isinstance(exc, Unreachable):
        return UNREACHABLE
    return FAILED


__all__ = ["DONE", "EPILOG", "FAILED", "FAILURES", "UNREACHABLE", "USAGE", "UsageError", "exit_code"]
