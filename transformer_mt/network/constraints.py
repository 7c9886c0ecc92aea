"""Lexically constrained beam search: every output contains, for each of its sentence's entries,
one of the entry's alternatives as consecutive tokens (a glossary's target terms), over
search.py's step function. No model here, no glossary: entries come as token ids.

The method is dynamic beam allocation (Post & Vilar 2018) vectorised over the batch as Hu et al.
(2019) do it, with these choices:

- Where a hypothesis stands is an Aho-Corasick automaton per sentence over all its entries'
  alternatives (automaton.py, one node space for the batch): `node` per row, the longest end of
  the output that begins an alternative, and `met` (rows, entries), the entries whose alternative
  has appeared. Both are tensors reordered with the beam, as the decoder's cache is.
- Candidates per row: its k best tokens by the model, plus every token of its sentence's
  alternatives (Hu et al.'s constraint tokens; one that is among the k best counts once).
- Banks: a candidate's progress is the tokens of the entries it has met (each entry counted by
  its shortest alternative) plus the depth of its node when that node starts an unmet entry's
  alternative. The next beam takes the best candidate of each bank, the highest bank first, then
  the second best of each, and so on (fairseq's striping of DBA's banks), k in all; an EOS among
  the first k finishes its hypothesis, as in search.beam_search.
- EOS is blocked until every entry is met; after a token that completes an entry, a piece that
  would continue the word (no word-start mark, a letter or digit first: `continues`) is blocked
  for one step, so the term ends as a whole word.
- Room: a hypothesis never takes a token that leaves it fewer positions before its sentence's
  length limit than its unmet entries still need (automaton.Automata.needed), so every
  hypothesis that can meet them does, however weak the model (one that would wander to the limit
  mid-term is steered into the terms while there is room). The caller makes room: decoding.py
  lengthens the limit by the terms' lengths. At the limit EOS is forced as always: a hypothesis
  that never had the room (terms longer than the limit allows) is kept apart and returned only
  when no satisfied one was found.

With a beam as wide as every candidate, nothing is pruned and the result is the exact best
satisfying output (tests/test_constraints.py checks it against exhaustive search).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from transformer_mt.common import languages
from transformer_mt.data import glossary as glossaries
from transformer_mt.data.tokenizer import Tokenizer
from transformer_mt.network.automaton import Automata, Terms
from transformer_mt.network.maxima import ranked
from transformer_mt.network.search import (
    STOPPING_RULES,
    Hypothesis,
    SearchState,
    StepFn,
    _done,
    _Finished,
    _Forcing,
    _mask,
    length_penalty,
)


def constrained_beam_search(
    step_fn: StepFn,
    state: SearchState,
    max_lengths: Sequence[int],
    terms: Sequence[Terms],
    bos_id: int,
    eos_id: int,
    beam_size: int,
    continues: torch.Tensor | None = None,
    alpha: float = 0.6,
    form: str = "gnmt",
    nbest: int = 1,
    banned: Sequence[int] = (),
    early_stopping: str = "bound",
    device: torch.device | str = "cpu",
    prefixes: Sequence[Sequence[int]] = (),
    forced_eos: str = "log_prob",
) -> list[list[Hypothesis]]:
    """search.beam_search's contract, each output holding its sentence's `terms` (one
    alternative of every entry; the module docstring says how). `continues` (V,) bool: the
    pieces that would continue a word, blocked right after a term."""
    if early_stopping not in STOPPING_RULES:
        raise ValueError(f"early_stopping {early_stopping!r}: expected one of {STOPPING_RULES}")
    forcing = _Forcing(max_lengths, prefixes, eos_id, device)
    n, k, limits = len(max_lengths), beam_size, forcing.limits
    bound_lp = [float(length_penalty(length, alpha, form)) for length in limits.tolist()]
    bound_lp = torch.tensor(bound_lp, dtype=torch.float64, device=device)
    beams = _Beams.start(n, forcing.steps, bos_id, device)
    satisfied = _Finished(n, k, forcing.steps, device)
    unmet = _Finished(n, 1, forcing.steps, device)  # the best unmet: where no output can hold all
    auto = None
    banned_ids = torch.tensor(list(banned), dtype=torch.long, device=device)
    for t in range(1, forcing.steps + 1):
        log_probs, state = step_fn(beams.tokens, state)  # (N·width, V)
        if auto is None:  # the vocabulary is the model's output width
            auto = Automata(terms, log_probs.size(-1), device)
            beams.node, beams.met = auto.root.clone(), auto.real.new_zeros(auto.real.shape)
        forced = forcing.tokens(beams.live, t, beams.width)
        log_probs = _mask(log_probs, banned_ids, forced)
        if forced_eos == "zero":
            forcing.zero_eos(log_probs, beams.live, t, beams.width)
        moves = _Moves.of(auto, beams, log_probs, forced, eos_id, continues, k)
        moves.keep_room(auto, beams, limits, t, free=forced < 0)
        order = _striped(moves.scores.view(len(beams.live), -1), moves.bank, auto.banks)
        penalty = float(length_penalty(t, alpha, form))
        moves.finish(order, beams, auto, satisfied, unmet, penalty, t, k)
        source_row = beams.advance(moves, order, k, t)
        horizon_lp = {"bound": bound_lp[beams.live], "current": penalty}.get(early_stopping)
        done = _done(satisfied, beams.live, beams.scores, limits[beams.live], t=t, k=k,
                     horizon_lp=horizon_lp)  # fmt: skip
        keep = (~done).nonzero().squeeze(1)  # the one host sync of a step
        if len(keep) == 0:
            break
        kept_rows = beams.keep(keep, k)
        state.reorder(source_row[kept_rows], k)
    found, fallback = satisfied.best(nbest), unmet.best(1)
    return [hyps or spare for hyps, spare in zip(found, fallback, strict=True)]


class _Beams:
    """The live hypotheses of a constrained search: each row's last token, output so far,
    score, automaton node, met entries and whether a term just ended in it; rows `width` to a
    live sentence."""

    def __init__(self, live: torch.Tensor, tokens: torch.Tensor, history: torch.Tensor,
                 scores: torch.Tensor) -> None:  # fmt: skip
        self.live, self.tokens, self.history, self.scores = live, tokens, history, scores
        self.width = 1
        self.node = self.met = torch.zeros(0)  # set once the vocabulary is known
        self.guard = torch.zeros(len(live), dtype=torch.bool, device=live.device)

    @classmethod
    def start(cls, n: int, steps: int, bos_id: int, device: torch.device | str) -> _Beams:
        live = torch.arange(n, device=device)  # sentence of each live sentence
        tokens = torch.full((n,), bos_id, dtype=torch.long, device=device)
        history = torch.zeros(n, steps, dtype=torch.long, device=device)  # (N·width, T)
        return cls(live, tokens, history, torch.zeros(n, 1, device=device))

    @property
    def row_sentence(self) -> torch.Tensor:
        return self.live.repeat_interleave(self.width)  # (N·width,)

    def advance(self, moves: _Moves, order: torch.Tensor, k: int, t: int) -> torch.Tensor:
        """The first k valid non-EOS candidates of each sentence live on (fewer: -inf beams fill
        the rest); the row each came from (m·k,)."""
        m, cand_count, device = len(self.live), moves.candidates.size(1), self.live.device
        scores_sorted = moves.scores.view(m, -1).gather(1, order)
        valid = scores_sorted > -math.inf
        eos_sorted = moves.is_eos.view(m, -1).gather(1, order) & valid
        keep_rank = _first_true(valid & ~eos_sorted, k)  # (m, k) positions, -1 where none
        have = keep_rank >= 0
        pick = keep_rank.clamp(min=0)
        chosen = order.gather(1, pick)  # (m, k) candidate index within the sentence
        self.scores = scores_sorted.gather(1, pick).masked_fill(~have, -math.inf)
        source_row = torch.arange(m, device=device)[:, None] * self.width + chosen // cand_count
        flat = chosen.view(-1) % cand_count + source_row.view(-1) * cand_count
        source_row = source_row.view(-1)  # (m·k,)
        entries = self.met.size(1)
        self.tokens = moves.candidates.view(-1)[flat]
        new_met = moves.next_met.view(-1, entries)[flat]
        self.guard = (moves.reached.view(-1, entries)[flat] & ~self.met[source_row]).any(dim=1)
        self.node, self.met = moves.next_node.view(-1)[flat], new_met
        self.history = self.history[source_row]
        self.history[:, t - 1] = self.tokens
        self.width = k
        return source_row

    def keep(self, keep: torch.Tensor, k: int) -> torch.Tensor:
        """Only the sentences `keep` (indices into live) stay; their rows (len(keep)·k,)."""
        beams = torch.arange(k, device=keep.device)
        rows = (keep[:, None] * k + beams).view(-1)
        self.live, self.scores = self.live[keep], self.scores[keep]
        self.tokens, self.history = self.tokens[rows], self.history[rows]
        self.node, self.met, self.guard = self.node[rows], self.met[rows], self.guard[rows]
        return rows


@dataclass
class _Moves:
    """One step's candidates of every live row (N·w, K): each row's k best tokens and its
    sentence's term tokens (once), their scores, the automaton state each leads to and its
    bank."""

    candidates: torch.Tensor  # (N·w, K) token ids
    scores: torch.Tensor  # (N·w, K) the hypothesis's score with the token
    next_node: torch.Tensor  # (N·w, K)
    next_met: torch.Tensor  # (N·w, K, E)
    reached: torch.Tensor  # (N·w, K, E) the entries the token completes
    is_eos: torch.Tensor  # (N·w, K)
    bank: torch.Tensor  # (m, w·K) progress in tokens

    @classmethod
    def of(
        cls, auto: Automata, beams: _Beams, log_probs: torch.Tensor, forced: torch.Tensor,
        eos_id: int, continues: torch.Tensor | None, k: int,
    ) -> _Moves:  # fmt: skip
        row_sentence, met = beams.row_sentence, beams.met
        free = forced < 0
        all_met = (met | ~auto.real[row_sentence]).all(dim=1)
        log_probs[free & ~all_met, eos_id] = -math.inf  # no end before every term
        guard = beams.guard & free
        if continues is not None and bool(guard.any()):
            log_probs[guard] = log_probs[guard].masked_fill(continues, -math.inf)
        vocab = log_probs.size(-1)
        best = ranked(log_probs, min(k, vocab))  # (N·w, k)
        extra = auto.alphabet[row_sentence]  # (N·w, G), -1 padding
        if best.size(1) + extra.size(1) < k:  # a tiny vocabulary: k candidates a row at least
            pad = extra.new_full((extra.size(0), k - best.size(1) - extra.size(1)), -1)
            extra = torch.cat([extra, pad], dim=1)
        extra_scores = log_probs.gather(1, extra.clamp(min=0))
        repeated = (extra[:, :, None] == best[:, None, :]).any(dim=2) | (extra < 0)
        candidates = torch.cat([best, extra.clamp(min=0)], dim=1)  # (N·w, K)
        scores = torch.cat([log_probs.gather(1, best),
                            extra_scores.masked_fill(repeated, -math.inf)], dim=1)  # fmt: skip
        scores = scores + beams.scores.reshape(-1, 1)  # (N·w, K)
        next_node = auto.step(beams.node, candidates)  # (N·w, K)
        reached = auto.completes[next_node] & auto.real[row_sentence][:, None]  # (N·w, K, E)
        next_met = met[:, None, :] | reached
        is_eos = candidates == eos_id
        next_node = torch.where(is_eos, beams.node[:, None], next_node)
        next_met = torch.where(is_eos[:, :, None], met[:, None, :], next_met)
        bank = auto.progress(row_sentence[:, None], next_node, next_met)  # (N·w, K)
        m = len(beams.live)
        return cls(candidates=candidates, scores=scores, next_node=next_node, next_met=next_met,
                   reached=reached, is_eos=is_eos, bank=bank.view(m, -1))  # fmt: skip

    def keep_room(
        self, auto: Automata, beams: _Beams, limits: torch.Tensor, t: int, free: torch.Tensor
    ) -> None:
        """A row that can still meet every entry before its sentence's length limit keeps that
        room: its candidates that would leave fewer free positions than the tokens its terms
        still need are dropped (a weak model would otherwise run to the limit mid-term). A row
        that never had the room (its terms longer than the limit) is left to do its best."""
        row_sentence = beams.row_sentence
        room = limits[row_sentence] - t  # positions left before the forced EOS, this one incl.
        before = auto.needed(row_sentence, beams.node, beams.met)  # (N·w,)
        after = auto.needed(row_sentence[:, None], self.next_node, self.next_met)  # (N·w, K)
        tight = free & (before <= room)
        drop = tight[:, None] & (after > (room - 1)[:, None]) & ~self.is_eos
        self.scores = self.scores.masked_fill(drop, -math.inf)

    def finish(
        self, order: torch.Tensor, beams: _Beams, auto: Automata, satisfied: _Finished,
        unmet: _Finished, penalty: float, t: int, k: int,
    ) -> None:  # fmt: skip
        """EOS candidates among the first k of each sentence finish (apart, if an entry is
        unmet: only at a maximum length, where EOS is forced)."""
        m, entries = len(beams.live), beams.met.size(1)
        scores_sorted = self.scores.view(m, -1).gather(1, order)
        ends = (self.is_eos.view(m, -1).gather(1, order) & (scores_sorted > -math.inf))[:, :k]
        ended_met = (self.next_met.view(m, -1, entries).gather(
            1, order[:, :k, None].expand(-1, -1, entries)) | ~auto.real[beams.live][:, None, :]
        ).all(dim=2)  # fmt: skip
        cand_count = self.candidates.size(1)
        row_of = torch.arange(m, device=order.device)[:, None] * beams.width + order // cand_count
        raw = scores_sorted[:, :k].double()
        satisfied.add(beams.live, ends & ended_met, raw, penalty, beams.history[row_of[:, :k]],
                      length=t - 1)  # fmt: skip
        if bool((ends & ~ended_met).any()):
            first = _first_true(ends & ~ended_met, 1)  # (m, 1)
            at = first.clamp(min=0)
            unmet.add(beams.live, first >= 0, raw.gather(1, at), penalty,
                      beams.history[row_of[:, :k].gather(1, at)], length=t - 1)  # fmt: skip


def _striped(scores: torch.Tensor, bank: torch.Tensor, banks: int) -> torch.Tensor:
    """(m, C) candidate order: the best of each bank (highest bank first), then the second best of
    each, ...; within a bank by score, ties to the lower index; -inf candidates last."""
    by_score = ranked(scores, scores.size(1))  # best first, ties to the lower index
    grouped = bank.gather(1, by_score).sort(dim=1, descending=True, stable=True).indices
    order = by_score.gather(1, grouped)  # by bank, by score within
    sorted_bank = bank.gather(1, order)
    position = torch.arange(order.size(1), device=order.device).expand_as(order)
    new_group = torch.ones_like(sorted_bank, dtype=torch.bool)
    new_group[:, 1:] = sorted_bank[:, 1:] != sorted_bank[:, :-1]
    start = torch.where(new_group, position, 0).cummax(dim=1).values
    rank = position - start  # within its bank
    key = rank * banks + (banks - 1 - sorted_bank)
    key = key.masked_fill(scores.gather(1, order) == -math.inf, torch.iinfo(torch.long).max)
    return order.gather(1, key.sort(dim=1, stable=True).indices)


def _first_true(mask: torch.Tensor, count: int) -> torch.Tensor:
    """(m, count) the positions of each row's first `count` True values, -1 past the last."""
    position = torch.arange(mask.size(1), device=mask.device).expand_as(mask)
    ranked = torch.where(mask, position, mask.size(1)).sort(dim=1).values[:, :count]
    if ranked.size(1) < count:
        pad = ranked.new_full((ranked.size(0), count - ranked.size(1)), mask.size(1))
        ranked = torch.cat([ranked, pad], dim=1)
    return torch.where(ranked < mask.size(1), ranked, -1)


