"""Term hints (issue 48): the annotation (golden styles, lemmas), the candidates and each epoch's
hints as a pure function of (seed, epoch, pair), batches packed by hinted lengths, kill and resume
bit for bit, the tags never split and never output, glossary.mode hint and auto (re-decoding only
the lines that miss an entry), the refusal on a model trained without hints, the CTranslate2
export decoding hints as tmt does, and `tmt terms` (eflomal or a model's alignments, resumable,
its memory bounded)."""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, write_parallel
from hypothesis import given, settings
from hypothesis import strategies as st
from test_reliability import same_run
from test_train import cli_args, run_tmt, with_train
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, apply_overrides, load_config
from transformer_mt.data import glossary as glossaries
from transformer_mt.data import hints
from transformer_mt.data.batches import prepare_data
from transformer_mt.training.train import train
from transformer_mt.translation import decoding, terms, translate

runner = CliRunner()
# Identity entries of the reverse task (a target writes the source's words): the terms a pair's
# reference uses, so its candidates; and entries whose target the reference never uses.
SYLLABLES = ["ka", "lo", "mi", "nu", "pe", "ri"]
DICTIONARY = "".join(f"{a}{b}\t{a}{b}\n" for a in SYLLABLES for b in SYLLABLES) + "sotu\tvawe\n"


@pytest.fixture(scope="module")
def hint_cfg(tiny_cfg: Config, tmp_path_factory: pytest.TempPathFactory) -> Config:
    """The tiny config with term hints on half of the pairs that have a term."""
    root = tmp_path_factory.mktemp("hint_dictionary")
    (root / "dict.tsv").write_text(DICTIONARY, encoding="utf-8")
    return apply_overrides(tiny_cfg, [f"data.terms.dictionary={root / 'dict.tsv'}",
                                      "data.terms.annotate=0.5"])  # fmt: skip


