"""Greedy and batched beam search over a step function (after Flax's WMT decode.py): no model here.

    step_fn(tokens (N,), state) -> (log_probs (N, V), state), where `state` has reorder(index, beam)

feeds the last token of each of N live rows and returns next-token log-probabilities. Rows are
sentences (greedy) or sentence × beam (beam search); reorder(index, beam) keeps rows `index`, each
`beam` consecutive ones from one sentence. Finished sentences leave the batch, so they cost
nothing afterwards. All bookkeeping stays in tensors on the device of the tokens (the
model's): no log-probabilities are copied to the host; one small check per step decides which
sentences leave the batch.

A row may be given a target prefix (`prefixes`, token ids per sentence): its first tokens are
forced, whatever the model prefers, and the search goes on from them (fairseq's prefix_tokens,
CTranslate2's target_prefix); their log-probabilities count in the score, and a sentence's maximum
length is at least its prefix and the EOS. Forcing is one mask (_Forcing): the prefix's token at
its steps, EOS at the maximum length.

Scores are sums of log-probabilities; a finished hypothesis is ranked by score / lp(|Y|), |Y|
counting the EOS. lp is the GNMT penalty ((5 + |Y|) / 6)^α (Wu et al. 2016, used by the paper, §6.1)
or the plain |Y|^α of fairseq, HF and CTranslate2 ("power"). Sums and ranks are kept in float64, so
ties and roundings fall exactly as in plain Python arithmetic on the float32 log-probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from transformer_mt.network.maxima import logits_argmax, ranked, row_max

# When beam search stops a sentence: see beam_search.
STOPPING_RULES = ("bound", "current", "k_finished")


class SearchState(Protocol):
    """Keeps rows `index`, each `beam` consecutive ones from one sentence, the sentences in
    their order: a search drops finished sentences, never reorders them."""

    def reorder(self, index: torch.Tensor, beam: int) -> None: ...


StepFn = Callable[[torch.Tensor, Any], tuple[torch.Tensor, Any]]


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]  # the output, EOS excluded
    score: float  # length-normalised: log_prob / lp(len(tokens) + 1)
    log_prob: float  # sum of token log-probabilities, EOS included
    # (source, output) index pairs, when decode.alignment asks for them (alignment.py)
    alignment: tuple[tuple[int, int], ...] | None = None
    # With a glossary, per entry its line matched: (the alternative the output uses, -1 for
    # none; whether constrained decoding wrote it; why strict could not place it, or "")
    # (decoding.py)
    terms: tuple[tuple[int, bool, str], ...] | None = None


def length_penalty(length: int | torch.Tensor, alpha: float, form: str = "gnmt") -> Any:
    """lp(|Y|): GNMT ((5 + |Y|) / 6)^α or power |Y|^α; α = 0 gives 1 (no normalisation)."""
    if form == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    if form == "power":
        return length**alpha
    raise ValueError(f"length penalty form {form!r}: expected 'gnmt' or 'power'")


def greedy(
    step_fn: StepFn,
    state: SearchState,
    max_lengths: Sequence[int],
    bos_id: int,
    eos_id: int,
    banned: Sequence[int] = (),
    alpha: float = 0.0,
    form: str = "gnmt",
    device: torch.device | str = "cpu",
    prefixes: Sequence[Sequence[int]] = (),
    forced_eos: str = "log_prob",
    logits: bool = False,
) -> list[Hypothesis]:
    """The argmax token at every step until EOS or the sentence's maximum length (EOS forced).

    logits: step_fn returns the raw logits, not log-probabilities, and the hypotheses carry no
    scores (nan): the argmax needs no normaliser, a pass over the vocabulary saved per step
    (logits_argmax), with the tokens the log-probabilities would give."""

    def argmax(log_probs: torch.Tensor, live: torch.Tensor, t: int) -> tuple[torch.Tensor, ...]:
        if logits:
            return torch.zeros(len(live), device=log_probs.device), logits_argmax(log_probs)
        return row_max(log_probs)

    return _one_path(
        step_fn, state, max_lengths, bos_id=bos_id, eos_id=eos_id, banned=banned, alpha=alpha,
        form=form, device=device, choose=argmax, prefixes=prefixes, forced_eos=forced_eos,
        scored=not logits,
    )  # fmt: skip


def sample(
    step_fn: StepFn,
    state: SearchState,
    max_lengths: Sequence[int],
    uniforms: torch.Tensor,
    bos_id: int,
    eos_id: int,
    method: str = "full",
    temperature: float = 1.0,
    banned: Sequence[int] = (),
    alpha: float = 0.0,
    form: str = "gnmt",
    device: torch.device | str = "cpu",
    prefixes: Sequence[Sequence[int]] = (),
    forced_eos: str = "log_prob",
) -> list[Hypothesis]:
    """One sampled output per row: at step t, row r draws from the model's distribution at
    `temperature`, truncated by `method` ("full", "topk:K": the K likeliest tokens, "topp:P": the
    smallest set whose probability reaches P) and renormalised, by inverting its cumulative
    distribution at uniforms[r, t - 1] (uniforms (N, >= max length), in [0, 1)). A row's output
    thus depends only on its own uniforms, never on the batch it is in. Temperature 0 is greedy.
    The score is the model's log-probability of the sample (temperature 1, untruncated)."""
    kind, _, value = method.partition(":")
    uniforms = uniforms.to(device=device, dtype=torch.float64)

    def draw(log_probs: torch.Tensor, live: torch.Tensor, t: int) -> tuple[torch.Tensor, ...]:
        if temperature == 0:
            return log_probs.max(dim=-1)
        probs = (log_probs.double() / temperature).softmax(dim=-1)  # (N, V); banned ones 0
        if kind == "topk":
            probs, ids = probs.topk(min(int(value), probs.size(-1)), dim=-1)  # (N, K), sorted
        else:
            probs, ids = probs.sort(dim=-1, descending=True)
            if kind == "topp":  # keep a token while the mass before it is below P
                probs = probs * ((probs.cumsum(dim=-1) - probs) < float(value))
        cdf = probs.cumsum(dim=-1)  # (N, K)
        u = uniforms[live, t - 1, None] * cdf[:, -1:]  # (N, 1), scaled to the kept mass
        at = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.size(-1) - 1)
        choice = ids.gather(1, at).squeeze(1)  # (N,)
        return log_probs.gather(1, choice[:, None]).squeeze(1), choice

    return _one_path(
        step_fn, state, max_lengths, bos_id=bos_id, eos_id=eos_id, banned=banned, alpha=alpha,
        form=form, device=device, choose=draw, prefixes=prefixes, forced_eos=forced_eos,
    )  # fmt: skip


