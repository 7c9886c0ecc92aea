"""Maxima over a vocabulary, block by block (a plain maximum vectorises over a row; torch's max
with indices and topk over a whole row do not): greedy's argmax (row_max), the argmax the
log-probabilities would give taken from the raw logits (logits_argmax), and exact top-k with ties
to the lower index (ranked), which beam search's block-wise ranking uses (search.py)."""

from __future__ import annotations

import math

import torch


def row_max(values: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """values.max(dim=-1) of a (N, V) tensor, the same maxima and indices (the first of equal
    ones), 4x faster on a CPU at V = 8,000 (torch's max with indices does not vectorise over a
    row; a plain maximum does): the maxima of blocks of `block` tokens, the first block holding
    the row's maximum, the first position in it. Greedy's argmax over the vocabulary is a tenth
    of a one-layer decoder's step (scripts/bench_decode.py --breakdown)."""
    best, index, _, _ = _row_max_blocks(values, block)
    return best, index


def _row_max_blocks(
    values: torch.Tensor, block: int = 64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """row_max's (maxima (N,), indices (N,)) and how it found them: the block maxima (N, blocks)
    and the values of the block holding the maximum (N, block), or for a vocabulary under two
    blocks the whole rows in both places."""
    rows, vocab = values.shape
    if vocab < 2 * block:
        best, index = values.max(dim=-1)
        return best, index, values, values
    full = vocab - vocab % block  # tokens in whole blocks; a shorter block ends the row
    values = values.contiguous()
    maxima = values.as_strided((rows, full // block, block), (vocab, block, 1)).amax(dim=-1)
    if full < vocab:
        maxima = torch.cat([maxima, values[:, full:].amax(dim=-1, keepdim=True)], dim=1)
    best, which = maxima.max(dim=-1)  # (N,): the first block holding the maximum
    start = which * block
    # Past a row's end the last token is repeated: after it, so never the first maximum.
    index = (start[:, None] + torch.arange(block, device=values.device)).clamp(max=vocab - 1)
    inside = values.gather(1, index)  # (N, block)
    return best, start + inside.max(dim=-1).indices, maxima, inside


def logits_argmax(logits: torch.Tensor) -> torch.Tensor:
    """(N,) the token row_max(log_softmax(logits)) picks, from the logits (N, V) alone.

    log_softmax subtracts one constant per row, rounded: it keeps the order of a row's values but
    may round two that differ by a few ulps to one value, which then ties (and the first wins).
    So a row whose runner-up lies within `near` of its maximum (rare: two logits equal to about
    six digits) is decided on its log-probabilities, computed for those rows alone; every other
    row's argmax is the logits'. `near`, 2^-20 of the magnitudes log_softmax's two subtractions
    round at (the maximum and log V), is 8 times their rounding error. A runner-up that near
    lies in the maximum's block or raises its own block's maximum that near: both are counted
    from row_max's blocks, with no second pass over the vocabulary."""
    best, index, maxima, inside = _row_max_blocks(logits)
    floor = (best - (best.abs() + math.log(logits.size(-1)) + 1.0) * 2.0**-20)[:, None]  # (N, 1)
    # In a short vocabulary (one "block") or a repeated last token, one value may count twice.
    close = ((maxima >= floor).sum(dim=-1) > 1) | ((inside >= floor).sum(dim=-1) > 1)  # (N,)
    if bool(close.any()):
        rows = close.nonzero().squeeze(1)
        index[rows] = row_max(torch.log_softmax(logits[rows], dim=-1))[1]
    return index


def ranked(values: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` largest float32 values of each row, largest first, ties to the lower
    index: topk over int64 keys (the value's bits in an order-preserving form, then the index)."""
    bits = (values + 0.0).view(torch.int32)  # + 0.0: -0.0 ties with 0.0, as floats compare
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()  # as signed ints, ordered like the floats
    size = values.size(-1)
    reverse = torch.arange(size - 1, -1, -1, device=values.device)  # lower index, larger key
    return (key * (1 << 32) + reverse).topk(count, dim=-1).indices