@pytest.fixture(scope="module")
def hinted_run(hint_cfg: Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hinted_run")
    train(with_train(hint_cfg, out_dir=str(out), max_steps=30, save_every=10, valid_every=10))
    return out


def tag_ids(tokenizer) -> list[int]:
    return [tokenizer.piece_to_id(tag) for tag in hints.TAGS]


# --- the annotation -----------------------------------------------------------------------------


def test_the_two_styles_golden() -> None:
    text = "der Hund bellt den Mann an"
    spans = [(4, 8, "dog"), (19, 23, "man")]
    assert hints.annotate(text, spans, "append") == (
        "der <t> Hund </t> <tr> dog </tr> bellt den <t> Mann </t> <tr> man </tr> an"
    )
    assert (
        hints.annotate(text, spans, "replace") == "der <tr> dog </tr> bellt den <tr> man </tr> an"
    )
    assert hints.annotate(text, [], "append") == text


def test_hints_are_lemmas_when_asked() -> None:
    assert hints.hint("dogs", lemma=False, lang="en") == "dogs"
    assert hints.hint("dogs", lemma=True, lang="en") == "dog"
    assert hints.hint("Hunde", lemma=True, lang="de") == "Hund"
    assert hints.hint("running dogs", lemma=True, lang="en") == "run dog"
    assert hints.hint("dogs", lemma=True, lang="eng") == "dog"  # ISO 639-3 codes too
    with pytest.raises(TmtError, match="simplemma has no"):
        hints.hint("x", lemma=True, lang="tlh")


def test_candidates_are_the_terms_a_reference_uses(tmp_path: Path) -> None:
    import datasets

    glossary = glossaries.parse("Hund\tdog | hound\nKatze\tcat\nMann\tman\n", "tsv", "g.tsv")
    pairs = datasets.Dataset.from_dict({
        "src": ["Der Hund sieht die Katze", "Ein Mann", "Der Feuerwehrmann", "Hund"],
        "tgt": ["The hound sees a dog", "A woman", "The fireman", "dog"],
    })  # fmt: skip
    table = hints.candidates(pairs, glossary, hints.TermsConfig(annotate=0.5), "en")
    # "Katze" is not in its reference (no cat), "Mann" neither; a word inside a word is no match
    assert table.column("row").to_pylist() == [0, 3]
    assert table.column("hints").to_pylist() == [["dog"], ["dog"]]  # the alternative it uses
    assert table.column("starts").to_pylist() == [[4], [0]]


# --- each epoch's hints ---------------------------------------------------------------------------


def test_hints_are_a_pure_function_of_seed_epoch_and_pair(hint_cfg: Config) -> None:
    data = prepare_data(hint_cfg)
    split, tok = data.train, data.tokenizer
    found = split.hints
    positions = np.arange(len(split.rows))

    def hinted(order: np.ndarray, epoch: int, seed_of=found) -> dict[int, list[int]]:
        out = seed_of.hinted(order, split.rows[order], split.groups, epoch)
        return {int(order[i]): ids.tolist() for i, ids in out.items()}

    epoch0 = hinted(positions, 0)
    # In any order, any subset: the same hints for the same pair (a batch, a rank, a resume).
    shuffled = np.random.default_rng(3).permutation(positions)
    assert hinted(shuffled, 0) == epoch0
    assert hinted(shuffled[:50], 0) == {p: epoch0[p] for p in shuffled[:50] if p in epoch0}
    # Drawn anew each epoch and for another seed.
    assert hinted(positions, 1) != epoch0
    other = dataclasses.replace(found, seed=found.seed + 1)
    assert hinted(positions, 0, other) != epoch0
    # About data.terms.annotate of the pairs with candidates; none without.
    with_terms = int((found.index[split.rows] >= 0).sum())
    assert with_terms > 100
    assert 0.35 < len(epoch0) / with_terms < 0.65
    assert all(found.index[split.rows[p]] >= 0 for p in epoch0)
    # A hinted source is the pair's own source with the hint inserted: its words all still there.
    for position, ids in list(epoch0.items())[:20]:
        plain = tok.decode([split.ids([position])[0][0].tolist()])[0]
        pieces = [tok._sp.id_to_piece(i) for i in ids]
        assert pieces.count("<t>") == pieces.count("</t>") == pieces.count("<tr>") >= 1
        assert set(plain.split()) <= set(tok.decode([ids])[0].split())


def test_batches_keep_within_max_tokens_packed_by_hinted_lengths(hint_cfg: Config) -> None:
    cfg = with_train(hint_cfg)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_tokens=160))
    data = prepare_data(cfg)
    sampler = data.train.sampler(cfg.data.max_tokens, cfg.train.seed)
    pad, tr = data.tokenizer.pad_id, data.tokenizer.piece_to_id("<tr>")
    for epoch in range(3):
        src_lengths, _ = sampler.epoch_lengths(epoch)
        hinted_rows = 0
        for positions in sampler.epoch_batches(epoch):
            batch = data.train.batch(positions, data.tokenizer, epoch=epoch)
            real = (batch.src != pad).sum(1).tolist()
            assert real == src_lengths[positions].tolist()  # packed by the lengths it has
            assert batch.src.numel() <= cfg.data.max_tokens
            assert batch.tgt_out.numel() <= cfg.data.max_tokens
            hinted_rows += int((batch.src == tr).any(1).sum())
        assert hinted_rows > 50


def test_the_tags_are_single_pieces_and_validation_has_none(hint_cfg: Config) -> None:
    data = prepare_data(hint_cfg)
    tok = data.tokenizer
    ids = tok.encode(["kalo <t> mipe </t> <tr> mipe </tr> nuri"], side="source")[0]
    pieces = [tok._sp.id_to_piece(i) for i in ids]
    assert [p for p in pieces if p in hints.TAGS] == list(hints.TAGS)
    assert set(tok.never_output) == {tok.pad_id, tok.bos_id, *tag_ids(tok)}
    valid_src, _ = data.valid.ids(list(range(len(data.valid.rows))))
    assert not set(np.concatenate(valid_src).tolist()) & set(tag_ids(tok))
    # Without data.terms the tokenizer is the one it always was: no tags.
    plain = prepare_data(apply_overrides(hint_cfg, ["data.terms.annotate=0"])).tokenizer
    assert plain.tag_ids("<t>") is None and plain.never_output == (plain.pad_id, plain.bos_id)


