"""Lexical shortlists (issue 49): the table and its file's verification, decoding with one (each
line's outputs within its own candidates, independent of its batch; an all-pieces shortlist is
the exact decode), prefixes and glossary pieces always candidates, the aligner fallback, Marian's
lex.s2t, and the commands."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import shared_fixtures
import torch
from conftest import multi30k_sentences, reverse_pairs
from typer.testing import CliRunner, Result

from transformer_mt.cli import app
from transformer_mt.common.exits import TmtError
from transformer_mt.network import shortlist
from transformer_mt.translation import shortlisting, translate

REPO = Path(__file__).resolve().parents[1]
LINES = multi30k_sentences(40)


def _multi30k_pairs(n: int, tmp_path: Path) -> tuple[Path, Path]:
    """The first n Multi30k training pairs (de, en) as two plain files."""
    import gzip

    paths = []
    for lang in ("de", "en"):
        with gzip.open(REPO / "transformer_mt" / "multi30k" / f"train.{lang}.gz", "rt") as f:
            lines = [next(f) for _ in range(n)]
        path = tmp_path / f"train.{lang}"
        path.write_text("".join(lines), encoding="utf-8")
        paths.append(path)
    return paths[0], paths[1]


@pytest.fixture(scope="module")
def made(multi30k_run: Path, request: pytest.FixtureRequest) -> Path:
    """A shortlist of multi30k_run from 500 training pairs (eflomal), in a file of its own;
    made once for all workers (eflomal on 500 pairs takes 10-20 s on one core)."""

    def build(root: Path) -> None:
        src, ref = _multi30k_pairs(500, root)
        shortlisting.make(str(multi30k_run), root / "model.shortlist", src, ref, first=50, best=20)

    return shared_fixtures.shared(request, "shortlist_made", build) / "model.shortlist"


def _translator(run: Path, table: Path | str, *more: str) -> translate.Translator:
    return translate.load_translator(run, [f"decode.shortlist={table}", *more])


@pytest.mark.parametrize("beam", [1, 4])
def test_each_line_keeps_to_its_own_candidates_whatever_its_batch(
    multi30k_run: Path, made: Path, beam: int
) -> None:
    t = _translator(multi30k_run, made, f"decode.beam_size={beam}", "decode.max_tokens=200")
    together = translate.translate_lines(t, LINES)
    assert t.shortlist is not None
    for line, hyps in zip(LINES, together, strict=True):
        alone = translate.translate_lines(t, [line])[0]
        assert [h.tokens for h in hyps] == [h.tokens for h in alone]
        assert [h.score for h in hyps] == pytest.approx([h.score for h in alone], abs=1e-4)
        source = t.tokenizer.encode([line])[0]
        allowed = set(t.shortlist.candidates(source).tolist()) | {t.tokenizer.eos_id}
        assert set(hyps[0].tokens) <= allowed
        assert len(allowed) < t.tokenizer.vocab_size // 2  # it restricts: not vacuous


@pytest.mark.parametrize("beam", [1, 3])
def test_a_shortlist_of_every_piece_is_the_exact_decode(
    multi30k_run: Path, made: Path, tmp_path: Path, beam: int
) -> None:
    plain = translate.load_translator(multi30k_run, [f"decode.beam_size={beam}"])
    tok = plain.tokenizer
    every = shortlist.Shortlist(np.arange(tok.vocab_size, dtype=np.int32),
                                np.zeros(tok.source_vocab_size + 1, dtype=np.int64),
                                np.zeros(0, dtype=np.int32), {"first": tok.vocab_size})  # fmt: skip
    out = tmp_path / "every.npz"
    shortlist.save(every, out, translate.fingerprint(plain))
    listed = _translator(multi30k_run, out, f"decode.beam_size={beam}")
    exact = translate.translate_lines(plain, LINES)
    found = translate.translate_lines(listed, LINES)
    assert [h[0].tokens for h in found] == [h[0].tokens for h in exact]
    assert [h[0].score for h in found] == pytest.approx([h[0].score for h in exact], abs=1e-5)
    texts = translate.translate_text(listed, LINES)  # greedy from logits, too, when beam is 1
    assert texts == translate.translate_text(plain, LINES)
    # A real one restricts the search: its outputs differ on some lines, never with more
    # probability mass outside the candidates than the exact decode allows.
    small = translate.translate_lines(_translator(multi30k_run, made, f"decode.beam_size={beam}"),
                                      LINES)  # fmt: skip
    assert [h[0].tokens for h in small] != [h[0].tokens for h in exact]


def test_prefix_and_glossary_pieces_are_always_candidates(
    multi30k_run: Path, made: Path, tmp_path: Path
) -> None:
    # A shortlist with no frequent pieces and one translation a piece: the prefix and the
    # glossary's target must still come out.
    src, ref = _multi30k_pairs(300, tmp_path)
    tiny = tmp_path / "tiny.shortlist"
    shortlisting.make(str(multi30k_run), tiny, src, ref, first=0, best=1, aligner="ibm1")
    t = _translator(multi30k_run, tiny)
    out = translate.translate_text(t, ["Ein Hund rennt."], prefixes=["Zebras quickly"])[0]
    assert out.startswith("Zebras quickly")
    glossary = tmp_path / "g.tsv"
    glossary.write_text("Hund\tcrocodile\n", encoding="utf-8")
    assert "crocodile" in t.translate(["Ein Hund rennt."], glossary=glossary)[0].lower()


def test_the_file_is_verified_and_refused_in_one_line(
    multi30k_run: Path, trained_run: Path, made: Path, tmp_path: Path
) -> None:
    with pytest.raises(TmtError, match="made for another model"):
        _translator(trained_run / "checkpoints" / "step_00000030", made)
    truncated = tmp_path / "truncated"
    truncated.write_bytes(made.read_bytes()[: made.stat().st_size // 2])
    with pytest.raises(TmtError, match="not a readable tmt shortlist"):
        _translator(multi30k_run, truncated)
    with np.load(made) as data:  # an id past the vocabulary, the digest made to match
        arrays = {k: data[k] for k in data.files}
    header = json.loads(arrays.pop("header").tobytes())
    table = shortlist.Shortlist(arrays["frequent"].copy(), arrays["offsets"], arrays["targets"],
                                header)  # fmt: skip
    table.frequent[0] = 10**6
    outside = tmp_path / "outside.npz"
    shortlist.save(table, outside, header["model"])
    with pytest.raises(TmtError, match="outside this model"):
        _translator(multi30k_run, outside)
    damaged = tmp_path / "damaged.npz"
    arrays["targets"] = arrays["targets"][::-1].copy()
    np.savez(damaged, **arrays, header=np.frombuffer(json.dumps(header).encode(), np.uint8))
    with pytest.raises(TmtError, match="damaged"):
        _translator(multi30k_run, damaged)
    with pytest.raises(TmtError, match="no shortlist.npz"):
        _translator(trained_run, "auto")
    with pytest.raises(TmtError, match="set when loading"):
        _translator(multi30k_run, made).translate(["Ein Hund."], shortlist="none")


def test_without_eflomal_ibm_model_1_aligns_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformer_mt.data import aligner

    def missing() -> None:
        raise ImportError("eflomal")

    monkeypatch.setattr(aligner, "eflomal_aligner", missing)
    # Source piece 10 + i always with target piece 20 + i, beside a frequent 5 / 6 pair.
    pairs = [([5, 10 + i % 7], [6, 20 + i % 7]) for i in range(70)]
    table, report = shortlist.build(pairs, 40, 40, never=(0, 1), first=1, best=1, min_prob=0.0)
    assert "IBM model 1" in report["aligner"] and "eflomal not used" in report["aligner"]
    assert table.frequent.tolist() == [6]
    for i in range(7):
        assert table.candidates([10 + i]).tolist() == [6, 20 + i]
    with pytest.raises(TmtError, match="eflomal is not installed"):
        shortlist.build(pairs, 40, 40, never=(), first=1, best=1, min_prob=0.0, aligner="eflomal")


def test_a_pair_with_a_side_past_align_tokens_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A line with no breaks is no sentence to align: its pair is left out of the counts (a
    50 MB line took 27.6 s and 4.2 GB, against 15.4 s and 0.3 GB without it)."""
    pairs = [([5, 10 + i % 7], [6, 20 + i % 7]) for i in range(70)]
    giant = ([11] * (shortlist.ALIGN_TOKENS + 1), [21, 22])
    base, _ = shortlist.build(pairs, 40, 40, never=(0, 1), first=1, best=2, min_prob=0.0,
                              aligner="ibm1")  # fmt: skip
    with_giant, _ = shortlist.build([*pairs, giant, giant[::-1]], 40, 40, never=(0, 1), first=1,
                                    best=2, min_prob=0.0, aligner="ibm1")  # fmt: skip
    for name in ("frequent", "offsets", "targets"):
        assert getattr(with_giant, name).tolist() == getattr(base, name).tolist()