def line_uniforms(seed: int, line: int, sample_index: int, steps: int) -> torch.Tensor:
    """(steps,) uniforms in [0, 1) that drive sample `sample_index` of input line `line`: a
    function of these three numbers alone, whichever process or batch translates the line."""
    key = np.random.SeedSequence([seed, line, sample_index]).generate_state(1, np.uint64)[0]
    generator = torch.Generator().manual_seed(int(key))
    return torch.rand(steps, generator=generator, dtype=torch.float64)


def _one_path(
    step_fn: StepFn,
    state: SearchState,
    max_lengths: Sequence[int],
    bos_id: int,
    eos_id: int,
    banned: Sequence[int],
    alpha: float,
    form: str,
    device: torch.device | str,
    choose: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, ...]],
    prefixes: Sequence[Sequence[int]],
    forced_eos: str = "log_prob",
    scored: bool = True,
) -> list[Hypothesis]:
    """One token per row and step, picked by choose(log_probs (N, V), live rows (N,), t) ->
    (its log-probability (N,), token (N,)), until EOS or the row's maximum length (EOS forced).
    Unless `scored`, the hypotheses' scores are nan (none were computed)."""
    forcing = _Forcing(max_lengths, prefixes, eos_id, device)
    n, steps = len(max_lengths), forcing.steps
    live = torch.arange(n, device=device)  # sentence index of each row
    tokens = torch.full((n,), bos_id, dtype=torch.long, device=device)
    outputs = torch.empty(n, steps, dtype=torch.long, device=device)  # (n, T), by sentence
    sums = torch.zeros(n, dtype=torch.float64, device=device)
    ends = torch.zeros(n, dtype=torch.long, device=device)  # the step that chose EOS
    banned_ids = torch.tensor(list(banned), dtype=torch.long, device=device)
    for t in range(1, steps + 1):
        log_probs, state = step_fn(tokens, state)  # (N, V)
        forced = forcing.tokens(live, t, width=1) if forcing.any_at(t) else None
        log_probs = _mask(log_probs, banned_ids, forced)
        if forced_eos == "zero":
            forcing.zero_eos(log_probs, live, t, width=1)
        best, choice = choose(log_probs, live, t)  # (N,)
        sums[live] += best.double()
        outputs[live, t - 1] = choice
        finished = choice == eos_id
        ends[live[finished]] = t
        keep = (~finished).nonzero().squeeze(1)  # the one host sync of a step
        if len(keep) == 0:
            break
        if len(keep) < len(live):
            state.reorder(keep, 1)
            live, choice = live[keep], choice[keep]
        tokens = choice
    out, log_prob, end = outputs.tolist(), sums.tolist(), ends.tolist()
    if not scored:
        log_prob = [math.nan] * n
    return [
        Hypothesis(out[s][: end[s] - 1], log_prob[s] / length_penalty(end[s], alpha, form),
                   log_prob[s])
        for s in range(n)
    ]  # fmt: skip