# slow: make test keeps its promise with
# test_hints.py::test_hints_are_a_pure_function_of_seed_epoch_and_pair and
# test_reliability.py::test_kill_and_resume_is_bit_exact
@pytest.mark.slow
def test_kill_and_resume_with_hints_is_bit_exact(hint_cfg: Config, tmp_path: Path) -> None:
    cfg = with_train(hint_cfg, max_steps=8, log_every=1, valid_every=4, save_every=4, keep_last=5)
    straight = tmp_path / "straight"
    train(with_train(cfg, out_dir=str(straight)))
    args = cli_args(cfg, tmp_path / "run")
    killed = run_tmt(args, fault="step@6:kill")
    assert killed.returncode == -9
    again = run_tmt(args)
    assert again.returncode == 0, again.stderr[-2000:]
    same_run(straight, tmp_path / "run")


# --- translating with hints -----------------------------------------------------------------------


GLOSSARY = "kalo\tmipe\nnuri\tpeka\n"
LINES = ["kalo mipe nuri", "sotu vawe", "nuri kalo", "pelo", "kalo"]


@pytest.fixture(scope="module")
def glossary_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("glossary") / "g.tsv"
    path.write_text(GLOSSARY, encoding="utf-8")
    return path


def test_a_hinted_model_records_it_and_defaults_to_auto(hinted_run: Path, glossary_file) -> None:
    translator = translate.Translator.load(hinted_run, device="cpu", glossary=glossary_file)
    assert hints.trained_with_hints(translator.config)
    assert translator.config.data.terms.annotate == 0.5
    assert translator.config.glossary.mode == "auto"
    strict = translate.load_ensemble([hinted_run], ["glossary.mode=strict",
                                                    f"glossary.path={glossary_file}"])  # fmt: skip
    assert strict.config.glossary.mode == "strict"


def test_hint_mode_writes_the_entries_into_the_source(hinted_run: Path, glossary_file) -> None:
    translator = translate.load_ensemble(
        [hinted_run], ["glossary.mode=hint", f"glossary.path={glossary_file}", "decode.device=cpu"]
    )
    matches = translator.glossary.match_lines(LINES)
    assert decoding._hinted(translator, LINES, matches) == [
        "<t> kalo </t> <tr> mipe </tr> mipe <t> nuri </t> <tr> peka </tr>",
        "sotu vawe",
        "<t> nuri </t> <tr> peka </tr> <t> kalo </t> <tr> mipe </tr>",
        "pelo",
        "<t> kalo </t> <tr> mipe </tr>",
    ]
    # hint mode is translating the annotated text without a glossary, nothing else
    plain = translate.load_ensemble([hinted_run], ["decode.device=cpu"])
    annotated = decoding._hinted(translator, LINES, matches)
    assert translator.translate(LINES) == plain.translate(annotated)


def test_the_tags_are_never_output(hinted_run: Path, monkeypatch) -> None:
    translator = translate.load_ensemble([hinted_run], ["decode.device=cpu"])
    tok = translator.tokenizer
    model = translator.model

    def pushing(ids: list[int]):
        def hook(module, args, output):
            output = output.clone()
            output[..., ids] += 50.0
            return output

        return model.output_projection.register_forward_hook(hook)

    control = tok.encode(["kalo"], side="target")[0][0]  # an ordinary piece
    handle = pushing([control])
    try:  # the hook works: a pushed ordinary piece fills the output
        pushed = translate.translate_lines(translator, ["mipe nuri"])[0][0].tokens
    finally:
        handle.remove()
    assert control in pushed
    handle = pushing(tag_ids(tok))
    try:
        for beam in (1, 3):
            hyps = translate.translate_lines(
                dataclasses.replace(translator, config=apply_overrides(
                    translator.config, [f"decode.beam_size={beam}", f"decode.nbest={min(beam, 2)}"])),
                ["mipe nuri", "kalo"])  # fmt: skip
            assert all(not set(h.tokens) & set(tag_ids(tok)) for line in hyps for h in line)
    finally:
        handle.remove()


