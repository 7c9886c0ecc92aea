"""The decoder's step over fixed shapes (decode.cuda_graphs; network/decoder_graphs.py), run
eagerly on the CPU: every search over it gives what the same search over DecoderCache gives, as
sentences finish at different steps (their buffers shrink by buckets) and outputs grow past each
power of two of positions. The recorded step on CUDA: tests/test_gpu.py."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from transformer_mt.config import ModelConfig
from transformer_mt.network import beam_graphs, decoder_graphs, search
from transformer_mt.network.decoder_graphs import DecoderGraphs
from transformer_mt.network.model import Transformer, make_src_mask
from transformer_mt.translation import decoding, translate

PAD, BOS, EOS, V = 0, 1, 2, 40
TINY = ModelConfig(d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2,
                   dropout=0.0, attention_dropout=0.0, max_positions=128)  # fmt: skip


def model_of(seed: int = 0, **changes: object) -> Transformer:
    torch.manual_seed(seed)
    cfg = dataclasses.replace(TINY, **changes)
    model = Transformer(cfg, V, PAD, source_vocab_size=V if not cfg.share_embeddings else None)
    # An untrained model rarely ends a sentence: EOS made likelier, so that they end apart.
    with torch.no_grad():
        model.embedding.weight[EOS] *= 3
    return model.eval()


def batch(sentences: int, seed: int = 1) -> torch.Tensor:
    """(B, S) sources of lengths 2..S, right-padded, each ended by EOS."""
    generator = torch.Generator().manual_seed(seed)
    src = torch.full((sentences, 12), PAD)
    for row in range(sentences):
        length = 2 + row % 10
        src[row, :length] = torch.randint(3, V, (length,), generator=generator)
        src[row, length] = EOS
    return src


def eager(model: Transformer, src: torch.Tensor, normalise: bool = True):
    """The search's step and state over DecoderCache, as decoding.py builds them."""
    mask = make_src_mask(src, PAD)
    state = decoding._DecodeState(model.start_cache(model.encode(src, mask)), mask)

    def step(tokens: torch.Tensor, s: decoding._DecodeState):
        logits = model.decode(tokens[:, None], None, s.src_mask, s.cache)[:, 0].float()
        return (F.log_softmax(logits, dim=-1) if normalise else logits), s

    return step, state


def fixed(model: Transformer, src: torch.Tensor, normalise: bool = True, record: bool = False):
    mask = make_src_mask(src, PAD)
    graphs = DecoderGraphs(model, model.encode(src, mask), mask, normalise=normalise,
                           record=record)  # fmt: skip
    return (lambda tokens, s: (s.step(tokens), s)), graphs


def limits(sentences: int) -> list[int]:
    """Maximum lengths 3..70: sentences leave the batch at many steps, the longest past 64."""
    return [3 + (row * 7) % 68 for row in range(sentences)]


def same(a: list[list[search.Hypothesis]], b: list[list[search.Hypothesis]]) -> None:
    assert [[h.tokens for h in hyps] for hyps in a] == [[h.tokens for h in hyps] for hyps in b]
    for x, y in zip(a, b, strict=True):
        for hx, hy in zip(x, y, strict=True):
            assert hx.score == pytest.approx(hy.score, rel=1e-5, abs=1e-5, nan_ok=True)


@pytest.mark.parametrize(
    "changes", [{}, {"pre_norm": True}, {"output_bias": True, "share_embeddings": False}]
)
def test_beam_search_over_fixed_shapes_equals_the_cache(changes: dict) -> None:
    model, src = model_of(**changes), batch(23)
    lengths = limits(23)
    runs = []
    for build in (eager, fixed):
        step, state = build(model, src)
        with torch.inference_mode():
            runs.append(search.beam_search(step, state, lengths, BOS, EOS, beam_size=3, nbest=3,
                                           banned=(PAD, BOS)))  # fmt: skip
        if build is fixed:
            keys = state.key
    same(*runs)
    # Finished sentences shrank the buffers to a bucket of the last live ones.
    assert keys[0] < 23 and keys[1] == 3 and keys[2] >= 64


