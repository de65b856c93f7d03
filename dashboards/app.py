"""The console's app factory: a Flask server with the session guard, and a multi-page Dash app on it.

Where it sits: ``python -m dashboards`` (started by ``controlplane up``) calls :func:`create_console` and
serves the result; every page reads the control plane through ``controlplane.client`` with the logged-in
user's token (see :mod:`dashboards.session`).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path

import dash
import flask

from dashboards import session

ASSETS = Path(__file__).resolve().parent / "assets"


@dataclass(slots=True, frozen=True)
class ConsoleConfig:
    """How the console runs; ``controlplane up`` passes its ``[console]`` section on the command line."""

    secret: str  # signs the session cookie; fresh for every start
    host: str = "127.0.0.1"
    port: int = 8050
    refresh_s: float = 3.0
    session_ttl_s: float = 3600.0
    extra_hosts: tuple[str, ...] = field(default_factory=tuple)  # more Host values to accept

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ValueError("the console secret must have at least 16 characters")
        if not 2 <= self.refresh_s <= 60:
            raise ValueError(f"refresh_s must be in [2, 60], got {self.refresh_s}")
        if self.session_ttl_s <= 0:
            raise ValueError(f"session_ttl_s must be > 0, got {self.session_ttl_s}")


def create_console(api_url: str, config: ConsoleConfig) -> dash.Dash:
    """The console for the control plane at ``api_url``."""
    server = flask.Flask("dashboards")
    server.secret_key = config.secret
    settings = session.AccessSettings(
        api_url=api_url,
        session_ttl_s=config.session_ttl_s,
        allowed_hosts=session.allowed_hosts(config.host, config.port, config.extra_hosts),
    )
    session.install(server, settings, session.SessionStore())
    app = dash.Dash(
        "dashboards",
        server=server,  # type: ignore[arg-type]  # Dash takes a Flask app here; its annotation does not say so
        use_pages=True,
        pages_folder="",
        title="LLM SRE console",
        assets_folder=str(ASSETS),
        suppress_callback_exceptions=True,
        update_title=None,  # type: ignore[arg-type]  # None turns the "Updating..." title off
        serve_locally=True,
    )
    # Imported after the app exists: register_page needs one. Each module of dashboards.pages is a page.
    from dashboards import pages, shell

    for module in pkgutil.iter_modules(pages.__path__):
        importlib.import_module(f"{pages.__name__}.{module.name}")
    app.layout = lambda: shell.layout(config.refresh_s)
    return app