def test_hint_is_refused_on_a_model_trained_without(trained_run: Path, glossary_file) -> None:
    for mode in ("hint", "auto"):
        result = runner.invoke(app, ["translate", "-m", str(trained_run), "--glossary",
                                     str(glossary_file), "--set", f"glossary.mode={mode}"],
                               input="kalo\n")  # fmt: skip
        assert result.exit_code == 2
        message = result.output.strip().splitlines()
        assert len(message) == 1 and "not trained with term hints" in message[0], result.output
    # strict stays its default, and works
    ok = runner.invoke(app, ["translate", "-m", str(trained_run), "--glossary",
                             str(glossary_file)], input="kalo\n")  # fmt: skip
    assert ok.exit_code == 0, ok.output


def test_auto_decodes_again_only_the_lines_that_miss_an_entry(
    hinted_run: Path, glossary_file, monkeypatch
) -> None:
    lines = LINES * 3
    hint = translate.load_ensemble(
        [hinted_run], ["glossary.mode=hint", f"glossary.path={glossary_file}", "decode.device=cpu"]
    )
    first = hint.translate(lines)
    glossary = hint.glossary
    missing = [i for i, (line, out) in enumerate(zip(lines, first, strict=True))
               if any(glossaries.used(m.entry, out) is None for m in glossary.match(line))]  # fmt: skip
    calls: list[list[int]] = []
    real = decoding._decode_all

    def counting(translator, ids, forced, todo, *rest, **kw):
        calls.append(list(todo))
        return real(translator, ids, forced, todo, *rest, **kw)

    monkeypatch.setattr(decoding, "_decode_all", counting)
    auto = translate.load_ensemble([hinted_run], [f"glossary.path={glossary_file}",
                                                  "decode.device=cpu"])  # fmt: skip
    assert auto.config.glossary.mode == "auto"
    outputs = auto.translate(lines)
    assert calls[0] == list(range(len(lines)))  # every line once, with hints
    assert missing, "the tiny model misses some entries: the re-decoding is exercised"
    assert sorted(calls[1]) == missing  # then only the lines that missed an entry
    assert len(calls) == 2
    report = glossaries.term_use(glossary, lines, outputs)
    assert report["terms_used"] == report["terms_matched"]  # auto: every entry in
    for i in set(range(len(lines))) - set(missing):  # a line with every entry keeps its output
        assert outputs[i] == first[i]


def test_the_ctranslate2_export_decodes_hints_as_tmt(
    hinted_run: Path, glossary_file, tmp_path: Path
) -> None:
    from transformer_mt.exchange import export

    export.export(hinted_run, "ctranslate2", tmp_path / "ct2")
    ours = translate.load_ensemble(
        [hinted_run], ["glossary.mode=hint", f"glossary.path={glossary_file}", "decode.device=cpu"]
    )
    theirs = translate.Translator.load(tmp_path / "ct2", engine="ctranslate2", device="cpu",
                                       glossary=glossary_file)  # fmt: skip
    assert theirs.config.glossary.mode == "hint"  # an export alone: auto needs the tmt model
    assert theirs.translate(LINES) == ours.translate(LINES)


# --- fine-tuning a model whose tokenizer lacks the tags -----------------------------------------


def test_with_tags_keeps_every_weight_and_adds_rows(tiny_spm: bytes, tiny_cfg: Config) -> None:
    from conftest import model_parts

    from transformer_mt.data.tokenizer import Tokenizer

    tok = Tokenizer(tiny_spm)
    weights, _ = model_parts(tiny_cfg, tiny_spm)
    grown, out = hints.with_tags(tok, weights, seed=0)
    assert grown.vocab_size == tok.vocab_size + 4
    assert [grown._sp.id_to_piece(tok.vocab_size + i) for i in range(4)] == list(hints.TAGS)
    # every other piece keeps its id and every weight its value
    for i in range(tok.vocab_size):
        assert grown._sp.id_to_piece(i) == tok._sp.id_to_piece(i)
    for name, value in weights.items():
        if out[name].shape == value.shape:
            assert torch.equal(out[name], value), name
        else:
            assert torch.equal(out[name][: value.shape[0]], value), name
    new = out["embedding.weight"][tok.vocab_size :]
    assert new.shape == (4, weights["embedding.weight"].shape[1])
    assert out["output_projection.weight"] is out["embedding.weight"]
    assert torch.isfinite(new).all() and not torch.equal(new[0], new[1])
    again, _ = hints.with_tags(grown, out, seed=0)
    assert again is grown  # a tokenizer that has them is left as it is
    _, same = hints.with_tags(tok, weights, seed=0)
    assert torch.equal(same["embedding.weight"], out["embedding.weight"])  # seeded


