"""``python -m dashboards --api URL``: serve the console (started by ``controlplane up``).

The session secret comes from ``$CONTROLPLANE_CONSOLE_SECRET`` (a random one when unset). The console
outlives the process that started it: when a control plane is killed with -9, its users keep the last
data with a banner that says the control plane is gone, and the next ``controlplane up`` adopts this
console (``controlplane.console``) and stops it with the rest at Ctrl-C. SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
import threading

from werkzeug.serving import make_server

from dashboards.app import ConsoleConfig, create_console

SECRET_ENV = "CONTROLPLANE_CONSOLE_SECRET"
log = logging.getLogger("dashboards")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dashboards", description=__doc__)
    p.add_argument("--api", default="http://127.0.0.1:8080", help="control plane REST API (%(default)s)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8050)
    p.add_argument("--refresh-s", type=float, default=3.0)
    p.add_argument("--session-ttl-s", type=float, default=3600.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request (and per poll)
    try:
        config = ConsoleConfig(
            secret=os.environ.get(SECRET_ENV) or secrets.token_urlsafe(32),
            host=args.host,
            port=args.port,
            refresh_s=args.refresh_s,
            session_ttl_s=args.session_ttl_s,
        )
    except ValueError as exc:
        print(f"dashboards: {exc}", file=sys.stderr)
        return 2
    app = create_console(args.api, config)
    try:
        server = make_server(args.host, args.port, app.server, threaded=True)
    except OSError as exc:
        print(f"dashboards: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    worker = threading.Thread(target=server.serve_forever, name="console-http", daemon=True)
    worker.start()
    log.info("console on http://%s:%s for the control plane at %s", args.host, args.port, args.api)
    stop.wait()
    server.shutdown()
    log.info("console stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
