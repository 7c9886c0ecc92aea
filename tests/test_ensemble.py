"""Ensembles: a model with itself is that model; two models follow the mean of their
probabilities step by step (an oracle over full forwards); weights, vocabularies and engines
that cannot be are one line."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
import torch.nn.functional as F
from conftest import reverse_pairs
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.common.exits import TmtError
from transformer_mt.data.tokenizer import Tokenizer
from transformer_mt.network import ensemble
from transformer_mt.network.model import make_src_mask
from transformer_mt.translation import translate

SOURCES = [s for s, _ in reverse_pairs(10, seed=5)]
runner = CliRunner()


def step(run_dir: Path, n: int) -> Path:
    return run_dir / "checkpoints" / f"step_{n:08d}"


def tokens_of(translator: translate.Translator, lines: list[str]) -> list[list[list[int]]]:
    return [[h.tokens for h in hyps] for hyps in translate.translate_lines(translator, lines)]


@pytest.mark.parametrize("settings", [["decode.beam_size=1"], ["decode.beam_size=3",
                                                               "decode.nbest=2"]])  # fmt: skip
def test_a_model_with_itself_is_that_model(trained_run: Path, settings: list[str]) -> None:
    alone = translate.load_translator(step(trained_run, 30), settings)
    twice = translate.load_ensemble([step(trained_run, 30)] * 2, settings, weights=[0.3, 0.7])
    assert twice.weights == pytest.approx((0.3, 0.7)) and len(twice.ensemble) == 1
    assert tokens_of(twice, SOURCES) == tokens_of(alone, SOURCES)
    for a, b in zip(translate.translate_lines(twice, SOURCES),
                    translate.translate_lines(alone, SOURCES), strict=True):  # fmt: skip
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)


def test_two_models_follow_the_mean_of_their_probabilities(trained_run: Path) -> None:
    # The oracle: greedy decoding where each token is the argmax of log(0.6 p_10 + 0.4 p_30),
    # every p from a full forward of the prefix (no cache, no batching, no search.py).
    paths, weights = [step(trained_run, 10), step(trained_run, 30)], [0.6, 0.4]
    pair = translate.load_ensemble(paths, ["decode.beam_size=1"], weights=weights)
    models = [pair.model, *pair.ensemble]
    tok = pair.tokenizer
    ids = translate.source_ids(pair, SOURCES)
    limits = translate.output_limits(pair, ids)
    expected = []
    with torch.inference_mode():
        for source, limit in zip(ids, limits, strict=True):
            src = torch.tensor([[*source, tok.eos_id]])
            mask = make_src_mask(src, tok.pad_id)
            prefix, out = [tok.bos_id], []
            for t in range(1, limit + 1):
                tgt = torch.tensor([prefix])
                each = [F.log_softmax(m.decode(tgt, m.encode(src, mask), mask)[0, -1], -1)
                        for m in models]  # fmt: skip
                mixed = torch.logsumexp(
                    torch.stack([lp + math.log(w) for lp, w in zip(each, weights, strict=True)]),
                    dim=0,
                )
                mixed[[tok.pad_id, tok.bos_id]] = -math.inf
                choice = tok.eos_id if t == limit else int(mixed.argmax())
                if choice == tok.eos_id:
                    break
                out.append(choice)
                prefix.append(choice)
            expected.append(out)
    found = [hyps[0] for hyps in tokens_of(pair, SOURCES)]
    assert found == expected
    # ... and it is neither model alone (else the test would prove little).
    alone = [
        tokens_of(translate.load_translator(p, ["decode.beam_size=1"]), SOURCES) for p in paths
    ]
    assert all(found != [hyps[0] for hyps in one] for one in alone)


def test_the_ensemble_is_one_model_for_jobs_and_the_api(trained_run: Path) -> None:
    paths = [step(trained_run, 10), step(trained_run, 30)]
    pair = translate.Translator.load(paths, weights=[1, 3])
    assert pair.weights == (0.25, 0.75) and "ensemble of" in pair.origin
    # the weights as --weights writes them
    assert translate.Translator.load(paths, weights="1,3").weights == pair.weights
    assert pair.parameters == 2 * translate.load_translator(paths[0]).parameters
    assert len(pair.translate(SOURCES[:3])) == 3
    # A job's identity: every model and its weight, in order.
    prints = {
        translate.fingerprint(t)
        for t in (pair, translate.Translator.load(paths, weights=[3, 1]),
                  translate.Translator.load(paths[::-1], weights=[3, 1]),
                  translate.Translator.load(paths[0]))
    }  # fmt: skip
    assert len(prints) == 4


def test_bad_ensembles_are_one_line_and_exit_2(trained_run: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("kalo mi\n")
    a, b = str(step(trained_run, 10)), str(step(trained_run, 30))
    for extra, message in [
        (["-m", a, "-m", b, "--weights", "0.5"], "--weights 0.5: 1 weights for 2 models"),
        (["-m", a, "-m", b, "--weights", "1,0"], "--weights 1,0: 0 is not a positive number"),
        (["-m", a, "-m", b, "--weights", "1,x"], "--weights '1,x': expected numbers"),
        (["-m", a, "-m", b, "--weights", "nan,1"], "--weights nan,1: nan is not a positive number"),
        (["-m", a, "-m", b, "--engine", "ctranslate2"], "an ensemble decodes with decode.engine=torch"),
    ]:  # fmt: skip
        result = runner.invoke(app, ["translate", *extra, "-i", str(source), "-o", "-"])
        assert result.exit_code == 2, (extra, result.output)
        assert message in result.stderr and "Traceback" not in result.output, result.stderr
    with pytest.raises(TmtError, match="no model"):
        translate.load_ensemble([])


def test_models_that_do_not_share_a_vocabulary_are_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def trained(size: int, name: str, text: str) -> Tokenizer:
        corpus = tmp_path / f"{name}.txt"
        corpus.write_text(text * 50)
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(tmp_path / name), vocab_size=size, pad_id=0,
            unk_id=1, bos_id=2, eos_id=3, minloglevel=2,
        )  # fmt: skip
        return Tokenizer.from_file(tmp_path / f"{name}.model")

    text = "".join(f"{s}\n{t}\n" for s, t in reverse_pairs(40, seed=1))
    first, same = trained(30, "a", text), trained(30, "b", text)
    # The same corpus and settings in other files: other bytes (the file records the input's
    # path), the same pieces: accepted with a warning.
    assert first.sha256 != same.sha256
    with caplog.at_level(logging.WARNING):
        ensemble.check_same_vocabulary([first, same], ["A", "B"])
    assert "B: the same pieces as A in another sentencepiece file" in caplog.text
    smaller = trained(28, "c", text)
    with pytest.raises(TmtError, match="C does not share the vocabulary of A: 28 pieces, not 30"):
        ensemble.check_same_vocabulary([first, same, smaller], ["A", "B", "C"])
    other = trained(30, "d", "".join(f"{t}\n" for _, t in reverse_pairs(40, seed=9)))
    with pytest.raises(TmtError, match=r"D does not share the vocabulary of A: piece \d+ is '"):
        ensemble.check_same_vocabulary([first, other], ["A", "D"])


def test_mean_log_probs_is_the_log_of_the_weighted_mean() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(3, 7, generator=g).log_softmax(-1) for _ in range(2))
    mixed = ensemble.mean_log_probs([a, b], torch.tensor([0.2, 0.8]).log())
    torch.testing.assert_close(mixed.exp(), 0.2 * a.exp() + 0.8 * b.exp())
    torch.testing.assert_close(mixed.exp().sum(-1), torch.ones(3))


def test_translate_and_evaluate_decode_the_ensemble_of_their_models(
    trained_run: Path, tmp_path: Path
) -> None:
    source, reference = tmp_path / "src.txt", tmp_path / "ref.txt"
    pairs = reverse_pairs(8, seed=11)
    source.write_text("".join(s + "\n" for s, _ in pairs))
    reference.write_text("".join(t + "\n" for _, t in pairs))
    a, b = str(step(trained_run, 10)), str(step(trained_run, 30))
    expected = translate.translate_text(
        translate.load_ensemble([a, b], weights=[2, 1]), [s for s, _ in pairs]
    )
    out = tmp_path / "out.txt"
    args = ["-m", a, "-m", b, "--weights", "2,1"]
    result = runner.invoke(app, ["translate", *args, "-i", str(source), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text().splitlines() == expected
    scored = runner.invoke(
        app, ["evaluate", *args, "-i", str(source), "--ref", str(reference), "--json"]
    )
    assert scored.exit_code == 0, scored.output
    alone = runner.invoke(app, ["evaluate", "--hyp", str(out), "--ref", str(reference), "--json"])
    ours, theirs = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (scored, alone))
    assert ours["bleu"] == theirs["bleu"] and ours["chrf"] == theirs["chrf"]