def beam_search(
    step_fn: StepFn,
    state: SearchState,
    max_lengths: Sequence[int],
    bos_id: int,
    eos_id: int,
    beam_size: int,
    alpha: float = 0.6,
    form: str = "gnmt",
    nbest: int = 1,
    banned: Sequence[int] = (),
    early_stopping: str = "bound",
    device: torch.device | str = "cpu",
    prefixes: Sequence[Sequence[int]] = (),
    forced_eos: str = "log_prob",
) -> list[list[Hypothesis]]:
    """Batched beam search; returns the `nbest` best hypotheses of each sentence, best first.

    `state` must describe the n sentences, one row each. Per step the best 2k continuations of a
    sentence's beams are ranked (ties to the lower beam, then the lower token id); an EOS
    continuation is finished if it ranks within the top k (so beam 1 is greedy), the first k
    others live on. All beams start alike, so the first step expands the one row per sentence
    (as CTranslate2 does on CPU), and the state is then reordered into k rows per sentence. A
    sentence stops once it has k finished hypotheses and no live one can beat the worst of them,
    even under the most favourable length penalty, lp(max length) (early_stopping "bound",
    tensor2tensor's: the paper's "terminate early when possible"), or under lp(current length)
    (early_stopping "current", HF generate's default heuristic); or as soon as it has k finished
    hypotheses (early_stopping "k_finished": fairseq's rule, CTranslate2's and HF's
    early_stopping=True). The EOS forced at a sentence's maximum length scores its
    log-probability, or 0 with forced_eos "zero" (transformers' ForcedEOSTokenLogitsProcessor,
    which an imported OPUS-MT model's generate applies). While a prefix is forced, a sentence has
    one live hypothesis (the others score -inf), which the first free step expands to k.

    Longer than 60 lines because one step is one indivisible algorithm over shared tensors
    (expand, rank, finish, keep alive, drop finished sentences, reorder the state); its separable
    parts are helpers (_mask, _best_continuations, _Finished, _done).
    """
    if early_stopping not in STOPPING_RULES:
        raise ValueError(f"early_stopping {early_stopping!r}: expected one of {STOPPING_RULES}")
    forcing = _Forcing(max_lengths, prefixes, eos_id, device)
    n, k, steps, limits = len(max_lengths), beam_size, forcing.steps, forcing.limits
    # lp(max length) of each sentence, computed as Python computes it (the "bound" horizon).
    bound_lp = [float(length_penalty(length, alpha, form)) for length in limits.tolist()]
    bound_lp = torch.tensor(bound_lp, dtype=torch.float64, device=device)
    live = torch.arange(n, device=device)  # sentence index of each live sentence
    width = 1  # rows per live sentence: 1 before the first step, k after it
    tokens = torch.full((n,), bos_id, dtype=torch.long, device=device)
    history = torch.zeros(n, steps, dtype=torch.long, device=device)  # (N·width, T) outputs
    beam_scores = torch.zeros(n, width, device=device)
    finished = _Finished(n, k, steps, device)
    beams = torch.arange(k, device=device)
    banned_ids = torch.tensor(list(banned), dtype=torch.long, device=device)
    for t in range(1, steps + 1):
        log_probs, state = step_fn(tokens, state)  # (N·width, V)
        forced = forcing.tokens(live, t, width) if forcing.any_at(t) else None
        log_probs = _mask(log_probs, banned_ids, forced)
        if forced_eos == "zero":
            forcing.zero_eos(log_probs, live, t, width)
        m, vocab = len(live), log_probs.size(-1)
        top_scores, top_index = _best_continuations(log_probs, beam_scores, 2 * k)  # (m, 2k)
        top_beam, top_token = top_index // vocab, top_index % vocab
        is_eos = top_token == eos_id
        # EOS continuations ranked within the top k of their sentence are finished.
        ends = is_eos[:, :k] & (top_scores[:, :k] > -math.inf)  # (m, k)
        penalty = float(length_penalty(t, alpha, form))
        if bool(ends.any()):  # (the add's own check, before its arguments are gathered)
            rows = torch.arange(m, device=device)[:, None] * width + top_beam[:, :k]  # (m, k)
            finished.add(live, ends, top_scores[:, :k].double(), penalty, history[rows], t - 1)
        # The first k non-EOS continuations live on (at most k of the 2k are EOS: one per beam).
        order = is_eos.to(torch.uint8).sort(dim=-1, stable=True).indices[:, :k]  # (m, k)
        beam_scores = top_scores.gather(1, order)
        source_row = torch.arange(m, device=device)[:, None] * width + top_beam.gather(1, order)
        source_row = source_row.view(-1)  # (m·k,)
        tokens = top_token.gather(1, order).view(-1)
        history = history[source_row]
        history[:, t - 1] = tokens
        width = k
        # Sentences that are done leave the batch; the rest of the state follows its beams.
        horizon_lp = (bound_lp[live] if early_stopping == "bound"
                      else penalty if early_stopping == "current" else None)  # fmt: skip
        done = _done(finished, live, beam_scores, limits[live], t=t, k=k, horizon_lp=horizon_lp)
        keep = (~done).nonzero().squeeze(1)  # the one host sync of a step
        if len(keep) == 0:
            break
        kept_rows = (keep[:, None] * k + beams).view(-1)
        state.reorder(source_row[kept_rows], k)
        live, beam_scores = live[keep], beam_scores[keep]
        tokens, history = tokens[kept_rows], history[kept_rows]
    return finished.best(nbest)


