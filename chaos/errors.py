"""chaos's error tree: a root and the same few kinds as the control plane's (``controlplane.errors``),
which chaos may not import. Faults, experiments and drills derive their errors from these kinds; the
control plane's API maps them to HTTP next to its own (400, 409, 404, 403, 503).

A :class:`ChaosError` of no kind is a failure (a fault that could not be injected or reverted, a drill
that could not finish); its message says what and why.
"""

from __future__ import annotations


class ChaosError(Exception):
    """The root. ``param`` names the experiment or request field to blame and ``subject`` what the error is
    about (a replica, a fault, a drill), where one is known."""

    def __init__(self, message: str, *, param: str | None = None, subject: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.subject = subject


class Refused(ChaosError):
    """Bad input (an experiment, a fault spec, a kind that cannot run here): fix it and send it again."""


class Conflict(ChaosError):
    """The request contradicts the current state (halted, over the blast radius, one drill at a time)."""


class NotFound(ChaosError):
    """Nothing has the id the request names."""


class Forbidden(ChaosError):
    """The caller may not do this."""


class Unavailable(ChaosError):
    """Something the run needs is down or not there yet; the same request may succeed later."""

    def __init__(self, message: str, *, retry_after_s: float | None = None, param: str | None = None,
                 subject: str | None = None) -> None:
        super().__init__(message, param=param, subject=subject)
        self.retry_after_s = retry_after_s


KINDS: tuple[type[ChaosError], ...] = (Refused, Conflict, NotFound, Forbidden, Unavailable)

__all__ = ["KINDS", "ChaosError", "Conflict", "Forbidden", "NotFound", "Refused", "Unavailable"]
