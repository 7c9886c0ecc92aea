"""Which pairs share a batch: token-bucket batches under a token budget, shuffled per (seed, epoch),
sharded by rank, and, with data.bucketing, drawn from a bounded set of batch shapes.

Why bounded shapes: a GPU pays for every batch shape the first time it meets it (cuDNN builds an
attention plan per shape, ~0.4 s on an H200; CUDA graphs and compiled kernels are made per shape
too). With exact lengths nearly every batch has a shape of its own: 118 in the 129 batches of a
Multi30k epoch, thousands an epoch on a WMT-size corpus. With bucketing, each pair's source length
is padded up to one of `source` bucket lengths chosen from the epoch's own length distribution
(those that waste the fewest padding tokens, found by dynamic programming), and its target length
up to one of `target` bucket lengths chosen the same way among the pairs of its source bucket
(targets follow their sources, so a source bucket's targets span a narrow range). Pairs are then
packed cell by cell (a cell: one source bucket and one target bucket), each batch's rows a
multiple of rows_multiple (fairseq's required_batch_size_multiple: the rest is carried into the
next batch). A cell's batches are all full but the one that crosses into the next cell, so an
epoch has at most two shapes a cell, 2 × source × target + 1 at most whatever the corpus or
data.max_tokens, and in practice far fewer (docs/benchmarks.md: 149-272 on a 100k-pair
WMT-length corpus, against 165-765 with exact lengths).

On a CPU the shapes cost nothing and every padding token costs arithmetic, so exact lengths stay
(data.bucketing=auto: on with CUDA only). Pure numpy: no torch, no state besides the arguments, so
(epoch, index) resumes exactly and every rank draws the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from transformer_mt.common.exits import TmtError


@dataclass(frozen=True)
class ShapeBuckets:
    """data.bucketing on: the bucket lengths each side is padded to, and the rows' multiple."""

    source: int = 32  # data.source_buckets: source lengths an epoch pads to
    target: int = 8  # data.target_buckets: target lengths per source bucket
    rows_multiple: int = 8  # data.rows_multiple: a batch's rows, but the last of an epoch's

    def pad_lengths(
        self, src: np.ndarray, tgt: np.ndarray, drawn: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each pair's (source, target) length padded up to its bucket's length (N,) each, the
        buckets chosen from the lengths of the `drawn` pairs (an epoch's, repeats counted). A pair
        that is not drawn keeps its lengths where they exceed every bucket."""
        src_bounds = length_boundaries(src[drawn], self.source)
        padded_src = _pad_to(src, src_bounds)
        padded_tgt = tgt.copy()
        cell = np.searchsorted(src_bounds, np.minimum(src, src_bounds[-1]))  # (N,) source bucket
        drawn_cell = cell[drawn]
        for bucket in np.unique(drawn_cell).tolist():
            tgt_bounds = length_boundaries(tgt[drawn[drawn_cell == bucket]], self.target)
            members = cell == bucket
            padded_tgt[members] = _pad_to(tgt[members], tgt_bounds)
        return padded_src, padded_tgt


def length_boundaries(lengths: np.ndarray, k: int) -> np.ndarray:
    """At most `k` bucket lengths, sorted, the last the longest length: those that minimise the
    padding Σ (bucket(L) - L) over `lengths` when each length is padded up to the first bucket
    at or above it. Each bucket is a length that occurs (padding beyond it would be waste).

    Dynamic programming over the distinct lengths v_0 < ... < v_{m-1}: best_c[j], the least
    padding of the lengths up to v_j with at most c + 1 buckets, the last at v_j, is the smaller
    of best_{c-1}[j] and min over i < j of best_{c-1}[i] + cost(i, j), where cost(i, j) pads
    v_{i+1}..v_j to v_j (prefix sums make it O(1)); O(k m²) with m distinct lengths (at most
    data.max_len + 1)."""
    values, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
    m = len(values)
    if m <= k:
        return values
    pairs = np.concatenate([[0], np.cumsum(counts)])  # pairs[j + 1]: pairs of length <= v_j
    tokens = np.concatenate([[0], np.cumsum(counts * values)])
    best = values * pairs[1:] - tokens[1:]  # one bucket at v_j holds every length up to it
    choices = []  # per bucket added: where the previous bucket ends (-1: the bucket did not pay)
    j, i = np.tril_indices(m, -1)  # i < j: the previous bucket ends at v_i, this one at v_j
    rows = np.arange(m)
    for _ in range(1, k):
        cost = np.full((m, m), np.inf)  # [j, i]
        cost[j, i] = (
            best[i] + values[j] * (pairs[j + 1] - pairs[i + 1]) - (tokens[j + 1] - tokens[i + 1])
        )
        previous = np.argmin(cost, axis=1)  # the first of equal costs: deterministic
        split = cost[rows, previous]
        better = split < best
        choices.append(np.where(better, previous, -1))
        best = np.where(better, split, best)
    bounds, end = [values[m - 1]], m - 1  # the last bucket is the longest length
    for choice in reversed(choices):
        if choice[end] >= 0:
            end = int(choice[end])
            bounds.append(values[end])
    return np.asarray(bounds[::-1], dtype=np.int64)


def _pad_to(lengths: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Each length padded up to the first bucket at or above it (a longer one stays as it is)."""
    index = np.searchsorted(bounds, lengths)
    inside = index < len(bounds)
    padded = lengths.copy()
    padded[inside] = bounds[index[inside]]
    return padded


class TokenBucketSampler:
    """Length-bucketed batches under a token budget, shuffled per (seed, epoch), sharded by rank.

    A batch's cost is its sentence count × its longest padded length on either side, at most
    max_tokens. Pairs are sorted by (source, target) length after a seeded shuffle that breaks ties,
    packed greedily, and the batch order is shuffled. Batches are split until their count divides
    world_size, so every rank gets the same number of non-empty batches and each pair drawn
    appears exactly once per epoch (see _split_until_divisible for the one case that exceeds
    max_tokens). A single corpus draws each pair once per epoch. Several corpora (`groups`,
    `weights`) draw as many pairs as they hold together, corpus i's share weights[i] /
    sum(weights) of them (see epoch_draw), so a pair may come twice, or not at all. With `shapes`
    (data.bucketing), lengths are padded to the epoch's buckets first (the module docstring).
    """

    def __init__(
        self,
        src_lengths: np.ndarray,
        tgt_lengths: np.ndarray,
        max_tokens: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        groups: np.ndarray | None = None,
        weights: Sequence[float] = (),
        src_extra: Callable[[int], np.ndarray] | None = None,
        shapes: ShapeBuckets | None = None,
    ) -> None:
        self.src_extra = src_extra  # epoch -> (N,) tokens each source gains (data.terms' hints)
        self.shapes = shapes
        self.src_lengths = np.asarray(src_lengths, dtype=np.int64)
        self.tgt_lengths = np.asarray(tgt_lengths, dtype=np.int64)
        self.longest = np.maximum(self.src_lengths, self.tgt_lengths)
        if len(self.longest) and self.longest.max() > max_tokens:
            raise ValueError(
                f"a pair of {self.longest.max()} tokens exceeds max_tokens={max_tokens}"
            )
        if len(self.longest) < world_size:
            raise TmtError(f"{len(self.longest)} pairs cannot be shared by {world_size} ranks")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.max_tokens, self.seed, self.shuffle = max_tokens, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.members = None  # with several corpora: the pair indices of each
        if groups is not None and len(weights) > 1:
            self.members = [np.flatnonzero(groups == i) for i in range(len(weights))]
            self.weights = np.asarray(weights, dtype=np.float64)
            if not math.isfinite(sum(weights)):  # each finite, their sum not: scaled
                self.weights = self.weights / self.weights.max()
        self._epoch: tuple[int, list[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None

    def epoch_draw(self, epoch: int) -> np.ndarray:
        """The pairs of `epoch` (indices, with repeats): all pairs once for a single corpus; for
        a mixture, corpus i's quota q_i (its share of all pairs, rounded by largest remainder so
        the quotas sum to the pairs held) as q_i // n_i passes over its n_i pairs plus a seeded
        random q_i % n_i of them: exact shares, the same on every rank, per (seed, epoch)."""
        total = len(self.longest)
        if self.members is None:
            return np.arange(total)
        exact = total * self.weights / self.weights.sum()
        quotas = np.floor(exact).astype(np.int64)
        by_remainder = np.argsort(-(exact - quotas), kind="stable")
        quotas[by_remainder[: total - int(quotas.sum())]] += 1
        rng = np.random.default_rng((self.seed, epoch, 1))  # apart from the shuffle's stream
        drawn = []
        for members, quota in zip(self.members, quotas.tolist(), strict=True):
            passes, rest = divmod(quota, len(members))
            drawn += [members] * passes + [members[rng.permutation(len(members))[:rest]]]
        return np.concatenate(drawn)

    def epoch_lengths(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, target) lengths of each pair in `epoch`: a hinted source's with its hints."""
        if self.src_extra is None:
            return self.src_lengths, self.tgt_lengths
        return self.src_lengths + self.src_extra(epoch), self.tgt_lengths

    def padded_lengths(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, target) length each pair's batch pads it to at least in `epoch` (N,) each:
        its bucket's with data.bucketing, else its own (a batch pads to its longest)."""
        return self._plan(epoch)[2]

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches for `epoch`, in order: arrays of example indices."""
        return self._plan(epoch)[1][self.rank :: self.world_size]

    def epoch_shapes(self, epoch: int) -> set[tuple[int, int, int]]:
        """The distinct (rows, source length, target length) of `epoch`'s batches, all ranks'."""
        batches, (src, tgt) = self._plan(epoch)[1:]
        return {(len(b), int(src[b].max()), int(tgt[b].max())) for b in batches}

    def batch_shape(self, epoch: int, batch: np.ndarray) -> tuple[int, int]:
        """The (source, target) lengths `batch` of `epoch` is padded to at least, eos and bos
        included (collate's pad_to): its bucket's with data.bucketing; (0, 0) without, so that
        the batch pads to its longest sequence, whatever a BPE-dropout draw made it."""
        if self.shapes is None:
            return 0, 0
        src, tgt = self.padded_lengths(epoch)
        return int(src[batch].max()), int(tgt[batch].max())

    def _plan(self, epoch: int) -> tuple[int, list[np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """`epoch`'s batches of every rank, in order, and its padded lengths (kept for the
        epoch: the training loop asks for both at every update)."""
        if self._epoch is not None and self._epoch[0] == epoch:
            return self._epoch
        rng = np.random.default_rng((self.seed, epoch))
        drawn = self.epoch_draw(epoch)
        src, tgt = self.epoch_lengths(epoch)
        padded = (src, tgt)
        if self.shapes is not None:
            padded = self.shapes.pad_lengths(src, tgt, drawn)
        longest = np.maximum(*padded)
        # A single corpus: drawn is arange, so this is rng.permutation(N) as it always was.
        order = drawn[rng.permutation(len(drawn))] if self.shuffle else drawn
        if self.shapes is None:
            order = order[np.lexsort((tgt[order], src[order]))]  # stable
            packed = _pack(order, longest, self.max_tokens)
        else:  # cell by cell (padded lengths first), each cell sorted as above
            keys = (tgt[order], src[order], padded[1][order], padded[0][order])
            order = order[np.lexsort(keys)]
            packed = _pack_in_multiples(order, *padded, self.max_tokens, self.shapes.rows_multiple)
        batches = _split_until_divisible(packed, self.world_size, longest)
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        self._epoch = (epoch, batches, padded)
        return self._epoch


def _pack(order: np.ndarray, longest: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Greedy packing of sorted indices: extend a batch while count × max length fits."""
    batches, start, batch_max = [], 0, 0
    for i, length in enumerate(longest[order].tolist()):
        batch_max = max(batch_max, length)
        if (i - start + 1) * batch_max > max_tokens:
            batches.append(order[start:i])
            start, batch_max = i, length
    if start < len(order):
        batches.append(order[start:])
    return batches


def _pack_in_multiples(
    order: np.ndarray, src: np.ndarray, tgt: np.ndarray, max_tokens: int, multiple: int
) -> list[np.ndarray]:
    """Greedy packing of sorted indices by their padded (source, target) lengths, a batch's rows
    a multiple of `multiple` where it holds that many: when the next pair does not fit, the
    batch's rows past the last multiple are carried into the next batch (fairseq's
    batch_by_size), which then pads them as its longest pair asks."""
    batches, start, i = [], 0, 0
    src_of, tgt_of = src[order].tolist(), tgt[order].tolist()
    src_max = tgt_max = 0  # of order[start:i]
    while i < len(order):
        s, t = max(src_max, src_of[i]), max(tgt_max, tgt_of[i])
        if i > start and (i - start + 1) * max(s, t) > max_tokens:
            rows = i - start
            keep = rows - rows % multiple if rows >= multiple else rows
            batches.append(order[start : start + keep])
            start += keep
            src_max, tgt_max = max(src_of[start:i], default=0), max(tgt_of[start:i], default=0)
            continue  # pair i again, after what was carried
        src_max, tgt_max, i = s, t, i + 1
    if start < len(order):
        batches.append(order[start:])
    return batches


def _split_until_divisible(
    batches: list[np.ndarray], world_size: int, longest: np.ndarray
) -> list[np.ndarray]:
    """Halve the largest batches until the count is a multiple of world_size (no pair dropped).

    When every batch already holds a single pair (data.max_tokens near data.max_len) none can be
    halved: the shortest pairs are then merged in twos instead, the one case in which a batch may
    exceed max_tokens (by at most a factor 2), since an empty batch would give a rank nothing."""
    while len(batches) % world_size:
        largest = max(range(len(batches)), key=lambda i: len(batches[i]))
        if len(batches[largest]) == 1:
            return _merge_singles(batches, world_size, longest)
        batch = batches.pop(largest)
        half = len(batch) // 2
        batches[largest:largest] = [batch[:half], batch[half:]]
    return batches


def _merge_singles(
    batches: list[np.ndarray], world_size: int, longest: np.ndarray
) -> list[np.ndarray]:
    """Single-pair batches, their count cut to a multiple of world_size by merging the shortest
    pairs two by two (len(batches) >= world_size, so there are enough of them)."""
    extra = len(batches) % world_size
    by_length = sorted(range(len(batches)), key=lambda i: int(longest[batches[i][0]]))
    merged = by_length[: 2 * extra]
    is_merged = set(merged)
    kept = [b for i, b in enumerate(batches) if i not in is_merged]
    firsts, seconds = merged[::2], merged[1::2]
    pairs = [np.concatenate([batches[a], batches[b]]) for a, b in zip(firsts, seconds, strict=True)]
    return pairs + kept


def padding_efficiency(
    batches: Sequence[np.ndarray],
    src_lengths: np.ndarray,
    tgt_lengths: np.ndarray,
    padded: tuple[np.ndarray, np.ndarray] | None = None,
) -> float:
    """Non-pad tokens / all tokens of source and target tensors over the given batches; a batch
    pads each side to its longest `padded` length (TokenBucketSampler.padded_lengths), by
    default to its longest real one."""
    src_padded, tgt_padded = padded if padded is not None else (src_lengths, tgt_lengths)
    real = pad = 0
    for batch in batches:
        real += int(src_lengths[batch].sum() + tgt_lengths[batch].sum())
        pad += len(batch) * int(src_padded[batch].max() + tgt_padded[batch].max())
    return real / pad if pad else 0.0
