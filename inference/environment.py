"""What a child process inherits: this process's environment without its secrets.

Every spawner of the project (replicas, stress-ng, the drills' load client, Prometheus, the console) builds
its child's environment here. The control plane runs with its operators' credentials in the environment
(``CONTROLPLANE_ADMIN_TOKEN``, ``CONTROLPLANE_ADMIN_PASSWORD``, ``CONTROLPLANE_TOKEN``, ...); a child that
inherited them would hold them in ``/proc/<pid>/environ`` for its whole life, readable by anything running
as the same user and by whatever the child itself runs. A child that needs one secret gets that one,
explicitly, in ``extra``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

# Named exactly: the secrets this project reads from its environment.
SECRET_NAMES = frozenset({
    "CONTROLPLANE_ADMIN_TOKEN", "CONTROLPLANE_ADMIN_PASSWORD", "CONTROLPLANE_TOKEN", "CONTROLPLANE_USERS",
    "CONTROLPLANE_CONSOLE_SECRET", "INFERENCE_API_KEY", "INFERENCE_ADMIN_TOKEN",
})
# And by the shape of their name: other tools' tokens, passwords and keys (HF_TOKEN, AWS_SECRET_ACCESS_KEY).
_SECRET_SHAPE = re.compile(r"TOKEN|PASSWORD|PASSWD|SECRET|API_?KEY|CREDENTIAL", re.IGNORECASE)


def is_secret(name: str) -> bool:
    """Whether an environment variable called ``name`` is withheld from children."""
    return name in SECRET_NAMES or _SECRET_SHAPE.search(name) is not None


def child_environment(extra: Mapping[str, str] | None = None, *,
                      base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: ``os.environ``) without any secret, plus ``extra`` (which may name one on
    purpose, e.g. a replica's own admin token)."""
    source = os.environ if base is None else base
    env = {name: value for name, value in source.items() if not is_secret(name)}
    env.update(extra or {})
    return env
