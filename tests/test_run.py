"""The run directory: finding models, retention, leftovers, and each checkpoint read once."""

from __future__ import annotations

import builtins
import io
import json
import os
import re
from collections import Counter
from pathlib import Path

import pytest
from conftest import model_parts
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, load_config
from transformer_mt.data.tokenizer import Tokenizer
from transformer_mt.network.model import Transformer
from transformer_mt.runs import averaging, checkpoint, run
from transformer_mt.training.train import train
from transformer_mt.translation import translate

CFG = load_config("tiny")


@pytest.fixture
def save(tiny_spm: bytes):
    """Write training checkpoint `step` of a tiny model into a run directory."""

    def save(run_dir: Path, step: int) -> Path:
        weights, state = model_parts(CFG, tiny_spm, seed=step)
        final = run.checkpoint_dir(run_dir, step)
        return checkpoint.write(final, step, CFG, weights, tiny_spm, state)

    return save


def test_prune_keeps_last_k_best_and_protected(tmp_path: Path, save) -> None:
    paths = [save(tmp_path, step) for step in (10, 20, 30, 40, 50, 60)]
    run.set_best(tmp_path, paths[1])
    run.prune(tmp_path, keep_last=2, protect={paths[0]})
    assert [p.name for p in run.list_checkpoints(tmp_path)] == [
        "step_00000010",
        "step_00000020",
        "step_00000050",
        "step_00000060",
    ]
    assert run.best(tmp_path) == paths[1]
    run.set_best(tmp_path, paths[5])
    assert run.best(tmp_path) == paths[5]


def test_sweep_removes_interrupted_writes_only(tmp_path: Path, save) -> None:
    kept = save(tmp_path, 1)
    root = tmp_path / "checkpoints"
    leftovers = [root / ".tmp-step_00000002-99", root / ".old-step_00000001-99"]
    for path in leftovers:
        path.mkdir()
    (root / ".best-99").symlink_to(kept.name)
    (tmp_path / ".config.yaml.abc123.tmp").write_text("half")
    run.sweep(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoints"]
    assert checkpoint.verify(kept) is None


def test_load_model_takes_a_checkpoint_or_a_run(tmp_path: Path, save) -> None:
    first, second = save(tmp_path, 1), save(tmp_path, 2)
    assert run.load_model(first).path == first  # a checkpoint directory as given
    assert run.load_model(tmp_path).path == second  # a run: its newest, without a best
    run.set_best(tmp_path, first)
    assert run.load_model(tmp_path).path == first  # ... its best when it has one
    (first / "model.pt").write_bytes(b"broken")
    assert run.load_model(tmp_path).path == second  # a broken best: the newest that reads
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(TmtError, match="not a checkpoint .* nor a run directory"):
        run.load_model(tmp_path / "elsewhere")
    with pytest.raises(TmtError, match="nowhere: no such file or directory$"):
        run.load_model(tmp_path / "nowhere")


def test_a_model_named_as_transformers_names_one_is_sent_to_tmt_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """-m with a Hub id or a Hugging Face directory (what from_pretrained takes) says what makes
    it a tmt model; a typo under a directory that is there stays a typo."""
    monkeypatch.chdir(tmp_path)
    hub = "; a Hugging Face model id? `tmt import -m Helsinki-NLP/opus-mt-de-en -o DIR` makes it"
    with pytest.raises(TmtError, match=f"no such file or directory{re.escape(hub)}"):
        run.load_model(Path("Helsinki-NLP/opus-mt-de-en"))
    tuned = CliRunner().invoke(app, ["train", "--init-from", "Helsinki-NLP/opus-mt-de-en",
                                     "--set", "train.out_dir=run", "--dry-run"])  # fmt: skip
    assert tuned.exit_code == 2 and "no such checkpoint or run directory" + hub in tuned.stderr
    (tmp_path / "runs").mkdir()
    with pytest.raises(TmtError, match="^runs/x: no such file or directory$"):
        run.load_model(Path("runs/x"))
    hf = tmp_path / "opus-mt-de-en"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    with pytest.raises(TmtError, match="a Hugging Face model directory; `tmt import -m"):
        run.load_model(hf)
    (hf / "tmt_export.json").write_text("{}")  # tmt export --format huggingface's
    with pytest.raises(TmtError, match="tmt's Hugging Face export; name its model"):
        run.load_model(hf)


# --- each checkpoint file is opened (read, hashed, verified) once per command -------------------


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch):
    """Counts the opens for reading of files inside checkpoint directories, by path, whichever
    way they are opened (builtins.open, pathlib through io.open, os.open)."""
    counts: Counter[str] = Counter()
    real_open, real_os_open = io.open, os.open

    def count(file: object) -> None:
        if "checkpoints" in str(file):
            counts[str(Path(str(file)).resolve())] += 1

    def counting_open(file, mode="r", *args, **kwargs):
        if "r" in mode and "+" not in mode:
            count(file)
        return real_open(file, mode, *args, **kwargs)

    def counting_os_open(path, flags, *args, **kwargs):
        if not flags & (os.O_WRONLY | os.O_RDWR):
            count(path)
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(io, "open", counting_open)  # pathlib's read_bytes/read_text
    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(os, "open", counting_os_open)
    return counts


