"""Translating: equivalences on a tiny trained model, 1:1 lines, streams, loading, the Python API."""

from __future__ import annotations

import io
import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import reverse_pairs

from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, apply_overrides
from transformer_mt.runs import checkpoint, run
from transformer_mt.translation import decoding, sources, streams, translate

SOURCES = [s for s, _ in reverse_pairs(12, seed=7)]


def translator(trained_run: Path, *overrides: str) -> translate.Translator:
    return translate.load_translator(trained_run / "checkpoints" / "step_00000030", list(overrides))


@pytest.mark.parametrize("beam", [1, 3])
def test_batched_equals_one_by_one_and_order_is_restored(trained_run: Path, beam: int) -> None:
    t = translator(
        trained_run, f"decode.beam_size={beam}", "decode.max_tokens=60"
    )  # several batches
    together = translate.translate_lines(t, SOURCES)
    for source, hyps in zip(SOURCES, together, strict=True):
        alone = translate.translate_lines(t, [source])[0]
        assert [h.tokens for h in hyps] == [h.tokens for h in alone]
        assert [h.score for h in hyps] == pytest.approx([h.score for h in alone], abs=1e-4)
    assert translate.translate_text(t, SOURCES[::-1]) == translate.translate_text(t, SOURCES)[::-1]


@pytest.mark.parametrize("beam", [1, 4])
def test_beam_score_equals_forced_decoding_score(trained_run: Path, beam: int) -> None:
    t = translator(trained_run, f"decode.beam_size={beam}", "decode.nbest=1")
    tok = t.tokenizer
    for source, hyps in zip(SOURCES[:6], translate.translate_lines(t, SOURCES[:6]), strict=True):
        hyp = hyps[0]
        src = torch.tensor([[*tok.encode([source])[0], tok.eos_id]])
        tgt_in = torch.tensor([[tok.bos_id, *hyp.tokens]])
        target = torch.tensor([*hyp.tokens, tok.eos_id])
        with torch.no_grad():
            log_probs = torch.log_softmax(t.model(src, tgt_in)[0], dim=-1)
        forced = log_probs[torch.arange(len(target)), target].sum().item()
        assert hyp.log_prob == pytest.approx(forced, abs=1e-4)


