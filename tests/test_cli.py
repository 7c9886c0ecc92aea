"""The command line: help, the dry run's report, one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cli_processes
import pytest
from typer.testing import CliRunner

from transformer_mt.cli import app

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


def tiny_args(tiny_corpus: dict[str, Path]) -> list[str]:
    return [
        "--config", "tiny",
        "--set", "data.source=files",
        "--set", f"data.train={tiny_corpus['train']}",
        "--set", f"data.valid={tiny_corpus['valid']}",
        "--set", "tokenizer.vocab_size=64",
        "--set", "tokenizer.byte_fallback=false",
    ]  # fmt: skip


def test_help_lists_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "train" in result.output
    result = runner.invoke(app, ["train", "--help"])
    assert result.exit_code == 0
    assert "--dry-run" in result.output and "--set" in result.output


def test_the_command_list_gives_each_command_one_unbroken_description() -> None:
    """Rich kept a docstring's source line breaks in `tmt --help`, so evaluate's sentence stopped
    at "of a model or a" and went on under it; on a wide terminal each one is a line."""
    env = {**os.environ, "COLUMNS": "400"}
    out = subprocess.run(
        [sys.executable, "-m", "transformer_mt", "--help"],
        capture_output=True, text=True, check=True, cwd=REPO, env=env,
    )  # fmt: skip
    rows = [line.strip("│ ") for line in out.stdout.splitlines() if line.startswith("│ ")]
    commands = [row.split()[0] for row in rows if not row.startswith("--")]
    assert len(commands) >= 12 and commands[:3] == ["train", "translate", "evaluate"], rows
    evaluate = next(row for row in rows if row.startswith("evaluate"))
    assert "of a model or a hypothesis file; with several --hyp" in evaluate


def test_help_is_instant_no_heavy_imports() -> None:
    code = "import sys, transformer_mt.cli; print(sorted(m for m in ('torch', 'datasets', 'sentencepiece') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert out.stdout.strip() == "[]"


def test_module_entry_point_for_torchrun() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "transformer_mt", "--help"], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0 and "train" in out.stdout


def test_dry_run_reports_for_people_and_as_json(tiny_corpus: dict[str, Path]) -> None:
    result = runner.invoke(app, ["train", *tiny_args(tiny_corpus), "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["pairs"] == 300 and summary["valid_pairs"] == 40
    assert summary["vocab_size"] == 64
    # d_model 32, d_ff 64: attention 4·(32·32 + 32) = 4,224; FFN 2·32·64 + 64 + 32 = 4,192;
    # encoder layer 4,224 + 4,192 + 2 LayerNorms (128) = 8,544; decoder layer 2·4,224 + 4,192
    # + 3 LayerNorms (192) = 12,832; tied embedding 64·32 = 2,048.
    assert summary["parameters"] == 2_048 + 2 * 8_544 + 2 * 12_832
    assert summary["batches"] >= 1
    assert 0.5 < summary["padding_efficiency"] <= 1.0
    assert summary["filters"]["train"]["read"] == 300
    result = runner.invoke(app, ["train", *tiny_args(tiny_corpus), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "# resolved config" in result.stdout and "vocab_size: 64" in result.stdout
    assert "data.train: read 300" in result.stdout and "padding efficiency: " in result.stdout
    assert (
        f"train: {tiny_corpus['train']}" in result.stdout
    )  # the resolved config shows the overrides


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "optim.warmup_step=1"], "unknown key optim.warmup_step; valid keys in optim:"),
        (["--config", "nope.yaml"], "config 'nope.yaml': no such file or preset"),
        (
            ["--set", "data.source=files", "--set", "data.train=/nonexistent/x"],
            "data.train: neither /nonexistent/x.de",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["train", *args, "--dry-run"])
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("tmt: error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.output


def test_real_process_bad_input_has_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_model: [\n")
    out = subprocess.run(
        [sys.executable, "-m", "transformer_mt", "train", "-c", str(bad), "--dry-run"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"tmt: error: {bad}:")


def test_train_runs_and_reports_where_it_ended(
    tiny_corpus: dict[str, Path], tmp_path: Path
) -> None:
    args = [
        *tiny_args(tiny_corpus),
        "--set",
        f"train.out_dir={tmp_path}",
        "--set",
        "train.max_steps=3",
    ]
    result = runner.invoke(app, ["train", *args, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["step"] == 3 and summary["stop"] == "max_steps"
    assert Path(summary["checkpoint"]).name == "step_00000003"
    assert (tmp_path / "checkpoints" / "step_00000003" / "manifest.json").is_file()


@pytest.fixture(scope="module")
def trained(tiny_corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("cli_run")
    args = [
        *tiny_args(tiny_corpus),
        "--set",
        f"train.out_dir={run_dir}",
        "--set",
        "train.max_steps=6",
        "--set",
        "train.save_every=2",
    ]
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    return run_dir


def test_end_to_end_train_average_translate_evaluate(
    trained: Path, tiny_corpus: dict[str, Path], tmp_path: Path
) -> None:
    result = runner.invoke(
        app, ["average", "-m", str(trained), "--last", "2", "-o", str(tmp_path / "avg"), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["averaged"][-1].endswith("step_00000006")
    source = tmp_path / "in.txt"
    source.write_text("kalo mi\n\nnupe ri so\n")
    result = runner.invoke(
        app,
        [
            "translate",
            "-m",
            str(tmp_path / "avg"),
            "-i",
            str(source),
            "-o",
            str(tmp_path / "out.txt"),
            "--set",
            "decode.beam_size=2",
        ],
    )
    assert result.exit_code == 0, result.output
    lines = (tmp_path / "out.txt").read_text().split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""  # 3 outputs, the empty one kept
    result = runner.invoke(
        app,
        [
            "evaluate",
            "-m",
            str(tmp_path / "avg"),
            "--split",
            "valid",
            "--json",
            "--set",
            "decode.beam_size=1",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["sentences"] == 40 and {"bleu", "chrf", "bleu_lc", "signature"} <= set(report)
    hyp = tmp_path / "hyp.txt"
    hyp.write_text("x\n" * 39)
    result = runner.invoke(
        app, ["evaluate", "--hyp", str(hyp), "--ref", f"{tiny_corpus['valid']}.en"]
    )
    assert result.exit_code == 2 and "39 hypotheses but 40 references" in result.stderr
    result = runner.invoke(
        app,
        ["evaluate", "--hyp", f"{tiny_corpus['valid']}.en", "--ref", f"{tiny_corpus['valid']}.en"],
    )
    assert result.exit_code == 0 and "BLEU = 100.00" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["translate", "-m", "/nonexistent"], "/nonexistent: no such file or directory"),
        (["average", "-m", "/nonexistent", "--last", "2", "-o", "x"], "not a run directory"),
        (["evaluate", "--split", "dev"], "--split 'dev': expected test, valid or train"),
    ],
)
def test_bad_paths_and_options_are_one_line_errors(args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.output


def test_translate_streams_stdin_before_eof(trained: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "transformer_mt", "translate", "-m", str(trained)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    try:
        process.stdin.write(b"kalo mi nu\n")
        process.stdin.flush()
        first = process.stdout.readline()  # arrives while stdin is still open
        assert first.endswith(b"\n")
        process.stdin.write(b"\n")
        process.stdin.close()
        rest = process.stdout.read()
        assert rest == b"\n"  # the empty line's empty translation
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()


def test_ctrl_c_ends_translate_waiting_on_stdin_with_130_and_a_closed_stdin_is_one_line(
    trained: Path,
) -> None:
    """Ctrl-C while translate waits for stdin's next line (read on a thread) aborted Python
    ("Fatal Python error: _enter_buffered_busy", exit -6): exiting, it closed sys.stdin, whose
    lock the blocked read held. stdin closed at the start (<&-) was a traceback."""
    command = [sys.executable, "-m", "transformer_mt", "translate", "-m", str(trained)]

    def as_from_a_terminal() -> None:  # a test runner's worker may ignore or block SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, cwd=REPO, preexec_fn=as_from_a_terminal)  # fmt: skip
    try:
        process.stdin.write(b"kalo mi nu\n")
        process.stdin.flush()
        assert process.stdout.readline().endswith(b"\n")  # translated; now it waits for more
        time.sleep(1)  # in its wait
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)  # stdin still open: closed, the read would end and let go
        err = process.stderr.read()
    finally:
        process.kill()
        process.stdin.close()
    assert process.returncode == 130 and b"Fatal Python error" not in err, err
    closed = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            cwd=REPO, timeout=120, preexec_fn=lambda: os.close(0))  # fmt: skip
    assert closed.returncode == 2 and closed.stderr.splitlines()[-1] == (
        "tmt: error: --input -: stdin is closed; pipe the input in, or name a file"
    ), closed.stderr


def test_a_command_forked_for_the_tests_shows_what_a_started_one_shows(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Most tests run `tmt` through tests/cli_processes.py, in children of one process that has
    imported torch: a child must show what `python -m transformer_mt` started afresh shows."""
    monkeypatch.delenv("TMT_TESTS_FORK", raising=False)
    forked_help = cli_processes.popen(["--help"], stdout=subprocess.DEVNULL)
    assert isinstance(forked_help, cli_processes.Process) and forked_help.wait(timeout=60) == 0
    source = tmp_path / "in.txt"
    source.write_text("kalo mi nu\n\nfari giri\n" * 4)
    cases = [
        (["translate", "-m", str(trained)], "kalo mi nu\n\nfari giri\n"),  # stdin -> stdout
        (["translate", "-m", str(tmp_path / "none")], None),  # a one-line error, exit 2
    ]
    for args, given in cases:
        forked = cli_processes.run(args, input=given, timeout=120)
        started = subprocess.run([sys.executable, "-m", "transformer_mt", *args], input=given,
                                 capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip
        assert (forked.returncode, forked.stdout) == (started.returncode, started.stdout), args
        if started.returncode:
            assert forked.stderr == started.stderr
    job = ["translate", "-m", str(trained), "-i", str(source), "--set", "decode.chunk_lines=3"]
    killed = cli_processes.run([*job, "-o", str(tmp_path / "a.txt")],
                               env={**os.environ, "TMT_FAULT": "chunk@2:kill"})  # fmt: skip
    assert killed.returncode == -signal.SIGKILL
    hung = cli_processes.popen([*job, "-o", str(tmp_path / "b.txt")], stdout=subprocess.DEVNULL,
                               env={**os.environ, "TMT_FAULT": "chunk@1:hang"})  # fmt: skip
    with pytest.raises(subprocess.TimeoutExpired):
        hung.wait(timeout=0.5)
    hung.kill()
    assert hung.wait(timeout=60) == -signal.SIGKILL
    # run_tmt sets PYTHONUNBUFFERED, which the child applies itself: forked with or without it.
    for unbuffered in ({"PYTHONUNBUFFERED": "1"}, {"PYTHONUNBUFFERED": ""}):
        env = {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, **unbuffered}
        either = cli_processes.popen(["--help"], env=env, stdout=subprocess.DEVNULL)
        assert isinstance(either, cli_processes.Process) and either.wait(timeout=60) == 0
    # torch sets TORCHINDUCTOR_CACHE_DIR in the test process once inductor's cache is asked for
    # (torchao's int8, torch.compile: torch/_inductor/runtime/cache_dir_utils.py): later
    # commands are still forked.
    later = cli_processes.popen(["--help"], env={**os.environ, "TORCHINDUCTOR_CACHE_DIR":
                                                 str(tmp_path / "inductor")},
                                stdout=subprocess.DEVNULL)  # fmt: skip
    assert isinstance(later, cli_processes.Process) and later.wait(timeout=60) == 0
    # PYTHONFAULTHANDLER (tests/test_serve.py's servers): forked too, and on SIGABRT the child
    # prints its threads' stacks and dies of it, as a started interpreter would.
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "TMT_FAULT": "chunk@1:hang"}
    aborted = cli_processes.popen([*job, "-o", str(tmp_path / "c.txt")], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert isinstance(aborted, cli_processes.Process)
    with pytest.raises(subprocess.TimeoutExpired):
        aborted.wait(timeout=0.5)
    aborted.send_signal(signal.SIGABRT)
    _, stderr = aborted.communicate(timeout=60)
    assert aborted.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in stderr and "most recent call first" in stderr, stderr
    # What an interpreter reads only as it starts must be the server's, else a real one runs.
    other = cli_processes.popen(["--help"], env={**os.environ, "HF_HOME": str(tmp_path)},
                                stdout=subprocess.DEVNULL)  # fmt: skip
    assert isinstance(other, subprocess.Popen) and other.wait(timeout=60) == 0


def test_translate_into_head_exits_quietly(trained: Path) -> None:
    command = f"yes kalo mi nu | head -2000 | {sys.executable} -m transformer_mt translate -m {trained} | head -1"
    out = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert len(out.stdout.splitlines()) == 1
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr


def test_decoding_flags_become_decode_overrides(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformer_mt.translation import translate

    seen = []
    real = translate.load_translator

    def spy(*args, **kwargs):
        translator = real(*args, **kwargs)
        seen.append(translator.config.decode)
        return translator

    monkeypatch.setattr(translate, "load_translator", spy)
    (tmp_path / "in.txt").write_text("kalo mi\n")
    flags = ["--beam", "3", "--lenpen", "1.0", "--max-tokens", "77", "--device", "cpu",
             "--precision", "bf16", "--set", "decode.beam_size=9", "--nbest", "2"]  # fmt: skip
    result = runner.invoke(app, ["translate", "-m", str(trained), "-i", str(tmp_path / "in.txt"),
                                 *flags])  # fmt: skip
    assert result.exit_code == 0, result.output
    decode = seen[-1]
    assert (decode.beam_size, decode.length_penalty, decode.max_tokens) == (3, 1.0, 77)
    assert (decode.device, decode.precision, decode.nbest) == ("cpu", "bf16", 2)  # flags win
    assert len(result.stdout.splitlines()) == 2  # --nbest 2: two rows for the one line
    result = runner.invoke(app, ["evaluate", "-m", str(trained), "--split", "valid", "--json",
                                 "--beam", "1"])  # fmt: skip
    assert result.exit_code == 0 and seen[-1].beam_size == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--beam", "0"], "--beam 0: decode.beam_size = 0: expected >= 1"),
        (["--lenpen", "nan"], "--lenpen nan: decode.length_penalty = nan: expected a finite"),
        (["--max-tokens", "-1"], "--max-tokens -1: decode.max_tokens = -1: expected >= 0"),
        (["--device", "gpu"], "--device gpu: decode.device = 'gpu': expected auto, cpu, cuda"),
        (["--device", "cuda"], "decode.device=cuda: no CUDA device"),
        (["--device", "cpu", "--precision", "fp16"], "decode.precision=fp16 needs a GPU"),
        (["--precision", "fp8"], "--precision fp8: decode.precision = 'fp8': expected one of"),
    ],
)
def test_bad_decoding_flags_are_one_line(
    trained: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str], message: str
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = runner.invoke(app, ["translate", "-m", str(trained), *flags], input="kalo\n")
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output


