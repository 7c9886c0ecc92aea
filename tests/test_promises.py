"""The promises an independent probe broke, one section per class; each test failed before its fix.

docs/reliability.md lists each promise with its test and what the test does to break it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import cli_processes
import pytest
import torch
from conftest import reverse_pairs, write_parallel
from test_train import cli_args, numbers, records, run_tmt, with_train
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.common import files
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, apply_overrides
from transformer_mt.data.batches import prepare_data
from transformer_mt.runs import checkpoint, metrics, run
from transformer_mt.training.train import train

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


@pytest.fixture
def train_cfg(tiny_cfg: Config) -> Config:
    return with_train(tiny_cfg, max_steps=8, log_every=1, valid_every=4, save_every=4, keep_last=5)


@pytest.fixture(scope="module")
def finished(tiny_cfg: Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 8-step run, checkpoints at 4 and 8 (never modified: tests copy it)."""
    out = tmp_path_factory.mktemp("finished")
    changes = {"max_steps": 8, "log_every": 1, "valid_every": 4, "save_every": 4, "keep_last": 5}
    train(with_train(tiny_cfg, out_dir=str(out), **changes))
    return out


def copy_run(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(source, target, symlinks=True)
    return target


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory by relative path, with its bytes."""
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and not p.is_symlink() and p.name != ".lock"
    }


def one_line_error(stderr: str) -> str:
    """The single `tmt: error:` line of a failed command (and no traceback)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("tmt: error:")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


# --- 1. a finished run stays finished ----------------------------------------------------------


@pytest.mark.parametrize(
    "budget",
    [
        {"max_steps": 8},
        # Saves and validations every 3 steps of a 4-step epoch: the final save follows the
        # rollover to epoch 1, where a re-run used to train a whole epoch more.
        {"max_steps": 0, "max_epochs": 1, "save_every": 3, "valid_every": 3},
        {"max_steps": 50, "valid_every": 2, "patience": 2},  # with lr 0: stops by patience
        # A last logging interval cut short: its partial record was written again by a rerun,
        # after the stop record (round 3 of the probe, docs/reliability.md P20), every end.
        {"max_steps": 8, "log_every": 3},
        {"max_steps": 0, "max_epochs": 1, "save_every": 3, "valid_every": 3, "log_every": 3},
        {"max_steps": 50, "valid_every": 2, "patience": 2, "log_every": 3},
        {"max_steps": 0, "max_minutes": 0.001, "log_every": 1000},
    ],
    ids=[
        "max_steps",
        "max_epochs",
        "patience",
        "max_steps_partial",
        "max_epochs_partial",
        "patience_partial",
        "max_minutes_partial",
    ],
)
def test_rerunning_a_finished_run_trains_nothing(
    train_cfg: Config, tmp_path: Path, budget: dict
) -> None:
    cfg = with_train(train_cfg, out_dir=str(tmp_path), **budget)
    if "patience" in budget:
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr_scale=0.0))
    first = train(cfg)
    before = snapshot(tmp_path)
    again = train(cfg)
    for key in ("step", "epoch", "stop", "best_step"):
        assert again[key] == first[key], key
    assert snapshot(tmp_path) == before  # no step, no record, no checkpoint rewritten


# --- 2. averaging never destroys a training checkpoint -----------------------------------------


def test_average_refuses_to_overwrite_a_training_checkpoint(finished: Path, tmp_path: Path) -> None:
    run_dir = copy_run(finished, tmp_path)
    target = run.checkpoint_dir(run_dir, 8)
    before = snapshot(target)
    for output in (target, run_dir / "checkpoints" / "averaged"):
        result = runner.invoke(app, ["average", "-m", str(run_dir), "--last", "2",
                                     "-o", str(output), "--overwrite"])  # fmt: skip
        assert result.exit_code == 2, result.output
        assert str(output) in one_line_error(result.stderr)
    assert snapshot(target) == before and checkpoint.verify(target) is None
    assert not (run_dir / "checkpoints" / "averaged").exists()
    # An averaged model may be replaced by a new average (training's OUT_DIR/average is), when
    # asked to: --overwrite.
    args = ["average", "-m", str(run_dir), "-o", str(tmp_path / "avg"), "--last", "2"]
    for extra in ([], ["--overwrite"]):
        result = runner.invoke(app, [*args, *extra])
        assert result.exit_code == 0, result.output
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "exists; add --overwrite" in one_line_error(result.stderr)


