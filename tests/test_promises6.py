"""Keep the promises, round 6 (an outside probe, 2026-11-27; docs/reliability.md, P69-P72): a
place to write that is not one, a mistake on the command line, and an export's stray lines.

A file where a run or cache directory belongs, or on the way to one, is the user's to fix: one
line naming the setting, exit 2 (bad input). Exit 4 stays for a disk without room (full, quota,
file size, I/O): it said "free some space" for a cache that was a file."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import cli_processes
import pytest

from transformer_mt.common import exits


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("tmt: error")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def train(tmp_path: Path, *sets: str, env: dict[str, str] | None = None):
    args = ["train", "-c", "tiny", "--set", "train.max_steps=1"]
    for item in (f"train.out_dir={tmp_path / 'run'}", *sets):
        args += ["--set", item]
    return cli_processes.run(args, env={**os.environ, **(env or {})}, timeout=300)


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("train.out_dir", "train.out_dir={file}: exists and is not a directory"),
        ("train.out_dir=under", "{file}/run: cannot write there (Not a directory)"),
        ("data.cache_dir", "data.cache_dir={file}: exists and is not a directory"),
        ("TMT_CACHE", "TMT_CACHE={file}: exists and is not a directory"),
    ],
)
def test_a_file_where_a_directory_belongs_is_bad_input_naming_the_setting(
    tmp_path: Path, where: str, message: str
) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("the user's\n")
    if where == "TMT_CACHE":
        result = train(tmp_path, env={"TMT_CACHE": str(file)})
    elif where == "train.out_dir=under":
        result = train(tmp_path, f"train.out_dir={file / 'run'}")
    else:
        result = train(tmp_path, f"{where}={file}")
    assert result.returncode == exits.BAD_INPUT
    assert message.format(file=file) in one_line(result)
    assert file.read_text() == "the user's\n"


def test_a_write_that_failed_exits_4_only_when_the_disk_had_no_room() -> None:
    for number in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
        assert exits.write_failed(OSError(number, os.strerror(number))) == (
            os.strerror(number), exits.NO_ROOM,
        )  # fmt: skip
    for number in (errno.EACCES, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EEXIST):
        assert exits.write_failed(OSError(number, os.strerror(number))) == (
            os.strerror(number), exits.BAD_INPUT,
        )  # fmt: skip
    # torch's checkpoint writer says no more than this: a failed write, taken as no room.
    failed = RuntimeError("[enforce fail at inline_container.cc] file write failed\nmore")
    assert exits.write_failed(failed) == ("[enforce fail at inline_container.cc] file write failed",
                                          exits.NO_ROOM)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["translate", "--beam", "abc"], "Invalid value for '--beam'"),
        (["translate", "--bogus"], "No such option: --bogus"),
        (["bogus"], "No such command 'bogus'"),
        (["--bogus"], "No such option: --bogus"),
        (["export", "-m", "a", "-m", "b"], "--model/-m given more than once"),
        (["evaluate", "--hyp"], "Option '--hyp' requires an argument"),
    ],
)
def test_a_mistake_on_the_command_line_is_one_line(args: list[str], message: str) -> None:
    """As every other error of tmt: one line, exit 2. Click drew a box of five lines under a
    usage line and a hint."""
    result = cli_processes.run(args, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    line = one_line(result)
    assert message in line and line.endswith(" --help"), line


def test_an_export_says_tmts_lines_only(trained_run: Path, tmp_path: Path) -> None:
    """With torchao installed (the int8 extra, in dev), importing transformers' models printed
    "Failed to load .../torchao/_C_mxfp8...so", "Detected no triton" and torch's pytree notes,
    and the parity check two progress bars of transformers'."""
    result = cli_processes.run(["export", "-m", str(trained_run), "--format", "huggingface", "-o",
                                str(tmp_path / "hf")], timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    theirs = [line for line in result.stderr.splitlines() if not line.startswith("tmt:")]
    assert theirs == [], result.stderr
    # torchao's went through tmt's own log handler: "tmt: Failed to load ...".
    assert "torchao" not in result.stderr and "triton" not in result.stderr.lower(), result.stderr


def test_tmt_alone_shows_the_help_and_no_error_line() -> None:
    result = cli_processes.run([], timeout=60)
    assert "Usage: tmt" in result.stdout and "train" in result.stdout
    assert "error" not in result.stderr, result.stderr
