"""The ``[console]`` section: defaults that run as they are, bad values refused at start with the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.config import ConfigError, load_config


def test_defaults_serve_the_console_on_loopback() -> None:
    console = load_config().console
    assert (console.enabled, console.host, console.port) == (True, "127.0.0.1", 8050)
    assert 2 <= console.refresh_s <= 5 and console.session_ttl_s == 3600 and console.users == []


@pytest.mark.parametrize("line,key", [("refresh_s = 0.5", "console.refresh_s"),
                                      ("session_ttl_s = 10", "console.session_ttl_s"),
                                      ("port = 0", "console.port"),
                                      ('users = "alice"', "console.users")])
def test_bad_console_values_name_the_key(tmp_path: Path, line: str, key: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"[console]\n{line}\n")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(path)
