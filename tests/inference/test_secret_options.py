"""Picking a secret from the command line: the argument (with a warning), its file (first line, stripped; a
file others may read is warned about), or the environment, in that order; both the argument and the file,
a missing file and an empty one are refused."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from inference.secret_options import SecretFileError, secret_option

ENV = {"MY_TOKEN": "from-env"}


def pick(value: str | None = None, file: Path | None = None) -> tuple[str | None, str]:
    warn = io.StringIO()
    secret = secret_option(value=value, file=str(file) if file else None, env=ENV, env_name="MY_TOKEN",
                           option="--token", warn=warn)
    return secret, warn.getvalue()


def test_the_environment_is_the_default_and_quiet() -> None:
    assert pick() == ("from-env", "")


def test_a_file_wins_over_the_environment_and_gives_its_first_line(tmp_path: Path) -> None:
    file = tmp_path / "t"
    file.write_text("  from-file  \nsecond line\n")
    file.chmod(0o600)
    assert pick(file=file) == ("from-file", "")
    file.chmod(0o640)
    secret, warning = pick(file=file)
    assert secret == "from-file" and "may be read by other users (mode 0640)" in warning


def test_an_argument_wins_and_is_warned_about_without_echoing_it() -> None:
    secret, warning = pick(value="from-argv")
    assert secret == "from-argv"
    assert "--token on the command line can be read by every user" in warning and "from-argv" not in warning


@pytest.mark.parametrize("case", ["both", "missing", "empty"])
def test_unusable_choices_are_refused(tmp_path: Path, case: str) -> None:
    file = tmp_path / "t"
    if case != "missing":
        file.write_text("x\n" if case == "both" else "\n")
    with pytest.raises(SecretFileError):
        pick(value="v" if case == "both" else None, file=file)
