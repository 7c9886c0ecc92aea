"""tmt translate FILE -> FILE: chunks committed one by one, shared by processes, resumable, in order."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import reverse_pairs
from test_train import run_tmt
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.common import faults
from transformer_mt.common.exits import TmtError
from transformer_mt.translation import bulk, translate

runner = CliRunner()
CHUNK = 10
SAMPLING = ["--sampling", "topp:0.9", "--temperature", "1.2", "--seed", "7", "--nbest", "2"]


@pytest.fixture(scope="module")
def big_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """47 lines (5 chunks, the last one short) with an empty line, invalid UTF-8 and no final
    newline: what a real corpus throws at a translator."""
    lines = [s.encode() for s, _ in reverse_pairs(45, seed=5)]
    lines[3] = b""
    lines[12] = b"kalo \xff\xfe mi"
    path = tmp_path_factory.mktemp("bulk") / "big.txt"
    path.write_bytes(b"\n".join([*lines, b"fari giri", b"yoco xiza"]))  # no final b"\n"
    return path


def translate_args(model: Path, source: Path, output: Path, *extra: str) -> list[str]:
    return ["translate", "-m", str(model), "-i", str(source), "-o", str(output),
            "--set", f"decode.chunk_lines={CHUNK}", *extra]  # fmt: skip


def stream_output(model: Path, source: Path, *extra: str) -> bytes:
    """What the streaming path (stdin -> stdout) writes for the same input."""
    result = runner.invoke(app, ["translate", "-m", str(model), *extra], input=source.read_bytes())
    assert result.exit_code == 0, result.output
    return result.stdout_bytes


@pytest.mark.parametrize("extra", [[], SAMPLING], ids=["beam", "sampling"])
def test_one_process_writes_what_the_stream_path_writes(
    trained_run: Path, big_input: Path, tmp_path: Path, extra: list[str]
) -> None:
    out = tmp_path / "out.txt"
    result = runner.invoke(app, translate_args(trained_run, big_input, out, *extra))
    assert result.exit_code == 0, result.output
    rows = 2 if extra else 1
    assert out.read_bytes().count(b"\n") == 47 * rows
    assert out.read_bytes() == stream_output(trained_run, big_input, *extra)
    # The job's chunks are gone; its record of what it wrote stays (the same command: done).
    job = tmp_path / f"out.txt{bulk.JOB_SUFFIX}"
    assert sorted(p.name for p in job.iterdir()) == [".lock", "done.json"]
    assert "5 chunks" in result.stderr


@pytest.mark.parametrize("extra", [[], SAMPLING], ids=["beam", "sampling"])
def test_two_gloo_processes_write_the_bytes_of_one(
    trained_run: Path, big_input: Path, tmp_path: Path, extra: list[str]
) -> None:
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    assert runner.invoke(app, translate_args(trained_run, big_input, one, *extra)).exit_code == 0
    done = run_tmt(translate_args(trained_run, big_input, two, *extra), ranks=2)
    assert done.returncode == 0, done.stderr[-2000:]
    assert two.read_bytes() == one.read_bytes()


def test_kill_then_resume_translates_only_the_missing_chunks(
    trained_run: Path, big_input: Path, tmp_path: Path
) -> None:
    straight, out = tmp_path / "straight.txt", tmp_path / "out.txt"
    assert runner.invoke(app, translate_args(trained_run, big_input, straight)).exit_code == 0
    killed = run_tmt(translate_args(trained_run, big_input, out), fault="chunk@3:kill")
    assert killed.returncode == -9 and not out.exists()
    job = tmp_path / f"out.txt{bulk.JOB_SUFFIX}"
    committed = sorted(p.name for p in job.glob("*.txt"))
    assert committed == ["00000000.txt", "00000001.txt", "00000002.txt"]
    stamps = {name: (job / name).stat().st_mtime_ns for name in committed}
    # The resumed job, in process, so its chunk commits can be watched.
    translator = translate.load_translator(trained_run, [f"decode.chunk_lines={CHUNK}"])
    written: list[str] = []
    real_write = bulk.files.atomic_write

    def watched(path: Path, data: bytes) -> None:
        if path.suffix == ".txt":  # chunk texts (their commit records follow them)
            written.append(path.name)
        assert path.name not in stamps or (job / path.name).stat().st_mtime_ns == stamps[path.name]
        real_write(path, data)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bulk.files, "atomic_write", watched)
        report = bulk.translate_job(translator, str(big_input), str(out))
    assert written == ["00000003.txt", "00000004.txt"]  # nothing committed is translated twice
    assert report["resumed_chunks"] == 3 and report["translated_chunks"] == 2
    assert out.read_bytes() == straight.read_bytes()


# slow: make test keeps its promise with
# test_bulk.py::test_kill_then_resume_translates_only_the_missing_chunks and
# ::test_two_gloo_processes_write_the_bytes_of_one
@pytest.mark.slow
def test_a_killed_rank_then_the_same_command_gives_the_same_bytes(
    trained_run: Path, big_input: Path, tmp_path: Path
) -> None:
    straight, out = tmp_path / "straight.txt", tmp_path / "out.txt"
    args = translate_args(trained_run, big_input, out, *SAMPLING)
    assert (
        runner.invoke(app, translate_args(trained_run, big_input, straight, *SAMPLING)).exit_code
        == 0
    )
    lost = run_tmt(args, ranks=2, fault="chunk@2:kill@rank1")  # rank 1's first chunk is 2
    assert lost.returncode != 0 and not out.exists()
    resumed = run_tmt(args, ranks=2)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "translated before" in resumed.stderr
    assert out.read_bytes() == straight.read_bytes()


def test_a_resume_with_another_model_or_options_is_refused(
    trained_run: Path, big_input: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out.txt"
    monkeypatch.setenv("TMT_FAULT", "chunk@1:raise")
    result = runner.invoke(app, translate_args(trained_run, big_input, out))
    assert isinstance(result.exception, faults.FaultInjected)
    monkeypatch.delenv("TMT_FAULT")
    for extra, named in [
        (["--beam", "3"], "-> 3"),
        (SAMPLING, "decode.nbest: 1 -> 2"),
        (["--set", "decode.chunk_lines=7"], "decode.chunk_lines: 10 -> 7"),
    ]:
        args = [*translate_args(trained_run, big_input, out), *extra]
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and named in result.stderr, result.output
        assert "other decoding options (decode." in result.stderr
        assert "--overwrite" in result.stderr and "Traceback" not in result.output
    translator = translate.load_translator(trained_run, [f"decode.chunk_lines={CHUNK}"])
    other = dataclasses.replace(translator, fingerprint="0" * 64)
    with pytest.raises(TmtError, match="unfinished job with another model"):
        bulk.translate_job(other, str(big_input), str(out))
    changed = tmp_path / "big.txt"
    changed.write_bytes(big_input.read_bytes() + b"\nnew line")
    with pytest.raises(TmtError, match="unfinished job with another input"):
        bulk.translate_job(translator, str(changed), str(out))
    # --overwrite starts again; the job's options are then the new ones.
    result = runner.invoke(app, [*translate_args(trained_run, big_input, out), "--beam", "3",
                                 "--overwrite"])  # fmt: skip
    assert result.exit_code == 0 and "(0 translated before)" in result.stderr


def test_a_new_job_clears_its_directory_but_not_what_a_link_there_points_to(
    trained_run: Path, big_input: Path, tmp_path: Path
) -> None:
    out, mine = tmp_path / "out.txt", tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("the user's")
    job = tmp_path / f"out.txt{bulk.JOB_SUFFIX}"
    job.mkdir()
    (job / "00000000.txt").write_text("a chunk of no job\n")  # no job.json: not a job's
    (job / "linked").symlink_to(mine, target_is_directory=True)
    result = runner.invoke(app, translate_args(trained_run, big_input, out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes().count(b"\n") == 47 and b"a chunk of no job" not in out.read_bytes()
    assert sorted(p.name for p in job.iterdir()) == [".lock", "done.json"]
    assert (mine / "keep.txt").read_text() == "the user's"


def test_bad_outputs_and_inputs_are_one_line(
    trained_run: Path, big_input: Path, tmp_path: Path
) -> None:
    taken = tmp_path / "taken.txt"
    taken.write_text("keep me\n")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for args, message in [
        (translate_args(trained_run, big_input, taken), "exists; add --overwrite"),
        (translate_args(trained_run, tmp_path / "nope.txt", tmp_path / "o.txt"), "no such file"),
        (translate_args(trained_run, big_input, blocker / "out.txt"),
         "the output's parent"),  # one message for every command (issue 47)
        (translate_args(trained_run, big_input, big_input), "is the input file"),
        (translate_args(trained_run, big_input, tmp_path / "o.txt", "--sampling", "topk:0"),
         "--sampling topk:0: decode.sampling = 'topk:0': expected none, full, topk:K"),
        (translate_args(trained_run, big_input, tmp_path / "o.txt", "--temperature", "-1"),
         "--temperature -1.0: decode.temperature = -1.0: expected >= 0"),
    ]:  # fmt: skip
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and message in result.stderr, (message, result.output)
        assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) <= 2
    assert taken.read_text() == "keep me\n"
    result = runner.invoke(app, [*translate_args(trained_run, big_input, taken), "--overwrite"])
    assert result.exit_code == 0 and taken.read_bytes().count(b"\n") == 47


def test_a_second_job_on_the_same_output_is_refused(
    trained_run: Path, big_input: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out.txt"
    translator = translate.load_translator(trained_run, [f"decode.chunk_lines={CHUNK}"])
    holder = bulk.run.RunLock(tmp_path / f"out.txt{bulk.JOB_SUFFIX}")
    holder.acquire()  # another job, alive, holds the output's job directory
    try:
        with pytest.raises(TmtError, match=r"in use by pid \d+ .* translate into another output"):
            bulk.translate_job(translator, str(big_input), str(out))
        refused = runner.invoke(app, translate_args(trained_run, big_input, out))
        assert refused.exit_code == 2 and "translate into another --output" in refused.stderr
        assert refused.stderr.startswith(f"tmt: error: --output {out} (its job directory ")
    finally:
        holder.release()
    assert not out.exists()
    assert bulk.translate_job(translator, str(big_input), str(out))["lines"] == 47


def test_an_output_where_its_job_directory_cannot_be_made_is_named_as_the_user_named_it(
    trained_run: Path, big_input: Path, tmp_path: Path
) -> None:
    """The job directory beside the output is tmt's: a refusal names the output given."""
    (tmp_path / f"out.txt{bulk.JOB_SUFFIX}").write_text("a file, where the job's directory goes\n")
    for out in (tmp_path / "out.txt", Path("/proc/out.txt")):
        result = runner.invoke(app, translate_args(trained_run, big_input, out))
        assert result.exit_code == 2, result.stderr
        assert result.stderr.startswith(f"tmt: error: --output {out} (its job directory"), (
            result.stderr
        )
        assert "cannot write there" in result.stderr and not out.exists()
