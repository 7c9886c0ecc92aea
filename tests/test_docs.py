"""The manual: it builds with mkdocs --strict (no broken link or anchor, no page outside the nav),
its configuration reference is the one the config dataclasses make, every option of every command
is documented on its command's page, and the README stays one screen of getting started."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from transformer_mt.cli import app

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"

# The page that documents each command (tmt average and tmt plot are training's tools).
PAGE_OF = {
    "train": "train.md",
    "average": "train.md",
    "plot": "train.md",
    "clean": "data.md",
    "translate": "translate.md",
    "shortlist": "translate.md",
    "terms": "glossaries.md",
    "evaluate": "evaluate.md",
    "export": "export.md",
    "import": "import.md",
    "distill": "distill.md",
    "serve": "serve.md",
}


def test_the_manual_builds_strictly(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").exists()


def test_the_configuration_reference_is_the_one_the_config_makes() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "config_reference.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_every_config_key_is_in_the_reference() -> None:
    import dataclasses

    from transformer_mt.config import Config, to_dict

    def keys(values: dict, prefix: str = "") -> list[str]:
        return [
            k
            for name, value in values.items()
            for k in (
                keys(value, f"{prefix}{name}.") if isinstance(value, dict) else [prefix + name]
            )
        ]

    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    missing = [k for k in keys(to_dict(Config())) if f"| `{k}` |" not in page]
    assert not missing and dataclasses.is_dataclass(Config), missing


def long_options(command: str) -> list[str]:
    click_command = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return [
        o
        for p in click_command.params
        if not getattr(p, "hidden", False)  # the old spellings, kept for one release
        for o in p.opts
        if o.startswith("--") and o != "--help"
    ]


def test_every_command_has_its_page() -> None:
    assert set(typer.main.get_command(app).commands) == set(PAGE_OF)  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", sorted(PAGE_OF))
def test_every_option_of_a_command_is_documented_on_its_page(command: str) -> None:
    page = (DOCS / PAGE_OF[command]).read_text(encoding="utf-8")
    missing = [o for o in long_options(command) if not re.search(re.escape(o) + r"(?![\w-])", page)]
    assert not missing, f"tmt {command}: document {', '.join(missing)} in docs/{PAGE_OF[command]}"


def test_the_readme_is_one_screen_of_getting_started() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    # It links into the manual, and every page it links exists.
    linked = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert {"docs/index.md", "docs/configuration.md"} <= set(linked)
    assert all((REPO / link).exists() for link in linked), linked


def all_options(command: str) -> set[str]:
    """Every spelling of every option of `tmt command`, short ones and hidden old ones too."""
    click_command = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return {o for p in click_command.params for o in [*p.opts, *p.secondary_opts]} | {"--help"}


def documented_calls() -> list[tuple[str, str, str]]:
    """(page, command, option) for each option of each `tmt COMMAND ...` the manual and the README
    show, in code blocks and in `inline code` (comments after # aside)."""
    found = []
    for page in [*sorted(DOCS.glob("*.md")), REPO / "README.md"]:
        text = page.read_text(encoding="utf-8")
        calls = re.findall(r"(?m)^\s*(?:\S+=\S+\s+)*tmt (\w+)([^\n#]*)", text)
        calls += re.findall(r"`tmt (\w+)([^`]*)`", text)
        for command, rest in calls:
            rest = re.split(r"&&|\|\||[|;<>]", rest)[0]  # up to the next command of a pipeline
            if command not in PAGE_OF:
                continue
            for option in re.findall(r"(?:^|\s)(--?[a-zA-Z][\w-]*)", rest):
                found.append((page.name, command, option))
    return found


def test_every_option_the_manual_shows_exists() -> None:
    """The other direction (issue 61): an option the manual or the README gives a command is one
    that command takes (docs/evaluate.md once showed `tmt evaluate ... -o FILE`)."""
    calls = documented_calls()
    assert len(calls) > 200, "the manual's commands must be found for this test to mean anything"
    unknown = sorted({(page, f"tmt {command} {option}") for page, command, option in calls
                      if option not in all_options(command)})  # fmt: skip
    assert not unknown, unknown