def test_empty_lines_are_empty_outputs_without_the_model(
    trained_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = translator(trained_run)
    seen: list[int] = []
    real = decoding._translate_batch
    monkeypatch.setattr(
        decoding,
        "_translate_batch",
        lambda tr, sources, ids, forced, terms=None, **kw: (
            seen.append(len(sources)) or real(tr, sources, ids, forced, **kw)
        ),
    )
    out = translate.translate_text(t, ["", SOURCES[0], "   ", "\t", SOURCES[1], ""])
    assert len(out) == 6 and out[0] == out[2] == out[3] == out[5] == ""
    assert sum(seen) == 2  # only the two real sentences were decoded
    assert translate.translate_text(t, ["", " "]) == ["", ""]
    assert translate.translate_text(t, []) == []


def test_over_long_lines_are_truncated_with_a_warning(
    trained_run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t = translator(trained_run, "decode.beam_size=2")
    long_line = " ".join([SOURCES[0]] * 100)  # far more tokens than model.max_positions (128)
    with caplog.at_level(logging.WARNING):
        out = translate.translate_text(t, [SOURCES[1], long_line])
    assert len(out) == 2
    assert any("line 2" in r.message and "truncated to 127" in r.message for r in caplog.records)


def test_a_truncated_line_is_named_by_its_place_in_the_input_not_in_its_chunk(
    trained_run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream is decoded a chunk at a time (decode.buffer_lines); its warnings named a long
    line by its place in the chunk ("line 1" for the input's 6th), a prefix too."""
    t = translator(trained_run, "decode.buffer_lines=2")
    long_line = " ".join([SOURCES[0]] * 100)  # past model.max_positions (128)
    lines = [SOURCES[0], "", SOURCES[1], SOURCES[2], SOURCES[3], long_line, long_line]
    with caplog.at_level(logging.WARNING):
        streams.translate_stream(t, io.BytesIO(("\n".join(lines) + "\n").encode()), io.StringIO())
    warned = [r.message.split(":")[0] for r in caplog.records if "truncated to" in r.message]
    assert warned == ["line 6", "line 7"]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        decoding.translate_lines(t, [SOURCES[0], SOURCES[1]], first_line=40,
                                 prefixes=["", long_line])  # fmt: skip
    warned = [r.message.split(":")[0] for r in caplog.records if "truncated to" in r.message]
    assert warned == ["prefix 42"]


def test_lines_not_consecutive_in_the_input_are_named_by_their_own_places(
    trained_run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank translates every world_size-th validation line: its warnings named a line by its
    place in the rank's share ("line 2" for the split's 4th at 2 ranks)."""
    t = translator(trained_run)
    long_line = " ".join([SOURCES[0]] * 100)  # past model.max_positions (128)
    with caplog.at_level(logging.WARNING):
        out = translate.translate_text(t, [SOURCES[0], long_line], lines_at=range(1, 5, 2))
    assert len(out) == 2
    warned = [r.message.split(":")[0] for r in caplog.records if "truncated to" in r.message]
    assert warned == ["line 4"]
    with pytest.raises(TmtError, match="1 line indices for 2 lines"):
        translate.translate_text(t, [SOURCES[0], long_line], lines_at=[3])


def test_a_line_far_past_the_positions_is_read_from_its_head_with_the_same_tokens(
    trained_run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only a line's first max_positions - 1 tokens are read, so only a head of it is encoded
    (a line of 2 * 10^8 characters took 9 GB and 40 s): those tokens equal the whole line's,
    whatever lies at the cut: words, long runs of whitespace or of what the normalisation
    removes (which make the head grow), one word with no space at all."""
    t = translator(trained_run)
    limit = sources.max_positions(t) - 1
    words = " ".join(SOURCES * 200)  # ~ 50k characters: far past the head of 12k
    lines = [
        words,
        "ein" + " " * 50_000 + words,  # whitespace the normalisation folds into one space
        "ein " + "\u200b" * 50_000 + " " + words,  # zero-width spaces, removed
        "Donaudampfschifffahrt" * 2_000,  # one word, cut inside it
        "ein\t\t" * 10_000 + words,  # tabs
        SOURCES[0],
    ]
    with caplog.at_level(logging.WARNING):
        heads = sources.source_ids(t, lines)
    whole = [seq[:limit] for seq in t.tokenizer.encode(lines, side="source")]
    assert heads == whole
    warned = [r.message for r in caplog.records if "truncated to" in r.message]
    assert len(warned) == 5 and f"line 1: {len(words)} characters, truncated to {limit} tokens" in (
        warned[0]
    )  # fmt: skip


def test_a_line_far_past_the_positions_is_matched_and_reported_on_what_the_model_reads(
    trained_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A glossary matched a giant line whole: 4 * 10^7 matches of one entry ran past 300 s and
    16 GB. Such a line is read as its head of 1,024 characters a position, cut at a space."""
    t = translator(trained_run)
    size = sources._READ_CHARS * (sources.max_positions(t) + 64)
    giant = ("Katze " * 99 + "Hund ") * (size // 500 + 20)  # a match every 100 words
    with caplog.at_level(logging.WARNING):
        cut = sources.readable(t, [SOURCES[0], giant], at=[7, 8])
    assert cut[0] == SOURCES[0] and giant.startswith(cut[1]) and size - 5 <= len(cut[1]) <= size
    assert not cut[1].endswith(" ")  # a whole word last
    assert f"line 9: {len(giant)} characters, read as its first {len(cut[1])}" in caplog.text
    assert sources.readable(t, SOURCES[:3]) == SOURCES[:3]  # lines of a sentence: as they are
    glossary = tmp_path / "g.tsv"
    glossary.write_text("Hund\tdog\n")
    checked = translate.load_ensemble(
        [trained_run], [f"glossary.path={glossary}", "glossary.mode=check"]
    )
    rows = streams.output_and_report(checked, [SOURCES[0], giant], 0, None)
    report = json.loads(rows[1][1])
    matched = len(report["terms"])  # the head's matches only
    assert matched == cut[1].split().count("Hund") < giant.split().count("Hund")
    # tmt evaluate's term use counts the same matches
    from transformer_mt.translation import evaluate

    scored = evaluate.evaluate(checked, None, [SOURCES[0], giant], ["a", "b"],
                               glossary=checked.glossary)  # fmt: skip
    assert scored["glossary"]["terms_matched"] == matched


def test_stream_keeps_lines_one_to_one(trained_run: Path) -> None:
    t = translator(trained_run)
    raw = ("\n".join([SOURCES[0], "", SOURCES[1] + "\r", "bad \xff byte"]) + "\n").encode(
        "utf-8", "surrogateescape"
    )
    raw = raw.replace("\xff".encode(), b"\xff")
    sink = io.StringIO()
    assert streams.translate_stream(t, io.BytesIO(raw), sink) == 4
    lines = sink.getvalue().split("\n")
    assert len(lines) == 5 and lines[-1] == "" and lines[1] == ""
    assert lines[0] == translate.translate_text(t, [SOURCES[0]])[0]
    assert lines[2] == translate.translate_text(t, [SOURCES[1]])[0]  # the \r of a CRLF is dropped


def test_stream_nbest_format(trained_run: Path) -> None:
    t = translator(trained_run, "decode.beam_size=3", "decode.nbest=3")
    sink = io.StringIO()
    streams.translate_stream(t, io.BytesIO(f"{SOURCES[0]}\n\n".encode()), sink)
    rows = [line.split("\t") for line in sink.getvalue().splitlines()]
    assert [r[0] for r in rows] == ["0", "0", "0", "1", "1", "1"]
    scores = [float(r[1]) for r in rows[:3]]
    assert scores == sorted(scores, reverse=True)
    assert [r[2] for r in rows[3:]] == ["", "", ""]


def test_load_translator_from_run_directory_and_average(trained_run: Path) -> None:
    best = run.best(trained_run)
    assert translate.load_translator(trained_run).origin == str(best)
    averaged = translate.load_translator(trained_run, last=3)
    assert "step_00000010, step_00000020, step_00000030" in averaged.origin
    with pytest.raises(TmtError, match="nowhere: no such file or directory"):
        translate.load_translator(trained_run / "nowhere")
    with pytest.raises(TmtError, match="model.d_model: fixed by the checkpoint"):
        translate.load_translator(trained_run, ["model.d_model=64"])


def test_early_stopping_setting_reaches_the_search(
    trained_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs["early_stopping"])
        return real(*args, **kwargs)

    real = decoding.beam_search
    monkeypatch.setattr(decoding, "beam_search", recording)
    bound = translate.translate_text(translator(trained_run, "decode.beam_size=3"), SOURCES[:3])
    current = translate.translate_text(
        translator(trained_run, "decode.beam_size=3", "decode.early_stopping=current"), SOURCES[:3]
    )
    assert seen[0] == "bound" and seen[-1] == "current"
    assert len(bound) == len(current) == 3
    with pytest.raises(TmtError, match="early_stopping"):
        translator(trained_run, "decode.early_stopping=never")


def test_decode_settings_given_to_train_are_what_the_run_decodes_with(
    tiny_cfg: Config, tmp_path: Path
) -> None:
    # make demo trains with --set decode.length_penalty=1.0, then translates and scores the run
    # without saying it again. Decode settings leave training alone (the same weights), and the
    # run trained with them decodes as the other run does when it is given them at translation.
    from transformer_mt.training.train import train

    decode = ["decode.length_penalty=1.0", "decode.beam_size=3"]
    plain = apply_overrides(tiny_cfg, [f"train.out_dir={tmp_path / 'plain'}", "train.max_steps=4"])
    train(plain)
    train(apply_overrides(plain, [f"train.out_dir={tmp_path / 'set'}", *decode]))
    a, b = (run.checkpoint_dir(tmp_path / name, 4) for name in ("plain", "set"))
    weights_a, weights_b = (checkpoint.read(c).state_dict for c in (a, b))
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    kept = translate.load_translator(b)
    assert (kept.config.decode.length_penalty, kept.config.decode.beam_size) == (1.0, 3)
    given = translate.load_translator(a, decode)
    assert translate.translate_text(kept, SOURCES) == translate.translate_text(given, SOURCES)
    assert (
        translate.load_translator(b, ["decode.length_penalty=0.6"]).config.decode.length_penalty
        == 0.6
    )


# --- the Python API and the decoding precision -------------------------------------------------


def test_python_api_translates_as_the_command_does(trained_run: Path) -> None:
    from transformer_mt import Translator

    translator = Translator.load(trained_run, device="cpu")
    assert translator.config.decode.device == "cpu" and translator.device.type == "cpu"
    out = translator.translate(SOURCES[:4], beam=2)
    command = translate.load_translator(trained_run, ["decode.beam_size=2"])
    assert out == translate.translate_text(command, SOURCES[:4])
    assert translator.translate(["", SOURCES[0]]) == ["", translate.translate_text(
        translate.load_translator(trained_run), [SOURCES[0]])[0]]  # fmt: skip
    with pytest.raises(TmtError, match="device: set when loading"):
        translator.translate(["x"], device="cuda")
    with pytest.raises(TmtError, match="decode.beam_size = 0: expected >= 1"):
        translator.translate(["x"], beam=0)
    # One string is one line, its translation a string (as DeepL's translate_text): it was read
    # as a list of characters, each translated.
    assert translator.translate(SOURCES[0], beam=2) == out[0]
    assert translator.translate(SOURCES[0], prefix="") == translator.translate([SOURCES[0]])[0]
    assert translator.translate(iter(SOURCES[:2]), beam=2) == out[:2]  # any iterable of lines
    for lines, message in [(None, "lines: expected a list of strings, got NoneType"),
                           ([SOURCES[0], 7], "lines\\[1\\]: expected a string, got int")]:  # fmt: skip
        with pytest.raises(TypeError, match=message):
            translator.translate(lines)
    with pytest.raises(TypeError, match="prefix: expected a list of strings, got int"):
        translator.translate([SOURCES[0]], prefix=3)
    with pytest.raises(TypeError, match="path: expected a path or a list of paths, got NoneType"):
        Translator.load(None)


def test_the_python_examples_of_the_readme_and_the_manual_run(
    trained_run: Path, tmp_path: Path
) -> None:
    repo = Path(__file__).resolve().parent.parent
    pages = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    text = "".join(page.read_text(encoding="utf-8") for page in pages)
    examples = [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]
    assert len(examples) >= 4 and all("Translator.load(" in e for e in examples)
    run_dir = tmp_path / "run"  # a copy: the ctranslate2 example writes its export beside it
    shutil.copytree(trained_run, run_dir, symlinks=True)
    translated = []
    for example in examples:
        namespace: dict = {}
        exec(example.replace('"runs/multi30k"', repr(str(run_dir))), namespace)
        translated.append(namespace.get("translations"))
    assert any(isinstance(t, list) and len(t) == 2 for t in translated)


def test_bf16_decoding_on_cpu_translates_every_line(trained_run: Path) -> None:
    bf16 = translate.load_translator(trained_run, ["decode.precision=bf16"])
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    out = translate.translate_text(bf16, SOURCES)
    assert len(out) == len(SOURCES) and all(isinstance(t, str) for t in out)
    fp32 = translate.translate_text(translate.load_translator(trained_run), SOURCES)
    assert sum(a == b for a, b in zip(out, fp32, strict=True)) >= len(SOURCES) // 2


def test_greedy_without_scores_gives_the_same_translations(multi30k_run: Path) -> None:
    # Issue 49's exact saving: a caller that reads no scores (translate_text, the file job, the
    # server without n-best) gets greedy's tokens from the raw logits, identical to the
    # log-probabilities' argmax, on varied real sentences in batches of several sizes.
    from conftest import multi30k_sentences

    lines = multi30k_sentences(60)
    for max_tokens in (64, 4096):
        t = translate.load_translator(
            multi30k_run, ["decode.beam_size=1", f"decode.max_tokens={max_tokens}"]
        )
        scored = translate.translate_lines(t, lines)
        raw = translate.translate_lines(t, lines, scores=False)
        assert [h[0].tokens for h in raw] == [h[0].tokens for h in scored]
        assert all(math.isnan(h[0].score) for h in raw)
        assert not any(math.isnan(h[0].score) for h in scored)
        assert len({tuple(h[0].tokens) for h in raw}) > 30  # varied outputs: not vacuous
    ensemble = translate.load_ensemble([multi30k_run, multi30k_run], ["decode.beam_size=1"])
    assert not decoding.greedy_from_logits(ensemble)  # a mean of probabilities needs them
