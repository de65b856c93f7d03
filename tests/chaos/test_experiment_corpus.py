"""Our validation and Chaos Toolkit's agree: every experiment of the corpus (``corpus/valid``,
``corpus/invalid``, each file opening with the reason for its verdict) gets the same verdict from
chaostoolkit-lib's own ``ensure_experiment_is_valid`` and from ours alone (as where chaoslib is not
installed), and so do seeded mutations of them. Through :func:`validate_experiment`, a refusal names the
field and carries chaoslib's message."""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from chaoslib.experiment import ensure_experiment_is_valid  # type: ignore[import-untyped]

from chaos.experiment_format import validate_experiment
from chaos.experiment_rules import InvalidExperiment, chaoslib_problem, check_format

CORPUS = Path(__file__).parent / "corpus"
CASES = sorted(CORPUS.glob("*/*.yaml"))
UNSET = "LLM_SRE_CORPUS_UNSET"  # the variable the env cases name; never set


@pytest.fixture(autouse=True)
def _unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UNSET, raising=False)


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def chaoslib_accepts(experiment: Any) -> bool:
    try:
        ensure_experiment_is_valid(experiment)
    except Exception:  # its own errors, and whatever Python raises on shapes it does not expect
        return False
    return True


def ours_accepts(experiment: Any) -> bool:
    try:
        check_format(experiment)
    except InvalidExperiment:
        return False
    return True


def test_the_corpus_holds_the_cases_of_the_issue_with_their_reasons() -> None:
    names = {f"{p.parent.name}/{p.stem}" for p in CASES}
    assert {"invalid/no-description", "invalid/hypothesis-without-title", "valid/hypothesis-only",
            "valid/process-provider", "valid/background-activity"} <= names
    assert len([p for p in CASES if p.parent.name == "valid"]) >= 10
    assert len([p for p in CASES if p.parent.name == "invalid"]) >= 30
    for path in CASES:
        first = path.read_text().splitlines()[0]
        assert first.startswith(f"# {path.parent.name}: ") and len(first) > 20, path


@pytest.mark.parametrize("path", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_chaoslib_and_ours_give_the_corpus_verdict(path: Path) -> None:
    experiment, valid = load(path), path.parent.name == "valid"
    assert chaoslib_accepts(copy.deepcopy(experiment)) is valid
    assert ours_accepts(copy.deepcopy(experiment)) is valid


def test_seeded_mutations_of_the_corpus_get_the_same_verdict_from_both() -> None:
    rng = random.Random(16)
    bases = [load(p) for p in CASES]
    verdicts = []
    for _ in range(400):
        mutant = mutate(rng, rng.choice(bases))
        theirs, ours = chaoslib_accepts(copy.deepcopy(mutant)), ours_accepts(copy.deepcopy(mutant))
        assert theirs is ours, mutant
        verdicts.append(ours)
    assert 0 < sum(verdicts) < len(verdicts)  # both verdicts were exercised


def test_a_refusal_names_the_field_and_carries_chaoslibs_message() -> None:
    with pytest.raises(InvalidExperiment) as refused:
        validate_experiment(load(CORPUS / "invalid" / "no-description.yaml"))
    assert str(refused.value) == "description: required (chaoslib: experiment requires a description)"
    with pytest.raises(InvalidExperiment) as refused:
        validate_experiment(load(CORPUS / "invalid" / "python-bad-arguments.yaml"))
    message = str(refused.value)
    assert message.startswith("method[0].provider.arguments: do not fit chaos.ctk.inject_fault")
    assert "(chaoslib: argument 'blast' is not part of the function signature" in message
    assert "\n" not in message


def test_without_chaoslib_ours_decides_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "chaoslib.experiment", None)  # import fails as if not installed
    assert chaoslib_problem(load(CORPUS / "invalid" / "no-description.yaml")) is None
    with pytest.raises(InvalidExperiment, match=r"^description: required$"):
        validate_experiment(load(CORPUS / "invalid" / "no-description.yaml"))
    validate_experiment(load(CORPUS / "valid" / "hypothesis-only.yaml"))


# ---- mutations -----------------------------------------------------------------------------------
VALUES: list[Any] = [
    None, "", "x", 0, 1, 0.5, -1, True, False, [], [1], ["a"], [1, 2], {}, {"a": 1}, "${x}", "probe",
    "action", "python", "process", "http", "chaos.ctk", "ready_replicas", "echo", {"ref": "ready"},
    {"type": "env", "key": "HOME"}, {"type": "env", "key": UNSET}, {"type": "range", "range": [1, 2]},
    {"type": "regex", "pattern": "a"}, {"name": "c", "provider": {"type": "python", "module": "x"}},
]
KEYS = ["background", "pauses", "timeout", "controls", "tags", "extensions", "ref", "tolerance", "headers",
        "arguments", "secrets", "configuration"]


def mutate(rng: random.Random, experiment: Any) -> Any:
    """One to three edits: a value replaced, a key deleted or a known key added, anywhere in the tree."""
    mutant = copy.deepcopy(experiment)
    for _ in range(rng.randint(1, 3)):
        places = list(_places(mutant))
        if not places:
            break
        parent, key = rng.choice(places)
        roll = rng.random()
        if roll < 0.3 and isinstance(parent, dict):
            del parent[key]
        elif roll < 0.4 and isinstance(parent, dict):
            parent[rng.choice(KEYS)] = copy.deepcopy(rng.choice(VALUES))
        else:
            parent[key] = copy.deepcopy(rng.choice(VALUES))
    return mutant


def _places(node: Any) -> Iterator[tuple[Any, Any]]:
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in list(items):
        yield node, key
        yield from _places(value)
