"""Scores: sacreBLEU golden values, counts, the evaluate library function on a split and a file."""

from __future__ import annotations

from pathlib import Path

import pytest

from transformer_mt.common import textio
from transformer_mt.common.exits import TmtError
from transformer_mt.config import apply_overrides, load_config
from transformer_mt.data import corpus
from transformer_mt.translation import evaluate, translate


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


def test_ter_and_chrf_plus_plus_golden_values() -> None:
    refs = ["The cat sat on the mat.", "A dog runs in the park."]
    partial = evaluate.score(["The cat sat on a mat.", "A dog runs in the park."], refs)
    # TER by hand: one substitution (a -> the) over 12 reference words: 8.33.
    assert partial["ter"] == pytest.approx(100 / 12, abs=0.01)
    assert partial["ter_signature"].startswith("nrefs:1|case:lc|tok:tercom|norm:no|punct:yes")
    # chrF++ adds word unigrams and bigrams to chrF's character n-grams: above chrF here, where
    # 5 of 6 words per sentence match.
    assert partial["chrfpp"] > partial["chrf"] and "nw:2" in partial["chrfpp_signature"]
    perfect = evaluate.score(refs, refs)
    assert (perfect["ter"], perfect["chrfpp"]) == (0.0, 100.0)
    report = evaluate.format_report({**partial, "model": None})
    assert "TER = 8.33" in report and "chrF2++ = " in report
    # Training's validation leaves the slow ones out.
    assert "ter" not in evaluate.score(refs, refs, all_metrics=False)


