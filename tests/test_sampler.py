"""The sampler: token-bucket batches (every pair once per epoch across ranks, within the budget,
deterministic per seed and epoch) and bounded batch shapes (data.bucketing): the buckets' padding
is the least possible, an epoch's shapes stay under their bound on the real corpus and a
WMT-length one at three batch sizes, and padding efficiency stays within 0.02 of exact lengths."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_mt.common.exits import TmtError
from transformer_mt.data.batches import collate
from transformer_mt.data.sampler import (
    ShapeBuckets,
    TokenBucketSampler,
    length_boundaries,
    padding_efficiency,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"

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


# --- bounded shapes (data.bucketing) -----------------------------------------------------------


def _padding(lengths: np.ndarray, bounds: np.ndarray) -> int:
    return int((bounds[np.searchsorted(bounds, lengths)] - lengths).sum())


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 14), min_size=1, max_size=40), k=st.integers(1, 5))
def test_bucket_lengths_waste_the_least_padding(lengths: list[int], k: int) -> None:
    """Oracle: every choice of at most k buckets among the lengths that occur (the longest
    always one of them) pads at least as much as the chosen ones."""
    lengths = np.array(lengths)
    bounds = length_boundaries(lengths, k)
    values = np.unique(lengths)
    assert len(bounds) <= k and bounds[-1] == values[-1] and set(bounds) <= set(values)
    assert list(bounds) == sorted(set(bounds))
    best = min(
        _padding(lengths, np.array([*chosen, values[-1]]))
        for r in range(min(k, len(values)))
        for chosen in itertools.combinations(values[:-1], r)
    )
    assert _padding(lengths, bounds) == best


def test_as_many_buckets_as_lengths_pad_nothing() -> None:
    lengths = np.array([3, 9, 3, 5, 9])
    assert length_boundaries(lengths, 3).tolist() == [3, 5, 9]
    assert length_boundaries(lengths, 1).tolist() == [9]


def multi30k_lengths() -> tuple[np.ndarray, np.ndarray]:
    """The bundled training split's lengths under the default recipe's tokenizer (eos/bos
    included): scripts/length_fixture.py."""
    with np.load(FIXTURES / "multi30k_lengths.npz") as saved:
        return saved["source"].astype(np.int64), saved["target"].astype(np.int64)


def wmt_lengths(pairs: int = 100_000) -> tuple[np.ndarray, np.ndarray]:
    """A WMT-length corpus: source lengths log-normal around 25 pieces (WMT14 en-de's median
    sentence is about 22 words), each target its source's times a log-normal ratio; at most 256
    pieces a side (configs/base.yaml's data.max_len), +1 for eos/bos."""
    rng = np.random.default_rng(0)
    src = np.clip(np.round(rng.lognormal(np.log(25), 0.6, pairs)), 1, 256).astype(np.int64)
    tgt = np.clip(np.round(src * rng.lognormal(0, 0.15, pairs)), 1, 256).astype(np.int64)
    return src + 1, tgt + 1


SHAPE_BOUND = 300  # "a few hundred" (issue 60); the structural bound is 2 × cells + 1


@pytest.mark.parametrize("corpus", ["multi30k", "wmt"])
@pytest.mark.parametrize("max_tokens", [4096, 16384, 25000])
def test_an_epoch_has_a_bounded_set_of_shapes(corpus: str, max_tokens: int) -> None:
    src, tgt = multi30k_lengths() if corpus == "multi30k" else wmt_lengths()
    buckets = ShapeBuckets()
    exact = TokenBucketSampler(src, tgt, max_tokens, seed=1)
    bounded = TokenBucketSampler(src, tgt, max_tokens, seed=1, shapes=buckets)
    padded_src, padded_tgt = bounded.padded_lengths(0)
    cells = len(set(zip(padded_src.tolist(), padded_tgt.tolist(), strict=True)))
    shapes = bounded.epoch_shapes(0)
    assert len(shapes) <= min(2 * cells + 1, SHAPE_BOUND)
    assert cells <= buckets.source * buckets.target
    # Every epoch draws the same lengths: its shapes are the first epoch's.
    assert set().union(*(bounded.epoch_shapes(e) for e in range(3))) == shapes
    before = padding_efficiency(exact.epoch_batches(0), src, tgt)
    after = padding_efficiency(bounded.epoch_batches(0), src, tgt, (padded_src, padded_tgt))
    assert after >= before - 0.02, (before, after)
    # Rows: a multiple of 8 for every batch but those that end a cell (or fill the budget alone).
    odd = [b for b in bounded.epoch_batches(0) if len(b) % buckets.rows_multiple]
    assert len(odd) <= cells


def test_the_gpu_recipes_buckets_meet_half_the_shapes_for_no_more_padding() -> None:
    """configs/multi30k-gpu.yaml's 8 × 4 buckets at its 8,192 tokens: on an H200 each shape met
    for the first time cost ~0.3 s of a 96-second budget (119 of them with the default buckets
    at 4,096 tokens); fewer, wider length cells here also pad less than the default's."""
    from transformer_mt.config import load_config

    data = load_config("multi30k-gpu").data
    src, tgt = multi30k_lengths()
    recipe = ShapeBuckets(data.source_buckets, data.target_buckets, data.rows_multiple)
    runs = {
        name: TokenBucketSampler(src, tgt, data.max_tokens, seed=1, shapes=buckets)
        for name, buckets in (("default", ShapeBuckets()), ("recipe", recipe))
    }
    shapes = {name: len(sampler.epoch_shapes(0)) for name, sampler in runs.items()}
    efficiency = {
        name: padding_efficiency(sampler.epoch_batches(0), src, tgt, sampler.padded_lengths(0))
        for name, sampler in runs.items()
    }
    assert (shapes["default"], shapes["recipe"]) == (70, 35)
    assert efficiency["recipe"] >= efficiency["default"] - 0.02 and efficiency["recipe"] > 0.89


def test_exact_lengths_give_a_wmt_corpus_a_shape_a_batch() -> None:
    """What bucketing is for: with exact lengths nearly every batch has a shape of its own."""
    src, tgt = wmt_lengths()
    sampler = TokenBucketSampler(src, tgt, 4096, seed=1)
    assert len(sampler.epoch_shapes(0)) > 0.8 * len(sampler.epoch_batches(0)) > SHAPE_BOUND


bucket_lengths = st.lists(
    st.tuples(st.integers(1, 60), st.integers(1, 60)), min_size=1, max_size=300
)


@settings(max_examples=60, deadline=None)
@given(
    lengths=bucket_lengths, max_tokens=st.integers(64, 600), world=st.integers(1, 3),
    seed=st.integers(0, 9), k=st.tuples(st.integers(1, 6), st.integers(1, 4)),
)  # fmt: skip
def test_bucketed_batches_keep_every_promise_of_the_sampler(
    lengths, max_tokens, world, seed, k
) -> None:
    """Each pair once an epoch across ranks, equal batch counts, every batch within the budget
    by the lengths it is padded to (each at least the pair's own), the same batches for the same
    (seed, epoch)."""
    src, tgt = np.array(lengths).T
    if len(src) < world:
        return
    buckets = ShapeBuckets(source=k[0], target=k[1], rows_multiple=4)

    def ranks(epoch: int) -> list[list[np.ndarray]]:
        return [
            TokenBucketSampler(src, tgt, max_tokens, seed, r, world, shapes=buckets)
            .epoch_batches(epoch)
            for r in range(world)
        ]  # fmt: skip

    per_rank = ranks(1)
    assert len({len(b) for b in per_rank}) == 1
    drawn = np.concatenate([b for batches in per_rank for b in batches])
    assert sorted(drawn.tolist()) == list(range(len(src)))
    sampler = TokenBucketSampler(src, tgt, max_tokens, seed, shapes=buckets)
    padded_src, padded_tgt = sampler.padded_lengths(1)
    assert (padded_src >= src).all() and (padded_tgt >= tgt).all()
    for batch in sampler.epoch_batches(1):
        rows, s, t = len(batch), padded_src[batch].max(), padded_tgt[batch].max()
        assert rows * max(s, t) <= max_tokens or rows <= 2  # _merge_singles' one exception
        assert sampler.batch_shape(1, batch) == (s, t)  # what collate pads it to
    exact = TokenBucketSampler(src, tgt, max_tokens, seed)  # no buckets: each batch its longest
    assert all(exact.batch_shape(1, b) == (0, 0) for b in exact.epoch_batches(1))
    again = ranks(1)
    assert all(
        [x.tolist() for x in a] == [y.tolist() for y in b]
        for a, b in zip(per_rank, again, strict=True)
    )


def test_a_batch_is_padded_to_its_bucket_and_a_longer_draw_to_a_multiple_of_8() -> None:
    batch = collate([[5, 6]], [[7]], pad_id=0, bos_id=1, eos_id=2, pad_to=(6, 4))
    assert batch.src.tolist() == [[5, 6, 2, 0, 0, 0]]
    assert batch.tgt_in.tolist() == [[1, 7, 0, 0]] and batch.tgt_out.tolist() == [[7, 2, 0, 0]]
    # A BPE-dropout draw longer than the bucket its unsampled length was packed in:
    longer = collate([list(range(3, 12))], [[7]], pad_id=0, bos_id=1, eos_id=2, pad_to=(6, 4))
    assert longer.src.shape == (1, 16)
    assert collate([[5]], [[7]], pad_id=0, bos_id=1, eos_id=2).src.shape == (1, 2)