def _best_continuations(
    log_probs: torch.Tensor, beam_scores: torch.Tensor, count: int, settled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` best continuations of each sentence, best first: (scores, index) (m, count),
    index = beam · V + token, score = beam score + log-probability, ties to the lower index.

    log_probs (m·w, V) and beam_scores (m, w) for w beams per sentence. The exact top of the w·V
    candidates without computing them all: a continuation among the best `count` lies in one of
    the `count` best blocks of B consecutive tokens by their maximum (the `count` block maxima
    ranked above its block each hold a better one), so only those blocks are scored and ranked.
    On the demo model this is 2x faster than topk over (m, w·V) (scripts/bench_decode.py).
    A vocabulary that is no multiple of B (OPUS-MT's 58,101 tokens) ends each row with a shorter
    block, whose missing tokens score -inf. Fewer than `count` candidates (a tiny vocabulary) are
    padded with -inf ones. `settled` (a CUDA graph's step, beam_graphs.py): no look at the
    device, so the missing tokens stay in their places and may be among the -inf candidates
    chosen, which no search keeps or finishes: the finite ones are the same."""
    rows, vocab = log_probs.shape
    m, block = beam_scores.size(0), 64
    blocks, full = -(-vocab // block), vocab - vocab % block  # per row; tokens in whole blocks
    log_probs = log_probs.contiguous()
    maxima = log_probs.as_strided((rows, full // block, block), (vocab, block, 1)).amax(dim=-1)
    if full < vocab:  # (m·w, V/B): and the short block at each row's end
        maxima = torch.cat([maxima, log_probs[:, full:].amax(dim=-1, keepdim=True)], dim=1)
    maxima = (beam_scores.reshape(-1, 1) + maxima).view(m, -1)  # (m, w·blocks): scores monotone
    chosen = ranked(maxima, min(count, maxima.size(1))).sort(dim=-1).values  # in index order
    offsets = torch.arange(block, device=log_probs.device)
    token = (chosen % blocks)[:, :, None] * block + offsets  # (m, chosen, B)
    index = ((chosen // blocks)[:, :, None] * vocab + token.clamp(max=vocab - 1)).view(m, -1)
    scores = beam_scores.gather(1, index // vocab) + log_probs.view(m, -1).gather(1, index)
    candidates = scores.size(1)
    if full < vocab:  # whole blocks have no token past a row's end: no check, no device wait
        past = (token >= vocab).view(m, -1)  # past a row's end: after every token, -inf ones too
        if settled:
            scores = scores.masked_fill(past, -math.inf)
        elif bool(past.any()):
            last = past.to(torch.uint8).sort(dim=1, stable=True).indices
            scores, index = scores.gather(1, last).masked_fill(past.gather(1, last), -math.inf), (
                index.gather(1, last))  # fmt: skip
            candidates -= int(past.sum(dim=1).min())
    order = ranked(scores, min(count, candidates))
    scores, index = scores.gather(1, order), index.gather(1, order)
    if scores.size(1) < count:
        missing = count - scores.size(1)
        scores = torch.cat([scores, scores.new_full((m, missing), -math.inf)], dim=1)
        index = torch.cat([index, index.new_zeros(m, missing)], dim=1)
    return scores, index


class _Forcing:
    """The token each row must emit at step t: its prefix's t-th, EOS at its maximum length (at
    least the prefix and the EOS), none (-1) otherwise."""

    def __init__(
        self,
        max_lengths: Sequence[int],
        prefixes: Sequence[Sequence[int]],
        eos_id: int,
        device: torch.device | str,
    ) -> None:
        if prefixes and len(prefixes) != len(max_lengths):
            raise ValueError(f"{len(prefixes)} prefixes for {len(max_lengths)} sentences")
        given = [len(p) for p in prefixes] or [0] * len(max_lengths)
        lengths = [max(limit, size + 1) for limit, size in zip(max_lengths, given, strict=True)]
        self.limits = torch.as_tensor(lengths, device=device)
        self.steps, self.eos_id, self.longest = max(lengths), eos_id, max(given)
        self.first_end = min(lengths)  # before it and after the prefixes, nothing is forced
        self.prefix = torch.full((len(lengths), self.longest), -1, dtype=torch.long)  # (n, P)
        for row, prefix in enumerate(prefixes):
            self.prefix[row, : len(prefix)] = torch.as_tensor(list(prefix), dtype=torch.long)
        self.prefix = self.prefix.to(device)

    def zero_eos(self, log_probs: torch.Tensor, live: torch.Tensor, t: int, width: int) -> None:
        """The EOS forced at the maximum length scores 0 (in place), as transformers scores it."""
        if t < self.first_end:  # no sentence at its maximum length yet
            return
        ended = self.limits[live] <= t  # (m,)
        if bool(ended.any()):
            rows = ended.repeat_interleave(width) if width > 1 else ended
            log_probs[rows, self.eos_id] = 0.0

    def any_at(self, t: int) -> bool:
        """Whether any row may have a forced token at step t, known on the host (no device
        wait): within the longest prefix, or from the first maximum length on."""
        return t <= self.longest or t >= self.first_end

    def tokens(self, live: torch.Tensor, t: int, width: int) -> torch.Tensor:
        """(len(live) · width,) the forced token of each row of the live sentences at step t."""
        forced = torch.where(self.limits[live] <= t, self.eos_id, -1)  # (m,)
        if t <= self.longest:
            forced = torch.where(self.prefix[live, t - 1] >= 0, self.prefix[live, t - 1], forced)
        return forced.repeat_interleave(width) if width > 1 else forced


def _mask(
    log_probs: torch.Tensor, banned: torch.Tensor, forced: torch.Tensor | None
) -> torch.Tensor:
    """Never emit `banned` ids (pad, bos: a tensor on the device, made once a search, not copied
    to it each step); a row with a forced token (>= 0) may emit it only (`forced` None: no row
    has one)."""
    log_probs = log_probs.float()
    if len(banned):
        log_probs.index_fill_(1, banned, -math.inf)
    if forced is None:
        return log_probs
    rows = forced >= 0
    if rows.any():
        kept = log_probs[rows].gather(1, forced[rows, None])  # (r, 1)
        log_probs[rows] = -math.inf
        log_probs[rows] = log_probs[rows].scatter(1, forced[rows, None], kept)
    return log_probs


class _Finished:
    """Each sentence's best k finished hypotheses, as tensors: kept sorted by normalised score,
    ties in the order they finished (what a stable sort of the finishing order gives)."""

    def __init__(self, n: int, k: int, steps: int, device: torch.device | str) -> None:
        self.k = k
        self.score = torch.full((n, k), -math.inf, dtype=torch.float64, device=device)
        self.log_prob = torch.zeros(n, k, dtype=torch.float64, device=device)
        self.length = torch.zeros(n, k, dtype=torch.long, device=device)  # EOS excluded
        self.tokens = torch.zeros(n, k, steps, dtype=torch.long, device=device)

    def add(
        self,
        live: torch.Tensor,
        ends: torch.Tensor,
        raw: torch.Tensor,
        penalty: float | torch.Tensor,
        tokens: torch.Tensor,
        length: int | torch.Tensor,
        settled: bool = False,
    ) -> None:
        """Merge the hypotheses where `ends` (m, k) into the pools of sentences `live` (m,):
        raw (m, k) their sums, tokens (m, k, T) their outputs of `length` tokens. `settled` (a
        CUDA graph's step): merged whether any ends or not, no look at the device; `penalty`
        and `length` may then be tensors (1,)."""
        if not settled and not bool(ends.any()):
            return
        score = torch.where(ends, raw / penalty, -math.inf)  # (m, k)
        merged = torch.cat([self.score[live], score], dim=1)  # (m, 2k): earlier ones first
        order = merged.sort(dim=1, descending=True, stable=True).indices[:, : self.k]  # (m, k)
        self.score[live] = merged.gather(1, order)
        log_prob = torch.cat([self.log_prob[live], raw], dim=1)
        self.log_prob[live] = log_prob.gather(1, order)
        new_length = torch.zeros_like(self.length[live]) + length  # an int, or (1,) in a graph
        self.length[live] = torch.cat([self.length[live], new_length], dim=1).gather(1, order)
        both = torch.cat([self.tokens[live], tokens], dim=1)  # (m, 2k, T)
        self.tokens[live] = both.gather(1, order[:, :, None].expand(-1, -1, both.size(2)))

    def best(self, nbest: int) -> list[list[Hypothesis]]:
        score, log_prob = self.score.tolist(), self.log_prob.tolist()
        length, tokens = self.length.tolist(), self.tokens.tolist()
        return [
            [
                Hypothesis(tokens[s][j][: length[s][j]], score[s][j], log_prob[s][j])
                for j in range(min(nbest, self.k))
                if score[s][j] > -math.inf
            ]
            for s in range(len(score))
        ]


def _done(
    finished: _Finished,
    live: torch.Tensor,
    alive_scores: torch.Tensor,
    limits: torch.Tensor,
    t: int,
    k: int,
    horizon_lp: torch.Tensor | float | None,
) -> torch.Tensor:
    """(m,) whether each live sentence is done: at its maximum length, nothing alive, or k
    finished hypotheses that no live one can beat. Log-probabilities only fall and lp grows with
    length, so lp(limit) (the "bound" horizon) is the best any live hypothesis can still get;
    lp(t) (the "current" horizon) assumes it finishes now; without a horizon ("k_finished") a
    full pool is enough."""
    best_alive = alive_scores.max(dim=1).values.double()  # (m,)
    pool = finished.score[live]  # (m, k), sorted
    full = pool[:, k - 1] > -math.inf
    if horizon_lp is None:
        beaten = torch.ones_like(full)
    else:
        beaten = best_alive / horizon_lp <= pool[:, k - 1]  # the worst of a full pool
    return (limits <= t) | (best_alive == -math.inf) | (full & beaten)
