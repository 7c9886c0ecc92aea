"""A batch's candidate outputs under a lexical shortlist (shortlist.py, decode.shortlist): the
union of its sentences' sets, each sentence's own set as a mask, the output matrix's rows of the
union, and the step's logits over them; decoding.py runs the search over them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from transformer_mt.data.tokenizer import Tokenizer
from transformer_mt.network import kernels
from transformer_mt.network.model import DecoderCache, Transformer
from transformer_mt.network.search import Hypothesis
from transformer_mt.network.shortlist import Shortlist


class Candidates:
    """A batch's outputs under a lexical shortlist (shortlist.py): the search runs over the
    union of its sentences' candidate sets, `vocab` (U,) target ids in increasing order (so ties
    still go to the lower id), and each row is masked to its own sentence's set (`allowed`
    (B, U)): what a line may output never depends on the lines beside it. A sentence's set is
    the shortlist's candidates for its source, </s>, and the pieces of its prefix and glossary
    entries, and the pieces never output, which the search bans after normalising (as without
    a shortlist); the start token is in the union to be fed. `full`: the
    search runs over the whole vocabulary instead (constrained search's token ids), the
    outputs outside a row's set scored -inf."""

    def __init__(
        self,
        table: Shortlist,
        tok: Tokenizer,
        sources: list[list[int]],
        extra: list[list[int]],
        start: int,
        device: torch.device,
        full: bool,
    ) -> None:
        eos = [tok.eos_id]
        never = np.array(tok.never_output, dtype=np.int64)
        sets = []
        for source, more in zip(sources, extra, strict=True):
            # The never-output pieces count in the normaliser as in the exact decode, which bans
            # them after its log-softmax: a shortlist of every piece decodes exactly as none.
            found = np.union1d(table.candidates(source), never)
            sets.append(np.union1d(found, np.array(eos + more, dtype=np.int64)))
        union = np.unique(np.concatenate([*sets, [start]]))
        allowed = np.zeros((len(sets), len(union)), dtype=bool)
        for row, ids in enumerate(sets):
            allowed[row, np.searchsorted(union, ids)] = True
        self.ids, self.full = union, full
        self.vocab = torch.from_numpy(union).to(device)
        # Added to a sentence's rows' logits: 0 on its candidates, -inf elsewhere (B, U).
        self.allowed = torch.zeros(allowed.shape, device=device).masked_fill_(
            torch.from_numpy(~allowed).to(device), -math.inf)  # fmt: skip

    @classmethod
    def of_batch(
        cls,
        table: Shortlist,
        tok: Tokenizer,
        sources: list[list[int]],
        prefixes: list[list[int]],
        terms: Sequence[Sequence[Sequence[Sequence[int]]]] | None,
        start: int,
        device: torch.device,
    ) -> Candidates:
        """Each sentence's candidates: the shortlist's, its prefix's pieces, and with `terms`
        (constrained search: the whole vocabulary's ids) its glossary entries' pieces."""
        extra = [list(prefixes[row]) if prefixes else [] for row in range(len(sources))]
        for row, line in enumerate(terms or []):
            extra[row] += [piece for entry in line for option in entry for piece in option]
        return cls(table, tok, sources, extra, start, device, full=terms is not None)

    def index(self, ids: Sequence[int]) -> list[int]:
        """Search-space indices of these target ids (each in the union)."""
        return ids if self.full else np.searchsorted(self.ids, ids).tolist()

    def restore(self, hypotheses: list[list[Hypothesis]]) -> list[list[Hypothesis]]:
        """Hypotheses in search-space indices -> in target ids."""
        if self.full:
            return hypotheses
        return [[dataclasses.replace(h, tokens=self.ids[h.tokens].tolist()) for h in line]
                for line in hypotheses]  # fmt: skip

    def project(self, model: Transformer) -> Callable[[torch.Tensor], torch.Tensor]:
        """hidden (N, D) -> logits over the union (N, U): the output matrix's rows (and biases)
        of the union gathered once a batch, packed for oneDNN where the model's linear layers
        are (decode.cpu_linear)."""
        projection = model.output_projection
        bias = projection.bias[self.vocab] if projection.bias is not None else None
        weight = projection.weight[self.vocab]  # (U, D)
        if isinstance(projection, kernels.PackedLinear):
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return lambda x: F.linear(x, weight, bias)

    def search_ids(
        self, tok: Tokenizer, start: int, prefixes: list[list[int]]
    ) -> tuple[int, int, list[int], list[list[int]]]:
        """start, eos, banned ids and prefixes in the search's ids."""
        start_index, eos = self.index([start])[0], self.index([tok.eos_id])[0]
        banned = self.index(list(tok.never_output))  # in every set (__init__): banned
        return start_index, eos, banned, [self.index(p) for p in prefixes]

    def logits(
        self,
        model: Transformer,
        tokens: torch.Tensor,
        src_mask: torch.Tensor,
        cache: DecoderCache,
        allowed: torch.Tensor,
        project: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """A step's logits over the batch's candidates (N, U), each row's outside its sentence's
        set -inf (allowed (B, U), reordered with the search's sentences); in the whole vocabulary
        (N, V) for constrained search (full)."""
        fed = tokens if self.full else self.vocab[tokens]  # (N,) target ids
        hidden = model.decode(fed[:, None], None, src_mask, cache, project=False)[:, 0]  # (N, D)
        logits = project(hidden).float()  # (N, U)
        sentences, union = allowed.shape
        logits = (logits.view(sentences, -1, union) + allowed[:, None]).view(-1, union)
        if not self.full:
            return logits
        whole = logits.new_full((logits.size(0), model.vocab_size), -math.inf)  # (N, V)
        return whole.index_copy_(1, self.vocab, logits)