def test_fine_tuning_an_import_with_hints(imported: dict[str, Path], tmp_path: Path) -> None:
    from test_pretrained import multi30k

    from transformer_mt.exchange import export
    from transformer_mt.runs import checkpoint

    pairs = list(zip(multi30k("en", n=300), multi30k("fr", n=300), strict=True))
    corpus = write_parallel(tmp_path / "data" / "train", pairs, src="en", tgt="fr")
    valid = write_parallel(tmp_path / "data" / "valid", pairs[:20], src="en", tgt="fr")
    (tmp_path / "dict.tsv").write_text("dog\tchien\nman\thomme\nwoman\tfemme\nwater\teau\n")
    model = imported["multi"]
    out = tmp_path / "tuned"
    settings = {
        "data.source": "files", "data.train": corpus, "data.valid": valid,
        "data.src_lang": "en", "data.tgt_lang": "fr", "decode.target_lang": "fra",
        "data.max_tokens": 512, "train.max_steps": 4, "train.save_every": 4,
        "train.valid_every": 4, "train.bleu_every": 0, "train.best_metric": "val_loss",
        "train.patience": 0, "train.average_last": 0, "train.out_dir": out,
        "data.terms.dictionary": tmp_path / "dict.tsv", "data.terms.annotate": 0.5,
    }  # fmt: skip
    sets = [a for key, value in settings.items() for a in ("--set", f"{key}={value}")]
    result = runner.invoke(app, ["train", "-c", str(model / "config.yaml"), "--init-from",
                                 str(model), *sets])  # fmt: skip
    assert result.exit_code == 0, result.output
    parent = checkpoint.read(model)
    tuned = checkpoint.read(out / "checkpoints" / "step_00000004")
    before = parent.tokenizer.vocab_size
    assert tuned.tokenizer.vocab_size == before + 4
    assert [tuned.tokenizer.piece_to_id(t) for t in hints.TAGS] == [before + i for i in range(4)]
    assert set(tuned.tokenizer.never_output) >= {before + i for i in range(4)}
    rows = tuned.state_dict["embedding.weight"]
    assert rows.shape[0] == before + 4
    # The new rows were trained (the hinted sources read them), the old ones too.
    _, start = hints.with_tags(parent.tokenizer, parent.state_dict, tuned.config.train.seed)
    assert not torch.equal(rows[before:], start["embedding.weight"][before:])
    # A hinted source encodes the tags as one piece each, and the exports carry them.
    tuned_model = translate.load_ensemble(
        [out], ["decode.device=cpu", "glossary.mode=hint",
                f"glossary.path={tmp_path / 'dict.tsv'}"])  # fmt: skip
    line = ["A man and a dog."]
    ours = tuned_model.translate(line)
    export.export(out, "ctranslate2", tmp_path / "ct2", check_lines=5)
    ct2 = translate.Translator.load(tmp_path / "ct2", engine="ctranslate2", device="cpu",
                                    glossary=tmp_path / "dict.tsv")  # fmt: skip
    assert ct2.translate(line) == ours
    export.export(out, "huggingface", tmp_path / "hf", check_lines=5)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    hinted = "A <t> man </t> <tr> homme </tr> and a dog."
    want = tuned_model.tokenizer.encode([hinted], side="source")[0]
    got = hf(hinted)["input_ids"]
    assert (
        [i for i in got if i >= before]
        == [i for i in want if i >= before]
        == [before, before + 1, before + 2, before + 3]
    )


