"""Target prefixes on a real model (the search's oracle tests are in test_search.py): the greedy
output's start gives the greedy output, an unlikely prefix is kept in every hypothesis, both
engines agree, and the command line's file paths (stream and job) keep one prefix a line."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import multi30k_sentences
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.common import faults
from transformer_mt.translation import bulk, translate

SOURCES = multi30k_sentences(12)
runner = CliRunner()


@pytest.fixture(scope="module")
def greedy_model(multi30k_run: Path) -> translate.Translator:
    return translate.load_translator(multi30k_run, ["decode.beam_size=1"])


def test_the_greedy_outputs_start_as_prefix_gives_the_greedy_output(
    greedy_model: translate.Translator,
) -> None:
    plain = translate.translate_lines(greedy_model, SOURCES)
    tok, checked = greedy_model.tokenizer, 0
    for k in (1, 2, 4, 100):
        starts = [hyps[0].tokens[:k] for hyps in plain]
        texts = tok.decode(starts)
        # The prefix is text: where its segmentation is the output's own, the output is unchanged.
        same = [tok.encode([t])[0] == s for t, s in zip(texts, starts, strict=True)]
        forced = translate.translate_lines(greedy_model, SOURCES, prefixes=texts)
        for i in (i for i, ok in enumerate(same) if ok):
            assert forced[i][0].tokens == plain[i][0].tokens
            assert forced[i][0].log_prob == pytest.approx(plain[i][0].log_prob, abs=1e-4)
            checked += 1
    assert checked >= 0.8 * 4 * len(SOURCES)  # the check is not vacuous


@pytest.mark.parametrize("settings", [["decode.beam_size=1"],
                                      ["decode.beam_size=4", "decode.nbest=3"],
                                      ["decode.sampling=topk:5", "decode.nbest=2"]])  # fmt: skip
def test_an_unlikely_prefix_is_kept_by_every_hypothesis(
    multi30k_run: Path, settings: list[str]
) -> None:
    model = translate.load_translator(multi30k_run, settings)
    prefixes = ["Zebra zebra zebra", "", "The", ""]
    lines = [SOURCES[0], SOURCES[1], SOURCES[2], ""]
    found = translate.translate_lines(model, lines, prefixes=prefixes)
    texts = [translate.detokenize(model, [h.tokens for h in hyps]) for hyps in found]
    assert all(t.startswith("Zebra zebra zebra") for t in texts[0])
    assert len(texts[0]) == model.config.decode.nbest
    assert all(len(t) > len("Zebra zebra zebra") for t in texts[0])  # the search went on
    assert all(t.startswith("The") for t in texts[2])
    assert texts[3] == []  # an empty line with no prefix: nothing
    plain = translate.translate_lines(model, lines[:2])  # an empty prefix is no prefix
    assert [[h.tokens for h in hyps] for hyps in found[1:2]] == [
        [h.tokens for h in hyps] for hyps in plain[1:2]
    ]
    # the Python API and an empty source: the translation is the prefix alone
    assert model.translate(["", SOURCES[0]], prefix=["Ein Hund", "A dog"])[0] == "Ein Hund"
    assert model.translate([SOURCES[0]], prefix=["A dog"])[0].startswith("A dog")


def test_ctranslate2_keeps_the_prefixes_as_tmt_does(
    greedy_model: translate.Translator, multi30k_run: Path
) -> None:
    pytest.importorskip("ctranslate2")
    fast = translate.load_translator(
        multi30k_run, ["decode.beam_size=1", "decode.engine=ctranslate2"]
    )
    prefixes = ["Zebra zebra", "", "Two", "A man in a", *[""] * (len(SOURCES) - 4)]
    ours = translate.translate_lines(greedy_model, SOURCES, prefixes=prefixes)
    theirs = translate.translate_lines(fast, SOURCES, prefixes=prefixes)
    assert [h[0].tokens for h in theirs] == [h[0].tokens for h in ours]


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_translate_prefix_file_stream_and_job(multi30k_run: Path, tmp_path: Path) -> None:
    source = write(tmp_path / "in.de", SOURCES[:5])
    prefix = write(tmp_path / "prefix.en", ["A", "", "Zebra", "", "Two"])
    model = translate.load_translator(multi30k_run)
    expected = model.translate(SOURCES[:5], prefix=["A", "", "Zebra", "", "Two"])
    args = ["translate", "-m", str(multi30k_run), "--prefix", str(prefix)]
    streamed = runner.invoke(app, args, input=source.read_text())
    assert streamed.exit_code == 0, streamed.output
    assert streamed.stdout.splitlines() == expected
    out = tmp_path / "out.en"
    job = runner.invoke(app, [*args, "-i", str(source), "-o", str(out)])
    assert job.exit_code == 0, job.output
    assert out.read_text().splitlines() == expected
    nbest = runner.invoke(app, [*args, "--nbest", "2"], input=source.read_text())
    rows = [row.split("\t") for row in nbest.stdout.splitlines()]
    assert len(rows) == 10 and all(text.startswith("Zebra") for i, _, text in rows if i == "2")


def test_a_prefix_file_of_another_length_is_one_line(multi30k_run: Path, tmp_path: Path) -> None:
    source = write(tmp_path / "in.de", SOURCES[:5])
    short = write(tmp_path / "short.en", ["A", ""])
    base = ["translate", "-m", str(multi30k_run), "--prefix", str(short)]
    for extra, stdin in [([], source.read_text()), (["-i", str(source)], None),
                         (["-i", str(source), "-o", str(tmp_path / "out.en")], None)]:  # fmt: skip
        result = runner.invoke(app, [*base, *extra], input=stdin)
        assert result.exit_code == 2, result.output
        assert f"{short}: 2 lines" in result.stderr and "--prefix" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not (tmp_path / "out.en").exists()
    missing = runner.invoke(app, [*base[:-1], str(tmp_path / "nope"), "-i", str(source), "-o",
                                  str(tmp_path / "out.en")])  # fmt: skip
    assert missing.exit_code == 2 and "nope: no such file" in missing.stderr
    # Prefixes and input both from stdin: the prefixes took every line ("the input has 0").
    both = runner.invoke(app, [*base[:-1], "-"], input=source.read_text())
    assert both.exit_code == 2 and both.stderr.splitlines()[-1] == (
        "tmt: error: --prefix -: the input reads stdin too; give one of them as a file"
    ), both.stderr


def test_a_job_resumed_with_another_prefix_file_is_refused(
    multi30k_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = write(tmp_path / "in.de", SOURCES[:6])
    first = write(tmp_path / "a.en", ["A"] * 6)
    other = write(tmp_path / "b.en", ["The"] * 6)
    out = tmp_path / "out.en"
    args = ["translate", "-m", str(multi30k_run), "-i", str(source), "-o", str(out),
            "--set", "decode.chunk_lines=2"]  # fmt: skip
    monkeypatch.setenv("TMT_FAULT", "chunk@1:raise")
    result = runner.invoke(app, [*args, "--prefix", str(first)])
    assert isinstance(result.exception, faults.FaultInjected)
    monkeypatch.delenv("TMT_FAULT")
    for extra in (["--prefix", str(other)], []):
        refused = runner.invoke(app, [*args, *extra])
        assert refused.exit_code == 2 and "another target prefix file" in refused.stderr
    done = runner.invoke(app, [*args, "--prefix", str(first)])
    assert done.exit_code == 0 and "(1 translated before)" in done.stderr, done.output
    assert all(line.startswith("A") for line in out.read_text().splitlines())
    job = tmp_path / f"out.en{bulk.JOB_SUFFIX}"
    assert sorted(p.name for p in job.iterdir()) == [".lock", "done.json"]  # the record stays


def test_a_prefix_file_is_read_as_the_input_is_and_never_overwritten(
    multi30k_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = write(tmp_path / "in.de", SOURCES[:3])
    prefix = tmp_path / "prefix.en"
    prefix.write_bytes(b"A \xff man\n\nTwo")  # invalid UTF-8 and no final newline
    args = ["translate", "-m", str(multi30k_run), "--prefix", str(prefix)]
    streamed = runner.invoke(app, args, input=source.read_text())
    assert streamed.exit_code == 0 and "prefix.en:1: invalid UTF-8" in caplog.text
    out = tmp_path / "out.en"
    assert runner.invoke(app, [*args, "-i", str(source), "-o", str(out)]).exit_code == 0
    assert out.read_bytes() == streamed.stdout_bytes  # the job reads it as the stream does
    expected = translate.load_translator(multi30k_run).translate(
        SOURCES[:3], prefix=["A \ufffd man", "", "Two"]
    )
    assert out.read_text().splitlines() == expected
    before = prefix.read_bytes()
    for extra in (["-i", str(source)], []):  # the file job, and stdin into a file
        same = runner.invoke(app, [*args, *extra, "-o", str(prefix), "--overwrite"],
                             input=source.read_text())  # fmt: skip
        assert same.exit_code == 2 and "is the input file" in same.stderr, same.output
    assert prefix.read_bytes() == before
    for bad in (tmp_path, tmp_path / "missing.en"):
        refused = runner.invoke(app, [*args[:-1], str(bad)], input=source.read_text())
        assert refused.exit_code == 2 and str(bad) in refused.stderr, refused.output
        assert len(refused.stderr.strip().splitlines()) == 1
