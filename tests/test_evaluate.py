"""Scores: sacreBLEU golden values, counts, the evaluate library function on a split and a file."""

from __future__ import annotations

from pathlib import Path

import pytest

from transformer_mt import corpus, evaluate, textio, translate
from transformer_mt.exits import TmtError


def translator(trained_run: Path, *overrides: str) -> translate.Translator:
    return translate.load_translator(trained_run / "checkpoints" / "step_00000030", list(overrides))


def test_score_golden_values() -> None:
    refs = ["The cat sat on the mat.", "A dog runs in the park."]
    perfect = evaluate.score(refs, refs)
    assert (perfect["bleu"], perfect["chrf"], perfect["bleu_lc"], perfect["sentences"]) == (
        100.0,
        100.0,
        100.0,
        2,
    )
    assert perfect["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    lower = evaluate.score([r.lower() for r in refs], refs)
    assert lower["bleu_lc"] == 100.0 and lower["bleu"] < 100.0
    partial = evaluate.score(["The cat sat on a mat.", "A dog runs in the park."], refs)
    # By hand: 1..4-gram precisions 13/14, 10/12, 7/10, 5/8, brevity penalty 1:
    # exp(mean(log p_n)) = 0.33854^(1/4) = 0.7628.
    assert partial["bleu"] == pytest.approx(76.28, abs=0.01)


def test_count_mismatch_is_an_error() -> None:
    with pytest.raises(TmtError, match="3 hypotheses but 2 references"):
        evaluate.score(["a", "b", "c"], ["a", "b"])


def test_evaluate_split_and_hypothesis_file(trained_run: Path, tmp_path: Path) -> None:
    t = translator(trained_run, "decode.beam_size=1")
    cfg = t.config
    report = evaluate.evaluate(t, split="valid")
    assert report["sentences"] == 40
    sources, _ = corpus.read_split(cfg.data, "data.valid")
    hyp_file = tmp_path / "hyp.txt"
    hyp_file.write_text("".join(h + "\n" for h in translate.translate_text(t, sources)))
    again = evaluate.evaluate(
        None, split="valid", hypotheses=textio.read_text_file(hyp_file, "hyp"), cfg=cfg
    )
    assert again["bleu"] == report["bleu"] and again["chrf"] == report["chrf"]
    with pytest.raises(TmtError, match="39 hypotheses but 40 references"):
        evaluate.evaluate(
            None, split="valid", hypotheses=textio.read_text_file(hyp_file, "hyp")[:-1], cfg=cfg
        )