@pytest.mark.parametrize("normalise", [True, False])
def test_greedy_over_fixed_shapes_equals_the_cache(normalise: bool) -> None:
    model, src = model_of(seed=3), batch(17, seed=4)
    runs = []
    for build in (eager, fixed):
        step, state = build(model, src, normalise)
        with torch.inference_mode():
            found = search.greedy(step, state, limits(17), BOS, EOS, banned=(PAD, BOS),
                                  logits=not normalise)  # fmt: skip
        runs.append([[h] for h in found])
    same(*runs)


def test_sampling_and_prefixes_over_fixed_shapes_equal_the_cache() -> None:
    model, src = model_of(seed=5), batch(9, seed=6)
    uniforms = torch.rand(9, 128, generator=torch.Generator().manual_seed(7))
    prefixes = [[5 + row, 6] if row % 2 else [] for row in range(9)]
    sampled, searched = [], []
    for build in (eager, fixed):
        with torch.inference_mode():
            step, state = build(model, src)
            found = search.sample(step, state, limits(9), uniforms, BOS, EOS, method="topk:5",
                                  banned=(PAD, BOS))  # fmt: skip
            sampled.append([[h] for h in found])
            step, state = build(model, src)
            searched.append(search.beam_search(step, state, limits(9), BOS, EOS, beam_size=4,
                                               banned=(PAD, BOS), prefixes=prefixes))  # fmt: skip
    same(*sampled)
    same(*searched)
    forced = [hyps[0].tokens[:2] for row, hyps in enumerate(searched[1]) if row % 2]
    assert forced == [[5 + row, 6] for row in range(1, 9, 2)]


def test_buckets_hold_the_live_rows_and_grow_by_powers_of_two() -> None:
    model, src = model_of(), batch(40)
    mask = make_src_mask(src, PAD)
    graphs = DecoderGraphs(model, model.encode(src, mask), mask)
    for live in range(1, 41):
        for positions in (1, 15, 16, 17, 100):
            sentences, beam, room = graphs._key(live, 4, positions)
            assert live <= sentences <= 40 and (sentences == 40 or sentences < 8 * live + 8)
            assert beam == 4 and room >= max(positions, 16) and room & (room - 1) == 0
            assert room < 2 * max(positions, 16)


