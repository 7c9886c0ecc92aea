"""The fault and bad-input matrix (docs/reliability.md): every guarantee, made to fail on purpose.

Faults come from TMT_FAULT fault points (transformer_mt/common/faults.py), so they happen exactly where a
test says. Tests that need more than 30 s are marked slow and run by `make test-reliability`.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import write_parallel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_train import cli_args, final_weights, numbers, records, run_tmt, with_train
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.common import textio
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, apply_overrides
from transformer_mt.data.batches import prepare_data
from transformer_mt.network.model import Transformer
from transformer_mt.runs import averaging, checkpoint, run, train_state
from transformer_mt.training.loss import Objective
from transformer_mt.training.optim import build_optimizer
from transformer_mt.training.step import Optimization, train_step
from transformer_mt.training.train import train
from transformer_mt.translation import translate

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "transformer_mt"
runner = CliRunner()


@pytest.fixture
def train_cfg(tiny_cfg: Config) -> Config:
    return with_train(tiny_cfg, max_steps=8, log_every=1, valid_every=4, save_every=4, keep_last=5)


@pytest.fixture(scope="module")
def straight(tiny_cfg: Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 8-step run every fault run is compared with."""
    run_dir = tmp_path_factory.mktemp("straight")
    train(
        with_train(
            tiny_cfg,
            max_steps=8,
            log_every=1,
            valid_every=4,
            save_every=4,
            keep_last=5,
            out_dir=str(run_dir),
        )
    )
    return run_dir


def same_run(a: Path, b: Path, step: int = 8) -> None:
    assert numbers(a) == numbers(b)  # every logged loss and validation figure, bit for bit
    wa, wb = final_weights(a, step), final_weights(b, step)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    sa = checkpoint.read(a / "checkpoints" / f"step_{step:08d}", train_state=True).train_state[
        "optimizer"
    ]["state"]
    sb = checkpoint.read(b / "checkpoints" / f"step_{step:08d}", train_state=True).train_state[
        "optimizer"
    ]["state"]
    assert all(
        torch.equal(sa[i][k], sb[i][k])
        for i in sa
        for k in sa[i]
        if isinstance(sa[i][k], torch.Tensor)
    )


def checkpoint_size(run_dir: Path, step: int) -> int:
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    return (path / "model.pt").stat().st_size + (path / "train_state.pt").stat().st_size


# --- F1/F2 kill at any moment, resume bit-exact ------------------------------------------------


# Each fault with the checkpoint that must survive it (None: killed before the first save).
@pytest.mark.parametrize(("fault", "survivor"), [("save8_bytes@{mid}:kill", 4)])
def test_kill_and_resume_is_bit_exact(
    train_cfg: Config, straight: Path, tmp_path: Path, fault: str, survivor: int | None
) -> None:
    kill_and_resume(train_cfg, straight, tmp_path, fault, survivor)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "survivor"),
    [
        ("step@6:kill", 4),
        ("step@3:exit", None),
        ("step@4:kill", None),
        ("step@8:kill", 4),
        ("save4_bytes@100:kill", None),
        ("after_save@8:kill", 8),  # after the final save: the same command trains nothing more
    ],
)
def test_kill_and_resume_is_bit_exact_more_points(
    train_cfg: Config, straight: Path, tmp_path: Path, fault: str, survivor: int | None
) -> None:
    kill_and_resume(train_cfg, straight, tmp_path, fault, survivor)


