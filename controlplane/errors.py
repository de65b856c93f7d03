"""The control plane's one error tree: a root and the few kinds that tell a caller what to do.

Every error the control plane raises on purpose derives from :class:`ControlPlaneError` through one of the
kinds below (a module's own class adds the kind as a base, and ``ValueError`` / ``KeyError`` where existing
callers catch those). The kinds are mapped once to HTTP, in ``controlplane.api.errors``, and once to exit
codes, in ``controlplane.cli.exits``:

======================  =====================================================  ====  =========
kind                    what the caller should do                              HTTP  exit code
======================  =====================================================  ====  =========
:class:`Refused`        fix the request (``param`` names the field)            400   1
:class:`Conflict`       look at the current state first: the request           409   1
                        contradicts it (a drill is running, a duplicate name)
:class:`NotFound`       check the id: nothing has it                           404   1
:class:`Forbidden`      use a token of a bigger role                           403   1
:class:`Unavailable`    retry later (``retry_after_s`` when known)             503   1 (3 when the
                                                                                      control plane
                                                                                      cannot be reached)
:class:`RateLimited`    slow down: try again after ``retry_after_s`` (too      429   1
                        many failed logins from this client or for this user)
======================  =====================================================  ====  =========

A :class:`ControlPlaneError` of no kind is a failure of the control plane itself (HTTP 500, exit 1).
``chaos`` keeps its own root with the same kinds (``chaos.errors``); the API maps both.
"""

from __future__ import annotations


class ControlPlaneError(Exception):
    """The root: a failure the control plane understands. ``message`` is for a person; ``param`` names the
    request field to blame and ``subject`` what the error is about (a replica, drill or schedule id), where
    one is known."""

    def __init__(self, message: str, *, param: str | None = None, subject: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.subject = subject


class Refused(ControlPlaneError):
    """Bad input: the request cannot be carried out as given; fix it and send it again (HTTP 400)."""


class Conflict(ControlPlaneError):
    """The request contradicts the current state (one drill at a time, a duplicate name, a halted fault
    manager); sending it again unchanged fails again until the state changes (HTTP 409)."""


class NotFound(ControlPlaneError):
    """Nothing has the id the request names (HTTP 404)."""


class Forbidden(ControlPlaneError):
    """The caller's role may not do this (HTTP 403)."""


class Unavailable(ControlPlaneError):
    """A dependency is down or busy; the same request may succeed later, after ``retry_after_s`` when that
    is known (HTTP 503 with ``Retry-After``)."""

    def __init__(self, message: str, *, retry_after_s: float | None = None, param: str | None = None,
                 subject: str | None = None) -> None:
        super().__init__(message, param=param, subject=subject)
        self.retry_after_s = retry_after_s


class RateLimited(ControlPlaneError):
    """The caller tried too often (failed logins); the same request is refused until ``retry_after_s`` has
    passed (HTTP 429 with ``Retry-After``)."""

    def __init__(self, message: str, *, retry_after_s: float, param: str | None = None,
                 subject: str | None = None) -> None:
        super().__init__(message, param=param, subject=subject)
        self.retry_after_s = retry_after_s


KINDS: tuple[type[ControlPlaneError], ...] = (Refused, Conflict, NotFound, Forbidden, Unavailable,
                                              RateLimited)

__all__ = ["KINDS", "Conflict", "ControlPlaneError", "Forbidden", "NotFound", "RateLimited", "Refused",
           "Unavailable"]