def test_decode_cuda_graphs_on_a_cpu_decodes_as_off_and_says_so(
    trained_run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = trained_run / "checkpoints" / "step_00000030"
    lines = ["a b c", "d e f g h", "i"]
    off = translate.load_translator(path, ["decode.device=cpu"])
    on = translate.load_translator(path, ["decode.device=cpu", "decode.cuda_graphs=on"])
    with caplog.at_level(logging.INFO, logger="transformer_mt.translation.decoding"):
        decoding._NO_GRAPHS_LOGGED.clear()
        assert decoding.translate_lines(on, lines) == decoding.translate_lines(off, lines)
        decoding.translate_lines(on, lines)
    said = [r.getMessage() for r in caplog.records if "cuda_graphs" in r.getMessage()]
    assert said == ["decode.cuda_graphs=on: a cpu has no CUDA graphs; decoding without them"]


def test_a_recording_that_fails_warns_once_and_decodes_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the step cannot be recorded (here: the stream refused, as a capture that meets an
    operation it forbids is), the search goes on eagerly with the same outputs, and the process
    says so once, whatever the batches after it."""
    monkeypatch.setattr(decoder_graphs, "_REFUSED", [])

    def refused(*args: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(torch.cuda, "Stream", refused)
    model, src = model_of(), batch(11)
    with caplog.at_level(logging.WARNING, logger=decoder_graphs.__name__):
        runs = []
        for record in (False, True, True):
            step, state = fixed(model, src, record=record)
            with torch.inference_mode():
                runs.append(search.beam_search(step, state, limits(11), BOS, EOS, beam_size=2))
            assert state.recorded == 0
    assert runs[0] == runs[1] == runs[2]
    (said,) = [r.getMessage() for r in caplog.records]
    assert "recording the decoder's step of key (11, 2, 16) failed" in said
    assert "(operation not permitted when stream is capturing)" in said


def searched_both(model: Transformer, src: torch.Tensor, lengths: list[int], **options):
    """beam_search over the fixed-shape steps, and graphed_beam_search over them (eager on the
    CPU), with the same options."""
    step, state = fixed(model, src)
    _, graphs = fixed(model, src)
    with torch.inference_mode():
        plain = search.beam_search(step, state, lengths, BOS, EOS, **options)
        graphed = beam_graphs.graphed_beam_search(graphs, lengths, BOS, EOS, **options)
    return plain, graphed, graphs


@pytest.mark.parametrize(
    "options",
    [
        {"beam_size": 3, "nbest": 3},
        {"beam_size": 4, "early_stopping": "current", "alpha": 1.0, "form": "power"},
        {"beam_size": 2, "early_stopping": "k_finished", "forced_eos": "zero", "nbest": 2},
        {"beam_size": 5, "alpha": 0.0},
    ],
)
def test_graphed_beam_search_equals_beam_search(options: dict) -> None:
    """Every step one graph: finished sentences stay in the batch until the live ones fit a
    smaller bucket, the step's number and the count of live sentences stay on the device. The
    same hypotheses, scores and order as search.beam_search, through gathers to smaller buckets
    and positions past 16, 32 and 64."""
    model, src = model_of(), batch(23)
    plain, graphed, graphs = searched_both(model, src, limits(23), banned=(PAD, BOS), **options)
    assert graphed == plain
    assert graphs.key[0] < 23 and graphs.key[2] >= 64  # gathered, and grown
    step, state = eager(model, src)  # DecoderCache's steps: the same within float32's rounding
    with torch.inference_mode():
        same(search.beam_search(step, state, limits(23), BOS, EOS, banned=(PAD, BOS), **options),
             graphed)  # fmt: skip


@pytest.mark.parametrize("vocab", [40, 130])
def test_graphed_beam_search_with_prefixes_and_a_vocabulary_past_whole_blocks(vocab: int) -> None:
    """Forced steps (prefixes, EOS at a maximum length) are keys of their own; a vocabulary that
    is no multiple of 64 leaves past-the-end candidates in place (-inf ones, never kept)."""
    torch.manual_seed(3)
    model = Transformer(TINY, vocab, PAD).eval()
    with torch.no_grad():
        model.embedding.weight[EOS] *= 3
    src = batch(13, seed=8)
    prefixes = [[5 + row, 6, 7][: row % 4] for row in range(13)]
    lengths = [2 + (row * 5) % 30 for row in range(13)]
    plain, graphed, _ = searched_both(model, src, lengths, beam_size=4, nbest=2, banned=(PAD,),
                                      prefixes=prefixes)  # fmt: skip
    assert graphed == plain
    assert [hyps[0].tokens[: row % 4] for row, hyps in enumerate(graphed)] == prefixes


@pytest.mark.parametrize("seed", range(12))
def test_graphed_beam_search_equals_beam_search_on_random_batches(seed: int) -> None:
    """Small random cases: one sentence or many, beams wider than a tiny vocabulary's best,
    maximum lengths of 1 up, prefixes as long as them, every option at random."""
    rng = torch.Generator().manual_seed(seed)

    def pick(*choices):
        return choices[int(torch.randint(len(choices), (1,), generator=rng))]

    vocab, sentences = pick(8, 40, 70), pick(1, 2, 5, 9)
    torch.manual_seed(seed)
    model = Transformer(TINY, vocab, PAD).eval()
    with torch.no_grad():
        model.embedding.weight[EOS] *= pick(1.0, 3.0)
    src = batch(sentences, seed=seed)
    src[src >= vocab] = vocab - 1
    lengths = [int(x) for x in torch.randint(1, 20, (sentences,), generator=rng)]
    prefixes = [[int(x) for x in torch.randint(3, vocab, (pick(0, 1, 3),), generator=rng)]
                for _ in range(sentences)]  # fmt: skip
    options = {"beam_size": pick(2, 3, 6), "nbest": pick(1, 2), "banned": pick((PAD,), (PAD, BOS)),
               "early_stopping": pick("bound", "current", "k_finished"),
               "form": pick("gnmt", "power"), "alpha": pick(0.0, 0.6, 1.0),
               "forced_eos": pick("log_prob", "zero"), "prefixes": pick([], prefixes)}  # fmt: skip
    plain, graphed, _ = searched_both(model, src, lengths, **options)
    same(plain, graphed)
