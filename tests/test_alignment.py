"""Alignments from the cross-attention: a model trained to copy aligns word i to word i; one pair
per target token; words are the line's whitespace words; the translations do not change; the
command line writes Marian's "text ||| i-j" and refuses what it cannot do in one line."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
from conftest import REPO, WORDS, multi30k_sentences, write_parallel
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.config import load_config
from transformer_mt.network import alignment
from transformer_mt.translation import decoding, translate

SOURCES = multi30k_sentences(12)
runner = CliRunner()


def copy_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """A copy task: the target is the source."""
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) + rng.choice(WORDS) for _ in range(rng.randint(2, 7)))
             for _ in range(n)]  # fmt: skip
    return [(line, line) for line in lines]


COPY_MODEL = REPO / "tests" / "fixtures" / "copy_model"


def train_copy_model(root: Path) -> Path:
    """A small model trained to copy (500 updates, about 35 s on 2 cores): it copies 38 of 40 new
    lines. scripts/copy_fixture.py keeps its weights as tests/fixtures/copy_model, which the tests
    read: the training is the input here, not the promise (tests/test_train.py holds training's),
    and a kept model aligns the same whatever the machine's thread count."""
    from transformer_mt.training.train import train

    cfg = load_config(REPO / "configs" / "tiny.yaml")
    train(dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, d_model=64, d_ff=256, n_heads=4, dropout=0.0),
        data=dataclasses.replace(
            cfg.data, source="files", max_tokens=2048,
            train=str(write_parallel(root / "train", copy_pairs(3000, 1))),
            valid=str(write_parallel(root / "valid", copy_pairs(40, 2))),
        ),
        tokenizer=dataclasses.replace(cfg.tokenizer, vocab_size=400, byte_fallback=False),
        optim=dataclasses.replace(cfg.optim, warmup_steps=150, lr_scale=2.0),
        train=dataclasses.replace(cfg.train, out_dir=str(root / "run"), max_steps=500,
                                  save_every=500, valid_every=500, keep_last=1),
    ))  # fmt: skip
    return root / "run"


@pytest.fixture(scope="module")
def copy_run() -> Path:
    """The copy model (train_copy_model's, kept by scripts/copy_fixture.py)."""
    return COPY_MODEL


@pytest.mark.parametrize(("layer", "at_least"), [(-2, 0.9), (-1, 0.95)])
def test_a_copy_model_aligns_each_word_to_itself(
    copy_run: Path, layer: int, at_least: float
) -> None:
    settings = ["decode.alignment=word", f"decode.alignment_layer={layer}"]
    model = translate.load_translator(copy_run, settings)
    lines = [s for s, _ in copy_pairs(40, 3)]
    diagonal = total = copied = 0
    for line, hyps in zip(lines, decoding.translate_lines(model, lines), strict=True):
        if translate.detokenize(model, [hyps[0].tokens])[0] != line:
            continue
        copied += 1
        pairs = hyps[0].alignment
        assert sorted({j for _, j in pairs}) == list(range(len(line.split())))  # every word
        diagonal += sum(i == j for i, j in pairs)
        total += len(pairs)
    assert copied >= 30 and diagonal >= at_least * total, (copied, diagonal, total)


def test_one_pair_per_target_token_and_the_translations_unchanged(multi30k_run: Path) -> None:
    plain = translate.load_translator(multi30k_run, ["decode.nbest=2"])
    aligned = translate.load_translator(
        multi30k_run, ["decode.nbest=2", "decode.alignment=subword"]
    )
    ids = decoding.source_ids(aligned, SOURCES)
    found = decoding.translate_lines(aligned, SOURCES)
    expected = decoding.translate_lines(plain, SOURCES)
    assert [[h.tokens for h in hs] for hs in found] == [[h.tokens for h in hs] for hs in expected]
    for source, hyps in zip(ids, found, strict=True):
        for h in hyps:
            assert [j for _, j in h.alignment] == list(range(len(h.tokens)))
            assert all(0 <= i < len(source) for i, _ in h.alignment)


def test_word_indices_are_the_lines_whitespace_words(multi30k_run: Path) -> None:
    tok = translate.load_translator(multi30k_run).tokenizer
    for line in multi30k_sentences(200, "val"):
        ids = tok.encode([line])[0]
        words = alignment.word_indices(tok, ids)
        assert words == sorted(words) and words[-1] == len(line.split()) - 1
        for w, word in enumerate(line.split()):
            pieces = [t for t, index in zip(ids, words, strict=True) if index == w]
            assert tok.decode([pieces])[0] == word


def test_translate_writes_text_then_its_alignment(multi30k_run: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.de"
    source.write_text("".join(s + "\n" for s in [*SOURCES[:4], ""]), encoding="utf-8")
    model = translate.load_translator(multi30k_run, ["decode.alignment=word"])
    hyps = decoding.translate_lines(model, [*SOURCES[:4], ""])
    texts = translate.translate_text(model, SOURCES[:4])
    expected = [
        f"{t} ||| {alignment.pharaoh(h[0].alignment)}" for t, h in zip(texts, hyps, strict=False)
    ]
    args = ["translate", "-m", str(multi30k_run), "--alignment", "word"]
    streamed = runner.invoke(app, args, input=source.read_text())
    assert streamed.exit_code == 0, streamed.output
    assert streamed.stdout.splitlines() == [*expected, " ||| "]
    out = tmp_path / "out.en"
    assert runner.invoke(app, [*args, "-i", str(source), "-o", str(out)]).exit_code == 0
    assert out.read_text().splitlines() == [*expected, " ||| "]
    nbest = runner.invoke(app, [*args, "--nbest", "2"], input=source.read_text())
    rows = [row.split("\t") for row in nbest.stdout.splitlines()]
    assert len(rows) == 10 and all(len(row) == 4 for row in rows)
    assert rows[0][3] == expected[0].split(" ||| ")[1] and rows[-1] == ["4", "0.0000", "", ""]


@pytest.mark.parametrize(("extra", "named"), [
    (["--alignment", "phrase"], "decode.alignment"),
    (["--alignment", "word", "--set", "decode.alignment_layer=5"], "decode.alignment_layer=5"),
    (["--alignment", "word", "--engine", "ctranslate2"], "decode.alignment=word: not with"),
])  # fmt: skip
def test_what_alignments_cannot_do_is_one_line(
    multi30k_run: Path, extra: list[str], named: str
) -> None:
    result = runner.invoke(app, ["translate", "-m", str(multi30k_run), *extra], input="Ein Hund\n")
    assert result.exit_code == 2 and named in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
