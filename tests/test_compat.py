"""Runs written by an earlier tmt load and translate as they did when they were written.

tests/fixtures/run_v0.2.0 is a run written by tmt 0.2.0 (before the package was split into its
wings) with scripts/compat_fixture.py, and run_v0.2.0.golden.json what that tmt's command line
printed for it. A change that moves, renames or re-reads anything a run holds (checkpoint
manifests, config.yaml's keys, the tokenizer, the model's parameter names) and changes a
translation or refuses the run fails here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from transformer_mt.cli import app

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="module")
def old_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the fixture run: loading it must work from anywhere and write nothing into the
    repository."""
    run = tmp_path_factory.mktemp("compat") / "run_v0.2.0"
    shutil.copytree(FIXTURES / "run_v0.2.0", run)
    return run


GOLDEN = json.loads((FIXTURES / "run_v0.2.0.golden.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    ("key", "options"),
    [("beam2", []), ("greedy", ["--beam", "1"]), ("nbest2", ["--nbest", "2"])],
)
def test_a_run_written_by_tmt_0_2_0_translates_as_it_did(
    old_run: Path, key: str, options: list[str]
) -> None:
    text = "".join(line + "\n" for line in GOLDEN["inputs"])
    result = CliRunner().invoke(app, ["translate", "-m", str(old_run), *options], input=text)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == GOLDEN[key]
    assert len(GOLDEN[key]) == len(GOLDEN["inputs"]) * (2 if key == "nbest2" else 1)