# --- a glossary's matches as constraints ------------------------------------------------------


_PIECES: dict[tuple[str, str], list[int]] = {}


def compile_terms(tok: Tokenizer, matches: Sequence[glossaries.Match]) -> Terms:
    """Each entry's alternatives as the target tokenizer writes them at a word start, as they
    stand and with a capital first letter (a sentence's first word), and for a target in a
    script written without spaces (Chinese, Japanese) also as a sentence goes on into it, with no
    word-start mark (else the output would hold a space before the term: "我们在 公园里"); an
    alternative with a piece the model cannot write (unknown) is left out, and an entry left
    with none becomes []."""
    terms = []
    for match in matches:
        alternatives: list[list[int]] = []
        for target in match.entry.targets:
            for text in dict.fromkeys((target, glossaries.capitalised(target))):
                key = (tok.sha256, text)
                if key not in _PIECES:
                    if len(_PIECES) > 200_000:
                        _PIECES.clear()
                    _PIECES[key] = tok.encode([text], side="target")[0]
                pieces = _PIECES[key]
                written = [pieces]
                if pieces and languages.unspaced(text[:1]):
                    written.append(_run_on(tok, pieces))
                for way in written:
                    if way and tok.unk_id not in way and way not in alternatives:
                        alternatives.append(way)
        terms.append(alternatives)
    return terms


