"""Averaging (§6.1): golden values, copies average back bitwise, refusals, a loadable model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import model_parts, reverse_pairs

from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, apply_overrides
from transformer_mt.runs import averaging, checkpoint, run
from transformer_mt.translation import translate

SOURCES = [s for s, _ in reverse_pairs(12, seed=7)]


def fake(tmp_path: Path, name: str, cfg: Config, spm: bytes, step: int, **rows: list) -> Path:
    """A model checkpoint of `cfg` whose first embedding rows are set to `rows` (by row index)."""
    weights, _ = model_parts(cfg, spm)
    for index, values in rows.items():
        weights["embedding.weight"][int(index.removeprefix("row")), : len(values)] = torch.tensor(
            values
        )
    return checkpoint.write(tmp_path / name, step, cfg, weights, spm)


def test_average_golden_values(tiny_cfg: Config, tiny_spm: bytes, tmp_path: Path) -> None:
    a = fake(tmp_path, "a", tiny_cfg, tiny_spm, 1, row0=[1.0, 2.0, 3.0], row1=[-1.0])
    b = fake(tmp_path, "b", tiny_cfg, tiny_spm, 2, row0=[3.0, 4.0, 8.0], row1=[2.5])
    mean = averaging.average([b, a])  # any order: sources sorted by step
    embedding = mean.state_dict["embedding.weight"]
    assert torch.equal(embedding[0, :3], torch.tensor([2.0, 3.0, 5.5]))
    assert torch.equal(embedding[1, :1], torch.tensor([0.75]))
    # The tied pre-softmax projection is the same averaged matrix.
    assert torch.equal(mean.state_dict["output_projection.weight"], embedding)
    assert mean.step == 2 and mean.sources == (str(a), str(b))


def test_average_of_copies_is_bitwise_the_original(trained_run: Path) -> None:
    one = trained_run / "checkpoints" / "step_00000030"
    original = checkpoint.read(one).state_dict
    mean = averaging.average([one] * 3)
    assert all(torch.equal(original[k], mean.state_dict[k]) for k in original)


def test_average_refuses_different_models(
    tiny_cfg: Config, tiny_spm: bytes, tmp_path: Path
) -> None:
    from transformer_mt.data.tokenizer import train_tokenizer

    a = fake(tmp_path, "a", tiny_cfg, tiny_spm, 1)
    wider = apply_overrides(tiny_cfg, ["model.d_ff=128"])
    with pytest.raises(TmtError, match="cannot average .*: model.d_ff differ"):
        averaging.average([a, fake(tmp_path, "b", wider, tiny_spm, 2)])
    sentences = [s for pair in reverse_pairs(200, seed=9) for s in pair]
    other_spm = train_tokenizer(
        sentences, tiny_cfg.tokenizer.__class__(vocab_size=48, byte_fallback=False)
    )
    with pytest.raises(TmtError, match="the tokenizer model differ"):
        other = fake(tmp_path, "c", tiny_cfg, other_spm.model_bytes, 3)
        averaging.average([a, other])


def test_write_average_is_a_loadable_model(trained_run: Path, tmp_path: Path) -> None:
    out = averaging.write(averaging.newest(trained_run, 2), tmp_path / "avg").path
    assert checkpoint.verify(out) is None
    assert checkpoint.read(out).sources == tuple(
        str(p) for p in run.list_checkpoints(trained_run)[-2:]
    )
    # The written model translates exactly as the same average made in memory.
    written = translate.translate_text(translate.load_translator(out), SOURCES)
    assert written == translate.translate_text(
        translate.load_translator(trained_run, last=2), SOURCES
    )
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "notes.txt").write_text("mine")
    with pytest.raises(TmtError, match="exists and is not a checkpoint"):
        averaging.check_destination(tmp_path / "occupied")
    with pytest.raises(TmtError, match="exists; add overwrite to replace it"):
        averaging.check_destination(out)  # an averaged model is replaced only when asked
    averaging.check_destination(out, overwrite=True)
    with pytest.raises(TmtError, match="a training checkpoint; averaging into it would destroy"):
        averaging.check_destination(run.list_checkpoints(trained_run)[0], overwrite=True)


def test_an_average_keeps_its_models_shortlist_only_while_it_is_the_same_model(
    trained_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """tmt shortlist writes beside a model; averaging into that directory again (a finished run
    run again, tmt average --overwrite) is not refused for it: the same model keeps it, another
    drops it with a warning (it names the model it was made for)."""
    from transformer_mt.translation import shortlisting

    every = [str(p) for p in run.list_checkpoints(trained_run)]
    out = tmp_path / "avg"
    averaging.average_into(every[-2:], out)
    shortlisting.make(str(out), aligner="ibm1")
    table = (out / "shortlist.npz").read_bytes()
    averaging.average_into(every[-2:], out, overwrite=True)  # the same model
    assert (out / "shortlist.npz").read_bytes() == table
    assert translate.load_translator(out, ["decode.shortlist=auto"]).shortlist is not None
    with caplog.at_level("WARNING"):
        averaging.average_into(every[:2], out, overwrite=True)  # another model
    assert not (out / "shortlist.npz").exists()
    assert "shortlist.npz: made for the model this average replaced" in caplog.text
    with pytest.raises(TmtError, match="no shortlist.npz in"):
        translate.load_translator(out, ["decode.shortlist=auto"])
    (out / "shortlist.npz").symlink_to(tmp_path / "elsewhere.npz")  # not as tmt writes it
    with pytest.raises(TmtError, match="holds shortlist.npz, which tmt did not write there"):
        averaging.average_into(every[-2:], out, overwrite=True)
    (out / "shortlist.npz").unlink()
    (out / "notes.txt").write_text("mine")  # a file tmt did not write is still never replaced
    with pytest.raises(TmtError, match="holds notes.txt, which tmt did not write there"):
        averaging.average_into(every[-2:], out, overwrite=True)


def test_newest_takes_the_newest_that_read_and_counts(trained_run: Path, tmp_path: Path) -> None:
    every = [str(p) for p in run.list_checkpoints(trained_run)]  # steps 10, 20, 30
    assert averaging.newest(trained_run, 2).sources == tuple(every[-2:])
    with pytest.raises(TmtError, match="3 complete checkpoints, 9 asked for"):
        averaging.newest(trained_run, 9)
    # Training's final average takes what there is when the run kept fewer than asked.
    assert averaging.newest(trained_run, 9, allow_fewer=True).sources == tuple(every)
    copy = tmp_path / "run"
    shutil.copytree(trained_run, copy, symlinks=True)
    (copy / "checkpoints" / "step_00000030" / "model.pt").write_bytes(b"broken")
    assert [Path(p).name for p in averaging.newest(copy, 2).sources] == [
        "step_00000010",
        "step_00000020",
    ]  # the broken newest is skipped
