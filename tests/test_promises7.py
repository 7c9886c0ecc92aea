"""Keep the promises, round 7 (an outside probe, 2026-11-27; docs/reliability.md, P75-P85): what
a command leaves behind when it is refused, and what its error names.

A command refused for bad input (a model that is not there, a corpus that is not there) ends
with one line and leaves the disk as it found it: the directories it made to hold its output's
lock went again. Eight commands left an empty directory for an output they never wrote, and
`tmt plot -m TYPO` made the run directory TYPO."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.common import exits, files

runner = CliRunner()


def refusal(args: list[str]) -> str:
    """The one error line of a refused command (in this process: these end before a model)."""
    result = runner.invoke(app, args)
    lines = [line for line in result.stderr.splitlines() if line.startswith("tmt: error")]
    assert result.exit_code == exits.BAD_INPUT and len(lines) == 1, (result.exit_code, result)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return lines[0]


def corpus(typo: Path) -> list[str]:
    return ["-c", "tiny", "--set", "data.source=files", "--set", f"data.train={typo}"]


# (command line with {typo} a missing path, {out} an output two new directories down, {src} a
# text file, what the error says)
COMMANDS = [
    ("average -m {typo} -o {out}", "{typo}: no such file or directory"),
    ("export --format ctranslate2 -m {typo} -o {out}", "{typo}: no such file or directory"),
    ("translate -m {typo} -i {src} -o {out}", "{typo}: no such file or directory"),
    ("shortlist -m {typo} -i {src} -o {out}", "{typo}: no such file or directory"),
    ("distill -c tiny -m {typo} -o {out}", "{typo}: no such file or directory"),
    ("import -m {typo} -o {out}", "no such directory"),
    ("plot -m {typo} -o {out}.png", "{typo}: no such directory; name a run directory"),
    ("plot -m {typo}", "{typo}: no such directory; name a run directory"),
    ("terms {corpus} -o {out}", "{typo}"),
    ("clean {corpus} -o {out}", "{typo}"),
    ("train {corpus} --set train.out_dir={out}", "{typo}"),
]


@pytest.mark.parametrize(("command", "message"), COMMANDS, ids=[c.split()[0] + str(i) for i, (c, _)
                                                                in enumerate(COMMANDS)])  # fmt: skip
def test_a_refused_command_leaves_no_directory_it_made(
    tmp_path: Path, command: str, message: str
) -> None:
    typo, out, src = tmp_path / "typo", tmp_path / "new" / "deeper" / "out", tmp_path / "in.txt"
    src.write_text("ein Hund\n")
    args = []
    for word in command.split():
        if word == "{corpus}":
            args += corpus(typo)
        else:
            args.append(word.format(typo=typo, out=out, src=src))
    line = refusal(args)
    assert message.format(typo=typo) in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"], list(tmp_path.rglob("*"))


def test_the_directories_made_for_an_output_go_only_while_empty(tmp_path: Path) -> None:
    made = files.make_directories(tmp_path / "a" / "b" / "c")
    assert made == [tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"]
    assert files.make_directories(tmp_path / "a" / "b") == []  # there already: none made
    (tmp_path / "a" / "b" / "kept.txt").write_text("someone's\n")
    files.remove_made(made)  # c goes; b holds a file, so b and a stay
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "a", "a/b", "a/b/kept.txt"
    ]  # fmt: skip
    (tmp_path / "a" / "b" / "kept.txt").unlink()
    files.remove_made(made)
    assert list(tmp_path.iterdir()) == []


def test_a_model_that_is_a_file_is_named_as_one(tmp_path: Path) -> None:
    model_pt = tmp_path / "model.pt"  # what a user of fairseq names: the weights inside
    model_pt.write_bytes(b"weights")
    for args in (["translate", "-m", str(model_pt)],
                 ["average", "-m", str(model_pt), "-m", str(model_pt), "-o", str(tmp_path / "a")]):  # fmt: skip
        line = refusal(args)
        assert f"{model_pt}: a file; a checkpoint is a directory (with manifest.json)" in line


@pytest.mark.parametrize(
    ("key", "env", "what"),
    [
        ("", None, "empty"),
        ("two words", None, "not printable ASCII without spaces"),
        ("clé", None, "not printable ASCII without spaces"),
        (None, "", "empty"),  # TMT_API_KEY=$SECRET with SECRET unset: click read it as no key
        (None, "line\nbreak", "not printable ASCII without spaces"),
    ],
)
def test_a_key_no_client_can_send_is_refused_not_served_openly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str | None, env: str | None, what: str
) -> None:
    if env is not None:
        monkeypatch.setenv("TMT_API_KEY", env)
    args = ["serve", "-m", str(tmp_path / "model")] + ([] if key is None else ["--api-key", key])
    line = refusal(args)
    assert f"--api-key (or TMT_API_KEY): the key is {what};" in line
    assert (key or env or "\0") not in line.removeprefix("tmt: error: --api-key")  # never echoed


def test_a_config_nested_past_the_recursion_limit_is_one_line(tmp_path: Path) -> None:
    """PyYAML recurses per level: 50,000 brackets were a RecursionError traceback. Every other
    parse of what tmt reads is held to the same by test_code_rules (a rule over the source)."""
    deep = "[" * 50_000 + "]" * 50_000
    config = tmp_path / "deep.yaml"
    config.write_text(f"data:\n  train: {deep}\n")
    assert f"{config}: invalid YAML: nested too deeply to read" in refusal(
        ["train", "-c", str(config), "--dry-run"]
    )
    for key in ("data.train", "model.d_model"):  # taken as text, refused as a value
        line = refusal(["train", "-c", "tiny", "--set", f"{key}={deep}", "--dry-run"])
        assert key in line and "[[[[" in line, line[:300]


def test_a_bad_value_is_shown_at_a_glance(tmp_path: Path) -> None:
    """An error quoted the whole value: a list of 10^5 items was a line of 500 KB."""
    config = tmp_path / "long.yaml"
    config.write_text("data:\n  src_field: [" + ", ".join(["x"] * 100_000) + "]\n")
    line = refusal(["train", "-c", str(config), "--dry-run"])
    assert line.endswith("data.src_field = ['x', 'x', 'x', 'x', 'x', 'x', ...]: expected a string"
                         " (quote it in YAML)") and len(line) < 300  # fmt: skip