def _run_on(tok: Tokenizer, pieces: list[int]) -> list[int]:
    """`pieces` (a term as written at a word start) without the word-start mark of the first:
    [] where the vocabulary has no such piece."""
    first = tok.id_to_piece(pieces[0], "target")
    if not first.startswith("\u2581"):
        return pieces
    if first == "\u2581":
        return pieces[1:]
    rest = tok.piece_to_id(first[1:], "target")
    return [rest, *pieces[1:]] if rest != tok.unk_id else []


_CONTINUES: dict[str, torch.Tensor] = {}


_HYPHENS = "-\u2010\u2011"  # join two words into one (glossary.words)


def word_continuations(tok: Tokenizer) -> torch.Tensor:
    """(V,) the target pieces that continue a word: no word-start mark, and a letter, digit,
    hyphen or byte first (what may not follow a glossary term: it would make it part of a longer
    word, as glossary.words reads "coffee-like" as one word), but no character of a script
    without spaces (languages.UNSPACED: each is a word)."""
    if tok.sha256 not in _CONTINUES:
        flags = []
        for piece in tok.pieces("target"):
            byte = piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6
            first = piece[:1]  # a character of Chinese or Thai is a word of its own
            joined = (first.isalnum() and not languages.unspaced(first)) or first in _HYPHENS
            flags.append(byte or (not piece.startswith("\u2581") and joined))
        _CONTINUES[tok.sha256] = torch.tensor(flags, dtype=torch.bool)
    return _CONTINUES[tok.sha256]


def used_alternatives(
    tok: Tokenizer, matches: Sequence[glossaries.Match], hyp: Hypothesis
) -> list[int]:
    """The alternative of each matched entry that the hypothesis's text uses, -1 for none."""
    text = tok.decode([hyp.tokens])[0]
    return [-1 if (alt := glossaries.used(m.entry, text)) is None else alt for m in matches]