# --- one convention for every command, and tmt 0.1's spellings for one release ----------------


def test_old_spellings_still_work_with_a_note(trained: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("kalo mi\nnupe ri so\n")
    new = runner.invoke(app, ["translate", "-m", str(trained), "--last", "2", "-i", str(source)])
    assert new.exit_code == 0, new.output
    for old in (
        ["translate", "--checkpoint", str(trained), "--average-last", "2", "-i", str(source)],
        ["translate", "-m", str(trained), "--average-last", "2", "-i", str(source)],
    ):
        result = runner.invoke(app, old)
        assert result.exit_code == 0, result.output
        assert result.stdout == new.stdout  # the same translations
        assert "the old spelling goes in the next release" in result.stderr
    evaluated = runner.invoke(
        app, ["evaluate", "--checkpoint", str(trained), "--src", str(source), "--ref", str(source)]
    )
    assert evaluated.exit_code == 0 and "BLEU = " in evaluated.stdout, evaluated.output
    assert "--src is now --input" in evaluated.stderr
    averaged = runner.invoke(
        app, ["average", str(trained), "--last", "2", "-o", str(tmp_path / "a")]
    )
    assert averaged.exit_code == 0 and (tmp_path / "a" / "manifest.json").is_file()
    assert "a positional model is now -m/--model" in averaged.stderr
    both = runner.invoke(app, ["translate", "-m", str(trained), "--checkpoint", str(trained)])
    assert both.exit_code == 2 and "--checkpoint is the old spelling of --model" in both.stderr


def test_every_command_that_writes_refuses_to_replace_without_overwrite(
    trained: Path, tmp_path: Path
) -> None:
    taken = tmp_path / "taken.txt"
    taken.write_text("keep me\n")
    occupied = tmp_path / "occupied"
    averaged = runner.invoke(
        app, ["average", "-m", str(trained), "--last", "1", "-o", str(occupied)]
    )
    assert averaged.exit_code == 0, averaged.output
    cases = [
        ["translate", "-m", str(trained), "-o", str(taken)],  # stdin into an existing file
        ["translate", "-m", str(trained), "-i", str(taken), "-o", str(taken)],
        ["average", "-m", str(trained), "--last", "1", "-o", str(occupied)],
        ["plot", "-m", str(trained), "-o", str(taken)],
    ]
    for args in cases:
        result = runner.invoke(app, args, input="kalo mi\n")
        assert result.exit_code == 2, (args, result.output)
        assert "--overwrite" in result.stderr or "is the input file" in result.stderr, args
    assert taken.read_text() == "keep me\n"
    result = runner.invoke(app, ["translate", "-m", str(trained), "-o", str(taken), "--overwrite"],
                           input="kalo mi\n")  # fmt: skip
    assert result.exit_code == 0 and taken.read_text().count("\n") == 1


@pytest.mark.parametrize("command", ["train", "evaluate", "export", "average", "plot"])
def test_every_command_that_prints_a_result_takes_json(command: str) -> None:
    assert "--json" in runner.invoke(app, [command, "--help"]).stdout


@pytest.mark.parametrize("command", ["translate", "evaluate", "export", "average", "plot"])
def test_every_command_names_its_model_with_m(command: str) -> None:
    help_text = runner.invoke(app, [command, "--help"]).stdout
    assert "--model" in help_text and "-m" in help_text
    assert "--checkpoint" not in help_text and "--average-last" not in help_text  # hidden


SCRIPTS = sorted((REPO / "scripts").glob("*.py"))


def test_every_script_ends_on_bad_input_as_tmt_does() -> None:
    """The benchmarks and fixture writers users run from scripts/ end through run_script: a
    missing model or a GPU asked for where there is none is one line and exit 2, not a traceback
    (bench_train.py --device cuda was torch's AssertionError, bench_decode.py a TmtError's)."""
    main_blocks = {path.name: path.read_text().partition('if __name__ == "__main__":')[2]
                   for path in SCRIPTS}  # fmt: skip
    assert len(main_blocks) >= 15
    assert [name for name, block in main_blocks.items() if "run_script(main" not in block] == []
    # Each reads its options with argparse: copy_fixture.py, which read none, took --help for a
    # run and rewrote tests/fixtures/copy_model.
    assert [path.name for path in SCRIPTS if "ArgumentParser(" not in path.read_text()] == []
    for name in ("copy_fixture.py", "length_fixture.py", "compat_fixture.py"):  # they write
        done = subprocess.run([sys.executable, f"scripts/{name}", "--help"], cwd=REPO,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0 and done.stdout.startswith(f"usage: {name}"), done.stderr
    cases = [
        (["bench_decode.py", "--checkpoint", str(REPO / "no-such-run")], "no-such-run: no such"),
        (["bench_loss.py", "--vocab", "-5"], "--vocab -5: expected a positive integer"),
        (
            ["bench_gpu.py", "decode_profile", "--device", "cpu", "--model", "m", "--lines", "-5"],
            "--lines -5: expected a number of lines >= 1",
        ),  # a slice [:-5]: all but five
        (["bench_gpu.py", "decode", "--device", "cpu"], "decode decodes a model: name it with"),
        (  # a run directory OUT/.. that e2e would have removed first
            ["bench_gpu.py", "e2e", "--device", "cpu", "--out", "x", "--label", ".."],
            "--label '..': expected a plain name",
        ),
    ]
    import torch

    if not torch.cuda.is_available():
        cases.append((["bench_train.py", "--device", "cuda"], "--device=cuda: no CUDA device"))
    for args, message in cases:
        done = subprocess.run([sys.executable, f"scripts/{args[0]}", *args[1:]], cwd=REPO,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and message in done.stderr.splitlines()[-1]


def test_an_error_ends_a_command_on_one_line_unless_it_is_a_bug(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """exits.user_error, what the CLI and the scripts end with: bad input and failed writes on
    one line with their exit codes; a bug, a broken pipe and TMT_DEBUG=1 keep the traceback."""
    import errno

    from transformer_mt.common import exits

    monkeypatch.delenv("TMT_DEBUG", raising=False)
    named = exits.TmtError("exists", param="output")
    assert exits.user_error(named, lambda name: "--" + name) == ("--output exists", 2)
    assert exits.user_error(named) == ("output exists", 2)
    full = OSError(errno.ENOSPC, "No space left on device", "out.txt")
    assert exits.user_error(full) == ("out.txt: No space left on device", exits.NO_ROOM)
    denied = PermissionError(errno.EACCES, "Permission denied", "/root/x")
    assert exits.user_error(denied) == ("/root/x: Permission denied", exits.BAD_INPUT)
    assert exits.user_error(BrokenPipeError(errno.EPIPE, "Broken pipe")) is None
    assert exits.user_error(KeyError("bug")) is None
    monkeypatch.setenv("TMT_DEBUG", "1")
    assert exits.user_error(named) is None


def test_a_library_s_warning_is_printed_once() -> None:
    """datasets and huggingface_hub print their warnings with a handler of their own and pass
    them on to the root logger, where tmt's handler printed them a second time (each retry of an
    unreachable hub twice); transformers does the same where CI is set. In a process of its own:
    under pytest the root logger has pytest's handlers, and tmt's is not installed."""
    code = (
        "import logging, sys\n"
        "from transformer_mt import cli\n"
        "cli._log_to_stderr()\n"
        "hub = logging.getLogger('huggingface_hub')\n"
        "hub.addHandler(logging.StreamHandler(sys.stderr))\n"
        "logging.getLogger('huggingface_hub.utils._http').warning('Retrying in 1s')\n"
        "quiet = logging.getLogger('transformers')\n"
        "quiet.addHandler(logging.StreamHandler(sys.stderr)); quiet.propagate = False\n"
        "quiet.warning('said by transformers')\n"
        "logging.getLogger('transformer_mt.x').warning('said by tmt')\n"
        "cli._log_to_stderr()\n"  # a second command in the same process adds no handler
        "logging.getLogger('transformer_mt.x').info('said again')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "Retrying in 1s",
        "said by transformers",
        "tmt: said by tmt",
        "tmt: said again",
    ]


def test_every_shell_script_answers_help_without_running() -> None:
    """scripts/*.sh: -h and --help print the script's own comment and exit 0 before anything
    runs (`bash scripts/budget_matrix.sh --help` started hours of training); one that takes its
    settings from the environment (NO_ARGS=1) refuses an argument with exit 2. All through
    scripts/args.sh, which each sources before anything else."""
    scripts = sorted(set((REPO / "scripts").glob("*.sh")) - {REPO / "scripts" / "args.sh"})
    assert len(scripts) >= 10
    for path in scripts:
        header = path.read_text().splitlines()[1].removeprefix("# ")
        for flag in ("-h", "--help"):
            done = subprocess.run(["bash", str(path), flag], capture_output=True, text=True,
                                  timeout=60)  # fmt: skip
            assert done.returncode == 0 and done.stdout.startswith(header), (path.name, done)
        if 'NO_ARGS=1 . "$(dirname "$0")/args.sh"' in path.read_text():
            done = subprocess.run(["bash", str(path), "now"], capture_output=True, text=True,
                                  timeout=60)  # fmt: skip
            assert done.returncode == 2 and "no arguments" in done.stderr, (path.name, done)