# --- tmt terms ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def terms_cfg(tmp_path_factory: pytest.TempPathFactory, tiny_cfg: Config) -> Config:
    """A corpus of word-for-word translations (a toy lexicon, shuffled word order kept): the
    aligner should find each word's translation."""
    import random

    rng = random.Random(0)
    lexicon = {f"{a}{b}": f"{b}{a}x" for a in SYLLABLES for b in SYLLABLES}
    words = sorted(lexicon)
    pairs = []
    for _ in range(1200):
        sentence = rng.sample(words, rng.randint(3, 8))
        pairs.append((" ".join(sentence), " ".join(lexicon[w] for w in sentence)))
    root = tmp_path_factory.mktemp("terms_corpus")
    train_prefix = write_parallel(root / "train", pairs)
    return apply_overrides(tiny_cfg, [
        f"data.train={train_prefix}", "data.terms.skip_common=0", "data.terms.min_count=3",
        "data.terms.chunk_pairs=300", "data.terms.max_words=1",
    ])  # fmt: skip


def read_entries(path: Path) -> dict[str, list[str]]:
    glossary = glossaries.load(path, pair=("de", "en"))
    return {e.source: list(e.targets) for e in glossary.entries}


def test_terms_with_eflomal_finds_the_lexicon(terms_cfg: Config, tmp_path: Path) -> None:
    out = tmp_path / "terms.tsv"
    report = terms.build(terms_cfg, out)
    assert report["aligner"].startswith("eflomal") and report["pairs"] == 1200
    assert out.read_text().startswith("# tmt terms:") and "aligner: eflomal" in out.read_text()
    entries = read_entries(out)
    right = sum(entries.get(w, [""])[0] == f"{w[2:]}{w[:2]}x" for w in entries)
    assert len(entries) >= 30 and right / len(entries) > 0.9
    assert all(line.count("\t") == 2 for line in out.read_text().splitlines()[1:])
    work = out.with_name(out.name + terms.WORK_SUFFIX)  # the chunks go, the record stays
    assert [p.name for p in work.iterdir()] == ["done.json"]
    # The same command again says it is done and writes nothing (issue 61, J1's rule).
    stamp = out.stat().st_mtime_ns
    again = terms.build(terms_cfg, out)
    assert again["done"] and again["entries"] == len(entries) and out.stat().st_mtime_ns == stamp
    other = apply_overrides(terms_cfg, ["data.terms.min_count=4"])
    with pytest.raises(TmtError, match="a dictionary tmt terms made from other terms;"):
        terms.build(other, out)
    assert not terms.build(other, out, overwrite=True)["done"]


def test_terms_of_a_language_written_without_spaces() -> None:
    """A phrase of Chinese is written as Chinese writes it (公园, not 公 园: as a target, strict
    would force the space), and one character may be a term (狗, dog), where one letter is
    none; before, no Chinese phrase passed for a term, and the dictionary was empty."""

    class Everything:  # aligns every word with every word of the other side
        def align(self, source: list[list[str]], target: list[list[str]]) -> list[set]:
            return [{(i, j) for i in range(len(s)) for j in range(len(t))}
                    for s, t in zip(source, target)]  # fmt: skip

    assert glossaries.join(["公", "园", "park", "a", "東", "京"]) == "公园 park a 東京"
    assert list(terms.phrases(["公", "园"], ["park"], {(0, 0), (1, 0)}, 3))[-1] == ("公园", "park")
    cfg = apply_overrides(load_config("tiny"), ["data.terms.skip_common=0",
                                                "data.terms.min_count=2"])  # fmt: skip
    chunk = [("狗", "dog"), ("狗", "dog"), ("a", "x"), ("a", "x")]
    counted = terms._count(chunk, Everything(), cfg)
    totals = collections.Counter({(s, t): n for s, t, n in counted["pairs"]})
    freq = [collections.Counter(side) for side in counted["words"]]
    assert terms._dictionary(totals, freq, cfg) == [("狗", ["dog"], 2)]  # "a": one letter
    back = terms._count([("dog", "公园"), ("dog", "公园")], Everything(), cfg)
    assert back["pairs"] == [["dog", "公园", 2]]


