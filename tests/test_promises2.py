"""The promises a second outside probe broke, one section per class; each test failed before its
fix (on 09129c6). docs/reliability.md lists each promise (P15-P19) with its test."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import cli_processes
import pytest
from conftest import reverse_pairs
from test_promises import copy_run, one_line_error
from test_train import run_tmt
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config
from transformer_mt.data.batches import prepare_data
from transformer_mt.translation import bulk, decoding, translate

runner = CliRunner()
CHUNK = 10


# --- 15. what tmt wrote earlier is verified when it is read back: translation chunks ----------


@pytest.fixture(scope="module")
def lines_in(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chunks") / "in.txt"
    path.write_text("".join(s + "\n" for s, _ in reverse_pairs(45, seed=11)))
    return path


def job_args(model: Path, source: Path, output: Path) -> list[str]:
    return ["translate", "-m", str(model), "-i", str(source), "-o", str(output),
            "--set", f"decode.chunk_lines={CHUNK}"]  # fmt: skip


# slow: make test keeps its promise with
# test_promises2.py::test_assembly_verifies_each_chunk_as_it_copies_it
@pytest.mark.slow
def test_an_altered_committed_chunk_is_translated_again(
    trained_run: Path, lines_in: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    straight, out = tmp_path / "straight.txt", tmp_path / "out.txt"
    assert runner.invoke(app, job_args(trained_run, lines_in, straight)).exit_code == 0
    killed = run_tmt(job_args(trained_run, lines_in, out), fault="chunk@3:kill")
    assert killed.returncode == -9
    job = tmp_path / f"out.txt{bulk.JOB_SUFFIX}"
    altered = job / "00000001.txt"
    rows = altered.read_bytes().count(b"\n")
    altered.write_bytes(b"".join(b"X " + line for line in altered.read_bytes().splitlines(True)))
    assert altered.read_bytes().count(b"\n") == rows  # the same line count: only a hash tells
    (job / "00000002.json").unlink()  # a kill between a chunk's text and its record
    with caplog.at_level("WARNING"):
        result = runner.invoke(app, job_args(trained_run, lines_in, out))
    assert result.exit_code == 0, result.output
    assert "(1 translated before)" in result.stderr  # chunk 0 only: 1 altered, 2 uncommitted
    assert any("chunk 1" in m and "does not match its commit record" in m for m in caplog.messages)
    assert out.read_bytes() == straight.read_bytes()


def test_assembly_verifies_each_chunk_as_it_copies_it(
    trained_run: Path, lines_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    straight, out = tmp_path / "straight.txt", tmp_path / "out.txt"
    assert runner.invoke(app, job_args(trained_run, lines_in, straight)).exit_code == 0
    real = bulk._translate_chunks
    job = tmp_path / f"out.txt{bulk.JOB_SUFFIX}"

    def then_alter(translator, input_path, plan, chunks, info):  # after every rank's chunks
        done = real(translator, input_path, plan, chunks, info)
        if len(chunks) > 1:
            (job / "00000003.txt").write_bytes(b"tampered\n" * CHUNK)
        return done

    monkeypatch.setattr(bulk, "_translate_chunks", then_alter)
    translator = translate.load_translator(trained_run, [f"decode.chunk_lines={CHUNK}"])
    assert bulk.translate_job(translator, str(lines_in), str(out))["lines"] == 45
    assert out.read_bytes() == straight.read_bytes()


def test_an_unreadable_job_file_is_one_line(
    trained_run: Path, lines_in: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out.txt"
    job = tmp_path / f"out.txt{bulk.JOB_SUFFIX}"
    job.mkdir()
    wrong_types = ['{"decode": 7, "input_sha256": []}', '{"format": 1}',  # fields of another type
                   '{"format": 1, "input": "x", "input_sha256": "0", "model_sha256": "0",'
                   ' "decode": {}, "glossary": "g"}']  # fmt: skip
    for content in ('["job.json"]', "[1, 2]", "nul\0l", "{" * 100_000, *wrong_types):
        (job / "job.json").write_text(content)
        result = runner.invoke(app, job_args(trained_run, lines_in, out))
        assert result.exit_code == 2, result.output
        assert "an unreadable job.json" in one_line_error(result.stderr)


# --- ... the data cache, the tokenizer cache, the metrics log ---------------------------------


def with_cache(cfg: Config, cache: Path) -> Config:
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cache_dir=str(cache)))


def test_an_altered_data_cache_entry_is_rebuilt_not_trusted(
    tiny_cfg: Config, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = with_cache(tiny_cfg, tmp_path)
    first = prepare_data(cfg)
    ids = first.train.ids(range(len(first.train)))
    for arrow in (tmp_path / "encoded").glob("*/*.arrow"):
        data = bytearray(arrow.read_bytes())
        data[-200] ^= 0xFF  # one flipped byte inside the ids: the same size, still readable
        arrow.write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        again = prepare_data(cfg)
    assert any("does not match the SHA-256" in m and "rebuilding" in m for m in caplog.messages)
    again_ids = again.train.ids(range(len(again.train)))
    assert all((a == b).all() for a, b in zip(ids[0] + ids[1], again_ids[0] + again_ids[1]))


def test_a_replaced_cached_tokenizer_is_trained_again(
    tiny_cfg: Config, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformer_mt.data.tokenizer import train_tokenizer

    cfg = with_cache(tiny_cfg, tmp_path)
    first = prepare_data(cfg).tokenizer
    (cached,) = (tmp_path / "tokenizers").glob("*.model")
    other = train_tokenizer(
        (s for pair in reverse_pairs(200, seed=9) for s in pair),
        dataclasses.replace(cfg.tokenizer, vocab_size=48),
    )
    cached.write_bytes(other.model_bytes)  # a valid sentencepiece model, not the one tmt wrote
    with caplog.at_level("WARNING"):
        again = prepare_data(cfg).tokenizer
    assert any("cached tokenizer damaged" in m for m in caplog.messages)
    assert again.model_bytes == first.model_bytes


def test_a_damaged_metrics_log_neither_stops_a_resume_nor_a_plot(
    trained_run: Path, tmp_path: Path
) -> None:
    from transformer_mt.config import load_config
    from transformer_mt.training.train import train

    run_dir = copy_run(trained_run, tmp_path)
    log = run_dir / "metrics.jsonl"
    damage = b'{"step": Infinity}\n{"step": 99, "loss": 1e999}\n\xff\xfe\n[1, 2]\n'
    log.write_bytes(log.read_bytes() + damage)
    drawn = runner.invoke(app, ["plot", "-m", str(run_dir), "-o", str(tmp_path / "c.png")])
    assert drawn.exit_code == 0, drawn.output
    cfg = load_config(run_dir / "config.yaml", [f"train.out_dir={run_dir}", "train.max_steps=31"])
    assert train(cfg)["step"] == 31
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == sorted(steps) and 30 <= steps[-1] <= 31  # every line reads: the damage is gone


# --- 16. no output where tmt manages files -----------------------------------------------------


def test_no_command_writes_where_tmt_manages_files(
    trained_run: Path, lines_in: Path, tmp_path: Path
) -> None:
    from transformer_mt.runs import averaging

    run_dir = copy_run(trained_run, tmp_path)
    averaging.write(averaging.newest(run_dir, 2), run_dir / "average")
    checkpoint_dir = run_dir / "checkpoints" / "step_00000030"
    job_dir = tmp_path / f"out.txt{bulk.JOB_SUFFIX}"
    job_dir.mkdir()
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    refused = [
        ["export", "-m", str(run_dir), "--format", "ctranslate2", "-o", str(checkpoint_dir / "x")],
        ["export", "-m", str(run_dir), "--format", "ctranslate2", "-o", str(run_dir / "average" / "x")],
        ["export", "-m", str(run_dir), "--format", "huggingface", "-o", str(run_dir / "checkpoints" / "x")],
        ["translate", "-m", str(run_dir), "-i", str(lines_in), "-o", str(job_dir / "x.txt")],
        ["translate", "-m", str(run_dir), "-i", str(lines_in), "-o", str(checkpoint_dir / "x.txt")],
        ["average", "-m", str(run_dir), "--last", "2", "-o", str(run_dir / "average" / "x")],
        ["plot", "-m", str(run_dir), "-o", str(checkpoint_dir / "c.png")],
        ["train", "-c", "tiny", "--set", f"train.out_dir={checkpoint_dir}", "--dry-run"],
        ["train", "-c", "tiny", "--set", f"train.out_dir={checkpoint_dir / 'run'}"],
        ["train", "-c", "tiny", "--set", f"data.cache_dir={checkpoint_dir / 'cache'}", "--dry-run"],
    ]  # fmt: skip
    for args in refused:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        line = one_line_error(result.stderr)
        assert "checkpoint directory" in line or "job directory" in line, (args, line)
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before  # nothing written
    assert list(job_dir.iterdir()) == []


# --- 17. a size a config asks for that does not fit: one line, nothing written ---------------


def test_a_model_too_large_for_memory_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    huge = ["--set", "model.d_model=100000", "--set", "model.n_heads=2",
            "--set", f"train.out_dir={out}", "--set", f"data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    for extra in ([], ["--dry-run"]):
        result = cli_processes.run(["train", "-c", "tiny", *huge, *extra], timeout=120)
        assert result.returncode == 2, result.stderr[-2000:]
        line = one_line_error(result.stderr)
        assert "parameters" in line and "GiB" in line and "free" in line, line
        assert not out.exists() and not (tmp_path / "cache").exists()


def test_a_small_checkpoint_cannot_make_tmt_build_a_large_model(
    tiny_cfg: Config, tiny_spm: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import model_parts

    from transformer_mt.config import apply_overrides
    from transformer_mt.network.model import Transformer
    from transformer_mt.runs import checkpoint

    weights, _ = model_parts(tiny_cfg, tiny_spm)
    huge = apply_overrides(tiny_cfg, ["model.d_model=65536", "model.n_heads=2"])
    path = checkpoint.write(tmp_path / "c", 1, huge, weights, tiny_spm)  # a forged config
    monkeypatch.setattr(Transformer, "__init__", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(TmtError, match=r"the config describes [\d,]+ parameters, the file holds"):
        checkpoint.read(path)


def test_allocation_failures_when_building_and_decoding_are_one_line(
    tiny_cfg: Config, trained_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_train import with_train

    from transformer_mt.training import train as train_module

    def no_memory(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
        )

    with monkeypatch.context() as patch:
        patch.setattr(train_module, "Transformer", no_memory)
        with pytest.raises(TmtError, match=r"training a model of [\d,]+ parameters needs .* GiB"):
            train_module.train(with_train(tiny_cfg, out_dir=str(tmp_path / "run"), max_steps=2))
    monkeypatch.setattr(decoding, "_translate_batch", no_memory)
    result = runner.invoke(app, ["translate", "-m", str(trained_run)], input="kalo mi\n")
    assert result.exit_code == 2
    assert "ran out of memory" in one_line_error(result.stderr)
    assert "lower decode.max_tokens" in result.stderr


def test_updates_that_never_fit_stop_the_run_in_one_line(tiny_cfg: Config, tmp_path: Path) -> None:
    from test_train import cli_args, with_train

    cfg = with_train(tiny_cfg, max_steps=20, save_every=2, valid_every=2, oom_patience=3)
    fault = "loss@4:oom,loss@5:oom,loss@6:oom,loss@7:oom"  # every update after step 3
    result = run_tmt(cli_args(cfg, tmp_path / "run"), fault=fault)
    assert result.returncode == 2, result.stderr[-2000:]
    line = one_line_error(result.stderr)
    assert "out of memory on 3 consecutive updates after step 3" in line
    assert "lower data.max_tokens" in line and "step_00000002" in line


def test_cleaning_up_after_a_killed_write_touches_only_tmt_s_own_leftovers(
    trained_run: Path, tmp_path: Path
) -> None:
    from transformer_mt.exchange import export
    from transformer_mt.runs import averaging

    dead = 2**22 + 12345  # above any pid this machine hands out (pid_max)
    mine = tmp_path / f".tmp-notes-{dead}"
    killed_export = tmp_path / f".tmp-export-ct2-{dead}"
    killed_average = tmp_path / f".tmp-avg-{dead}"
    for path in (mine, killed_export, killed_average):
        path.mkdir()
    averaging.write(averaging.newest(trained_run, 1), tmp_path / "avg")
    assert not killed_average.exists() and mine.exists()
    export.export(trained_run, "ctranslate2", tmp_path / "ct2", check_lines=2)
    assert not killed_export.exists() and mine.exists()


def test_what_tmt_reads_back_must_be_a_plain_file_and_no_read_hangs(
    trained_run: Path, lines_in: Path, tiny_cfg: Config, tmp_path: Path, bounded_reads: None
) -> None:
    # A FIFO where tmt expects its own file would hang a naive read; a link could point anywhere.
    run_dir = copy_run(trained_run, tmp_path)
    log = run_dir / "metrics.jsonl"
    log.unlink()
    os.mkfifo(log)
    result = runner.invoke(app, ["plot", "-m", str(run_dir), "-o", str(tmp_path / "c.png")])
    assert result.exit_code == 2 and "metrics.jsonl" in one_line_error(result.stderr)
    out = tmp_path / "out.txt"
    killed = run_tmt(job_args(trained_run, lines_in, out), fault="chunk@2:kill")
    assert killed.returncode == -9
    job = tmp_path / f"out.txt{bulk.JOB_SUFFIX}"
    (job / "00000000.txt").unlink()
    os.mkfifo(job / "00000000.txt")
    (job / "00000001.json").unlink()
    (job / "00000001.json").symlink_to("/dev/zero")
    result = runner.invoke(app, job_args(trained_run, lines_in, out))  # each read bounded
    assert result.exit_code == 0, result.output  # both chunks translated again
    cfg = with_cache(tiny_cfg, tmp_path / "cache")
    prepare_data(cfg)
    (meta,) = list((tmp_path / "cache" / "encoded").glob("*/meta.json"))[:1]
    meta.unlink()
    os.mkfifo(meta)
    assert len(prepare_data(cfg).train) == 300  # the entry is rebuilt
