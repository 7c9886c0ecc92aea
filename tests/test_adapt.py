"""Adapt and watch: fine-tuning (train.init_from), corpus mixtures with weights and tags, training
curves (tmt plot, curves.png, TensorBoard) and best-N checkpoint averaging."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import reverse_pairs, with_data, write_parallel
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.common.distributed import DistInfo
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, Corpus
from transformer_mt.data.batches import prepare_data
from transformer_mt.data.sampler import TokenBucketSampler
from transformer_mt.network.model import Transformer
from transformer_mt.runs import averaging, checkpoint, run
from transformer_mt.training.optim import noam_lr
from transformer_mt.training.train import _build, train
from transformer_mt.translation import translate

CPU = DistInfo(0, 1, 0, torch.device("cpu"))


def with_train(cfg: Config, **changes: object) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **changes))


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tmt(*args: str) -> SimpleNamespace:
    """A tmt command, in this process (the CLI's own tests run it as a subprocess too)."""
    result = CliRunner().invoke(app, list(args))
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=result.stderr)


@pytest.fixture(scope="module")
def new_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Other pairs of the reverse task: data the parent never saw."""
    return write_parallel(tmp_path_factory.mktemp("new") / "new", reverse_pairs(200, seed=7))


# --- fine-tuning -------------------------------------------------------------------------------


def test_fine_tuning_starts_at_step_1_from_the_parents_weights_with_a_fresh_optimizer(
    tiny_cfg: Config,
    trained_run: Path,
    new_corpus: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    cfg = with_data(
        with_train(
            tiny_cfg,
            init_from=str(trained_run),
            out_dir=str(tmp_path),
            max_steps=3,
            save_every=1,
            keep_last=5,
        ),
        train=str(new_corpus),
    )
    parent = run.init_model(cfg)
    assert parent.path == run.load_model(trained_run).path  # a run directory: its best or average
    model, opt, progress, window = _build(cfg, parent.tokenizer, CPU, None, parent)
    weights = model.state_dict()
    assert weights.keys() == parent.state_dict.keys()
    assert all(torch.equal(weights[k], parent.state_dict[k]) for k in weights)
    assert opt.optimizer.state == {} and opt.scheduler.last_epoch == 0
    assert (progress.step, progress.epoch, progress.batch_index, window) == (0, 0, 0, None)

    def no_training(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the tokenizer was trained again")

    monkeypatch.setattr("transformer_mt.data.tokenizer.train_tokenizer", no_training)
    from transformer_mt.training.dry_run import dry_run

    assert dry_run(cfg)["vocab_size"] == parent.tokenizer.vocab_size  # the parent's, too
    capsys.readouterr()
    train(cfg)
    first, *later = records(tmp_path)
    assert first == {
        "step": 0,
        "init_from": str(trained_run),
        "init_checkpoint": str(parent.path),
        "init_step": parent.step,
    }
    assert all(r["step"] >= 1 for r in later)
    assert "init_from: " + str(trained_run) in (tmp_path / "config.yaml").read_text()
    step_1 = checkpoint.read(tmp_path / "checkpoints" / "step_00000001", train_state=True)
    assert step_1.config.train.init_from == str(trained_run)
    state = step_1.train_state
    assert state["progress"]["step"] == 1 and state["scheduler"]["last_epoch"] == 1
    assert float(state["optimizer"]["state"][0]["step"]) == 1.0  # a fresh Adam, not 30 + 1
    # The fresh schedule: the next update (the 2nd) uses noam(2), from the warmup's start.
    next_lr = noam_lr(2, cfg.model.d_model, cfg.optim.warmup_steps, cfg.optim.lr_scale)
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(next_lr)
    # The tokenizer is the parent's, never retrained on the new data.
    assert (tmp_path / "tokenizer.model").read_bytes() == parent.tokenizer_bytes
    assert step_1.tokenizer_bytes == parent.tokenizer_bytes


def test_fine_tuning_a_model_of_other_settings_is_refused_naming_them(
    tiny_cfg: Config, trained_run: Path, tmp_path: Path
) -> None:
    cfg = with_train(tiny_cfg, init_from=str(trained_run), out_dir=str(tmp_path / "child"))
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_ff=128))
    with pytest.raises(TmtError, match=r"model.d_ff 64 \(model\) vs 128 \(config\)"):
        run.init_model(other)
    vocab = dataclasses.replace(cfg, tokenizer=dataclasses.replace(cfg.tokenizer, vocab_size=99))
    with pytest.raises(TmtError, match=r"tokenizer.vocab_size 64 \(model\) vs 99 \(config\)"):
        run.init_model(vocab)
    # Dropout regularises the fine-tuning itself: it may change.
    run.init_model(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=0.3)))
    with pytest.raises(TmtError, match="no such checkpoint or run directory"):
        run.init_model(with_train(cfg, init_from=str(tmp_path / "nothing")))
    with pytest.raises(TmtError, match="inside this run's train.out_dir"):
        run.init_model(with_train(cfg, out_dir=str(trained_run)))


def test_a_fine_tuning_run_resumes_its_own_checkpoints_without_the_parent(
    tiny_cfg: Config, trained_run: Path, tmp_path: Path
) -> None:
    parent = tmp_path / "parent"
    shutil.copytree(trained_run, parent, symlinks=True)
    cfg = with_train(tiny_cfg, init_from=str(parent), out_dir=str(tmp_path / "child"))
    train(with_train(cfg, max_steps=2, save_every=2))
    shutil.rmtree(parent)  # gone: the child has its own checkpoint now
    summary = train(with_train(cfg, max_steps=4, save_every=2))
    assert summary["step"] == 4
    assert [r["step"] for r in records(tmp_path / "child") if "init_from" in r] == [0]


def test_train_init_from_on_the_command_line(trained_run: Path, tmp_path: Path) -> None:
    other = tmt("train", "-c", "tiny", "--init-from", str(trained_run),
                "--set", f"train.out_dir={tmp_path / 'child'}")  # fmt: skip
    assert other.returncode == 2 and "Traceback" not in other.stderr
    assert other.stderr.strip().splitlines()[-1] == (
        f"tmt: error: train.init_from={trained_run}: the model has other settings:"
        " tokenizer.vocab_size 64 (model) vs 500 (config); tokenizer.byte_fallback False (model)"
        " vs True (config); fine-tune with the model's own model and tokenizer settings (its"
        " config.yaml)"
    )


# --- corpus mixtures ---------------------------------------------------------------------------


def mixture_sampler(sizes: list[int], weights: list[float], seed: int, **kw) -> TokenBucketSampler:
    groups = np.concatenate([np.full(n, i) for i, n in enumerate(sizes)])
    lengths = np.random.default_rng(0).integers(2, 30, len(groups))
    return TokenBucketSampler(lengths, lengths, 256, seed, groups=groups, weights=weights, **kw)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_weights_3_to_1_give_the_mixture_over_an_epoch_per_seed(seed: int) -> None:
    sizes = [600, 400]
    draws = []
    for epoch in range(2):
        per_rank = [
            mixture_sampler(sizes, [3, 1], seed, rank=r, world_size=2).epoch_batches(epoch)
            for r in range(2)
        ]
        drawn = np.concatenate([b for batches in per_rank for b in batches])
        assert len(drawn) == sum(sizes)  # an epoch is as many pairs as the corpora hold
        corpus_1 = int((drawn >= 600).sum())
        assert abs(corpus_1 / len(drawn) - 0.25) < 0.01
        # 750 of 600 pairs: every pair once, 150 twice; 250 of 400: distinct pairs
        counts = np.bincount(drawn, minlength=1000)
        assert set(counts[:600]) <= {1, 2} and counts[:600].sum() == 750
        assert set(counts[600:]) <= {0, 1} and counts[600:].sum() == 250
        draws.append(np.sort(drawn))
    assert not np.array_equal(draws[0], draws[1])  # each epoch draws its own subset
    again = mixture_sampler(sizes, [3, 1], seed).epoch_batches(0)
    assert [b.tolist() for b in again] == [
        b.tolist() for b in mixture_sampler(sizes, [3, 1], seed).epoch_batches(0)
    ]


def test_one_corpus_as_a_list_trains_on_the_same_batches_as_the_plain_split(
    tiny_cfg: Config,
) -> None:
    plain = prepare_data(tiny_cfg)
    listed = prepare_data(with_data(tiny_cfg, train=(Corpus(tiny_cfg.data.train, weight=5.0),)))
    assert plain.tokenizer.sha256 == listed.tokenizer.sha256
    a, b = plain.train.sampler(200, 3), listed.train.sampler(200, 3)
    assert [x.tolist() for x in a.epoch_batches(0)] == [x.tolist() for x in b.epoch_batches(0)]


def test_a_mixture_reads_each_corpus_from_its_own_source(
    tiny_cfg: Config, tiny_corpus: dict[str, Path], tmp_path: Path
) -> None:
    import datasets

    pairs = reverse_pairs(30, seed=11)
    tsv = tmp_path / "extra.tsv"
    tsv.write_text("".join(f"{s}\t{t}\n" for s, t in pairs[:20]))
    saved = tmp_path / "saved"
    records_ = [{"translation": {"de": s, "en": t}} for s, t in pairs[20:]]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records_)}).save_to_disk(saved)
    cfg = with_data(
        tiny_cfg,
        train=(
            Corpus(str(tiny_corpus["train"])),  # the data section's source: files
            Corpus(str(tsv), source="tsv", weight=2.0),
            Corpus("train", source="hf_disk", path=str(saved), weight=0.5),
        ),
    )
    data = prepare_data(cfg)
    assert [data.counts[f"data.train[{i}]"].read for i in range(3)] == [300, 20, 10]
    assert data.counts["data.train"].kept == len(data.train) == 330
    assert [split.weight for split in data.corpora] == [1.0, 2.0, 0.5]
    assert np.bincount(data.train.groups).tolist() == [300, 20, 10]


def test_a_mixture_resumes_bit_exactly_and_is_no_split_to_score(
    tiny_cfg: Config, tiny_corpus: dict[str, Path], new_corpus: Path, tmp_path: Path
) -> None:
    from transformer_mt.data import corpus

    mixture = (Corpus(str(tiny_corpus["train"])), Corpus(str(new_corpus), weight=3.0, tag="<x>"))
    cfg = with_data(with_train(tiny_cfg, save_every=4, max_steps=8), train=mixture)
    train(with_train(cfg, out_dir=str(tmp_path / "whole")))
    train(with_train(cfg, out_dir=str(tmp_path / "halves"), max_steps=4))
    train(with_train(cfg, out_dir=str(tmp_path / "halves")))
    whole, halves = (
        checkpoint.read(run.checkpoint_dir(tmp_path / name, 8)).state_dict
        for name in ("whole", "halves")
    )
    assert all(torch.equal(whole[k], halves[k]) for k in whole)
    with pytest.raises(TmtError, match="data.train is a mixture of 2 corpora"):
        corpus.read_split(cfg.data, "data.train")


def test_a_tag_is_one_piece_that_reaches_the_encoder_of_its_corpus_only(
    tiny_cfg: Config, tiny_corpus: dict[str, Path], new_corpus: Path
) -> None:
    cfg = with_data(
        tiny_cfg,
        train=(Corpus(str(tiny_corpus["train"])), Corpus(str(new_corpus), weight=2.0, tag="<BT>")),
    )
    data = prepare_data(cfg)
    tokenizer = data.tokenizer
    tag = tokenizer.tag_ids("<BT>")
    assert tag is not None and tag[-1] not in (tokenizer.unk_id, tokenizer.eos_id)
    assert [p for p in tokenizer._sp.encode("<BT>", out_type=str) if p != "\u2581"] == ["<BT>"]
    assert tokenizer.encode(["<BT> kaka lomi"])[0] == tag + tokenizer.encode(["kaka lomi"])[0]
    groups = data.train.groups
    assert groups is not None and set(groups.tolist()) == {0, 1}
    src, _ = data.train.ids(np.arange(len(data.train)))
    for ids, group in zip(src, groups.tolist()):
        starts_with_tag = ids[: len(tag)].tolist() == tag
        assert starts_with_tag == (group == 1)
        assert tag[-1] not in ids[len(tag) if group else 0 :]
    # The tag reaches the encoder: the embedding sees it first in every tagged source.
    model = Transformer(cfg.model, tokenizer.vocab_size, tokenizer.pad_id).eval()
    seen = []
    model.embedding.register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
    tagged = np.flatnonzero(groups == 1)[:5]
    batch = data.train.batch(tagged, tokenizer)
    model(batch.src, batch.tgt_in)
    assert (seen[0][:, : len(tag)] == torch.tensor(tag)).all()
    # A tokenizer that lacks the tag (a given model_path, or the model of init_from) is refused.
    plain = prepare_data(tiny_cfg).tokenizer
    with pytest.raises(TmtError, match=r"data.train\[1\].tag='<BT>': not a piece"):
        prepare_data(cfg, plain)


def test_dry_run_reports_pairs_tokens_and_the_mixture_drawn_per_corpus(
    tiny_cfg: Config, tiny_corpus: dict[str, Path], new_corpus: Path
) -> None:
    from transformer_mt.training.dry_run import dry_run, format_report

    cfg = with_data(
        tiny_cfg,
        train=(Corpus(str(tiny_corpus["train"]), weight=3.0), Corpus(str(new_corpus), tag="<x>")),
    )
    summary = dry_run(cfg)
    first, second = summary["corpora"]
    assert (first["key"], first["pairs"], first["weight"]) == ("data.train[0]", 300, 3.0)
    assert (second["pairs"], second["tag"]) == (200, "<x>")
    assert first["drawn"] + second["drawn"] == 500 and first["drawn"] == 375
    assert first["share"] == 0.75 and second["passes"] == 0.625
    assert first["src_tokens"] > 0 and second["src_tokens"] > second["tgt_tokens"]  # + the tag
    assert summary["filters"]["train"]["kept"] == 500
    out = format_report(summary, cfg)
    assert "data.train[1]: 200 pairs" in out and "tag <x>; drawn 125 (25.0% of the epoch" in out


# --- best-N averaging --------------------------------------------------------------------------


def write_scored_run(tmp_path: Path, cfg: Config, spm: bytes, scores: list[dict]) -> Path:
    from conftest import model_parts

    for step, valid in enumerate(scores, 1):
        weights, state = model_parts(cfg, spm, seed=step)
        info = {"epoch": 0, "valid": valid} if valid is not None else {"epoch": 0}
        path = run.checkpoint_dir(tmp_path, step)
        checkpoint.write(path, step, cfg, weights, spm, state, info)
    return tmp_path


def test_average_best_n_picks_the_n_best_by_the_metric(
    tiny_cfg: Config, tiny_spm: bytes, tmp_path: Path
) -> None:
    scores = [
        {"val_bleu": 3.0, "val_loss": 2.0},
        {"val_bleu": 9.0, "val_loss": 2.5},
        {"val_loss": 1.0},  # BLEU not measured at this step
        {"val_bleu": 7.0, "val_loss": 1.5},
        {"val_bleu": "high", "val_loss": float("nan")},  # hostile values are no scores
        None,
    ]
    run_dir = write_scored_run(tmp_path / "run", tiny_cfg, tiny_spm, scores)
    steps = lambda mean: [int(Path(p).name.removeprefix("step_")) for p in mean.sources]  # noqa: E731
    assert steps(averaging.best_of(run_dir, 2, "val_bleu")) == [2, 4]
    assert steps(averaging.best_of(run_dir, 3, "val_loss")) == [1, 3, 4]
    assert averaging.scored_metric(run_dir) == "val_bleu"  # measured, so the default
    with pytest.raises(TmtError, match="4 checkpoints with val_bleu asked for, 3 carry it"):
        averaging.best_of(run_dir, 4, "val_bleu")
    with pytest.raises(TmtError, match="by bleu: expected one of val_bleu"):
        averaging.best_of(run_dir, 1, "bleu")
    for count in ({"last": 0}, {"best": 0}):  # every command that decodes shares the rule
        with pytest.raises(TmtError, match=" 0: expected a number of checkpoints >= 1"):
            translate.load_translator(run_dir, **count)

    best = tmt(
        "average", "-m", str(run_dir), "--best", "2", "--by", "val_bleu", "-o", str(tmp_path / "a"),
        "--json",
    )  # fmt: skip
    assert best.returncode == 0, best.stderr
    result = json.loads(best.stdout)
    assert result["by"] == "val_bleu"
    assert [Path(p).name for p in result["averaged"]] == ["step_00000002", "step_00000004"]
    mean = checkpoint.read(tmp_path / "a")
    parts = [checkpoint.read(run.checkpoint_dir(run_dir, s)).state_dict for s in (2, 4)]
    for name, tensor in mean.state_dict.items():
        assert torch.allclose(tensor, (parts[0][name] + parts[1][name]) / 2)
    for args, message in [
        (["--best", "9", "--last", "1"], "--last and --best: choose one"),
        (["--best", "-2"], "--best -2: expected a number of checkpoints >= 1"),
        # 0 read as "not asked", and the run's best checkpoint was taken without a word
        (["--best", "0"], "--best 0: expected a number of checkpoints >= 1"),
        (["--last", "0"], "--last 0: expected a number of checkpoints >= 1"),
        (["--by", "val_bleu"], "--by ranks the checkpoints of --best N"),
    ]:
        refused = tmt("average", "-m", str(run_dir), *args, "-o", str(tmp_path / "e"))
        assert refused.returncode == 2 and refused.stderr.strip() == f"tmt: error: {message}"
    assert not (tmp_path / "e").exists()


def test_training_keeps_the_best_checkpoints_with_their_scores(
    tiny_cfg: Config, tmp_path: Path
) -> None:
    cfg = with_train(
        tiny_cfg, out_dir=str(tmp_path), max_steps=24, save_every=3, valid_every=3,
        keep_last=1, keep_best=3,
    )  # fmt: skip
    train(cfg)
    losses = {r["step"]: r["val_loss"] for r in records(tmp_path) if "val_loss" in r}
    best_three = sorted(losses, key=losses.get)[:3]
    kept = [int(p.name.removeprefix("step_")) for p in run.list_checkpoints(tmp_path)]
    assert set(kept) == {*best_three, 24}
    for step in kept:
        path = run.checkpoint_dir(tmp_path, step)
        assert checkpoint.scores(path)["val_loss"] == pytest.approx(losses[step])


# --- curves ------------------------------------------------------------------------------------


def write_metrics(run_dir: Path, scale: float) -> Path:
    run_dir.mkdir(parents=True)
    lines = []
    for step in range(10, 110, 10):
        lines.append({"step": step, "epoch": 0, "loss": scale * 5 / step**0.3, "lr": 1e-3 * step,
                      "tokens_per_s": 900.0 + step})  # fmt: skip
        if step % 20 == 0:
            lines.append({"step": step, "val_loss": scale * 4 / step**0.3, "val_bleu": step / 5})
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 110, "loss'  # torn by a kill
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


def test_plot_overlays_runs_into_a_png_with_every_curve(tmp_path: Path) -> None:
    from matplotlib import image

    from transformer_mt.runs import plot

    runs = [write_metrics(tmp_path / "a", 1.0), write_metrics(tmp_path / "b", 1.3)]
    result = plot.draw_curves(runs, tmp_path / "out.png")
    # Two runs: train and validation loss of each, BLEU, learning rate and tokens/s of each.
    assert result["curves"] == {"loss": 4, "validation BLEU": 2, "learning rate": 2,
                                "throughput": 2}  # fmt: skip
    pixels = image.imread(tmp_path / "out.png")
    assert pixels.shape == (750, 1100, 4)
    rgb = (pixels[..., :3] * 255).round().astype(int)
    for colour in ((31, 119, 180), (255, 127, 14)):  # matplotlib's C0 and C1: both runs drawn
        assert (np.abs(rgb - colour).sum(-1) < 30).sum() > 500
    svg = plot.draw_curves(runs[:1], tmp_path / "out.svg")
    assert svg["curves"]["loss"] == 2 and (tmp_path / "out.svg").read_text().lstrip().startswith(
        "<"
    )
    with pytest.raises(TmtError, match=r"out.jpg: the plot is written as .png, .svg, .pdf"):
        plot.draw_curves(runs, tmp_path / "out.jpg")
    with pytest.raises(TmtError, match="missing: no such directory; name a run directory"):
        plot.draw_curves([tmp_path / "missing"], tmp_path / "x.png")
    (tmp_path / "missing").mkdir()
    with pytest.raises(TmtError, match="no metrics.jsonl"):
        plot.draw_curves([tmp_path / "missing"], tmp_path / "x.png")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "metrics.jsonl").write_text('not json\n[1, 2]\n"step"\n')
    with pytest.raises(TmtError, match=r"metrics.jsonl: no records to plot \(3 lines"):
        plot.draw_curves([tmp_path / "garbage"], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_damaged_lines_of_a_metrics_log_are_named_and_a_torn_last_one_is_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A kill may tear the log's last line: skipped quietly. Lines that do not read anywhere
    else (the log was damaged: its curves miss those points) are skipped by tmt plot, and
    dropped by a resume, with a warning that names them."""
    import logging

    from transformer_mt.runs import plot

    run_dir = write_metrics(tmp_path / "torn", 1.0)
    with caplog.at_level(logging.WARNING):
        whole = plot.read_curves(run_dir)
    assert not caplog.records and [s for s, _ in whole["loss"]] == list(range(10, 110, 10))
    log = run_dir / "metrics.jsonl"
    lines = log.read_text().split("\n")
    lines[2:2] = ["\x00\x00 garbage", '{"step": "x"}', "[1, 2]"]  # lines 3-5
    log.write_text("\n".join(lines) + "\n")  # the torn line is no longer the last: damaged too
    with caplog.at_level(logging.WARNING):
        damaged = plot.read_curves(run_dir)
    assert damaged == whole
    assert [r.getMessage() for r in caplog.records] == [
        f"{log}: 4 damaged lines skipped (lines 3, 4, 5, {len(lines)})"
    ]
    # A resume at step 60 drops the records past it, and the damaged lines, saying so.
    from transformer_mt.runs import metrics

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        metrics.trim(run_dir, 60)
    assert [r.getMessage() for r in caplog.records] == [
        f"{log}: 4 damaged lines dropped (lines 3, 4, 5, {len(lines)})"
    ]
    assert max(s for s, _ in plot.read_curves(run_dir)["loss"]) == 60


