"""Translation and scoring: equivalences on a tiny trained model, 1:1 lines, sacreBLEU, averaging."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
import torch
from conftest import model_parts, reverse_pairs

from transformer_mt import checkpoint, evaluate, run
from transformer_mt.config import Config, apply_overrides
from transformer_mt.exits import TmtError

SOURCES = [s for s, _ in reverse_pairs(12, seed=7)]


def translator(trained_run: Path, *overrides: str) -> evaluate.Translator:
    return evaluate.load_translator(trained_run / "checkpoints" / "step_00000030", list(overrides))


@pytest.mark.parametrize("beam", [1, 3])
def test_batched_equals_one_by_one_and_order_is_restored(trained_run: Path, beam: int) -> None:
    t = translator(
        trained_run, f"decode.beam_size={beam}", "decode.max_tokens=60"
    )  # several batches
    together = evaluate.translate_lines(t, SOURCES)
    for source, hyps in zip(SOURCES, together, strict=True):
        alone = evaluate.translate_lines(t, [source])[0]
        assert [h.tokens for h in hyps] == [h.tokens for h in alone]
        assert [h.score for h in hyps] == pytest.approx([h.score for h in alone], abs=1e-4)
    assert evaluate.translate_text(t, SOURCES[::-1]) == evaluate.translate_text(t, SOURCES)[::-1]


@pytest.mark.parametrize("beam", [1, 4])
def test_beam_score_equals_forced_decoding_score(trained_run: Path, beam: int) -> None:
    t = translator(trained_run, f"decode.beam_size={beam}", "decode.nbest=1")
    tok = t.tokenizer
    for source, hyps in zip(SOURCES[:6], evaluate.translate_lines(t, SOURCES[:6]), strict=True):
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
    real = evaluate._translate_batch
    monkeypatch.setattr(
        evaluate,
        "_translate_batch",
        lambda tr, sources, ids: seen.append(len(sources)) or real(tr, sources, ids),
    )
    out = evaluate.translate_text(t, ["", SOURCES[0], "   ", "\t", SOURCES[1], ""])
    assert len(out) == 6 and out[0] == out[2] == out[3] == out[5] == ""
    assert sum(seen) == 2  # only the two real sentences were decoded
    assert evaluate.translate_text(t, ["", " "]) == ["", ""]
    assert evaluate.translate_text(t, []) == []


def test_over_long_lines_are_truncated_with_a_warning(
    trained_run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t = translator(trained_run, "decode.beam_size=2")
    long_line = " ".join([SOURCES[0]] * 100)  # far more tokens than model.max_positions (128)
    with caplog.at_level(logging.WARNING):
        out = evaluate.translate_text(t, [SOURCES[1], long_line])
    assert len(out) == 2
    assert any("line 2" in r.message and "truncated to 127" in r.message for r in caplog.records)


def test_stream_keeps_lines_one_to_one(trained_run: Path) -> None:
    t = translator(trained_run)
    raw = ("\n".join([SOURCES[0], "", SOURCES[1] + "\r", "bad \xff byte"]) + "\n").encode(
        "utf-8", "surrogateescape"
    )
    raw = raw.replace("\xff".encode(), b"\xff")
    sink = io.StringIO()
    assert evaluate.translate_stream(t, io.BytesIO(raw), sink) == 4
    lines = sink.getvalue().split("\n")
    assert len(lines) == 5 and lines[-1] == "" and lines[1] == ""
    assert lines[0] == evaluate.translate_text(t, [SOURCES[0]])[0]
    assert lines[2] == evaluate.translate_text(t, [SOURCES[1]])[0]  # the \r of a CRLF is dropped


def test_stream_nbest_format(trained_run: Path) -> None:
    t = translator(trained_run, "decode.beam_size=3", "decode.nbest=3")
    sink = io.StringIO()
    evaluate.translate_stream(t, io.BytesIO(f"{SOURCES[0]}\n\n".encode()), sink)
    rows = [line.split("\t") for line in sink.getvalue().splitlines()]
    assert [r[0] for r in rows] == ["0", "0", "0", "1", "1", "1"]
    scores = [float(r[1]) for r in rows[:3]]
    assert scores == sorted(scores, reverse=True)
    assert [r[2] for r in rows[3:]] == ["", "", ""]


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
    sources, _ = evaluate.read_split(cfg, "data.valid")
    hyp_file = tmp_path / "hyp.txt"
    hyp_file.write_text("".join(h + "\n" for h in evaluate.translate_text(t, sources)))
    again = evaluate.evaluate(
        None, split="valid", hypotheses=evaluate.read_text_file(hyp_file), cfg=cfg
    )
    assert again["bleu"] == report["bleu"] and again["chrf"] == report["chrf"]
    with pytest.raises(TmtError, match="39 hypotheses but 40 references"):
        evaluate.evaluate(
            None, split="valid", hypotheses=evaluate.read_text_file(hyp_file)[:-1], cfg=cfg
        )


def test_load_translator_from_run_directory_and_average(trained_run: Path) -> None:
    best = run.best(trained_run)
    assert evaluate.load_translator(trained_run).origin == str(best)
    averaged = evaluate.load_translator(trained_run, average_last=3)
    assert "step_00000010, step_00000020, step_00000030" in averaged.origin
    with pytest.raises(TmtError, match="not a checkpoint .* nor a run directory"):
        evaluate.load_translator(trained_run / "nowhere")
    with pytest.raises(TmtError, match="--set model.d_model: fixed by the checkpoint"):
        evaluate.load_translator(trained_run, ["model.d_model=64"])


# --- averaging ---------------------------------------------------------------------------------


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
    mean = checkpoint.average(map(checkpoint.read, [b, a]))  # any order: sources sorted by step
    embedding = mean.state_dict["embedding.weight"]
    assert torch.equal(embedding[0, :3], torch.tensor([2.0, 3.0, 5.5]))
    assert torch.equal(embedding[1, :1], torch.tensor([0.75]))
    # The tied pre-softmax projection is the same averaged matrix.
    assert torch.equal(mean.state_dict["output_projection.weight"], embedding)
    assert mean.step == 2 and mean.sources == (str(a), str(b))


def test_average_of_copies_is_bitwise_the_original(trained_run: Path) -> None:
    one = trained_run / "checkpoints" / "step_00000030"
    original = checkpoint.read(one).state_dict
    mean = checkpoint.average(checkpoint.read(one) for _ in range(3))
    assert all(torch.equal(original[k], mean.state_dict[k]) for k in original)


def test_average_refuses_different_models(
    tiny_cfg: Config, tiny_spm: bytes, tmp_path: Path
) -> None:
    from transformer_mt.tokenizer import train_tokenizer

    a = fake(tmp_path, "a", tiny_cfg, tiny_spm, 1)
    wider = apply_overrides(tiny_cfg, ["model.d_ff=128"])
    with pytest.raises(TmtError, match="cannot average .*: model.d_ff differ"):
        checkpoint.average(map(checkpoint.read, [a, fake(tmp_path, "b", wider, tiny_spm, 2)]))
    sentences = [s for pair in reverse_pairs(200, seed=9) for s in pair]
    other_spm = train_tokenizer(
        sentences, tiny_cfg.tokenizer.__class__(vocab_size=48, byte_fallback=False)
    )
    with pytest.raises(TmtError, match="the tokenizer model differ"):
        other = fake(tmp_path, "c", tiny_cfg, other_spm.model_bytes, 3)
        checkpoint.average(map(checkpoint.read, [a, other]))


def test_write_average_is_a_loadable_model(trained_run: Path, tmp_path: Path) -> None:
    out = checkpoint.write_average(run.newest_models(trained_run, 2), tmp_path / "avg").path
    assert checkpoint.verify(out) is None
    assert checkpoint.read(out).sources == tuple(
        str(p) for p in run.list_checkpoints(trained_run)[-2:]
    )
    # The written model translates exactly as the same average made in memory.
    written = evaluate.translate_text(evaluate.load_translator(out), SOURCES)
    assert written == evaluate.translate_text(
        evaluate.load_translator(trained_run, average_last=2), SOURCES
    )
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "notes.txt").write_text("mine")
    with pytest.raises(TmtError, match="exists and is not a checkpoint"):
        checkpoint.write_average(run.newest_models(trained_run, 2), tmp_path / "occupied")
    with pytest.raises(TmtError, match="complete checkpoints, 9 asked for"):
        list(run.newest_models(trained_run, 9))
    # Training's final average takes what there is when the run kept fewer than asked.
    every = run.list_checkpoints(trained_run)
    assert [c.path for c in run.newest_models(trained_run, 9, allow_fewer=True)] == every[::-1]


def test_early_stopping_setting_reaches_the_search(
    trained_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs["early_stopping"])
        return real(*args, **kwargs)

    real = evaluate.beam_search
    monkeypatch.setattr(evaluate, "beam_search", recording)
    bound = evaluate.translate_text(translator(trained_run, "decode.beam_size=3"), SOURCES[:3])
    current = evaluate.translate_text(
        translator(trained_run, "decode.beam_size=3", "decode.early_stopping=current"), SOURCES[:3]
    )
    assert seen[0] == "bound" and seen[-1] == "current"
    assert len(bound) == len(current) == 3
    with pytest.raises(TmtError, match="early_stopping"):
        translator(trained_run, "decode.early_stopping=never")


# --- the Python API and the decoding precision -------------------------------------------------


def test_python_api_translates_as_the_command_does(trained_run: Path) -> None:
    from transformer_mt import Translator  # the package's own face, loaded on first use

    translator = Translator.load(trained_run, device="cpu")
    assert translator.config.decode.device == "cpu" and translator.device.type == "cpu"
    out = translator.translate(SOURCES[:4], beam=2)
    command = evaluate.load_translator(trained_run, ["decode.beam_size=2"])
    assert out == evaluate.translate_text(command, SOURCES[:4])
    assert translator.translate(["", SOURCES[0]]) == ["", evaluate.translate_text(
        evaluate.load_translator(trained_run), [SOURCES[0]])[0]]  # fmt: skip
    with pytest.raises(TmtError, match="device: set when loading"):
        translator.translate(["x"], device="cuda")
    with pytest.raises(TmtError, match="decode.beam_size = 0: expected >= 1"):
        translator.translate(["x"], beam=0)


def test_readme_python_example_runs(trained_run: Path) -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    example = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert "Translator.load(" in example and ".translate(" in example
    namespace: dict = {}
    exec(example.replace('"runs/multi30k"', repr(str(trained_run))), namespace)
    assert isinstance(namespace["translations"], list) and len(namespace["translations"]) == 2


def test_bf16_decoding_on_cpu_translates_every_line(trained_run: Path) -> None:
    bf16 = evaluate.load_translator(trained_run, ["decode.precision=bf16"])
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    out = evaluate.translate_text(bf16, SOURCES)
    assert len(out) == len(SOURCES) and all(isinstance(t, str) for t in out)
    fp32 = evaluate.translate_text(evaluate.load_translator(trained_run), SOURCES)
    assert sum(a == b for a, b in zip(out, fp32, strict=True)) >= len(SOURCES) // 2