def test_marian_lex_s2t_is_read_and_bad_lines_named(multi30k_run: Path, tmp_path: Path) -> None:
    t = translate.load_translator(multi30k_run)
    tok = t.tokenizer
    dog, hund = tok.encode(["dog"], side="target")[0][0], tok.encode(["Hund"])[0][0]
    pieces = (tok.id_to_piece(dog), tok.id_to_piece(hund, side="source"))
    lex = tmp_path / "lex.s2t"
    lex.write_text(f"{pieces[0]} {pieces[1]} 0.9\n", encoding="utf-8")
    out = tmp_path / "from_marian.npz"
    shortlisting.make(str(multi30k_run), out, marian=lex, first=10, best=5)
    fingerprint = translate.fingerprint(t)
    table = shortlist.load(out, fingerprint, tok.source_vocab_size, tok.vocab_size)
    assert dog in table.candidates([hund]).tolist()
    lex.write_text(f"{pieces[0]} {pieces[1]} 0.9\nnot-a-piece-here ▁Hund 0.5\n", encoding="utf-8")
    with pytest.raises(TmtError, match=r"lex.s2t:2: .*not in the model's vocabulary"):
        shortlisting.make(str(multi30k_run), out, marian=lex, overwrite=True)


def test_commands_make_it_beside_the_model_and_decode_with_it(
    trained_run: Path, tmp_path: Path
) -> None:
    # In this process (the command line's own code, without ten interpreters' start-up): that a
    # real process answers bad input without a traceback is test_cli's promise, for every command.
    model = tmp_path / "model"
    shutil.copytree(trained_run / "checkpoints" / "step_00000030", model)
    src = tmp_path / "src.txt"
    src.write_text("".join(s + "\n" for s, _ in reverse_pairs(30, seed=3)), encoding="utf-8")
    made = tmt(["shortlist", "-m", str(model), "-i", str(src), "--aligner", "ibm1", "--json"])
    assert made.exit_code == 0, made.output
    report = json.loads(made.stdout)
    assert Path(report["output"]) == model / "shortlist.npz" and "greedy" in report["corpus"]
    again = tmt(["shortlist", "-m", str(model), "-i", str(src)])
    assert again.exit_code != 0 and "exists; --overwrite" in again.stderr
    out = tmt(["translate", "-m", str(model), "-i", str(src), "--shortlist", "auto"])
    assert out.exit_code == 0, out.output
    assert len(out.stdout.splitlines()) == 30
    # The file job (chunks, resumable) writes what the stream wrote; evaluate takes it too.
    job = tmp_path / "out.txt"
    run = tmt(["translate", "-m", str(model), "-i", str(src), "-o", str(job),
               "--shortlist", str(model / "shortlist.npz")])  # fmt: skip
    assert run.exit_code == 0, run.output
    assert job.read_text(encoding="utf-8") == out.stdout
    ref = tmp_path / "ref.txt"
    ref.write_text("".join(t + "\n" for _, t in reverse_pairs(30, seed=3)), encoding="utf-8")
    scored = tmt(["evaluate", "-m", str(model), "-i", str(src), "--ref", str(ref),
                  "--shortlist", "auto", "--json"])  # fmt: skip
    assert scored.exit_code == 0, scored.output
    assert "bleu" in json.loads(scored.stdout)
    for args, named in ((["--first", "-1"], "--first -1"), (["--min-prob", "2"], "--min-prob 2"),
                        (["--aligner", "fast"], "--aligner fast"),
                        (["-o", str(src), "--overwrite"], str(src))):  # fmt: skip
        refused = tmt(["shortlist", "-m", str(model), "-i", str(src), *args])
        assert refused.exit_code == 2 and named in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        assert refused.stderr.count("--") == 1, refused.stderr  # the option named once
    assert len(src.read_text(encoding="utf-8").splitlines()) == 30  # the input survives
    for args, named in ((["shortlist", "-m", str(model), "--ref", str(src), "-o",
                          str(tmp_path / "x.npz")], "--ref needs -i"),
                        (["export", "-m", str(model), "--format", "huggingface", "-o",
                          str(tmp_path / "hf"), "--shortlist", "auto"], "--shortlist is for")):  # fmt: skip
        refused = tmt(args)
        assert refused.exit_code == 2 and named in refused.stderr, refused.stderr
        assert refused.stderr.count("--") == 1, refused.stderr
    bad = tmt(["translate", "-m", str(trained_run), "-i", str(src), "--shortlist", "auto"])
    assert bad.exit_code != 0 and "Traceback" not in bad.stderr
    assert "no shortlist.npz" in bad.stderr