def assert_each_once(counts: Counter[str], checkpoints: list[Path], names: list[str]) -> None:
    expected = {str((c / n).resolve()): 1 for c in checkpoints for n in names}
    assert dict(counts) == expected


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts Transformer builds and sentencepiece parses (Tokenizer objects made)."""
    counts: Counter[str] = Counter()
    for cls in (Transformer, Tokenizer):
        real = cls.__init__

        def counting(self, *args, _real=real, _name=cls.__name__, **kwargs):
            counts[_name] += 1
            _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", counting)
    return counts


def test_loading_a_run_parses_builds_and_reads_once(
    trained_run: Path, opened: Counter[str], built: Counter[str]
) -> None:
    translate.Translator.load(trained_run)  # a run directory: its best checkpoint
    assert built == {"Transformer": 1, "Tokenizer": 1}
    assert_each_once(opened, [run.best(trained_run)], ["manifest.json", "model.pt"])
    built.clear()
    opened.clear()
    translate.load_translator(trained_run, last=3)  # the average of its newest 3
    assert built == {"Transformer": 1, "Tokenizer": 1}
    assert_each_once(opened, run.list_checkpoints(trained_run)[-3:], ["manifest.json", "model.pt"])


def test_average_parses_builds_and_reads_once(
    trained_run: Path, tmp_path: Path, opened: Counter[str], built: Counter[str]
) -> None:
    result = CliRunner().invoke(
        app, ["average", "-m", str(trained_run), "--last", "3", "-o", str(tmp_path / "avg")]
    )
    assert result.exit_code == 0, result.output
    assert built == {"Transformer": 1, "Tokenizer": 1}
    averaged = run.list_checkpoints(trained_run)[-3:]
    assert_each_once(opened, averaged, ["manifest.json", "model.pt"])


def test_translate_reads_its_checkpoint_once(trained_run: Path, opened: Counter[str]) -> None:
    translator = translate.load_translator(trained_run)  # a run directory: its best checkpoint
    assert translate.translate_text(translator, ["kalo mi"])
    assert_each_once(opened, [run.best(trained_run)], ["manifest.json", "model.pt"])


def test_average_reads_each_checkpoint_once(
    trained_run: Path, tmp_path: Path, opened: Counter[str]
) -> None:
    result = CliRunner().invoke(
        app,
        ["average", "-m", str(trained_run), "--last", "3", "-o", str(tmp_path / "avg"), "--json"],
    )
    assert result.exit_code == 0, result.output
    averaged = run.list_checkpoints(trained_run)[-3:]
    assert json.loads(result.stdout)["averaged"] == [str(p) for p in averaged]
    assert_each_once(opened, averaged, ["manifest.json", "model.pt"])


def test_resume_reads_its_checkpoint_once(
    tiny_cfg: Config, trained_run: Path, tmp_path: Path, opened: Counter[str]
) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(trained_run, copy, symlinks=True)
    opened.clear()
    cfg = load_config(copy / "config.yaml", [f"train.out_dir={copy}", "train.max_steps=31"])
    assert train(cfg)["step"] == 31
    resumed = run.checkpoint_dir(copy, 30)
    reads = {path: n for path, n in opened.items() if path.startswith(str(resumed.resolve()))}
    assert reads == {
        str((resumed / name).resolve()): 1
        for name in ("manifest.json", "model.pt", "train_state.pt")
    }


def test_a_run_is_translated_by_its_average_first_and_says_so(
    tmp_path: Path, save, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = save(tmp_path, 1), save(tmp_path, 2)
    run.set_best(tmp_path, first)
    mean = averaging.write(averaging.average([first]), tmp_path / "average")
    with caplog.at_level("INFO"):
        assert run.load_model(tmp_path).path == mean.path  # the average, before the best
    assert any("using its average" in m for m in caplog.messages)
    # It averages up to step 1 while the run has step 2: used, with a warning.
    assert any("averages checkpoints up to step 1" in m for m in caplog.messages)
    (mean.path / "model.pt").write_bytes(b"broken")
    caplog.clear()
    with caplog.at_level("INFO"):
        assert run.load_model(tmp_path).path == first  # a broken average: the best
    assert any("using its best checkpoint" in m for m in caplog.messages)
    assert second.exists()
