"""``controlplane chaos run`` keeps the operator's token out of what an experiment runs and writes: a
process provider's command starts without it (nor any other secret of the environment), and a command that
finds it anyway (here: in a file) has it redacted from the journal and from what is printed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from controlplane.cli.main import main
from controlplane.client import TOKEN_ENV

from .conftest import URL

Capture = pytest.CaptureFixture[str]
TOKEN = "operator-token-3f9a1c"


def command(name: str, *argv: str) -> dict[str, object]:
    path = shutil.which(argv[0])
    assert path is not None, argv[0]
    return {"type": "action", "name": name, "provider": {"type": "process", "path": path,
                                                         "arguments": list(argv[1:])}}


@pytest.mark.parametrize("given", ["token-file", "environment"])
def test_the_operators_token_never_reaches_a_command_nor_the_journal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Capture, given: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    monkeypatch.setenv("CONTROLPLANE_URL", URL)  # `chaos run` sets both for chaos.ctk: restored after
    monkeypatch.setenv(TOKEN_ENV, TOKEN if given == "environment" else "overwritten-by-the-file")
    monkeypatch.setenv("SIGNING_KEY", "signing-key-value")
    experiment = {"title": "leaks", "description": "commands that look for the operator's token",
                  "method": [command("printenv", "printenv", TOKEN_ENV),
                             command("environment", "env"),
                             command("cat", "cat", str(token_file))]}
    path, journal_path = tmp_path / "experiment.json", tmp_path / "journal.json"
    path.write_text(json.dumps(experiment))
    token_option = [f"--token-file={token_file}"] if given == "token-file" else []
    code = main(["--url", URL, *token_option, "chaos", "run", str(path), "--journal", str(journal_path)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    journal_text = journal_path.read_text()
    printenv, environment, cat = json.loads(journal_text)["run"]
    assert printenv["output"]["status"] == 1 and printenv["output"]["stdout"] == ""  # not in its environment
    assert f"{TOKEN_ENV}=" not in environment["output"]["stdout"]
    assert "SIGNING_KEY=" not in environment["output"]["stdout"]  # nor any other secret-shaped variable
    assert "PATH=" in environment["output"]["stdout"]  # the rest of the environment is there
    assert cat["output"]["stdout"] == "***\n"  # found elsewhere: redacted
    assert TOKEN not in journal_text and TOKEN not in printed.out + printed.err