def test_a_pair_with_a_side_past_align_words_is_not_aligned_nor_read() -> None:
    """A side of more than ALIGN_WORDS words (a file without line breaks) leaves its pair out of
    the alignment, and its words out of the counts; past 64 characters a word it is not even
    split into words (a 50 MB line took 24 s and 2.3 GB)."""
    seen: list[int] = []

    class Recorder:  # aligns each word with the word at its position
        def align(self, source: list[list[str]], target: list[list[str]]) -> list[set]:
            seen.extend(len(s) for s in source)
            return [{(i, i) for i in range(min(len(s), len(t)))} for s, t in zip(source, target)]

    cfg = load_config("tiny")
    many = " ".join(["Hund"] * (terms.ALIGN_WORDS + 1))
    huge = "Hund " * (64 * terms.ALIGN_WORDS)
    chunk = [("Haus", "house"), (many, "dog"), ("Katze", huge), ("Baum", "tree")]
    counted = terms._count(chunk, Recorder(), cfg)
    assert seen == [1, 1]  # Haus and Baum
    assert counted["pairs"] == [["Baum", "tree", 1], ["Haus", "house", 1]]
    assert counted["words"] == [{"Haus": 1, "Katze": 1, "Baum": 1},
                                {"house": 1, "dog": 1, "tree": 1}]  # fmt: skip


def test_terms_resumes_after_a_kill(terms_cfg: Config, tmp_path: Path) -> None:
    from test_train import _flat, _text

    from transformer_mt.config import to_dict

    out = tmp_path / "terms.tsv"
    args = ["terms", "-c", "tiny", "-o", str(out), "--json"]
    for key, value in _flat(to_dict(terms_cfg)):
        args += ["--set", f"{key}={_text(value)}"]
    killed = run_tmt(args, fault="terms_chunk@2:kill")
    assert killed.returncode == -9
    work = out.with_name(out.name + terms.WORK_SUFFIX)
    assert sorted(p.name for p in work.glob("*.json")) == ["000000.json", "000001.json",
                                                           "state.json"]  # fmt: skip
    assert not out.exists()
    # a damaged committed chunk is counted again, not trusted
    (work / "000001.json").write_text('{"pairs": [], "words": [[], []]}')
    again = run_tmt(args)
    assert again.returncode == 0, again.stderr[-2000:]
    report = json.loads(again.stdout.splitlines()[-1])
    assert report["resumed_chunks"] == 1 and report["pairs"] == 1200
    assert "counting the chunk again" in again.stderr
    entries = read_entries(out)
    right = sum(entries.get(w, [""])[0] == f"{w[2:]}{w[:2]}x" for w in entries)
    assert right / len(entries) > 0.9


def test_terms_refuses_another_runs_work(terms_cfg: Config, tmp_path: Path) -> None:
    out = tmp_path / "terms.tsv"
    work = out.with_name(out.name + terms.WORK_SUFFIX)
    work.mkdir()
    (work / "state.json").write_text('{"format": 1, "corpora": ["other"]}')
    with pytest.raises(TmtError, match="an unfinished tmt terms of other corpora"):
        terms.build(terms_cfg, out)
    with pytest.raises(TmtError, match="an unfinished tmt terms"):  # whatever the aligner
        terms.build(terms_cfg, out, model=None)
    # with --overwrite the other run's chunks go, and the dictionary is made
    assert terms.build(terms_cfg, out, overwrite=True)["resumed_chunks"] == 0
    assert out.read_text().startswith("# tmt terms:")
    # a file tmt did not write is never replaced (textio's rule for every output)
    mine = tmp_path / "mine.tsv"
    mine.write_text("my notes\n")
    with pytest.raises(TmtError):
        terms.build(terms_cfg, mine)
    assert mine.read_text() == "my notes\n"
    (tmp_path / "notes").mkdir()
    with pytest.raises(TmtError, match="is a directory"):
        terms.build(terms_cfg, tmp_path / "notes", overwrite=True)


def test_terms_of_no_pairs_is_refused_in_one_line_and_writes_nothing(
    terms_cfg: Config, tmp_path: Path
) -> None:
    """Issue 61, TM-6: a corpus of 0 pairs gave exit 0 and a header-only dictionary."""
    empty = write_parallel(tmp_path / "empty", [])
    cfg = apply_overrides(terms_cfg, [f"data.train={empty}"])
    out = tmp_path / "terms.tsv"
    with pytest.raises(TmtError, match="no pairs to align; tmt terms wrote nothing"):
        terms.build(cfg, out)
    assert not out.exists() and not out.with_name(out.name + terms.WORK_SUFFIX).exists()