def test_tmt_plot_command(tmp_path: Path, trained_run: Path) -> None:
    runs = [write_metrics(tmp_path / "a", 1.0), write_metrics(tmp_path / "b", 1.3)]
    done = tmt("plot", "-m", str(runs[0]), "-m", str(runs[1]), "-o", str(tmp_path / "both.png"),
               "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["runs"] == 2 and (tmp_path / "both.png").stat().st_size > 10_000
    managed = tmt("plot", "-m", str(runs[0]), "-o", str(trained_run / "metrics.jsonl"))
    assert managed.returncode == 2 and "a file of the run directory" in managed.stderr


def test_training_draws_curves_and_writes_tensorboard_events(
    tiny_cfg: Config, tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(with_train(tiny_cfg, out_dir=str(tmp_path), max_steps=10, curves=True, tensorboard=True))
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [5, 10]
    assert [e.step for e in events.Scalars("valid/val_loss")] == [10]
    logged = [r["loss"] for r in records(tmp_path) if "loss" in r]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(logged, rel=1e-6)


def test_training_curves_cost_a_small_share_of_the_session_and_the_last_is_always_drawn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """matplotlib draws on the training thread: an H200's 96-second run, validating every ~11 s,
    draws only its last figure (the first was guessed at 2 s: 2 % of 96 s is under it); a run of
    hours at every validation; a failing figure is logged and training goes on."""
    from transformer_mt.runs import plot

    now, drawn = [0.0], []

    def draw(run_dirs: list[Path], output: Path) -> None:
        assert run_dirs == [tmp_path] and output == tmp_path / "curves.png"
        drawn.append(now[0])
        now[0] += cost

    monkeypatch.setattr(plot, "draw_curves", draw)
    cost = 2.5  # the first figure: matplotlib imported, its font cache built
    short = plot.RunCurves(tmp_path, enabled=True, start=0.0, clock=lambda: now[0])
    for now[0] in (43.0, 54.0, 65.0, 76.0, 87.0):
        assert not short.draw()
    now[0] = 96.0
    assert short.draw(final=True) and drawn == [96.0]

    drawn.clear()
    long = plot.RunCurves(tmp_path, enabled=True, start=0.0, clock=lambda: now[0])
    for now[0] in (180.0, 360.0, 540.0):  # the CPU preset's: every ~3 minutes
        assert long.draw()
        cost = 0.5  # the next ones
    assert drawn == [180.0, 360.0, 540.0]
    assert long.spent_s == pytest.approx(3.5) and long.last_s == pytest.approx(0.5)
    cost = 20.0  # a figure slower than the share allows (a huge metrics log): drawn less often
    now[0] = 720.0
    assert long.draw() and not long.draw() and drawn[-1] == 720.0
    now[0] = 2000.0  # 2 % of 2,000 s: 40 s, against 23.5 spent and 20 guessed for the next
    assert not long.draw()
    now[0] = 2200.0
    assert long.draw()

    def broken(run_dirs: list[Path], output: Path) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(plot, "draw_curves", broken)
    assert not long.draw(final=True) and long.enabled  # logged; the next one is tried
    off = plot.RunCurves(tmp_path, enabled=False, start=0.0, clock=lambda: now[0])
    assert not off.draw(final=True)


def test_tensorboard_without_the_package_is_a_one_line_error(
    tiny_cfg: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(TmtError, match=r"needs the tensorboard package: pip install"):
        train(with_train(tiny_cfg, out_dir=str(tmp_path), tensorboard=True))
    assert not (tmp_path / "checkpoints").exists()