def kill_and_resume(
    train_cfg: Config, straight: Path, tmp_path: Path, fault: str, survivor: int | None
) -> None:
    """Run with `fault`, check what survived it, run the same command again: the uninterrupted
    run, bit for bit."""
    fault = fault.format(mid=checkpoint_size(straight, 8) // 2)
    run_dir = tmp_path / "run"
    args = cli_args(train_cfg, run_dir)
    killed = run_tmt(args, fault=fault)
    assert killed.returncode != 0
    if survivor != 8:
        assert not list((run_dir / "checkpoints").glob("step_00000008")), (
            "no checkpoint under a final name is partial"
        )
    latest = run.latest_valid(run_dir)
    assert (latest and latest.name) == (survivor and f"step_{survivor:08d}")
    again = run_tmt(args)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.splitlines()[-1])["step"] == 8  # never a step past the budget
    assert not list((run_dir / "checkpoints").glob(".tmp-*")), (
        "leftovers of the killed save are cleaned"
    )
    same_run(straight, run_dir)


@pytest.mark.slow
def test_kill_during_save_at_twenty_offsets_never_corrupts(
    train_cfg: Config, straight: Path, tmp_path: Path
) -> None:
    size = checkpoint_size(straight, 8)
    offsets = [1, 512, 4096, *(size * i // 17 for i in range(1, 17)), size - 1]
    assert len(offsets) >= 20
    for offset in offsets:
        run_dir = tmp_path / f"run{offset}"
        killed = run_tmt(cli_args(train_cfg, run_dir), fault=f"save8_bytes@{offset}:kill")
        assert killed.returncode == -9
        assert [p.name for p in run.list_checkpoints(run_dir)] == ["step_00000004"]
        assert checkpoint.verify(run_dir / "checkpoints" / "step_00000004") is None
    # One of them resumed: bit-exact with the uninterrupted run, leftovers cleaned.
    again = run_tmt(cli_args(train_cfg, tmp_path / f"run{offsets[10]}"))
    assert again.returncode == 0, again.stderr
    same_run(straight, tmp_path / f"run{offsets[10]}")
    assert not list((tmp_path / f"run{offsets[10]}" / "checkpoints").glob(".tmp-*"))


@pytest.mark.slow
def test_kill_and_resume_two_gloo_ranks_during_save(train_cfg: Config, tmp_path: Path) -> None:
    straight_ddp = run_tmt(cli_args(train_cfg, tmp_path / "straight"), ranks=2)
    assert straight_ddp.returncode == 0, straight_ddp.stderr
    run_dir = tmp_path / "run"
    killed = run_tmt(
        cli_args(train_cfg, run_dir),
        ranks=2,
        fault=f"save8_bytes@{checkpoint_size(tmp_path / 'straight', 8) // 3}:kill",
    )
    assert killed.returncode != 0
    again = run_tmt(cli_args(train_cfg, run_dir), ranks=2)
    assert again.returncode == 0, again.stderr
    same_run(tmp_path / "straight", run_dir)


def test_without_rng_restore_a_resume_would_differ(
    train_cfg: Config, straight: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Negative control: the exactness above depends on the saved RNG states.
    train(with_train(train_cfg, out_dir=str(tmp_path), max_steps=4))
    monkeypatch.setattr(train_state, "restore_rng", lambda state: None)
    train(with_train(train_cfg, out_dir=str(tmp_path)))
    assert [r.get("loss") for r in records(tmp_path)][5:] != [
        r.get("loss") for r in records(straight)
    ][5:]


def test_exception_mid_save_at_byte_offsets(
    train_cfg: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for offset in (10, 3000, 20000):
        run_dir = tmp_path / str(offset)
        monkeypatch.setenv("TMT_FAULT", f"save8_bytes@{offset}:raise")
        with pytest.raises(Exception, match="fault injected"):
            train(with_train(train_cfg, out_dir=str(run_dir)))
        assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name != "best"] == [
            "step_00000004"
        ]
        assert checkpoint.verify(run_dir / "checkpoints" / "step_00000004") is None


# --- F3 SIGTERM / SIGINT -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "code"),
    [("step@3:sigterm", 143), pytest.param("step@3:sigint", 130, marks=pytest.mark.slow)],
)
def test_signal_saves_the_last_step_and_exits(
    train_cfg: Config, straight: Path, tmp_path: Path, fault: str, code: int
) -> None:
    run_dir = tmp_path / "run"
    args = cli_args(train_cfg, run_dir)
    start = time.monotonic()
    stopped = run_tmt(args, fault=fault)
    assert stopped.returncode == code, stopped.stderr
    assert time.monotonic() - start < 60
    saved = run.latest_valid(run_dir)
    assert saved is not None and saved.name == "step_00000003"
    last_logged = max(r["step"] for r in records(run_dir) if "loss" in r)
    assert checkpoint.read_manifest(saved)["step"] == last_logged == 3
    assert run_tmt(args).returncode == 0
    same_run(straight, run_dir)


def test_signal_to_one_of_two_gloo_ranks_stops_both(train_cfg: Config, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    start = time.monotonic()
    stopped = run_tmt(
        cli_args(train_cfg, run_dir), ranks=2, fault="step@3:sigterm@rank1"
    )  # rank 1 only
    assert stopped.returncode != 0 and time.monotonic() - start < 60, stopped.stderr[-2000:]
    assert "exitcode  : 143" in stopped.stderr  # torchrun's report: the ranks exited 143
    assert run.latest_valid(run_dir).name == "step_00000003"
    assert max(r["step"] for r in records(run_dir) if "loss" in r) == 3


def test_signal_handling_in_process(
    train_cfg: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGTERM sent to this very process during training: the loop saves and returns.
    monkeypatch.setenv("TMT_FAULT", "step@2:sigterm")
    summary = train(with_train(train_cfg, out_dir=str(tmp_path)))
    assert summary["stop"] == "sigterm" and summary["step"] == 2
    assert run.latest_valid(tmp_path).name == "step_00000002"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


# --- F4 a rank that dies or stalls --------------------------------------------------------------


def test_a_crashed_rank_makes_the_other_exit_naming_it(train_cfg: Config, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = cli_args(with_train(train_cfg, distributed_timeout_s=20.0), run_dir)
    start = time.monotonic()
    out = run_tmt(args, ranks=2, fault="step@3:exit@rank1")
    assert out.returncode != 0 and time.monotonic() - start < 60
    assert "a collective failed: rank 1 last reported step 3" in out.stderr, out.stderr[-2000:]
    assert not orphans(run_dir)


@pytest.mark.slow
def test_a_stalled_rank_makes_the_other_exit_within_the_timeout(
    train_cfg: Config, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    args = cli_args(with_train(train_cfg, distributed_timeout_s=5.0), run_dir)
    start = time.monotonic()
    out = run_tmt(args, ranks=2, fault="step@3:hang@rank1")
    assert out.returncode != 0
    assert "a collective failed: rank 1 last reported step 3" in out.stderr, out.stderr[-2000:]
    assert (
        time.monotonic() - start < 5 + 10 + 30 + 25
    )  # start-up + timeout + 10 s + the hung rank's grace
    assert not orphans(run_dir)


def orphans(run_dir: Path) -> list[str]:
    out = subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


# --- F6 non-finite, F7 out of memory ------------------------------------------------------------


def step_fixture(tiny_cfg: Config, precision: str = "fp32", init_scale: float = 2.0**16):
    from transformer_mt.common.distributed import DistInfo

    data = prepare_data(tiny_cfg)
    torch.manual_seed(0)
    model = Transformer(tiny_cfg.model, data.tokenizer.vocab_size, data.tokenizer.pad_id)
    optimizer, scheduler = build_optimizer(model.parameters(), tiny_cfg.model, tiny_cfg.optim)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=precision == "fp16")
    batch = data.train.batch(data.train.sampler(1024, 1).epoch_batches(0)[0], data.tokenizer)
    info = DistInfo(0, 1, 0, torch.device("cpu"))
    return model, Optimization(optimizer, scheduler, scaler), [batch], info


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> tuple:
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        json.dumps(optimizer.state_dict()["param_groups"]),
        {
            i: {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
            for i, s in optimizer.state_dict()["state"].items()
        },
        scheduler.last_epoch,
    )


def assert_unchanged(before: tuple, after: tuple) -> None:
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert before[1] == after[1] and before[3] == after[3]
    assert before[2].keys() == after[2].keys()
    assert all(
        torch.equal(before[2][i][k], after[2][i][k]) for i in before[2] for k in before[2][i]
    )


@pytest.mark.parametrize("fault", ["nan", "oom"])
def test_a_bad_update_changes_nothing(
    tiny_cfg: Config, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    model, opt, micro, info = step_fixture(tiny_cfg)
    train_step(model, micro, opt, tiny_cfg, info, attempt=1)  # Adam state exists
    before = snapshot(model, opt.optimizer, opt.scheduler)
    monkeypatch.setenv("TMT_FAULT", f"loss@2:{fault}")
    stats = train_step(model, micro, opt, tiny_cfg, info, attempt=2)
    assert stats.skipped == ("non_finite" if fault == "nan" else "oom")
    assert_unchanged(before, snapshot(model, opt.optimizer, opt.scheduler))
    monkeypatch.delenv("TMT_FAULT")
    assert train_step(model, micro, opt, tiny_cfg, info, attempt=3).skipped is None


def test_an_update_that_keeps_its_gradients_zeroes_them_in_place(tiny_cfg: Config) -> None:
    """CUDA graphs add into the parameters' .grad tensors (train.cuda_graphs): an update then
    keeps them, zeroed, and changes the model as one that frees them."""
    from transformer_mt.training import step

    updated = []
    for keep in (False, True):
        model, opt, micro, info = step_fixture(tiny_cfg)
        sums, oom = step._accumulate(model, micro, opt.scaler, Objective(0.1), info,
                                     micro[0].n_tokens, 1, "fp32")  # fmt: skip
        grads = [p.grad for p in model.parameters()]
        step._apply(opt, tiny_cfg, info, sums=sums, oom=oom, keep_grads=keep)
        after = [p.grad for p in model.parameters()]
        if keep:
            assert all(a is g and not a.any() for a, g in zip(after, grads, strict=True))
        else:
            assert all(a is None for a in after)
        updated.append(snapshot(model, opt.optimizer, opt.scheduler))
    assert_unchanged(*updated)


def test_fp16_overflow_is_the_scalers_business(tiny_cfg: Config) -> None:
    model, opt, micro, info = step_fixture(tiny_cfg, "fp16")
    before = snapshot(model, opt.optimizer, opt.scheduler)
    scale = opt.scaler.get_scale()
    # An overflowing fp16 backward: finite loss, infinite gradients.
    hook = model.embedding.weight.register_hook(lambda grad: grad * float("inf"))
    stats = train_step(model, micro, opt, tiny_cfg, info, attempt=1)
    hook.remove()
    assert stats.skipped == "overflow"  # not "non_finite": it does not count towards stopping
    assert_unchanged(before, snapshot(model, opt.optimizer, opt.scheduler))
    assert opt.scaler.get_scale() == scale / 2  # the scaler backed off
    assert train_step(model, micro, opt, tiny_cfg, info, attempt=2).skipped is None


def test_nan_steps_are_skipped_and_training_continues(
    train_cfg: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMT_FAULT", "loss@5:nan,loss@6:oom")
    summary = train(with_train(train_cfg, out_dir=str(tmp_path)))
    assert summary["step"] == 8 and summary["skipped_updates"] == 2
    assert [r["skipped"] for r in records(tmp_path) if "skipped" in r] == ["non_finite", "oom"]


def test_consecutive_nan_steps_stop_with_exit_3(train_cfg: Config, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = cli_args(with_train(train_cfg, nonfinite_patience=3), run_dir)
    result = run_tmt(args, fault="loss@5:nan,loss@6:nan,loss@7:nan")
    assert result.returncode == 3
    assert "training diverged: 3 consecutive non-finite updates after step 4" in result.stderr
    newest = run.latest_valid(run_dir)
    assert newest.name == "step_00000004"
    assert all(torch.isfinite(t).all() for t in checkpoint.read(newest).state_dict.values())


# after_backward in the slow set: make test keeps under its 5 minutes (the bit-for-bit test of
# test_train.py runs it there)
@pytest.mark.parametrize(
    "grad_sync", ["overlapped", pytest.param("after_backward", marks=pytest.mark.slow)]
)
def test_nan_and_oom_on_one_of_two_ranks_skip_everywhere(
    train_cfg: Config, tmp_path: Path, grad_sync: str
) -> None:
    """Also where the ranks average their gradients after the backward pass: the rank that ran
    out of memory has none, and sends zeros (the update is skipped anyway), not nothing."""
    run_dir = tmp_path / "run"
    cfg = with_train(train_cfg, grad_sync=grad_sync)
    out = run_tmt(cli_args(cfg, run_dir), ranks=2, fault="loss@3:nan@rank1,loss@5:oom@rank1")
    assert out.returncode == 0, out.stderr
    assert [r["skipped"] for r in records(run_dir) if "skipped" in r] == ["non_finite", "oom"]
    assert max(r["step"] for r in records(run_dir) if "loss" in r) == 8


def test_non_finite_weights_are_never_saved(tiny_cfg: Config, tmp_path: Path) -> None:
    weights = {"w": torch.tensor([1.0, float("nan")])}
    with pytest.raises(TmtError, match="non-finite values in w"):
        checkpoint.write(tmp_path / "c", 1, tiny_cfg, weights, b"spm")
    state = {"optimizer": {"state": {0: {"exp_avg": torch.tensor([float("inf")])}}}}
    with pytest.raises(TmtError, match=r"non-finite values in optimizer.state.0.exp_avg"):
        checkpoint.write(tmp_path / "c", 1, tiny_cfg, {"w": torch.ones(2)}, b"spm", state)
    assert not (tmp_path / "c").exists() and not list(tmp_path.iterdir())
    # Every bad tensor named, however nested; whole numbers (RNG states) are not floating.
    state = {"rng": [torch.ones(3, dtype=torch.uint8), {"h": torch.tensor(float("-inf"))}]}
    weights = {"a": torch.ones(2), "b": torch.tensor([float("nan")], dtype=torch.bfloat16)}
    with pytest.raises(TmtError, match=r"non-finite values in b, rng\[1\]\.h$"):
        checkpoint.write(tmp_path / "c", 1, tiny_cfg, weights, b"spm", state)
    # Finite values whose squares overflow (the check's first, total norm) are saved.
    huge = {"w": torch.full((4,), 3e38), "h": torch.full((2,), 6e4, dtype=torch.float16)}
    assert (checkpoint.write(tmp_path / "c", 1, tiny_cfg, huge, b"spm") / "manifest.json").is_file()


# --- F8 disk full ------------------------------------------------------------------------------


def test_disk_full_during_a_save(train_cfg: Config, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_tmt(cli_args(train_cfg, run_dir), fault="save8_bytes@2000:enospc")
    assert result.returncode == 4
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("tmt: error: saving checkpoint step 8 failed (No space left on device")
    assert [p.name for p in run.list_checkpoints(run_dir)] == ["step_00000004"]
    assert checkpoint.verify(run_dir / "checkpoints" / "step_00000004") is None
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]


def _limit_file_size(limit: int):
    def apply() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


# slow: make test keeps its promise with test_reliability.py::test_disk_full_during_a_save (the
# same failed write, another errno)
@pytest.mark.slow
def test_file_size_limit_makes_torch_save_fail_cleanly(
    train_cfg: Config, straight: Path, tmp_path: Path
) -> None:
    prepare_data(train_cfg)  # a warm cache: only the run's own files meet the limit
    # Room for the tokenizer file (with its normaliser table), not for a checkpoint (which holds it too).
    limit = (straight / "tokenizer.model").stat().st_size + 10_000
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "transformer_mt", *cli_args(train_cfg, run_dir)]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=REPO,
        preexec_fn=_limit_file_size(limit),
        timeout=120,
    )
    assert result.returncode == 4, result.stderr[-2000:]
    assert (
        "saving checkpoint step 4 failed (File too large)" in result.stderr
        and "Traceback" not in result.stderr
    )
    assert run.list_checkpoints(run_dir) == []
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]


def test_preflight_refuses_without_room_for_two_checkpoints(
    train_cfg: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        shutil,
        "disk_usage",
        lambda path: SimpleNamespace(total=10**9, used=10**9 - 1000, free=1000),
    )
    with pytest.raises(TmtError, match="MiB free, but a checkpoint takes about") as err:
        train(with_train(train_cfg, out_dir=str(tmp_path)))
    assert err.value.exit_code == 4
    assert not (tmp_path / "checkpoints").exists()


# --- F9 corruption, F10 untrusted files, F11 drift ----------------------------------------------


def corrupt(path: Path, kind: str) -> None:
    model = path / "model.pt"
    if kind == "truncated":
        model.write_bytes(model.read_bytes()[:1000])
    elif kind == "zero_byte":
        model.write_bytes(b"")
    elif kind == "bit_flip":
        data = bytearray(model.read_bytes())
        data[len(data) // 2] ^= 0x10
        model.write_bytes(bytes(data))
    elif kind == "missing_file":
        model.unlink()
    elif kind == "manifest_mismatch":
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["tokenizer_sha256"] = "0" * 64
        (path / "manifest.json").write_text(json.dumps(manifest))


KINDS = ["truncated", "zero_byte", "bit_flip", "missing_file", "manifest_mismatch"]


@pytest.mark.parametrize("kind", KINDS)
def test_corruption_is_caught_by_translate_average_and_resume(
    straight: Path, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir, symlinks=True)
    newest = run_dir / "checkpoints" / "step_00000008"
    corrupt(newest, kind)
    with pytest.raises(TmtError):
        translate.load_translator(newest)
    with pytest.raises(TmtError):
        averaging.average([run_dir / "checkpoints" / "step_00000004", newest])
    assert run.latest_valid(run_dir).name == "step_00000004"  # resume falls back...
    assert any(
        "skipping checkpoint" in r.message and "step_00000008" in r.message for r in caplog.records
    )  # ...and says so


def test_resume_falls_back_past_a_corrupt_checkpoint(
    train_cfg: Config, straight: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir, symlinks=True)
    corrupt(run_dir / "checkpoints" / "step_00000008", "bit_flip")
    with caplog.at_level("INFO"):
        summary = train(with_train(train_cfg, out_dir=str(run_dir), max_steps=10))
    assert summary["step"] == 10
    messages = [r.getMessage() for r in caplog.records]
    assert any("skipping checkpoint" in m and "step_00000008" in m for m in messages)
    assert any(m.startswith("resuming") and "step_00000004" in m for m in messages)


@pytest.mark.parametrize("file", ["model.pt", "train_state.pt"])
def test_malicious_checkpoint_is_refused_by_translate_and_resume(
    train_cfg: Config, straight: Path, tmp_path: Path, file: str, caplog: pytest.LogCaptureFixture
) -> None:
    import hashlib

    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir, symlinks=True)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    newest = run_dir / "checkpoints" / "step_00000008"
    torch.save({"model": Payload()}, newest / file)
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"][file] = hashlib.sha256((newest / file).read_bytes()).hexdigest()
    (newest / "manifest.json").write_text(json.dumps(manifest))  # forged, self-consistent
    with pytest.raises(TmtError, match="refused: holds more than tensors"):
        checkpoint.read(newest, train_state=True)  # what translate (model.pt) and resume read
    if file == "model.pt":
        with pytest.raises(TmtError, match="refused: holds more than tensors"):
            translate.load_translator(newest)
    # Resume never runs it either: the checkpoint is reported, skipped, and the one before it used.
    with caplog.at_level("INFO"):
        summary = train(with_train(train_cfg, out_dir=str(run_dir), max_steps=10))
    assert summary["step"] == 10
    messages = [r.getMessage() for r in caplog.records]
    assert any("skipping checkpoint" in m and "refused" in m for m in messages)
    assert any(m.startswith("resuming") and "step_00000004" in m for m in messages)
    assert not marker.exists()


def test_no_unsafe_loading_anywhere_in_the_source() -> None:
    for path in [*PACKAGE.glob("*.py"), *(REPO / "scripts").glob("*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                assert name not in ("pickle.load", "pickle.loads", "pickle.Unpickler"), (
                    f"{path}: {name}"
                )
                if name == "torch.load":
                    kwargs = {k.arg: ast.unparse(k.value) for k in node.keywords}
                    assert kwargs.get("weights_only") == "True", (
                        f"{path}:{node.lineno}: torch.load without weights_only=True"
                    )
        assert "weights_only=False" not in path.read_text(), path


def test_resume_with_another_tokenizer_or_architecture_is_refused_before_compute(
    train_cfg: Config, straight: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir, symlinks=True)
    for change, named in [
        (["tokenizer.vocab_size=80"], "tokenizer.vocab_size 64 -> 80"),
        (["model.n_heads=4"], "model.n_heads 2 -> 4"),
        (["model.pre_norm=true"], "model.pre_norm False -> True"),
    ]:  # each named with the run's value and the one given
        with pytest.raises(TmtError, match=f"holds a run of another model \\({named}; its"):
            train(
                apply_overrides(with_train(train_cfg, out_dir=str(run_dir), max_steps=10), change)
            )
    assert run.latest_valid(run_dir).name == "step_00000008"  # nothing trained, nothing written


def test_weights_that_do_not_fit_are_named(tiny_cfg: Config, tmp_path: Path) -> None:
    model = Transformer(tiny_cfg.model, 64, 0)
    weights = model.state_dict()
    weights["embedding.weight"] = torch.zeros(65, 32)
    with pytest.raises(TmtError, match=r"embedding.weight \(65, 32\) vs \(64, 32\)"):
        checkpoint.load_weights(model, weights, tmp_path)


# --- F12 retention -------------------------------------------------------------------------------


def test_retention_keeps_best_newest_and_resume_source(tiny_cfg: Config, tmp_path: Path) -> None:
    paths = [
        checkpoint.write(
            run.checkpoint_dir(tmp_path, s), s, tiny_cfg, {"w": torch.ones(1) * s}, b"spm"
        )
        for s in range(1, 8)
    ]
    run.set_best(tmp_path, paths[0])
    run.prune(tmp_path, keep_last=1, protect={paths[2], paths[6]})
    assert [p.name for p in run.list_checkpoints(tmp_path)] == [
        "step_00000001",
        "step_00000003",
        "step_00000007",
    ]


# --- I1–I10 bad input ----------------------------------------------------------------------------


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=300))
def test_reader_splits_on_newline_only(
    tmp_path_factory: pytest.TempPathFactory, data: bytes
) -> None:
    path = tmp_path_factory.mktemp("r") / "f.txt"
    path.write_bytes(data)
    expected = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    assert len(list(textio.read_lines(path))) == expected


@pytest.fixture(scope="module")
def fuzz_translator(straight: Path) -> translate.Translator:
    return translate.load_translator(straight, ["decode.beam_size=2", "decode.max_len_b=5"])


NASTY = st.text(
    alphabet=st.characters(blacklist_categories=(), blacklist_characters="\n"), max_size=40
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lines=st.lists(
        st.one_of(NASTY, st.sampled_from(["", " ", "\x00", "\u202e\u200b", "\ud800x", "\ufeffa"])),
        max_size=8,
    )
)
def test_translate_is_total_and_one_to_one(
    fuzz_translator: translate.Translator, lines: list[str]
) -> None:
    out = translate.translate_text(fuzz_translator, lines)
    assert len(out) == len(lines)
    assert not any("\n" in t or "\r" in t for t in out)
    assert all(out[i] == "" for i, line in enumerate(lines) if not line.strip(" \t"))


def test_translate_survives_a_10k_character_line_and_nul_bytes(
    straight: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = tmp_path / "in.txt"
    source.write_bytes(b"kalo " * 2000 + b"\nmi\x00nu\n\xed\xa0\x80 broken utf8\n\n")
    out = tmp_path / "out.txt"
    with caplog.at_level("WARNING"):
        result = runner.invoke(
            app, ["translate", "-m", str(straight), "-i", str(source), "-o", str(out)]
        )
    assert result.exit_code == 0, result.output
    assert len(out.read_text().split("\n")) == 5  # 4 lines + the final newline
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "truncated" in messages and "invalid UTF-8" in messages


def test_empty_input_gives_empty_output(straight: Path, tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    result = runner.invoke(
        app, ["translate", "-m", str(straight), "-i", str(tmp_path / "empty.txt")]
    )
    assert result.exit_code == 0 and result.stdout == ""


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        ([], "0 read"),
        ([("", ""), ("  ", "x")], "2 empty"),
    ],
)
def test_degenerate_corpora_fail_before_the_model_is_built(
    tiny_cfg: Config, straight: Path, tmp_path: Path, pairs: list, message: str
) -> None:
    prefix = write_parallel(tmp_path / "train", pairs)
    cfg = dataclasses.replace(
        tiny_cfg,
        data=dataclasses.replace(tiny_cfg.data, train=str(prefix)),
        tokenizer=dataclasses.replace(
            tiny_cfg.tokenizer, model_path=str(straight / "tokenizer.model")
        ),
    )
    with pytest.raises(TmtError, match=message):
        train(with_train(cfg, out_dir=str(tmp_path / "run")))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_untrained_tokenizer_on_an_empty_corpus_is_explained(
    tiny_cfg: Config, tmp_path: Path
) -> None:
    prefix = write_parallel(tmp_path / "train", [])
    cfg = dataclasses.replace(tiny_cfg, data=dataclasses.replace(tiny_cfg.data, train=str(prefix)))
    with pytest.raises(TmtError, match="tokenizer"):
        prepare_data(cfg)


def test_mismatch_between_hypotheses_and_references_is_exit_2(tmp_path: Path) -> None:
    (tmp_path / "h").write_text("a\nb\n")
    (tmp_path / "r").write_text("a\n")
    result = runner.invoke(
        app, ["evaluate", "--hyp", str(tmp_path / "h"), "--ref", str(tmp_path / "r")]
    )
    assert result.exit_code == 2 and "2 hypotheses but 1 references" in result.stderr


def test_every_test_the_reliability_doc_names_exists() -> None:
    """docs/reliability.md names its proofs as `file::test` (or `::test` after a file in the same
    cell): each must be a test function of that file, so the table cannot promise a lost test."""
    import re

    doc = (REPO / "docs" / "reliability.md").read_text()
    named = 0
    for cell in doc.split("|"):
        current = None
        for file, test in re.findall(r"`(test_\w+\.py)?::(test_\w+)", cell):
            current = file or current
            assert current, f"{test}: no file before it in its cell"
            source = (REPO / "tests" / current).read_text()
            assert f"def {test}(" in source, f"docs/reliability.md names {current}::{test}"
            named += 1
    assert named > 60
