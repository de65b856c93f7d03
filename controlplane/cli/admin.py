"""``controlplane admin reset-token``: break-glass recovery of admin access, on the control plane's host.

The first admin token is printed once; a lost one cannot be read back (the store keeps only hashes) and a
new ``CONTROLPLANE_ADMIN_TOKEN`` is ignored while any admin token is live. This command needs no token: it
opens the store in the state folder directly, and its authority is the folder's file permissions. It
refuses unless the state folder and ``controlplane.db`` belong to the user running it and no one else may
write them. It issues a new admin token (``break-glass-<UTC time>``), revokes the first admin's token
(``--revoke bootstrap``, the default), every other admin token (``--revoke all``) or none, audits it as
``local:<user>`` (action ``token.reset``), and prints the new token once on stdout. A running control plane
honours the change at once: it reads tokens from the store on every request.
"""

from __future__ import annotations

import argparse
import getpass
import sys

from controlplane.auth import BREAK_GLASS_REVOKES, Auditor, Principal, Role, TokenAuthority
from controlplane.config import load_config
from controlplane.store.database import Store
from controlplane.store.files import require_private

SUMMARY = "break-glass on the host: issue a new admin token from the state folder (no token needed)"
DATABASE = "controlplane.db"


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    actions = cmd.add_subparsers(dest="action", required=True)
    reset = actions.add_parser("reset-token", help="issue a new admin token; revoke the lost one",
                               description=__doc__.split("\n\n")[1] if __doc__ else None)
    reset.add_argument("--config", default=None, help="the TOML file `controlplane up` runs with (its "
                                                      "state_dir); default: $LLMSRE_STATE_DIR or "
                                                      "~/.local/state/llm-sre")
    reset.add_argument("--revoke", choices=BREAK_GLASS_REVOKES, default="bootstrap",
                       help="revoke the first admin's token (default), every admin token, or none")


def run(args: argparse.Namespace) -> int:
    state = load_config(args.config).state_path
    database = state / DATABASE
    require_private(state, database)
    user = getpass.getuser()
    with Store(database) as store:
        name, secret, revoked = TokenAuthority(store).break_glass(revoke=args.revoke)
        Auditor(store).record(Principal(f"local:{user}", Role.ADMIN), "token.reset", name,
                              {"revoke": args.revoke, "revoked": revoked}, "ok",
                              detail=f"controlplane admin reset-token on the host, state folder {state}")
    gone = ", ".join(revoked) if revoked else "none"
    print(f"new admin token {name} (shown once; export CONTROLPLANE_TOKEN=... or keep it in a 0600 file "
          f"for --token-file); revoked: {gone}", file=sys.stderr)
    print(secret)
    return 0
