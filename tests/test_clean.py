"""tmt clean and data.clean: each filter on planted cases it must remove and pairs it must keep
(names and numbers both sides share, short copies, accents that look like mojibake), the
duplicates across chunks and processes, the report, the annotation, the refusals, and the same
filters at training time, cached."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, write_parallel
from test_promises import one_line_error
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.config import CleanConfig, Config
from transformer_mt.data import cleaning, filters

runner = CliRunner()
RULES = filters.Rules(CleanConfig(), "de", "en")
GOOD = ("Ein Hund rennt über eine grüne Wiese.", "A dog runs across a green meadow.")


def reason(src: str, tgt: str, rules: filters.Rules = RULES, identify=None) -> str:
    code = filters.pair_reason(src, tgt, rules, identify)
    return filters.FILTERS[code - 1] if code else ""


# Each filter: pairs it removes, and nearby pairs it must keep.
PLANTED = {
    "empty": [("", "A dog."), ("Ein Hund.", "   ")],
    "encoding": [("Ein Hund\x07 rennt.", "A dog runs."), ("Ein Hund rennt.", "A dog \ufffd runs."),
                 ("Ein CafÃ© am See.", "A café by the lake."),
                 ("Er sagte â€žHalloâ€œ.", "He said hello.")],
    "length": [("Hund " * 151, "dog " * 151), ("x" * 1025, "y" * 1025)],
    "ratio": [("Ja", "Yes, and then a very long sentence follows that has nothing to do with it."),
              ("Ein sehr langer Satz über Hunde und Katzen im Garten.", "Dogs.")],
    "copy": [("The dog runs across the meadow.", "The dog runs across the meadow."),
             ("Ein Hund rennt schnell!", "ein hund rennt schnell")],
    "script": [("Собака бежит по зелёному лугу.", "A dog runs across a green meadow."),
               ("Ein Hund rennt über eine Wiese.", "Собака бежит по лугу.")],
    "symbols": [("### 12 34 56 $$ %% @@", "A dog runs across a meadow."),
                ("Ein Hund rennt.", "1 2 3 4 5 6 7 8 9 ## ** //"),
                ("$$ *** ### ***", "@@ @@ % ###")],  # punctuation alone is no shared name
}  # fmt: skip
KEEP = [
    GOOD,
    ("Berlin", "Berlin"),  # a name both sides share: a short copy is kept
    ("2019 - 2020", "2019 - 2020"),  # numbers only, shared
    ("Anruf unter 030 1234 5678.", "Call 030 1234 5678."),  # digits both sides share
    ("Ein Foto von Москва am Abend.", "A photo of Москва in the evening."),  # a shared name
    ("São Paulo ist groß.", "São Paulo is big."),  # Ã-free accents
    ("À bientôt, sagte er.", "À bientôt, he said."),
    ("Ein Hund.", "A dog."),
]


@pytest.mark.parametrize("name", list(PLANTED))
def test_each_filter_removes_what_it_is_for(name: str) -> None:
    for src, tgt in PLANTED[name]:
        assert reason(src, tgt) == name, (src, tgt)
    # Off, it removes nothing of its own.
    off = filters.Rules(dataclasses.replace(CleanConfig(), **{name: False}), "de", "en")
    assert all(reason(s, t, off) != name for s, t in PLANTED[name])


@pytest.mark.parametrize("pair", KEEP, ids=[p[0][:16] for p in KEEP])
def test_pairs_that_must_stay_do(pair: tuple[str, str]) -> None:
    assert reason(*pair) == ""


def test_overlap_removes_a_validation_or_test_sentence_in_any_casing() -> None:
    rules = filters.Rules(CleanConfig(), "de", "en", filters.eval_digests(["Zwei Hunde spielen."]),
                        filters.eval_digests(["Two dogs play."]))  # fmt: skip
    assert reason("zwei Hunde spielen", "Something else entirely.", rules) == "overlap"
    assert reason("Etwas ganz anderes hier.", "TWO dogs play!", rules) == "overlap"
    assert reason(*GOOD, rules) == ""


def test_duplicates_exact_and_normalised_across_chunks() -> None:
    chunks = [
        [GOOD, ("Zwei Katzen.", "Two cats."), GOOD],
        [("zwei katzen", "two cats!"), GOOD, ("Drei Vögel.", "Three birds.")],
    ]
    seen: dict[str, np.ndarray] = {}
    found = []
    for chunk in chunks:
        codes = np.zeros(len(chunk), dtype=np.int8)
        filters.duplicate_reasons(chunk, codes, seen, CleanConfig())
        found += [filters.FILTERS[c - 1] if c else "" for c in codes]
    assert found == ["", "", "duplicate", "near_duplicate", "duplicate", ""]
    assert len(seen["duplicate"]) == 4  # 8 bytes a distinct pair, not its text


def noisy_corpus(root: Path) -> Path:
    """Clean pairs and one of each kind of noise, planted at known lines."""
    pairs = [(f"Der Hund Nummer {i} rennt über die Wiese.", f"Dog number {i} runs across the"
              " meadow.") for i in range(40)]  # fmt: skip
    for planted in PLANTED.values():
        pairs += planted
    pairs += [pairs[0], pairs[1]]  # duplicates
    pairs.append(("Der hund nummer 2 rennt über die wiese", "dog number 2 runs across the meadow"))
    return write_parallel(root / "noisy", pairs)


def clean_args(prefix: Path, out: Path, *extra: str) -> list[str]:
    return ["clean", "-c", str(REPO / "configs" / "tiny.yaml"), "--set", "data.source=files",
            "--set", f"data.train={prefix}", "--set", "clean.overlap=false", "-o", str(out),
            *extra]  # fmt: skip


def test_tmt_clean_writes_the_kept_pairs_and_counts_each_removal_once(tmp_path: Path) -> None:
    prefix = noisy_corpus(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    result = runner.invoke(app, clean_args(prefix, tmp_path / "out" / "kept", "--json"))
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    expected = {name: len(planted) for name, planted in PLANTED.items()}
    expected.update(duplicate=2, near_duplicate=1)
    assert {k: v for k, v in report["removed"].items() if v} == expected
    assert report["pairs_in"] == 40 + sum(map(len, PLANTED.values())) + 3
    assert report["pairs_out"] == 40 == report["pairs_in"] - sum(report["removed"].values())
    kept = (tmp_path / "out" / "kept.de").read_text().splitlines()
    assert kept == [f"Der Hund Nummer {i} rennt über die Wiese." for i in range(40)]
    assert len((tmp_path / "out" / "kept.en").read_text().splitlines()) == 40
    assert (
        json.loads((tmp_path / "out" / "kept.report.json").read_text())["removed"]
        == (report["removed"])
    )
    assert all(len(v) <= 3 for v in report["examples"].values())
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    # For people: a table.
    table = runner.invoke(app, clean_args(prefix, tmp_path / "t", "--set", "clean.examples=0"))
    assert table.exit_code == 0 and "near_duplicate" in table.stdout and "pairs_out" in table.stdout
    # Trains as it is: data.source=files data.train=PREFIX.
    from transformer_mt.config import load_config
    from transformer_mt.data.corpus import open_split, read_split

    cfg = load_config("tiny", ["data.source=files", f"data.train={tmp_path / 'out' / 'kept'}"])
    assert len(read_split(cfg.data, "data.train")[0]) == 40
    assert open_split(cfg.data, "data.train").fingerprint


def test_annotate_keeps_every_pair_and_says_why_each_would_go(tmp_path: Path) -> None:
    prefix = noisy_corpus(tmp_path)
    result = runner.invoke(app, clean_args(prefix, tmp_path / "ann", "--annotate"))
    assert result.exit_code == 0, result.output
    sources = (tmp_path / "ann.de").read_text().splitlines()
    reasons = (tmp_path / "ann.reason").read_text().split("\n")[:-1]
    assert len(reasons) == len(sources) == (tmp_path / "noisy.de").read_text().count("\n")
    assert reasons[:40] == [""] * 40 and reasons[40] == "empty" and reasons[-1] == "near_duplicate"


def test_a_mixture_is_reported_corpus_by_corpus(tmp_path: Path) -> None:
    first = noisy_corpus(tmp_path)
    second = write_parallel(tmp_path / "second", [GOOD, GOOD, ("", "x")])
    mixture = f"[{{split: {first}, weight: 1}}, {{split: {second}, weight: 2}}]"
    args = ["clean", "-c", str(REPO / "configs" / "tiny.yaml"), "--set", "data.source=files",
            "--set", f"data.train={mixture}", "--set", "clean.overlap=false",
            "-o", str(tmp_path / "mix"), "--json"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = {row["key"]: row for row in report["corpora"]}
    assert rows["data.train[1]"]["pairs_in"] == 3 and rows["data.train[1]"]["pairs_out"] == 1
    assert rows["data.train[1]"]["removed"]["duplicate"] == 1
    assert report["pairs_out"] == 41 == sum(r["pairs_out"] for r in rows.values())


def test_bad_input_is_one_line_and_the_input_is_never_written(tmp_path: Path) -> None:
    prefix = noisy_corpus(tmp_path)
    missing = runner.invoke(app, clean_args(tmp_path / "nowhere", tmp_path / "o"))
    assert missing.exit_code == 2 and "nowhere" in one_line_error(missing.stderr)
    onto = runner.invoke(app, clean_args(prefix, prefix))  # PREFIX.de is the input
    assert onto.exit_code == 2 and "is the input file" in one_line_error(onto.stderr)
    (tmp_path / "bad.de").write_bytes(b"ein \xff Hund\n")
    (tmp_path / "bad.en").write_bytes(b"a dog\n")
    bad = runner.invoke(app, clean_args(tmp_path / "bad", tmp_path / "o2"))
    assert bad.exit_code == 2 and "bad.de:1" in one_line_error(bad.stderr)
    assert not list(tmp_path.glob("o2*")) and not list(tmp_path.glob(".o2*"))
    replaced = runner.invoke(app, clean_args(tmp_path / "bad", tmp_path / "o3",
                                             "--set", "data.encoding_errors=replace"))  # fmt: skip
    assert replaced.exit_code == 0 and "encoding" in replaced.stdout
    exists = runner.invoke(app, clean_args(prefix, tmp_path / "o3"))
    assert exists.exit_code == 2 and "--overwrite" in one_line_error(exists.stderr)


def test_a_killed_runs_staged_outputs_are_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    prefix = write_parallel(tmp_path / "c", [GOOD])
    dead = tmp_path / ".tmp-o.de-999999999"  # a pid no process has
    live = tmp_path / f".tmp-o.en-{os.getppid()}"  # a live process, not this one
    mine = tmp_path / ".tmp-notours-999999999"
    for path in (dead, live, mine):
        path.write_text("half\n")
    result = runner.invoke(app, clean_args(prefix, tmp_path / "o"))
    assert result.exit_code == 0, result.output
    assert not dead.exists() and live.exists() and mine.exists()
    assert (tmp_path / "o.de").read_text() == GOOD[0] + "\n"


def test_language_identification_removes_another_language(tmp_path: Path) -> None:
    pytest.importorskip("py3langid")
    identify = filters.Identify()
    rules = filters.Rules(dataclasses.replace(CleanConfig(), langid=True), "de", "en")
    french = ("Ein Hund rennt über eine grüne Wiese.", "Un chien court dans une prairie verte.")
    assert reason(*french, rules, identify) == "langid"
    assert reason(*GOOD, rules, identify) == ""
    assert reason("Ein Hund.", "Un chien.", rules, identify) == ""  # too short to tell
    # The same through the job, on 2 processes: the result of 1.
    prefix = write_parallel(tmp_path / "fr", [GOOD, french, GOOD, ("Zwei Katzen.", "Deux chats.")])
    reports = []
    for procs in ("1", "2"):
        result = runner.invoke(app, clean_args(prefix, tmp_path / f"p{procs}", "--json", "--set",
                                               "clean.langid=true", "--set",
                                               f"data.num_proc={procs}"))  # fmt: skip
        assert result.exit_code == 0, result.output
        reports.append(json.loads(result.stdout)["removed"])
        assert (tmp_path / f"p{procs}.en").read_text() == (
            "A dog runs across a green meadow.\nDeux chats.\n"
        )
    assert reports[0] == reports[1] and reports[0]["langid"] == 1


def test_without_the_extra_language_identification_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "py3langid.langid", None)
    prefix = write_parallel(tmp_path / "c", [GOOD])
    result = runner.invoke(app, clean_args(prefix, tmp_path / "o", "--set", "clean.langid=true"))
    assert result.exit_code == 2
    assert "pip install 'transformer_mt[clean]'" in one_line_error(result.stderr)


def test_training_applies_the_same_filters_cached_and_the_dry_run_counts_them(
    tiny_cfg: Config, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformer_mt.data.batches import prepare_data
    from transformer_mt.training.dry_run import dry_run

    prefix = noisy_corpus(tmp_path)
    cfg = dataclasses.replace(
        tiny_cfg,
        data=dataclasses.replace(tiny_cfg.data, train=str(prefix), clean=True,
                                 cache_dir=str(tmp_path / "cache")),
        clean=dataclasses.replace(tiny_cfg.clean, overlap=False),
        # The Cyrillic and symbols of the noise are not in the cleaned pairs the tokenizer
        # learns from: a vocabulary the clean pairs fill.
        tokenizer=dataclasses.replace(tiny_cfg.tokenizer, vocab_size=60),
    )  # fmt: skip
    with caplog.at_level("INFO"):
        prepared = prepare_data(cfg)
    assert prepared.cleaned["data.train"]["duplicate"] == 2
    assert prepared.counts["data.train"].clean == sum(map(len, PLANTED.values())) + 3
    assert len(prepared.train) <= 40
    caplog.clear()
    with caplog.at_level("INFO"):
        again = prepare_data(cfg)  # warm: read from the cache, not judged again
    assert not any("cleaning" in r.message for r in caplog.records)
    assert again.cleaned == prepared.cleaned and len(again.train) == len(prepared.train)
    report = dry_run(dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, out_dir=str(tmp_path / "run"))))  # fmt: skip
    assert report["cleaned"]["train"] == prepared.cleaned["data.train"]
    # The same pairs as tmt clean keeps.
    job = cleaning.clean_corpus(cfg, str(tmp_path / "job"))
    assert job["removed"] == prepared.cleaned["data.train"]