def test_terms_with_a_models_alignments(terms_cfg: Config, trained_run: Path, tmp_path) -> None:
    out = tmp_path / "terms.tsv"
    cfg = apply_overrides(terms_cfg, ["data.terms.min_count=1", "data.terms.min_prob=0"])
    report = terms.build(cfg, out, model=str(trained_run))
    assert report["aligner"].startswith("tmt --alignment word of")
    assert report["entries"] > 0 and f"aligner: {report['aligner']}" in out.read_text()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 6)), max_size=200),
       st.integers(4, 40))  # fmt: skip
def test_bounded_counts_keep_the_frequent(items, limit) -> None:
    counts = collections.Counter()
    for key, n in items:
        counts[(str(key), "t")] += n
    kept = terms.bounded(collections.Counter(counts), limit)
    assert len(kept) <= limit
    if len(counts) <= limit:
        assert kept == counts
    else:  # what is kept keeps its count, and every pair more frequent than one dropped is kept
        assert all(kept[k] == counts[k] for k in kept)
        dropped = [counts[k] for k in counts if k not in kept]
        assert all(counts[k] >= max(dropped) for k in kept)


@pytest.mark.slow
def test_terms_on_a_million_pairs_within_its_memory_bound(tmp_path: Path, tiny_cfg) -> None:
    """1M synthetic pairs, aligned in chunks: the peak memory of the command is the chunk's and
    the counts', not the corpus's (a few hundred MB, where the corpus's alignments in memory
    would be several GB); killed midway, it resumes."""
    import random
    import resource
    import subprocess
    import sys

    rng = random.Random(1)
    vocab = [f"w{i}" for i in range(5000)]
    prefix = tmp_path / "big"
    with open(f"{prefix}.de", "w") as de, open(f"{prefix}.en", "w") as en:
        for _ in range(1_000_000):
            words = rng.sample(vocab, 6)
            de.write(" ".join(words) + "\n")
            en.write(" ".join(w.upper() for w in words) + "\n")
    out = tmp_path / "terms.tsv"
    args = [sys.executable, "-m", "transformer_mt", "terms", "-c", "tiny", "-o", str(out),
            "--json", "--set", "data.source=files", "--set", f"data.train={prefix}",
            "--set", "data.terms.chunk_pairs=100000"]  # fmt: skip
    env = {**__import__("os").environ, "TMT_FAULT": "terms_chunk@3:kill"}
    killed = subprocess.run(args, env=env, capture_output=True, text=True, cwd=REPO)
    assert killed.returncode == -9
    done = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["pairs"] == 1_000_000 and report["resumed_chunks"] == 3
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    assert peak_mb < 3000, f"{peak_mb:.0f} MB"
    entries = read_entries(out)
    assert sum(entries[w][0] == w.upper() for w in entries if w in entries) / len(entries) > 0.9


def test_the_server_takes_hint_and_auto(hinted_run: Path, served_plain) -> None:
    from test_serve import Server

    pairs = [["kalo", "mipe"], ["nuri", "peka"]]
    glossary = glossaries.from_pairs(pairs, "request")
    server = Server(hinted_run)
    try:
        for mode in ("hint", "auto", None):  # None: the model's default, auto
            body = {"text": LINES, "glossary": pairs} | ({"glossary_mode": mode} if mode else {})
            answer = server.client.post("/v1/translate", json=body).json()
            local = translate.load_ensemble(
                [hinted_run], ["decode.device=cpu", f"glossary.mode={mode or 'auto'}"]
            )
            assert answer["translations"] == local.translate(LINES, glossary=glossary), mode
    finally:
        assert server.stop() == 0
    refused = served_plain.client.post("/v1/translate", json={
        "text": "kalo", "glossary": [["kalo", "mipe"]], "glossary_mode": "hint"})  # fmt: skip
    assert refused.status_code == 422
    assert "not trained with term hints" in refused.json()["error"]


@pytest.fixture
def served_plain(trained_run: Path):
    from test_serve import Server

    server = Server(trained_run)
    yield server
    assert server.stop() == 0
