"""Batches: sampler properties, collate shift and padding, filter counts, the encoded cache, and
subword regularization (BPE-dropout) of training batches."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import reverse_pairs, with_data, write_parallel
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config
from transformer_mt.data import corpus
from transformer_mt.data.batches import (
    SubwordSampling,
    TokenBucketSampler,
    collate,
    padding_efficiency,
    prepare_data,
)

# --- TokenBucketSampler ------------------------------------------------------------------------

lengths_strategy = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=300
)


def make(
    lengths: list[tuple[int, int]], max_tokens: int, seed: int, rank: int = 0, world: int = 1
) -> TokenBucketSampler:
    src, tgt = np.array(lengths).T
    return TokenBucketSampler(src, tgt, max_tokens, seed, rank, world)


@settings(max_examples=60, deadline=None)
@given(
    lengths=lengths_strategy,
    max_tokens=st.integers(40, 400),
    seed=st.integers(0, 9),
    world=st.integers(1, 4),
    epoch=st.integers(0, 5),
)
def test_every_example_exactly_once_per_epoch_across_ranks(
    lengths, max_tokens, seed, world, epoch
) -> None:
    if len(lengths) < world:
        return
    per_rank = [
        make(lengths, max_tokens, seed, r, world).epoch_batches(epoch) for r in range(world)
    ]
    seen = np.concatenate([b for batches in per_rank for b in batches])
    assert sorted(seen.tolist()) == list(range(len(lengths)))
    assert len({len(batches) for batches in per_rank}) == 1  # equal batch counts per rank
    assert all(len(b) > 0 for batches in per_rank for b in batches)  # every rank has work


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    max_tokens=st.integers(20, 200),
    world=st.integers(2, 4),
    seed=st.integers(0, 9),
)
def test_single_pair_batches_are_merged_not_emptied(data, max_tokens, world, seed) -> None:
    # Every pair is longer than half the budget, so every batch holds one pair: halving cannot
    # even out the count over the ranks, merging the shortest pairs does.
    long = st.integers(max_tokens // 2 + 1, max_tokens)
    n = data.draw(st.integers(world, 3 * world + 2))
    lengths = data.draw(st.lists(st.tuples(long, long), min_size=n, max_size=n))
    per_rank = [make(lengths, max_tokens, seed, r, world).epoch_batches(0) for r in range(world)]
    seen = np.concatenate([b for batches in per_rank for b in batches])
    assert sorted(seen.tolist()) == list(range(n))
    assert len({len(batches) for batches in per_rank}) == 1
    assert all(1 <= len(b) <= 2 for batches in per_rank for b in batches)
    merged = sum(len(b) == 2 for batches in per_rank for b in batches)
    assert merged == n % world  # only as many merges as the count needs


def test_three_single_pairs_on_two_ranks() -> None:
    # The reported case: each pair fills max_tokens alone; rank 1 used to get an empty batch.
    rank0, rank1 = (make([(10, 10), (9, 9), (8, 8)], 10, 0, r, 2).epoch_batches(0) for r in (0, 1))
    assert len(rank0) == len(rank1) == 1 and all(len(b) for b in rank0 + rank1)
    assert sorted(np.concatenate(rank0 + rank1).tolist()) == [0, 1, 2]
    merged = [b.tolist() for b in rank0 + rank1 if len(b) == 2]
    assert [sorted(b) for b in merged] == [[1, 2]]  # the two shortest pairs, together


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_strategy, max_tokens=st.integers(40, 400), seed=st.integers(0, 9))
def test_every_batch_fits_the_token_budget(lengths, max_tokens, seed) -> None:
    sampler = make(lengths, max_tokens, seed)
    for batch in sampler.epoch_batches(0):
        longest = max(sampler.src_lengths[batch].max(), sampler.tgt_lengths[batch].max())
        assert 0 < len(batch) * longest <= max_tokens


@settings(max_examples=30, deadline=None)
@given(lengths=lengths_strategy, seed=st.integers(0, 9))
def test_deterministic_per_seed_and_epoch(lengths, seed) -> None:
    # (epoch, batch index) is then a complete resume position: a resumed run recomputes the same
    # epoch and continues at the index.
    a, b = make(lengths, 120, seed), make(lengths, 120, seed)
    for epoch in (0, 1):
        first, again = a.epoch_batches(epoch), b.epoch_batches(epoch)
        assert [x.tolist() for x in first] == [x.tolist() for x in again]


def test_epochs_and_seeds_shuffle_differently() -> None:
    lengths = [(i % 17 + 1, i % 13 + 1) for i in range(500)]
    sampler = make(lengths, 100, seed=1)
    order = lambda batches: np.concatenate(batches).tolist()  # noqa: E731
    assert order(sampler.epoch_batches(0)) != order(sampler.epoch_batches(1))
    assert order(sampler.epoch_batches(0)) != order(make(lengths, 100, seed=2).epoch_batches(0))


def test_batches_group_similar_lengths() -> None:
    rng = np.random.default_rng(0)
    src = rng.integers(1, 60, 5000)
    tgt = np.clip(src + rng.integers(-3, 4, 5000), 1, None)
    sampler = TokenBucketSampler(src, tgt, 1000, seed=0)
    assert padding_efficiency(sampler.epoch_batches(0), src, tgt) > 0.9


def test_batch_count_is_split_to_a_multiple_of_world_size() -> None:
    # 3 pairs of 10 tokens under a 30-token budget pack into one batch; 2 ranks need it split.
    rank0, rank1 = (make([(10, 10)] * 3, 30, 0, r, 2).epoch_batches(0) for r in (0, 1))
    assert len(rank0) == len(rank1) == 1
    assert sorted(np.concatenate(rank0 + rank1).tolist()) == [0, 1, 2]


def test_fewer_pairs_than_ranks_is_an_error() -> None:
    with pytest.raises(TmtError, match="1 pairs cannot be shared by 2 ranks"):
        make([(3, 3)], 30, 0, 0, 2)


def test_unsorted_validation_order_is_stable() -> None:
    src = np.array([5, 1, 3, 1]), np.array([2, 2, 2, 2])
    sampler = TokenBucketSampler(*src, max_tokens=100, seed=0, shuffle=False)
    assert [b.tolist() for b in sampler.epoch_batches(0)] == [[1, 3, 2, 0]]
    assert [b.tolist() for b in sampler.epoch_batches(0)] == [
        b.tolist() for b in sampler.epoch_batches(7)
    ]


def test_padding_efficiency_golden() -> None:
    src, tgt = np.array([2, 4, 3]), np.array([3, 3, 1])
    # batch [0, 1]: real 2+4+3+3 = 12 of 2*4 + 2*3 = 14; batch [2]: 3+1 of 3+1.
    assert padding_efficiency([np.array([0, 1]), np.array([2])], src, tgt) == pytest.approx(16 / 18)


# --- collate -----------------------------------------------------------------------------------


def test_collate_shifts_targets_and_pads() -> None:
    pad, bos, eos = 0, 2, 3
    batch = collate([[10, 11, 12], [13]], [[20], [21, 22]], pad, bos, eos)
    assert batch.src.tolist() == [[10, 11, 12, 3], [13, 3, 0, 0]]
    assert batch.tgt_in.tolist() == [[2, 20, 0], [2, 21, 22]]
    assert batch.tgt_out.tolist() == [[20, 3, 0], [21, 22, 3]]
    assert batch.src.dtype == torch.int64
    assert batch.n_tokens == 5
    # tgt_in[t + 1] == tgt_out[t] wherever both are real tokens: the shift is exactly one.
    assert torch.equal(
        batch.tgt_in[:, 1:][batch.tgt_in[:, 1:] != pad],
        batch.tgt_out[:, :-1][batch.tgt_in[:, 1:] != pad],
    )


# --- prepare_data: filters, counts, cache ------------------------------------------------------


def test_encoded_batches_decode_to_the_original_text(tiny_cfg: Config) -> None:
    data = prepare_data(tiny_cfg)
    sampler = data.train.sampler(tiny_cfg.data.max_tokens, seed=1)
    positions = sampler.epoch_batches(0)[0]
    batch = data.train.batch(positions, data.tokenizer)
    texts = dict(reverse_pairs(300, seed=1))  # source -> target
    for src_row, tgt_row in zip(batch.src.tolist(), batch.tgt_out.tolist()):
        source = data.tokenizer.decode([[i for i in src_row if i != data.tokenizer.pad_id]])[0]
        target = data.tokenizer.decode([[i for i in tgt_row if i != data.tokenizer.pad_id]])[0]
        assert texts[source] == target


def test_filters_are_counted_per_filter(tmp_path: Path, tiny_cfg: Config) -> None:
    good = reverse_pairs(30, seed=5)
    bad = [
        ("", "kalo"),  # empty source
        ("   ", "kalo"),  # whitespace-only source
        ("kalo", "\t "),  # whitespace-only target
        (" ".join(["kalo"] * 60), " ".join(["kalo"] * 60)),  # too long (> max_len tokens)
        ("ka", " ".join(["loka mi"] * 6)),  # length ratio
    ]
    prefix = write_parallel(tmp_path / "train", good + bad)
    cfg = with_data(tiny_cfg, train=str(prefix), max_len=40, max_len_ratio=3.0)
    counts = prepare_data(cfg).counts["data.train"]
    assert (counts.read, counts.empty, counts.too_long, counts.ratio, counts.kept) == (
        35,
        3,
        1,
        1,
        30,
    )
    assert counts.invalid_utf8 == counts.replaced == 0


def test_encoding_policies_are_counted(tmp_path: Path, tiny_cfg: Config) -> None:
    prefix = write_parallel(tmp_path / "train", reverse_pairs(30, seed=5))
    Path(f"{prefix}.de").write_bytes(Path(f"{prefix}.de").read_bytes().replace(b"ka", b"k\xff", 1))
    skip = prepare_data(with_data(tiny_cfg, train=str(prefix), encoding_errors="skip")).counts[
        "data.train"
    ]
    assert (skip.invalid_utf8, skip.kept, skip.replaced) == (1, 29, 0)
    replace = prepare_data(
        with_data(tiny_cfg, train=str(prefix), encoding_errors="replace")
    ).counts["data.train"]
    assert (replace.invalid_utf8, replace.kept, replace.replaced) == (0, 30, 1)
    with pytest.raises(TmtError, match=r"train.de:\d+: invalid UTF-8"):
        prepare_data(with_data(tiny_cfg, train=str(prefix)))


def test_nothing_left_after_filtering_names_the_filters(tmp_path: Path, tiny_cfg: Config) -> None:
    (tmp_path / "spm.model").write_bytes(prepare_data(tiny_cfg).tokenizer.model_bytes)
    cfg = dataclasses.replace(
        tiny_cfg,
        tokenizer=dataclasses.replace(tiny_cfg.tokenizer, model_path=str(tmp_path / "spm.model")),
    )
    prefix = write_parallel(tmp_path / "train", [(" ".join(["kalo"] * 60), "mi")] * 3 + [("", "x")])
    with pytest.raises(TmtError) as err:
        prepare_data(with_data(cfg, train=str(prefix), max_len=40))
    message = str(err.value)
    assert "no pairs left after filtering" in message
    assert "4 read" in message and "1 empty" in message and "3 over data.max_len" in message


def test_second_run_reuses_tokenizer_and_encoding(
    tiny_cfg: Config, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cfg = with_data(tiny_cfg, cache_dir=str(tmp_path / "cache"))
    first = prepare_data(cfg)

    def no_reading(*args: object, **kwargs: object) -> None:
        raise AssertionError("a warm cache must not read or encode the corpus again")

    monkeypatch.setattr(corpus.RawSplit, "load", no_reading)
    second = prepare_data(cfg)
    assert second.tokenizer.sha256 == first.tokenizer.sha256
    assert np.array_equal(second.train.src_lengths, first.train.src_lengths)
    # A filter change is applied to the cached lengths: still no re-encoding, new counts.
    stricter = prepare_data(with_data(cfg, max_len=6))
    assert stricter.counts["data.train"].too_long > 0
    assert len(stricter.train) < len(first.train)
    assert not list((tmp_path / "cache").glob(".work.*"))  # scratch space is cleaned up


def test_a_different_tokenizer_re_encodes(tiny_cfg: Config, tmp_path: Path) -> None:
    cfg = with_data(tiny_cfg, cache_dir=str(tmp_path / "cache"))
    prepare_data(cfg)
    bigger = dataclasses.replace(cfg, tokenizer=dataclasses.replace(cfg.tokenizer, vocab_size=80))
    data = prepare_data(bigger)
    assert data.tokenizer.vocab_size == 80
    assert (
        len(list((tmp_path / "cache" / "encoded").iterdir())) == 4
    )  # (train, valid) × 2 tokenizers
    assert len(list((tmp_path / "cache" / "tokenizers").glob("*.model"))) == 2


def test_parallel_encoding_matches_serial(tiny_cfg: Config, tmp_path: Path) -> None:
    serial = prepare_data(with_data(tiny_cfg, cache_dir=str(tmp_path / "a")))
    parallel = prepare_data(with_data(tiny_cfg, cache_dir=str(tmp_path / "b"), num_proc=2))
    positions = np.arange(len(serial.train))
    assert (
        serial.train.ids(positions)[0][5].tolist() == parallel.train.ids(positions)[0][5].tolist()
    )
    assert all(
        np.array_equal(a, b)
        for a, b in zip(serial.train.ids(positions)[1], parallel.train.ids(positions)[1])
    )


def test_given_tokenizer_model_path_is_used(tiny_cfg: Config, tmp_path: Path) -> None:
    trained = prepare_data(tiny_cfg).tokenizer
    (tmp_path / "mine.model").write_bytes(trained.model_bytes)
    cfg = dataclasses.replace(
        tiny_cfg,
        tokenizer=dataclasses.replace(
            tiny_cfg.tokenizer, model_path=str(tmp_path / "mine.model"), vocab_size=999
        ),
    )
    assert prepare_data(cfg).tokenizer.sha256 == trained.sha256


def test_leftovers_of_killed_runs_are_removed(tiny_cfg: Config, tmp_path: Path) -> None:
    import os

    cache = tmp_path / "cache"
    cfg = with_data(tiny_cfg, cache_dir=str(cache))
    prepare_data(cfg)
    stale = [
        cache / ".work.dead",
        cache / "encoded" / ".abc.dead",
        cache / "tokenizers" / ".x.model.tmp",
    ]
    fresh = cache / ".work.live"
    for path in [*stale[:2], fresh]:
        path.mkdir()
    stale[2].write_bytes(b"partial")
    for path in stale:
        os.utime(path, (0, 0))
    prepare_data(cfg)
    assert not any(p.exists() for p in stale)
    assert fresh.exists()  # a build that may still be running is left alone


# --- subword regularization: BPE-dropout of training batches ----------------------------------


def sampled_cfg(cfg: Config, alpha: float = 0.3, **train: object) -> Config:
    cfg = with_data(cfg, subword_alpha=alpha, subword_sides="both")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def test_bpe_dropout_without_dropout_is_sentencepieces_own_segmentation(
    multi30k_cfg_data: tuple[Config, object],
) -> None:
    # A 500-piece model of the bundled Multi30k, 2,000 pairs: merging each word again from its
    # characters, best score first, gives exactly what sentencepiece's encoder gave.
    _, data = multi30k_cfg_data
    src, tgt = data.train.ids(np.arange(2000))
    for ids in src + tgt:
        assert data.tokenizer.bpe_dropout(ids, 0.0, seed=1) == ids.tolist()


@pytest.fixture(scope="module")
def multi30k_cfg_data() -> tuple[Config, object]:
    from transformer_mt.config import load_config

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml")
    return cfg, prepare_data(cfg)  # the data of conftest's multi30k_run: one cache entry


def test_sampled_batches_keep_the_text_vary_by_epoch_and_repeat_by_seed(
    multi30k_cfg_data: tuple[Config, object],
) -> None:
    cfg, data = multi30k_cfg_data
    tokenizer, positions = data.tokenizer, np.arange(100, 400)
    sampling = SubwordSampling.of(sampled_cfg(cfg, 0.1), tokenizer)
    src, _ = data.train.ids(positions)
    epoch0 = sampling.resegment(src, positions, tokenizer, epoch=0, side=0)
    again = sampling.resegment(src, positions, tokenizer, epoch=0, side=0)
    epoch1 = sampling.resegment(src, positions, tokenizer, epoch=1, side=0)
    assert all(np.array_equal(a, b) for a, b in zip(epoch0, again, strict=True))
    assert tokenizer.decode(epoch0) == tokenizer.decode(epoch1) == tokenizer.decode(src)
    changed = sum(not np.array_equal(a, b) for a, b in zip(epoch0, src, strict=True))
    assert changed > 150  # most sentences of ~12 words lose a merge or more at 0.1
    assert sum(map(len, epoch0)) > sum(map(len, src))  # dropped merges: more, shorter pieces
    assert sum(not np.array_equal(a, b) for a, b in zip(epoch0, epoch1, strict=True)) > 150
    # The pair, not its place in a batch, fixes its draw: a batch of one draws the same.
    alone = sampling.resegment([src[7]], positions[7:8], tokenizer, epoch=0, side=0)
    assert np.array_equal(alone[0], epoch0[7])


def test_validation_batches_and_the_defaults_are_never_sampled(tiny_cfg: Config) -> None:
    data = prepare_data(tiny_cfg)
    assert SubwordSampling.of(tiny_cfg, data.tokenizer) is None  # §5.1: one segmentation
    sampling = SubwordSampling.of(sampled_cfg(tiny_cfg, 0.5), data.tokenizer)
    positions = np.arange(30)
    plain = data.train.batch(positions, data.tokenizer)
    drawn = data.train.batch(positions, data.tokenizer, sampling, epoch=0)
    assert (
        drawn.src.shape[1] > plain.src.shape[1] and drawn.tgt_out.shape[1] > plain.tgt_out.shape[1]
    )
    # a draw longer than data.max_len keeps the cached segmentation
    short = dataclasses.replace(sampling, max_len=int(data.train.src_lengths[:30].max()))
    capped = data.train.batch(positions, data.tokenizer, short, epoch=0)
    assert capped.src.shape[1] <= short.max_len + 1


def test_tags_stay_whole_under_dropout(tiny_cfg: Config, tmp_path: Path) -> None:
    from transformer_mt.config import Corpus

    cfg = with_data(
        tiny_cfg, train=(Corpus(split=tiny_cfg.data.train, tag="<bt>"),), cache_dir=str(tmp_path)
    )
    data = prepare_data(cfg)
    tag = data.tokenizer.tag_ids("<bt>")[-1]
    src, _ = data.train.ids(np.arange(50))
    for i, ids in enumerate(src):
        drawn = data.tokenizer.bpe_dropout(ids, 0.9, seed=i)
        assert tag in drawn and data.tokenizer.decode([drawn]) == data.tokenizer.decode([ids])


def test_a_unigram_tokenizer_is_refused_in_one_line(tiny_cfg: Config, tmp_path: Path) -> None:
    cfg = dataclasses.replace(
        sampled_cfg(tiny_cfg),
        tokenizer=dataclasses.replace(tiny_cfg.tokenizer, model_type="unigram"),
    )
    data = prepare_data(with_data(cfg, cache_dir=str(tmp_path)))
    assert data.tokenizer.model_type == "unigram"
    with pytest.raises(TmtError, match=r"data.subword_alpha=0.3: BPE-dropout needs a bpe"):
        SubwordSampling.of(cfg, data.tokenizer)