def test_bleu_takes_sacrebleus_tokenizer_for_the_target_language(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As sacreBLEU's command picks it from -l: 13a leaves a line of Chinese one token (BLEU 0
    for all but an exact match), its zh tokenizer splits the characters; Japanese and Korean
    want MeCab, and without it are scored by character, said once and in the signature."""
    from sacrebleu.metrics import BLEU
    from sacrebleu.tokenizers import tokenizer_ja_mecab

    refs = ["我们的狗在公园里跑来跑去。", "今天天气很好，他很高兴。"]
    hyps = ["我们的狗在公园里跑。", "今天天气很好，她很高兴。"]
    plain, chinese = evaluate.score(hyps, refs), evaluate.score(hyps, refs, language="zh")
    assert plain["bleu"] == 0.0 and "tok:13a" in plain["signature"]
    assert plain["ter"] == 100.0 and "asian:no" in plain["ter_signature"]  # one word a sentence
    assert 0 < chinese["ter"] < 50 and "asian:yes" in chinese["ter_signature"]
    assert chinese["bleu"] == round(BLEU(tokenize="zh").corpus_score(hyps, [refs]).score, 2) > 30
    assert "tok:zh" in chinese["signature"] and chinese["bleu_lc"] == chinese["bleu"]
    assert evaluate.score(hyps, refs, language="de")["bleu"] == 0.0  # 13a: any other language
    cfg = load_config("multi30k", ["data.tgt_lang=cmn"])
    assert evaluate.target_language(cfg) == "zh"  # any ISO form of the language
    assert evaluate.target_language(apply_overrides(cfg, ["decode.target_lang=jpn"])) == "ja"
    assert evaluate.target_language(None) is None
    monkeypatch.setattr(tokenizer_ja_mecab, "MeCab", None)  # as where sacrebleu[ja] is not
    evaluate._said_once.cache_clear()
    for _ in range(2):
        japanese = evaluate.score(["犬が走る。"], ["犬が走った。"], language="ja")
        assert "tok:char" in japanese["signature"] and japanese["bleu"] > 0
    warned = [r.getMessage() for r in caplog.records if "MeCab" in r.getMessage()]
    assert len(warned) == 1 and "pip install 'sacrebleu[ja]'" in warned[0]
    ref, hyp = tmp_path / "ref.zh", tmp_path / "hyp.zh"
    ref.write_text("\n".join(refs * 20) + "\n")
    hyp.write_text("\n".join(hyps * 20) + "\n")
    report = evaluate.compare([("a", hyps * 20), ("b", refs * 20)], refs * 20, cfg=cfg)
    assert "tok:zh" in report["signatures"]["bleu"]
    from typer.testing import CliRunner

    from transformer_mt.cli import app

    args = ["evaluate", "--hyp", str(hyp), "--ref", str(ref), "--json"]
    evaluate._said_once.cache_clear()
    caplog.clear()
    for setting, tokenizer in (([], "tok:13a"), (["--set", "data.tgt_lang=zh"], "tok:zh")):
        result = CliRunner().invoke(app, [*args, *setting])
        assert result.exit_code == 0 and tokenizer in result.stdout, result.output
    # Chinese references scored as English (the default config's language): said, once.
    said = [r.getMessage() for r in caplog.records if "without spaces" in r.getMessage()]
    assert len(said) == 1 and "scored as en" in said[0] and "--set data.tgt_lang=zh" in said[0]
    caplog.clear()
    evaluate.score(["A dog runs.", "公园"], ["A dog runs.", "公园"])  # mostly Latin: nothing
    assert not [r for r in caplog.records if "without spaces" in r.getMessage()]


def compare_files(tmp_path: Path) -> dict[str, Path]:
    """40 references; system `good` is them with one word dropped in a line of 8, `bad` has a
    third of its lines replaced by an unrelated sentence, `same` is a copy of `good`."""
    refs = [f"a man in a red shirt {i} is walking his dog number {i} today" for i in range(40)]
    good = [" ".join(r.split()[1:]) if i % 8 == 0 else r for i, r in enumerate(refs)]
    bad = ["two cats sleep" if i % 3 == 0 else r for i, r in enumerate(good)]
    files = {"ref": refs, "good": good, "bad": bad, "same": good}
    for name, lines in files.items():
        (tmp_path / f"{name}.txt").write_text("\n".join(lines) + "\n")
    return {name: tmp_path / f"{name}.txt" for name in files}


def test_comparison_is_sacrebleus_paired_tests(tmp_path: Path) -> None:
    from sacrebleu.metrics import BLEU, CHRF, TER
    from sacrebleu.significance import PairedTest

    f = compare_files(tmp_path)
    systems = [(str(f[n]), textio.read_text_file(f[n], "hyp")) for n in ("good", "bad", "same")]
    refs = textio.read_text_file(f["ref"], "ref")
    report = evaluate.compare(systems, refs)
    good, bad, same = report["systems"]
    assert good["baseline"] and good["bleu"]["p_bootstrap"] is None
    # sacreBLEU's own numbers, called directly (its fixed seed): tmt passes them through.
    metrics = {"BLEU": BLEU(), "chrF2": CHRF(), "TER": TER()}
    _, direct = PairedTest(systems, metrics, [refs], test_type="bs", n_ar_confidence=-1)()
    for i, row in enumerate(report["systems"]):
        assert row["bleu"]["mean"] == round(float(direct["BLEU"][i].mean), 2)
        assert row["ter"]["ci95"] == round(float(direct["TER"][i].ci), 2)
        if not row["identical_to_baseline"]:
            assert row["chrf"]["p_bootstrap"] == direct["chrF2"][i].p_value
    # A third of the lines wrong: worse on every metric, significantly in both tests.
    assert (
        bad["bleu"]["score"] < good["bleu"]["score"] and bad["ter"]["score"] > good["ter"]["score"]
    )
    for metric in ("bleu", "chrf", "ter"):
        assert bad[metric]["p_bootstrap"] < 0.05 and bad[metric]["p_randomization"] < 0.05
        # The same output as the baseline: no test (sacreBLEU would say p = 0.001).
        assert same[metric]["p_bootstrap"] is None and same[metric]["p_randomization"] is None
    assert same["identical_to_baseline"] and not bad["identical_to_baseline"]
    table = evaluate.format_comparison(report)
    bad_rows = [line for line in table.splitlines() if line.startswith(str(f["bad"]))]
    same_rows = [line for line in table.splitlines() if line.startswith(str(f["same"]))]
    assert len(bad_rows) == 3 and all(line.endswith(" *") for line in bad_rows)
    assert len(same_rows) == 3 and all(line.endswith("identical") for line in same_rows)


def test_comparison_from_the_command_line(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from transformer_mt.cli import app

    f = compare_files(tmp_path)
    args = ["evaluate", "--hyp", str(f["good"]), "--hyp", str(f["bad"]), "--ref", str(f["ref"])]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [row["system"] for row in report["systems"]] == [str(f["good"]), str(f["bad"])]
    assert report["signatures"]["bleu"].startswith("nrefs:1|bs:1000|seed:12345|")
    text = CliRunner().invoke(app, args)
    assert (
        text.exit_code == 0
        and "mean ± 95% CI" in text.stdout
        and "p (randomization)" in text.stdout
    )
    short = tmp_path / "short.txt"
    short.write_text("one line\n")
    for bad_args, message in [
        (["--hyp", str(f["good"]), "--hyp", str(short), "--ref", str(f["ref"])],
         f"{short}: 1 hypotheses but 40 references"),
        (["--hyp", str(f["good"]), "--hyp", str(f["bad"]), "-m", str(tmp_path)],
         "-m: not with --hyp, whose lines are scored as they are"),
        (["--hyp", str(f["good"]), "--hyp", str(tmp_path / "nope.txt"), "--ref", str(f["ref"])],
         "no such file"),
        # a decoding option is refused with --hyp whatever its value: 0 was taken as not given
        (["--hyp", str(f["good"]), "--ref", str(f["ref"]), "--last", "0", "--beam", "0"],
         "--last, --beam: not with --hyp"),
    ]:  # fmt: skip
        result = CliRunner().invoke(app, ["evaluate", *bad_args])
        assert result.exit_code == 2 and message in result.stderr, result.output
        assert "Traceback" not in result.output


def test_several_references_score_as_sacrebleu_scores_them() -> None:
    """Each stream a reference of every sentence: sacreBLEU's multi-reference BLEU, chrF and TER,
    its figures and its signature (nrefs:2)."""
    from sacrebleu.metrics import BLEU, CHRF, TER

    first = ["The cat sat on the mat today.", "A dog runs in the green park."]
    second = ["A cat was sitting on the mat today.", "The dog is running in a green park."]
    hyps = ["A cat sat on the mat today.", "A dog runs in a green park."]
    both = evaluate.score(hyps, [first, second])
    for name, metric in {"bleu": BLEU(), "chrf": CHRF(), "ter": TER()}.items():
        assert both[name] == round(metric.corpus_score(hyps, [first, second]).score, 2), name
    assert both["signature"].startswith("nrefs:2|") and both["ter_signature"].startswith("nrefs:2")
    one = evaluate.score(hyps, first)
    assert one["signature"].startswith("nrefs:1|") and both["bleu"] > one["bleu"]
    assert evaluate.score(hyps, [first]) == one  # a list of one stream is that stream
    assert evaluate.score(second, [first, second])["bleu"] == 100.0  # each line matches one
    with pytest.raises(TmtError, match="2 hypotheses but 1 references"):
        evaluate.score(hyps, [first, second[:1]])


def test_several_references_from_the_command_line(trained_run: Path, tmp_path: Path) -> None:
    """--ref given once per reference: hypothesis files, a comparison and a model's output."""
    import json

    from typer.testing import CliRunner

    from transformer_mt.cli import app

    f = compare_files(tmp_path)
    other = tmp_path / "other.txt"
    other.write_text("".join(line.replace("man", "person") + "\n" for line in
                             textio.read_text_file(f["ref"], "ref")))  # fmt: skip
    refs = ["--ref", str(f["ref"]), "--ref", str(other)]
    hyps = textio.read_text_file(f["good"], "hyp")
    streams = [textio.read_text_file(f["ref"], "ref"), textio.read_text_file(other, "ref")]
    result = CliRunner().invoke(app, ["evaluate", "--hyp", str(f["good"]), *refs, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {**evaluate.score(hyps, streams), "model": None}
    compared = CliRunner().invoke(app, ["evaluate", "--hyp", str(f["good"]), "--hyp",
                                        str(f["bad"]), *refs, "--json"])  # fmt: skip
    assert compared.exit_code == 0, compared.output
    assert json.loads(compared.stdout)["signatures"]["bleu"].startswith("nrefs:2|")
    # A model's translations of -i against both references.
    sources, references = corpus.read_split(translator(trained_run).config.data, "data.valid")
    (tmp_path / "src").write_text("".join(line + "\n" for line in sources))
    (tmp_path / "r1").write_text("".join(line + "\n" for line in references))
    (tmp_path / "r2").write_text("".join(line.upper() + "\n" for line in references))
    model = ["-m", str(trained_run / "checkpoints" / "step_00000030"), "--beam", "1"]
    scored = CliRunner().invoke(app, ["evaluate", *model, "-i", str(tmp_path / "src"), "--ref",
                                      str(tmp_path / "r1"), "--ref", str(tmp_path / "r2"),
                                      "--json"])  # fmt: skip
    assert scored.exit_code == 0, scored.output
    report = json.loads(scored.stdout)
    hypotheses = translate.translate_text(translator(trained_run, "decode.beam_size=1"), sources)
    upper = [line.upper() for line in references]
    assert report["bleu"] == evaluate.score(hypotheses, [references, upper])["bleu"]
    assert report["signature"].startswith("nrefs:2|")
    # Reference files of other lengths: one line naming the file.
    short = tmp_path / "short.txt"
    short.write_text("one line\n")
    result = CliRunner().invoke(app, ["evaluate", "--hyp", str(f["good"]), "--ref", str(f["ref"]),
                                      "--ref", str(short)])  # fmt: skip
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"--ref {short}: 1 lines, but {f['ref']} has 40" in result.stderr
    # A split the model's config names that is not on this machine (a model trained elsewhere):
    # what else to do, in the command's flags.
    result = CliRunner().invoke(app, ["evaluate", *model, "--split", "test", "--set",
                                      f"data.test={tmp_path / 'elsewhere'}"])  # fmt: skip
    assert result.exit_code == 2 and result.stderr.strip().endswith(
        "exists: the model's config names it; score other text with --input SOURCES --ref"
        " REFERENCES"
    ), result.stderr


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
