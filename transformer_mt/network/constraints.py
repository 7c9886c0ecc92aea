"""Lexically constrained beam search: every output contains, for each of its sentence's entries,
one of the entry's alternatives as consecutive tokens (a glossary's target terms), over
search.py's step function. No model here, no glossary: entries come as token ids.

The method is dynamic beam allocation (Post & Vilar 2018) vectorised over the batch as Hu et al.
(2019) do it, with these choices:

- Where a hypothesis stands is an Aho-Corasick automaton per sentence over all its entries'
  alternatives (one node space for the batch): `node` per row, the longest end of the output that
  begins an alternative, and `met` (rows, entries), the entries whose alternative has appeared.
  Both are tensors reordered with the beam, as the decoder's cache is. A transition is one
  look-up in a sorted table of (node, token) keys; a token no alternative holds returns to the
  root.
- Candidates per row: its k best tokens by the model, plus every token of its sentence's
  alternatives (Hu et al.'s constraint tokens; one that is among the k best counts once).
- Banks: a candidate's progress is the tokens of the entries it has met (each entry counted by
  its shortest alternative) plus the depth of its node when that node starts an unmet entry's
  alternative. The next beam takes the best candidate of each bank, the highest bank first, then
  the second best of each, and so on (fairseq's striping of DBA's banks), k in all; an EOS among
  the first k finishes its hypothesis, as in search.beam_search.
- EOS is blocked until every entry is met; after a token that completes an entry, a piece that
  would continue the word (no word-start mark, a letter or digit first: `continues`) is blocked
  for one step, so the term ends as a whole word. At a sentence's maximum length EOS is forced
  as always: a hypothesis that got there unmet is kept apart and returned only when no satisfied
  one was found (the caller makes room: decoding.py lengthens the limit by the terms' lengths).

With a beam as wide as every candidate, nothing is pruned and the result is the exact best
satisfying output (tests/test_constraints.py checks it against exhaustive search).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from transformer_mt.data import glossary as glossaries
from transformer_mt.data.tokenizer import Tokenizer
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

# Per sentence: its entries; per entry: its alternatives; per alternative: token ids.
Terms = Sequence[Sequence[Sequence[int]]]


class Automata:
    """The Aho-Corasick automata of a batch's sentences, one node space, as tensors."""

    def __init__(self, sentences: Sequence[Terms], vocab: int, device: torch.device | str) -> None:
        self.vocab = vocab
        entries = max([len(terms) for terms in sentences] + [1])
        roots, root_of, depth, completes, starts = [], [], [], [], []
        keys, values, alphabets = [], [], []
        lengths = torch.zeros(len(sentences), entries, dtype=torch.long)
        for s, terms in enumerate(sentences):
            offset = len(depth)
            roots.append(offset)
            nodes = _automaton(terms)
            for node in nodes:
                root_of.append(offset)
                depth.append(node.depth)
                completes.append(node.completes)
                starts.append(node.starts)
                for token, target in sorted(node.delta.items()):
                    keys.append((offset + node.index) * vocab + token)
                    values.append(offset + target)
            for e, alternatives in enumerate(terms):
                lengths[s, e] = min(len(a) for a in alternatives)
            alphabets.append(sorted({t for alternatives in terms for a in alternatives for t in a}))
        self.root = torch.tensor(roots, dtype=torch.long, device=device)  # (n,)
        self.root_of = torch.tensor(root_of, dtype=torch.long, device=device)  # (nodes,)
        self.depth = torch.tensor(depth, dtype=torch.long, device=device)
        self.completes = _bits(completes, entries, device)  # (nodes, E)
        self.starts = _bits(starts, entries, device)  # (nodes, E): starts an alternative of e
        order = sorted(range(len(keys)), key=keys.__getitem__)
        self.keys = torch.tensor([keys[i] for i in order], dtype=torch.long, device=device)
        self.values = torch.tensor([values[i] for i in order], dtype=torch.long, device=device)
        self.real = torch.tensor(  # (n, E): the entries each sentence has
            [[e < len(terms) for e in range(entries)] for terms in sentences], device=device
        )
        self.lengths = lengths.to(device)  # (n, E): an entry's shortest alternative
        width = max([len(a) for a in alphabets] + [1])
        self.alphabet = torch.full((len(sentences), width), -1, dtype=torch.long)  # (n, G)
        for s, tokens in enumerate(alphabets):
            self.alphabet[s, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        self.alphabet = self.alphabet.to(device)
        # Above every bank: all entries' tokens and the deepest node.
        self.banks = int(lengths.sum(dim=1).max()) + max(depth) + 1

    def step(self, node: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The node after each of `tokens` (r, K) from `node` (r,)."""
        if len(self.keys) == 0:
            return self.root_of[node][:, None].expand_as(tokens)
        key = node[:, None] * self.vocab + tokens.clamp(min=0)
        at = torch.searchsorted(self.keys, key).clamp(max=len(self.keys) - 1)
        return torch.where(self.keys[at] == key, self.values[at], self.root_of[node][:, None])

    def progress(
        self, sentence: torch.Tensor, node: torch.Tensor, met: torch.Tensor
    ) -> torch.Tensor:
        """Tokens of progress (bank) of each candidate: sentence, node (...), met (..., E)."""
        real, lengths = self.real[sentence], self.lengths[sentence]
        done = (met & real).long().mul(lengths).sum(dim=-1)
        partial = (self.starts[node] & ~met & real).any(dim=-1)
        return done + torch.where(partial, self.depth[node], 0)


class _Node:
    def __init__(self, index: int, depth: int) -> None:
        self.index, self.depth = index, depth
        self.children: dict[int, int] = {}
        self.delta: dict[int, int] = {}  # token -> node, where not the root
        self.completes: set[int] = set()  # entries an alternative of which ends here
        self.starts: set[int] = set()  # entries an alternative of which begins with this node
        self.fail = 0


def _automaton(terms: Terms) -> list[_Node]:
    """One sentence's Aho-Corasick automaton over its entries' alternatives (node 0: the root):
    goto, failure links, the full transition function over the alternatives' tokens, and at each
    node the entries it completes (its own and its failure chain's)."""
    nodes = [_Node(0, 0)]
    for entry, alternatives in enumerate(terms):
        for alternative in alternatives:
            at = nodes[0]
            for token in alternative:
                if token not in at.children:
                    nodes.append(_Node(len(nodes), at.depth + 1))
                    at.children[token] = nodes[-1].index
                at = nodes[at.children[token]]
                at.starts.add(entry)
            at.completes.add(entry)
    alphabet = sorted({t for alternatives in terms for a in alternatives for t in a})
    queue = [0]
    for u in queue:  # breadth first: a node's failure is shallower, so done before it
        node = nodes[u]
        if u:
            node.completes |= nodes[node.fail].completes
        for token in alphabet:
            if token in node.children:
                target = node.children[token]
                nodes[target].fail = nodes[node.fail].delta.get(token, 0) if u else 0
                queue.append(target)
            else:
                target = nodes[node.fail].delta.get(token, 0) if u else 0
            if target:
                node.delta[token] = target
    return nodes


def _bits(sets: list[set[int]], width: int, device: torch.device | str) -> torch.Tensor:
    out = torch.zeros(len(sets), width, dtype=torch.bool)
    for row, members in enumerate(sets):
        out[row, list(members)] = True
    return out.to(device)


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
    pieces that would continue a word, blocked right after a term.

    Longer than 60 lines for beam_search's reason: one step is one algorithm over shared tensors.
    """
    if early_stopping not in STOPPING_RULES:
        raise ValueError(f"early_stopping {early_stopping!r}: expected one of {STOPPING_RULES}")
    forcing = _Forcing(max_lengths, prefixes, eos_id, device)
    n, k, steps, limits = len(max_lengths), beam_size, forcing.steps, forcing.limits
    bound_lp = [float(length_penalty(length, alpha, form)) for length in limits.tolist()]
    bound_lp = torch.tensor(bound_lp, dtype=torch.float64, device=device)
    live = torch.arange(n, device=device)  # sentence of each live sentence
    width = 1
    tokens = torch.full((n,), bos_id, dtype=torch.long, device=device)
    history = torch.zeros(n, steps, dtype=torch.long, device=device)  # (N·width, T)
    beam_scores = torch.zeros(n, width, device=device)
    auto = node = met = None  # the automata, each row's node (N·w,) and met entries (N·w, E)
    guard = torch.zeros(n, dtype=torch.bool, device=device)  # a term just ended in this row
    satisfied, unmet = _Finished(n, k, steps, device), _Finished(n, 1, steps, device)
    beams = torch.arange(k, device=device)
    for t in range(1, steps + 1):
        log_probs, state = step_fn(tokens, state)  # (N·width, V)
        if auto is None:  # the vocabulary is the model's output width
            auto = Automata(terms, log_probs.size(-1), device)
            node = auto.root.clone()
            met = torch.zeros(n, auto.real.size(1), dtype=torch.bool, device=device)
        forced = forcing.tokens(live, t, width)
        log_probs = _mask(log_probs, banned, forced)
        if forced_eos == "zero":
            forcing.zero_eos(log_probs, live, t, width)
        row_sentence = live.repeat_interleave(width)  # (N·width,)
        free = forced < 0
        all_met = (met | ~auto.real[row_sentence]).all(dim=1)
        log_probs[free & ~all_met, eos_id] = -math.inf  # no end before every term
        if continues is not None and bool((guard & free).any()):
            log_probs[guard & free] = log_probs[guard & free].masked_fill(continues, -math.inf)
        m, vocab = len(live), log_probs.size(-1)
        # Candidates: each row's k best tokens, and its sentence's term tokens (once).
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
        scores = scores + beam_scores.reshape(-1, 1)  # (N·w, K)
        next_node = auto.step(node, candidates)  # (N·w, K)
        reached = auto.completes[next_node] & auto.real[row_sentence][:, None]  # (N·w, K, E)
        next_met = met[:, None, :] | reached
        is_eos = candidates == eos_id
        next_node = torch.where(is_eos, node[:, None], next_node)
        next_met = torch.where(is_eos[:, :, None], met[:, None, :], next_met)
        bank = auto.progress(row_sentence[:, None], next_node, next_met)  # (N·w, K)
        # One sentence's candidates in one row: (m, w·K); the beam by bank striping.
        cand_count = candidates.size(1)
        order = _striped(scores.view(m, -1), bank.view(m, -1), auto.banks)  # (m, w·K)
        scores_sorted = scores.view(m, -1).gather(1, order)
        valid = scores_sorted > -math.inf
        eos_sorted = is_eos.view(m, -1).gather(1, order) & valid
        row_of = torch.arange(m, device=device)[:, None] * width + order // cand_count  # (m, wK)
        # EOS candidates among the first k finish (apart, if some term is unmet).
        ends = eos_sorted[:, :k]
        ended_met = (next_met.view(m, -1, met.size(1)).gather(
            1, order[:, :k, None].expand(-1, -1, met.size(1))) | ~auto.real[live][:, None, :]
        ).all(dim=2)  # fmt: skip
        penalty = float(length_penalty(t, alpha, form))
        raw = scores_sorted[:, :k].double()
        satisfied.add(live, ends & ended_met, raw, penalty, history[row_of[:, :k]], length=t - 1)
        if bool((ends & ~ended_met).any()):  # only at a maximum length: EOS forced
            first = _first_true(ends & ~ended_met, 1)  # (m, 1)
            at = first.clamp(min=0)
            unmet.add(live, first >= 0, raw.gather(1, at), penalty,
                      history[row_of[:, :k].gather(1, at)], length=t - 1)  # fmt: skip
        # The first k valid non-EOS candidates live on (fewer: -inf beams fill the rest).
        keep_rank = _first_true(valid & ~eos_sorted, k)  # (m, k) positions, -1 where none
        have = keep_rank >= 0
        pick = keep_rank.clamp(min=0)
        chosen = order.gather(1, pick)  # (m, k) candidate index within the sentence
        beam_scores = scores_sorted.gather(1, pick).masked_fill(~have, -math.inf)
        source_row = torch.arange(m, device=device)[:, None] * width + chosen // cand_count
        flat = chosen.view(-1) % cand_count + source_row.view(-1) * cand_count
        source_row = source_row.view(-1)  # (m·k,)
        tokens = candidates.view(-1)[flat]
        new_node = next_node.view(-1)[flat]
        new_met = next_met.view(-1, met.size(1))[flat]
        guard = (reached.view(-1, met.size(1))[flat] & ~met[source_row]).any(dim=1)
        node, met = new_node, new_met
        history = history[source_row]
        history[:, t - 1] = tokens
        width = k
        horizon_lp = {"bound": bound_lp[live], "current": penalty}.get(early_stopping)
        done = _done(satisfied, live, beam_scores, limits[live], t=t, k=k, horizon_lp=horizon_lp)
        keep = (~done).nonzero().squeeze(1)  # the one host sync of a step
        if len(keep) == 0:
            break
        kept_rows = (keep[:, None] * k + beams).view(-1)
        state.reorder(source_row[kept_rows], k)
        live, beam_scores = live[keep], beam_scores[keep]
        tokens, history = tokens[kept_rows], history[kept_rows]
        node, met, guard = node[kept_rows], met[kept_rows], guard[kept_rows]
    found, fallback = satisfied.best(nbest), unmet.best(1)
    return [hyps or spare for hyps, spare in zip(found, fallback, strict=True)]


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
    stand and with a capital first letter (a sentence's first word); an alternative with a piece
    the model cannot write (unknown) is left out, and an entry left with none becomes []."""
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
                if pieces and tok.unk_id not in pieces and pieces not in alternatives:
                    alternatives.append(pieces)
        terms.append(alternatives)
    return terms


_CONTINUES: dict[str, torch.Tensor] = {}


_HYPHENS = "-\u2010\u2011"  # join two words into one (glossary.words)


def word_continuations(tok: Tokenizer) -> torch.Tensor:
    """(V,) the target pieces that continue a word: no word-start mark, and a letter, digit,
    hyphen or byte first (what may not follow a glossary term: it would make it part of a longer
    word, as glossary.words reads "coffee-like" as one word)."""
    if tok.sha256 not in _CONTINUES:
        flags = []
        for piece in tok.pieces("target"):
            byte = piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6
            joined = piece[:1].isalnum() or piece[:1] in _HYPHENS
            flags.append(byte or (not piece.startswith("\u2581") and joined))
        _CONTINUES[tok.sha256] = torch.tensor(flags, dtype=torch.bool)
    return _CONTINUES[tok.sha256]


def used_alternatives(
    tok: Tokenizer, matches: Sequence[glossaries.Match], hyp: Hypothesis
) -> list[int]:
    """The alternative of each matched entry that the hypothesis's text uses, -1 for none."""
    text = tok.decode([hyp.tokens])[0]
    return [-1 if (alt := glossaries.used(m.entry, text)) is None else alt for m in matches]