def test_resume_skips_a_model_only_checkpoint_under_a_step_name(
    tiny_cfg: Config, finished: Path, tmp_path: Path
) -> None:
    run_dir = copy_run(finished, tmp_path)
    model_only = checkpoint.read(run.checkpoint_dir(run_dir, 8))
    checkpoint.write(run.checkpoint_dir(run_dir, 9), 9, model_only.config,
                     model_only.state_dict, model_only.tokenizer_bytes)  # fmt: skip
    assert run.latest_valid(run_dir) == run.checkpoint_dir(run_dir, 8)


# --- 3. an output is never an input ------------------------------------------------------------


def test_translate_refuses_an_output_that_is_an_input(finished: Path, tmp_path: Path) -> None:
    source = tmp_path / "f.txt"
    source.write_text("kalo mi\nnu pe\n")
    (tmp_path / "link.txt").symlink_to(source)
    os.link(source, tmp_path / "hard.txt")
    model_file = run.checkpoint_dir(finished, 8) / "model.pt"
    model_bytes = model_file.read_bytes()
    for output in (source, tmp_path / "link.txt", tmp_path / "hard.txt", model_file):
        result = runner.invoke(
            app, ["translate", "-m", str(finished), "-i", str(source), "-o", str(output)]
        )
        assert result.exit_code == 2, result.output
        assert f"--output {output}" in one_line_error(result.stderr)
    assert source.read_text() == "kalo mi\nnu pe\n" and model_file.read_bytes() == model_bytes


