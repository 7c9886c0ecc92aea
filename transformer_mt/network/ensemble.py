"""Ensembles: several models that share one vocabulary decode as one (fairseq-generate --path
a.pt:b.pt, Marian --models a b --weights, Sockeye --models).

At every step the ensemble's distribution is the weighted mean of the models' probabilities,
p(y) = Σ_m w_m p_m(y), computed in log space as logsumexp_m(log w_m + log p_m(y)): fairseq's
average of probabilities. (Marian instead sums weighted log-probabilities, a product of experts
that is not normalised.) Each model keeps its own decoder cache; search.py reorders them
together and knows nothing of ensembles. Their architectures may differ.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from transformer_mt.common.exits import TmtError
from transformer_mt.data.tokenizer import Tokenizer
from transformer_mt.network.search import SearchState

logger = logging.getLogger(__name__)


class EnsembleState:
    """One decoding state per model, reordered together (search.py's SearchState)."""

    def __init__(self, states: Sequence[SearchState]) -> None:
        self.states = list(states)

    def reorder(self, index: torch.Tensor, beam: int) -> None:
        for state in self.states:
            state.reorder(index, beam)


def mean_log_probs(log_probs: Sequence[torch.Tensor], log_weights: torch.Tensor) -> torch.Tensor:
    """log Σ_m w_m p_m(y): each (N, V) -> (N, V); log_weights (M,) on their device."""
    return torch.logsumexp(torch.stack(list(log_probs)) + log_weights[:, None, None], dim=0)


def normalized_weights(weights: Sequence[float] | None, count: int) -> tuple[float, ...]:
    """The models' weights, summing to 1; equal ones when none are given."""
    if weights is None:
        return tuple(1.0 / count for _ in range(count))
    given = ",".join(f"{w:g}" for w in weights)
    if len(weights) != count:
        raise TmtError(f"{given}: {len(weights)} weights for {count} models; give one per model",
                       param="weights")  # fmt: skip
    bad = [w for w in weights if not (math.isfinite(w) and w > 0)]
    if bad:
        raise TmtError(f"{given}: {bad[0]:g} is not a positive number", param="weights")
    if not math.isfinite(sum(weights)):  # each finite, their sum not (1e308 twice): scaled
        weights = [w / max(weights) for w in weights]
    total = sum(weights)
    return tuple(w / total for w in weights)


def parse_weights(text: str | None) -> list[float] | None:
    """--weights 0.6,0.4 -> [0.6, 0.4]."""
    if text is None:
        return None
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise TmtError(f"{text!r}: expected numbers separated by commas, e.g. 0.6,0.4",
                       param="weights") from None  # fmt: skip


def check_same_vocabulary(tokenizers: Sequence[Tokenizer], names: Sequence[str]) -> None:
    """Refuse, naming the first difference, models whose vocabularies differ: the ensemble adds
    their probabilities token id by token id. Sentencepiece models with the same pieces that
    differ elsewhere (trained from a copy of the corpus at another path, say: the file records
    it) are accepted with a warning, as fairseq compares dictionaries; the input is read with the
    first's."""
    first, first_name = tokenizers[0], names[0]
    for tokenizer, name in zip(tokenizers[1:], names[1:], strict=True):
        if tokenizer.sha256 == first.sha256:
            continue
        what = f"{name} does not share the vocabulary of {first_name}"
        if tokenizer.kind != first.kind:
            raise TmtError(f"{what}: a {tokenizer.kind} tokenizer, not a {first.kind} one")
        sides = ("source ", "target ") if first.kind == "marian" else ("",)  # tmt's: one list
        for side in sides:
            ours, theirs = (
                first.pieces(side.strip() or "target"),
                tokenizer.pieces(side.strip() or "target"),
            )
            if len(theirs) != len(ours):
                raise TmtError(f"{what}: {len(theirs)} {side}pieces, not {len(ours)}")
            for i, (mine, other) in enumerate(zip(ours, theirs, strict=True)):
                if mine != other:
                    raise TmtError(f"{what}: {side}piece {i} is {other!r}, not {mine!r}")
        logger.warning(
            "%s: the same pieces as %s in another sentencepiece file (its scores or training"
            " settings differ); the input is tokenized with %s's",
            name, first_name, first_name,
        )  # fmt: skip
