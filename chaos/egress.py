"""Where an experiment's ``http`` providers may send requests when a server runs them.

An experiment posted to the control plane runs inside it: an ``http`` probe is a request *from the control
plane*, and its status, headers and body land in a journal that viewers read. Without a rule that is a
server-side request forgery: any operator could make the control plane fetch an internal address and read
the answer back. :class:`HostAllowList` is the rule: a request goes out only to a listed ``host:port`` (or
``host``, any port). The control plane lists its own listeners (API, gateway, Prometheus) and its
replicas, on loopback, plus the hosts its configuration names; everything else is refused before a byte is
sent. Hosts are compared as written, never resolved: ``127.0.0.1`` and ``localhost`` are two entries, and a
name that merely resolves to a listed address is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

import httpx

DEFAULT_PORTS = {"http": 80, "https": 443}
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")

Entry = tuple[str, int | None]  # (host, port); None: any port


def parse_entry(text: str) -> Entry:
    """``host``, ``host:port`` or ``[v6]:port`` as (lowercased host, port or None); ValueError otherwise."""
    raw = text.strip()
    if not raw or "/" in raw or "@" in raw or "://" in raw:
        raise ValueError(f"not a host or host:port: {text!r}")
    try:
        parts = urlsplit(f"//{raw}")
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise ValueError(f"not a host or host:port: {text!r} ({exc})") from exc
    if not host:
        raise ValueError(f"not a host or host:port: {text!r}")
    return host.lower(), port


class HostAllowList:
    """Hosts an experiment's requests may reach: fixed ``entries`` plus ``dynamic()`` ones, read at every
    check (replicas come and go and change ports)."""

    def __init__(self, entries: Iterable[str] = (),
                 dynamic: Callable[[], Iterable[str]] | None = None) -> None:
        self._entries = frozenset(parse_entry(e) for e in entries)
        self._dynamic = dynamic

    def entries(self) -> frozenset[Entry]:
        found = set(self._entries)
        if self._dynamic is not None:
            found.update(parse_entry(e) for e in self._dynamic())
        return frozenset(found)

    def refusal(self, url: str | httpx.URL) -> str | None:
        """Why a request to ``url`` must not go out; None when the URL's host and port are listed."""
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, TypeError) as exc:
            return f"not a URL: {exc}"
        if parsed.scheme not in DEFAULT_PORTS or not parsed.host:
            return "only http and https URLs with a host may be requested"
        host, port = parsed.host.lower(), parsed.port or DEFAULT_PORTS[parsed.scheme]
        allowed = self.entries()
        if (host, port) in allowed or (host, None) in allowed:
            return None
        return (f"{host}:{port} is not an allowed host for experiments (the control plane's own listeners, "
                "its replicas, and chaos.experiment_hosts in its configuration)")


def host_entry(host: str, port: int) -> str:
    """``host:port`` as an entry (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def loopback_entries(ports: Iterable[int]) -> list[str]:
    """``host:port`` entries for every loopback name of each port."""
    return [host_entry(name, port) for port in sorted(set(ports)) for name in LOOPBACK_NAMES]