def test_a_failed_translation_keeps_the_old_output(
    finished: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformer_mt.translation import streams

    source, output = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("kalo mi\n")
    output.write_text("yesterday's translations\n")

    def fail(translator, lines, first_line=0, prefixes=None, matches=None, **_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(streams, "translate_lines", fail)  # both paths translate through it
    # The streaming path (stdin into a file): no temporary is left.
    result = runner.invoke(app, ["translate", "-m", str(finished), "-o", str(output),
                                 "--overwrite"], input="kalo mi\n")  # fmt: skip
    assert result.exit_code == 4
    assert output.read_text() == "yesterday's translations\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]
    # A file job: the old output stays; the job directory keeps what was committed (nothing).
    result = runner.invoke(app, ["translate", "-m", str(finished), "-i", str(source),
                                 "-o", str(output), "--overwrite"])  # fmt: skip
    assert result.exit_code == 4
    assert output.read_text() == "yesterday's translations\n"
    job = tmp_path / "out.txt.tmt-job"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt", job.name]
    assert sorted(p.name for p in job.iterdir()) == [".lock", "job.json"]


# --- 4. a run directory has one owner ----------------------------------------------------------


# slow: make test keeps its promise with ::test_a_held_run_directory_is_refused_in_process and
# ::test_a_lock_a_crashed_holder_left_is_taken_over_in_process (the same lock, in this process)
@pytest.mark.slow
def test_a_second_trainer_is_refused_and_a_dead_ones_lock_is_taken_over(
    train_cfg: Config, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    args = cli_args(with_train(train_cfg, max_steps=50), run_dir)
    env = {**os.environ, "TMT_FAULT": "step@2:hang", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "transformer_mt", *args]
    first = subprocess.Popen(command, env=env, cwd=REPO, stderr=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not (run_dir / "metrics.jsonl").exists() or not records(run_dir):
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.2)
        second = run_tmt(args)
        assert second.returncode == 2
        line = one_line_error(second.stderr)
        assert f"pid {first.pid} on {socket.gethostname()}" in line and str(run_dir) in line
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    third = run_tmt(cli_args(with_train(train_cfg, max_steps=3), run_dir))
    assert third.returncode == 0, third.stderr
    assert f"pid {first.pid}" in third.stderr and "gone" in third.stderr  # took the stale lock


def test_a_lock_a_crashed_holder_left_is_taken_over_in_process(
    train_cfg: Config, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # What a SIGKILLed trainer leaves: the lock file naming it, and no flock (the kernel dropped
    # it with the process). The next trainer takes it, says whose it was, and trains.
    (tmp_path / run.LOCK_FILE).write_text("pid 999999 on a-crashed-host", encoding="utf-8")
    with caplog.at_level("INFO"):
        assert train(with_train(train_cfg, out_dir=str(tmp_path), max_steps=2))["step"] == 2
    assert "pid 999999 on a-crashed-host" in caplog.text and "gone" in caplog.text


def test_a_held_run_directory_is_refused_in_process(train_cfg: Config, tmp_path: Path) -> None:
    holder = run.RunLock(tmp_path)
    holder.acquire()
    try:
        with pytest.raises(TmtError, match=f"in use by pid {os.getpid()}"):
            train(with_train(train_cfg, out_dir=str(tmp_path)))
    finally:
        holder.release()
    assert train(with_train(train_cfg, out_dir=str(tmp_path), max_steps=2))["step"] == 2


@pytest.mark.slow
def test_a_held_run_directory_refuses_every_rank_of_a_job(
    train_cfg: Config, tmp_path: Path
) -> None:
    holder = run.RunLock(tmp_path / "run")
    holder.acquire()
    try:
        start = time.monotonic()
        refused = run_tmt(cli_args(train_cfg, tmp_path / "run"), ranks=2, timeout=120)
        assert refused.returncode != 0 and time.monotonic() - start < 60
        assert f"in use by pid {os.getpid()}" in refused.stderr
        assert not (tmp_path / "run" / "checkpoints").exists()
    finally:
        holder.release()


# --- 5. the logged losses around a resume --------------------------------------------------------


def test_logged_losses_after_a_resume_equal_the_uninterrupted_runs(
    train_cfg: Config, tmp_path: Path
) -> None:
    # A record every 3 steps, checkpoints every 4: the checkpoint at 4 falls inside a record.
    # A run stopped after step 4 and resumed to 8 leaves what a kill after that save leaves.
    cfg = with_train(train_cfg, log_every=3)
    train(with_train(cfg, out_dir=str(tmp_path / "straight")))
    train(with_train(cfg, out_dir=str(tmp_path / "resumed"), max_steps=4))
    train(with_train(cfg, out_dir=str(tmp_path / "resumed")))
    # ... and a partial record of updates 7 and 8 when the run ends
    assert [r["step"] for r in records(tmp_path / "straight") if "loss" in r] == [3, 6, 8]
    assert numbers(tmp_path / "resumed") == numbers(tmp_path / "straight")


# --- 6. only the checkpoint's own plain files are read -----------------------------------------


def set_file_hash(path: Path, name: str) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = hashlib.sha256((path / name).read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))


def hostile(kind: str, path: Path, outside: Path) -> None:
    manifest_file = path / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    if kind in ("parent", "absolute"):
        name = "../../../secret.bin" if kind == "parent" else str(outside)
        manifest["files"][name] = hashlib.sha256(outside.read_bytes()).hexdigest()
        manifest_file.write_text(json.dumps(manifest))
    elif kind == "fifo_model":
        (path / "model.pt").unlink()
        os.mkfifo(path / "model.pt")
    elif kind == "fifo_manifest":
        manifest_file.unlink()
        os.mkfifo(manifest_file)
    elif kind == "dev_zero_model":
        (path / "model.pt").unlink()
        (path / "model.pt").symlink_to("/dev/zero")
    elif kind == "huge_manifest":
        manifest["padding"] = "x" * (5 << 20)
        manifest_file.write_text(json.dumps(manifest))


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail instead of hanging: SIGALRM interrupts even a blocked open() (PEP 475)."""

    def expire(signum, frame):
        raise TimeoutError(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize(
    "kind", ["parent", "absolute", "fifo_model", "fifo_manifest", "dev_zero_model", "huge_manifest"]
)
def test_hostile_checkpoint_files_are_refused_without_hanging(
    train_cfg: Config, finished: Path, tmp_path: Path, kind: str, bounded_reads: None
) -> None:
    run_dir = copy_run(finished, tmp_path)
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"not yours")
    newest = run.checkpoint_dir(run_dir, 8)
    hostile(kind, newest, outside)
    with pytest.raises(TmtError) as err:  # read directly: one line, at once
        checkpoint.read(newest, train_state=True)
    assert str(newest) in str(err.value) and "\n" not in str(err.value)
    # Through the run, translate and resume fall back to the checkpoint before it.
    assert run.load_model(run_dir).path == run.checkpoint_dir(run_dir, 4)
    resumed = run.resume(run_dir, with_train(train_cfg, out_dir=str(run_dir), max_steps=9))
    assert resumed is not None and resumed.path == run.checkpoint_dir(run_dir, 4)


# slow: make test keeps its promise with
# test_promises2.py::test_what_tmt_reads_back_must_be_a_plain_file_and_no_read_hangs
@pytest.mark.slow
def test_a_fifo_in_a_checkpoint_hangs_no_command(
    train_cfg: Config, finished: Path, tmp_path: Path
) -> None:
    run_dir = copy_run(finished, tmp_path)
    newest = run.checkpoint_dir(run_dir, 8)
    hostile("fifo_model", newest, tmp_path)
    direct = cli_processes.run(["translate", "-m", str(newest)], input="kalo mi\n", timeout=60)
    assert direct.returncode == 2 and str(newest) in one_line_error(direct.stderr)
    resumed = run_tmt(cli_args(with_train(train_cfg, max_steps=9), run_dir), timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming" in resumed.stderr and "step_00000004" in resumed.stderr


def test_best_link_outside_the_checkpoints_is_ignored(finished: Path, tmp_path: Path) -> None:
    run_dir = copy_run(finished, tmp_path)
    elsewhere = copy_run(finished, tmp_path / "other")
    link = run_dir / "checkpoints" / "best"
    link.unlink()
    link.symlink_to(run.checkpoint_dir(elsewhere, 4).resolve())
    assert run.best(run_dir) is None
    assert run.load_model(run_dir).path == run.checkpoint_dir(run_dir, 8)


# --- 8. a full disk at any write ---------------------------------------------------------------


def enospc(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


class FullAfter:
    """A file handle on a disk that is full once `marker` is about to be written."""

    def __init__(self, handle, marker: str) -> None:
        self.handle, self.marker, self.name = handle, marker, handle.name

    def write(self, text: str) -> int:
        if self.marker in text:
            enospc()
        return self.handle.write(text)

    def flush(self) -> None:
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


def test_full_disk_on_the_metrics_log(
    train_cfg: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_init = metrics.MetricsLog.__init__

    def init(self, *args, **kwargs):  # the disk fills up after the checkpoint of step 4
        real_init(self, *args, **kwargs)
        self.handle = FullAfter(self.handle, '"step": 6')

    monkeypatch.setattr(metrics.MetricsLog, "__init__", init)
    with pytest.raises(TmtError) as err:
        train(with_train(train_cfg, out_dir=str(tmp_path)))
    assert err.value.exit_code == 4
    assert "metrics.jsonl" in str(err.value) and "No space left" in str(err.value)
    assert run.latest_valid(tmp_path) == run.checkpoint_dir(tmp_path, 4)


@pytest.mark.parametrize("name", ["config.yaml", "tokenizer.model", "metrics.jsonl"])
def test_full_disk_on_the_run_files_loses_no_checkpoint(
    train_cfg: Config, finished: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    run_dir = copy_run(finished, tmp_path)
    before = snapshot(run_dir / "checkpoints")
    real = files.atomic_write
    monkeypatch.setattr(
        files,
        "atomic_write",
        lambda path, data: enospc() if path.name == name else real(path, data),
    )
    with pytest.raises(TmtError) as err:
        train(with_train(train_cfg, out_dir=str(run_dir), max_steps=10))
    assert err.value.exit_code == 4 and str(run_dir) in str(err.value)
    assert snapshot(run_dir / "checkpoints") == before


def limit_file_size(limit: int) -> Callable[[], None]:
    def apply() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_full_data_cache_is_one_line(train_cfg: Config, tmp_path: Path) -> None:
    args = [*cli_args(train_cfg, tmp_path / "run"), "--set", f"data.cache_dir={tmp_path / 'c'}"]
    result = subprocess.run(
        [sys.executable, "-m", "transformer_mt", *args], capture_output=True, text=True,
        cwd=REPO, preexec_fn=limit_file_size(2000), timeout=120,
    )  # fmt: skip
    assert result.returncode == 4, result.stderr[-2000:]
    assert str(tmp_path / "c") in one_line_error(result.stderr)


def test_full_disk_on_translate_output_and_average(finished: Path, tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("kalo mi\n")
    out = runner.invoke(app, ["translate", "-m", str(finished), "-i", str(tmp_path / "in.txt"),
                              "-o", "/dev/full"])  # fmt: skip
    assert out.exit_code == 4 and "/dev/full" in one_line_error(out.stderr)
    result = subprocess.run(
        [sys.executable, "-m", "transformer_mt", "average", "-m", str(finished), "--last", "2",
         "-o", str(tmp_path / "avg")],
        capture_output=True, text=True, cwd=REPO, preexec_fn=limit_file_size(4096), timeout=120,
    )  # fmt: skip
    assert result.returncode == 4
    assert str(tmp_path / "avg") in one_line_error(result.stderr)
    assert not (tmp_path / "avg").exists() and not list(tmp_path.glob(".tmp-avg*"))


# --- 9. hash-consistent but malformed contents -------------------------------------------------


def rewrite(path: Path, name: str, change: Callable[[dict], object]) -> None:
    """Change what `name` holds (in place, or by returning a replacement) and forge a manifest
    that vouches for it."""
    payload = torch.load(path / name, weights_only=True)
    replaced = change(payload)
    torch.save(payload if replaced is None else replaced, path / name)
    set_file_hash(path, name)


def drop_files(path: Path) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["files"]
    (path / "manifest.json").write_text(json.dumps(manifest))


def drop_a_weight(payload: dict) -> None:
    del payload["model"]["encoder_layers.0.ffn.linear1.weight"]


MALFORMED = {
    "manifest_without_files": drop_files,
    "weights_not_a_dict": lambda p: rewrite(p, "model.pt", lambda d: d.update(model=[1, 2])),
    "weights_missing_a_key": lambda p: rewrite(p, "model.pt", drop_a_weight),
    "weights_wrong_shape": lambda p: rewrite(
        p, "model.pt", lambda d: d["model"].update({"embedding.weight": torch.zeros(3, 3)})
    ),
    "config_not_a_dict": lambda p: rewrite(p, "model.pt", lambda d: d.update(config="tiny")),
    "payload_not_a_dict": lambda p: rewrite(p, "model.pt", lambda d: [d]),
    "optimizer_wrong_shape": lambda p: rewrite(
        p,
        "train_state.pt",
        lambda d: d["optimizer"]["state"][0].update(exp_avg=torch.zeros(2)),
    ),
    "rng_missing": lambda p: rewrite(p, "train_state.pt", lambda d: d.pop("rng") and None),
    "progress_not_a_dict": lambda p: rewrite(p, "train_state.pt", lambda d: d.update(progress=3)),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_contents_are_one_line_and_resume_falls_back(
    train_cfg: Config, finished: Path, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = copy_run(finished, tmp_path)
    newest = run.checkpoint_dir(run_dir, 8)
    MALFORMED[kind](newest)
    with pytest.raises(TmtError) as err:
        checkpoint.read(newest, train_state=True)
    assert str(newest) in str(err.value) and "\n" not in str(err.value)
    with caplog.at_level("INFO"):
        summary = train(with_train(train_cfg, out_dir=str(run_dir), max_steps=9))
    assert summary["step"] == 9
    assert any(m.startswith("resuming") and "step_00000004" in m for m in caplog.messages), (
        caplog.messages
    )


# --- 10. malformed input deep inside a line ----------------------------------------------------


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"translation": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested too deeply"),
        ('{"translation": {"de": "a", "en": ' + "1" * 5000 + "}}", "invalid JSON"),
        ('{"translation": {"de": "a", "en": "b"}, "x": ' + "1" * 5000 + "}", "invalid JSON"),
    ],
    ids=["deep_nesting", "huge_number_field", "huge_number_elsewhere"],
)
def test_jsonl_lines_that_break_the_parser(
    tiny_cfg: Config, tmp_path: Path, line: str, message: str
) -> None:
    path = tmp_path / "train.jsonl"
    good = json.dumps({"translation": {"de": "ka lo", "en": "lo ka"}})
    path.write_text(f"{good}\n{line}\n")
    cfg = dataclasses.replace(
        tiny_cfg,
        data=dataclasses.replace(tiny_cfg.data, source="jsonl", train=str(path), valid=str(path)),
    )
    with pytest.raises(TmtError, match=f"{path}:2: {message}"):
        prepare_data(cfg)


def test_scoring_empty_files_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "hyp").write_text("")
    (tmp_path / "ref").write_text("a reference\n")
    result = runner.invoke(app, ["evaluate", "--hyp", str(tmp_path / "hyp"),
                                 "--ref", str(tmp_path / "ref")])  # fmt: skip
    assert result.exit_code == 2
    assert str(tmp_path / "hyp") in one_line_error(result.stderr)


# --- 11. an empty validation split -------------------------------------------------------------


def test_an_empty_validation_split_is_refused_before_training(
    train_cfg: Config, tmp_path: Path
) -> None:
    empty = write_parallel(tmp_path / "valid", [])
    cfg = dataclasses.replace(train_cfg, data=dataclasses.replace(train_cfg.data, valid=str(empty)))
    with pytest.raises(TmtError, match=r"data.valid .*0 pairs.*train.valid_every=0"):
        train(with_train(cfg, out_dir=str(tmp_path / "run")))
    assert not (tmp_path / "run" / "checkpoints").exists()
    # Training without validation is a choice the user makes explicitly.
    summary = train(with_train(cfg, out_dir=str(tmp_path / "run"), valid_every=0, max_steps=2))
    assert summary["step"] == 2 and run.best(tmp_path / "run") is None
    with pytest.raises(TmtError, match="train.patience needs validation"):
        with_train(cfg, valid_every=0, patience=3)


# --- 12. another experiment in the same run directory ------------------------------------------


def test_resuming_with_other_training_settings_is_refused_unless_forced(
    train_cfg: Config, tmp_path: Path
) -> None:
    cfg = with_train(train_cfg, out_dir=str(tmp_path), max_steps=4)
    train(cfg)
    before = snapshot(tmp_path)
    other = apply_overrides(with_train(cfg, max_steps=8), ["optim.lr_scale=2", "train.seed=7"])
    with pytest.raises(TmtError) as err:
        train(other)
    message = str(err.value)
    assert "optim.lr_scale 1.0 -> 2.0" in message and "train.seed 1 -> 7" in message
    assert "train.resume=force" in message and "\n" not in message
    assert snapshot(tmp_path) == before  # refused before anything was written
    # Budgets, logging and checkpoint cadence may change: the run continues.
    longer = train(with_train(cfg, max_steps=6, log_every=2, save_every=3, keep_last=4))
    assert longer["step"] == 6
    forced = train(with_train(other, resume="force"))
    assert forced["step"] == 8
    changes = [r for r in records(tmp_path) if "config_changed" in r]
    assert changes == [
        {"step": 6, "config_changed": ["optim.lr_scale 1.0 -> 2.0", "train.seed 1 -> 7"]}
    ]


# --- 13. small: blame, directories, the --hyp encoding hint ------------------------------------


def test_a_directory_given_as_a_data_file_is_named_as_such(
    tiny_cfg: Config, tmp_path: Path
) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "pre.de").mkdir()
    write_parallel(tmp_path / "ok", reverse_pairs(3, 1))
    cases = [
        ("tsv", str(tmp_path / "dir"), f"{tmp_path / 'dir'}: is a directory"),
        ("files", str(tmp_path / "pre"), f"{tmp_path / 'pre.de'}: is a directory"),
    ]
    for source, location, message in cases:
        data = dataclasses.replace(tiny_cfg.data, source=source, train=location)
        with pytest.raises(TmtError, match=message):
            prepare_data(dataclasses.replace(tiny_cfg, data=data))
    result = runner.invoke(app, ["evaluate", "--hyp", str(tmp_path / "dir"),
                                 "--ref", str(tmp_path / "ok.en")])  # fmt: skip
    assert result.exit_code == 2 and "is a directory" in one_line_error(result.stderr)


def test_hyp_encoding_error_gives_advice_that_applies(tmp_path: Path) -> None:
    (tmp_path / "hyp").write_bytes(b"fine\nbad \xff byte\n")
    (tmp_path / "ref").write_text("fine\nfine\n")
    result = runner.invoke(app, ["evaluate", "--hyp", str(tmp_path / "hyp"),
                                 "--ref", str(tmp_path / "ref")])  # fmt: skip
    assert result.exit_code == 2
    line = one_line_error(result.stderr)
    assert f"{tmp_path / 'hyp'}:2: invalid UTF-8" in line and "data.encoding_errors" not in line


def test_cuda_asked_for_where_there_is_none(
    train_cfg: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TmtError, match="train.device=cuda: no CUDA device"):
        train(with_train(train_cfg, out_dir=str(tmp_path), device="cuda"))


# --- beyond the probe: interrupted swaps and a damaged data cache ------------------------------


def test_a_kill_inside_the_same_step_swap_loses_no_checkpoint(
    finished: Path, tmp_path: Path
) -> None:
    # Saving a step again renames the old directory aside, then the new one into place; a kill
    # between the two renames leaves only the aside copy, which the next start puts back.
    run_dir = copy_run(finished, tmp_path)
    newest = run.checkpoint_dir(run_dir, 8)
    newest.rename(newest.with_name(".old-step_00000008-999999"))
    run.sweep(run_dir)
    assert checkpoint.verify(newest) is None
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")] == []


def test_a_damaged_data_cache_entry_is_rebuilt(
    tiny_cfg: Config, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = dataclasses.replace(
        tiny_cfg, data=dataclasses.replace(tiny_cfg.data, cache_dir=str(tmp_path))
    )
    first = prepare_data(cfg)
    for meta in (tmp_path / "encoded").glob("*/meta.json"):
        meta.write_text("{torn")
    with caplog.at_level("WARNING"):
        again = prepare_data(cfg)
    assert len(again.train) == len(first.train)
    assert any("rebuilding" in m for m in caplog.messages)
