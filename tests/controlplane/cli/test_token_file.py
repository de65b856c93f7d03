"""The CLI's token stays out of ``ps``: ``--token-file PATH`` (or ``$CONTROLPLANE_TOKEN``) works, before or
after the command; ``--token VALUE`` still works but warns on stderr that every user can read it; of the
two, the one given last wins (after the command over before it); a missing or empty file is a usage error
(exit 2) and nothing is sent."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.cli.main import main

from .conftest import URL, Api

Capture = pytest.CaptureFixture[str]
WARNING = "can be read by every user of this machine (ps)"


def token_file(tmp_path: Path, token: str) -> Path:
    path = tmp_path / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


def test_a_token_file_before_or_after_the_command_is_used_without_a_warning(
        api: Api, tmp_path: Path, capsys: Capture) -> None:
    path = token_file(tmp_path, api.tokens["viewer"])
    assert main(["--url", URL, "--token-file", str(path), "status"], transport=api.transport) == 0
    assert main(["status", "--url", URL, "--token-file", str(path)], transport=api.transport) == 0
    out = capsys.readouterr()
    assert "3/3 replicas ready" in out.out and WARNING not in out.err


def test_the_environment_is_used_without_a_warning(api: Api, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: Capture) -> None:
    monkeypatch.setenv("CONTROLPLANE_TOKEN", api.tokens["viewer"])
    assert main(["--url", URL, "status"], transport=api.transport) == 0
    assert WARNING not in capsys.readouterr().err


def test_a_token_on_the_command_line_works_with_a_warning(api: Api, capsys: Capture) -> None:
    assert main(["--url", URL, f"--token={api.tokens['viewer']}", "status"], transport=api.transport) == 0
    err = capsys.readouterr().err
    assert WARNING in err and "--token-file" in err and api.tokens["viewer"] not in err


def test_a_token_file_readable_by_others_works_with_a_warning(api: Api, tmp_path: Path,
                                                              capsys: Capture) -> None:
    path = token_file(tmp_path, api.tokens["viewer"])
    path.chmod(0o644)
    assert main(["--url", URL, "--token-file", str(path), "status"], transport=api.transport) == 0
    assert "may be read by other users (mode 0644)" in capsys.readouterr().err


def test_the_token_given_last_wins_and_an_argument_anywhere_is_warned_about(api: Api, tmp_path: Path,
                                                                             capsys: Capture) -> None:
    good = token_file(tmp_path, api.tokens["viewer"])
    assert main(["--url", URL, "--token", "not-a-token", "status", "--token-file", str(good)],
                transport=api.transport) == 0
    assert WARNING in capsys.readouterr().err  # the bad token was on the command line all the same
    assert main(["--url", URL, "--token-file", str(good), "status", "--token", "not-a-token"],
                transport=api.transport) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith("controlplane: HTTP 401: ")


@pytest.mark.parametrize("argv", [
    ["--token-file", "{missing}", "status"],
    ["status", "--token-file", "{empty}"],
])
def test_bad_token_options_are_usage_errors(api: Api, tmp_path: Path, capsys: Capture,
                                            argv: list[str]) -> None:
    files = {"file": token_file(tmp_path, "x"), "missing": tmp_path / "nope", "empty": tmp_path / "empty"}
    files["empty"].write_text("\n")
    argv = [a.format(**{k: str(v) for k, v in files.items()}) for a in argv]
    assert main(["--url", URL, *argv], transport=api.transport) == 2
    assert capsys.readouterr().err.startswith("controlplane: ")
