"""``controlplane up``'s wiring that runs without processes: the viewer token the control plane's own
Prometheus shows ``/metrics/state``, kept in a file only its owner may read and renewed at each start."""

from __future__ import annotations

import stat
from pathlib import Path

from controlplane.app import SCRAPE_TOKEN_NAME, write_scrape_token
from controlplane.auth import Principal, Role, TokenAuthority
from controlplane.store.database import Store


def test_the_scrape_token_is_a_private_viewer_token_renewed_at_each_start(tmp_path: Path) -> None:
    path = tmp_path / "state" / "prometheus" / "scrape.token"
    with Store(tmp_path / "state.db") as store:
        tokens = TokenAuthority(store)
        write_scrape_token(tokens, path)
        first = path.read_text()
        write_scrape_token(tokens, path)  # the next start
        second = path.read_text()

        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert tokens.verify(second) == Principal(SCRAPE_TOKEN_NAME, Role.VIEWER)
        assert first != second and tokens.verify(first) is None  # the previous start's token is revoked