def tmt(args: list[str]) -> Result:
    return CliRunner().invoke(app, args)


def test_the_ctranslate2_export_carries_it_as_its_vmap(
    multi30k_run: Path, made: Path, tmp_path: Path
) -> None:
    pytest.importorskip("ctranslate2")
    from transformer_mt.exchange import export
    from transformer_mt.translation import ct2

    out = tmp_path / "ct2"
    report = export.export(multi30k_run, "ctranslate2", out, check_lines=50, shortlist=str(made))
    assert report["vmap_lines"] > 1 and (out / ct2.VMAP_FILE).is_file()
    assert ct2.read(out).has_vmap and "use_vmap=True" in (out / "README.md").read_text()
    listed = _translator(multi30k_run, made, "decode.beam_size=1")
    engine = translate.load_translator(
        out, ["decode.engine=ctranslate2", "decode.shortlist=auto", "decode.beam_size=1"]
    )
    # One line a call, CTranslate2's union is that line's own set: greedy picks as tmt does.
    for line in LINES[:15]:
        ours = translate.translate_lines(listed, [line])[0][0].tokens
        theirs = translate.translate_lines(engine, [line])[0][0].tokens
        assert ours == theirs
    # Together, its outputs stay within the batch's union (they may leave a line's own set).
    assert listed.shortlist is not None
    union = set().union(*(listed.shortlist.candidates(x).tolist()
                          for x in listed.tokenizer.encode(LINES)))  # fmt: skip
    for hyps in translate.translate_lines(engine, LINES):
        assert set(hyps[0].tokens) <= union | {listed.tokenizer.eos_id}
    with pytest.raises(TmtError, match="has none"):
        plain = tmp_path / "plain"
        export.export(multi30k_run, "ctranslate2", plain, check_lines=20)
        translate.load_translator(plain, ["decode.engine=ctranslate2", "decode.shortlist=auto"])
    with pytest.raises(TmtError, match="not for huggingface"):
        export.export(multi30k_run, "huggingface", tmp_path / "hf", shortlist="auto")


def test_a_model_decoding_in_bf16_keeps_its_shortlist_and_fingerprint(
    multi30k_run: Path, made: Path
) -> None:
    # The shortlist names the model by its float32 weights' fingerprint: rounding them to bf16
    # for decoding must not make it "made for another model".
    fp32 = translate.load_translator(multi30k_run, ["decode.device=cpu"])
    bf16 = _translator(multi30k_run, made, "decode.device=cpu", "decode.precision=bf16")
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert bf16.fingerprint == translate.fingerprint(fp32)
    assert bf16.shortlist is not None
    for line, hyps in zip(LINES, translate.translate_lines(bf16, LINES), strict=True):
        source = bf16.tokenizer.encode([line])[0]
        allowed = set(bf16.shortlist.candidates(source).tolist()) | {bf16.tokenizer.eos_id}
        assert hyps[0].tokens and set(hyps[0].tokens) <= allowed
