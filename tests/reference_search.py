"""Reference: the search of tmt before it moved its bookkeeping onto the model's device (commit
be112db), with today's first step (one row per sentence) and tie rule (the lower beam, then
token), written as plainly as possible: a full stable sort of every candidate. The property tests
in test_search.py compare the current search with it on random step functions: the outputs must
stay identical. Not used by the package."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# The interface and the length penalty are the current ones: the reference is the algorithm.
from transformer_mt.network.search import Hypothesis, SearchState, StepFn, length_penalty


def greedy(
    step_fn: StepFn,
    state: SearchState,
    max_lengths: Sequence[int],
    bos_id: int,
    eos_id: int,
    banned: Sequence[int] = (),
    alpha: float = 0.0,
    form: str = "gnmt",
) -> list[Hypothesis]:
    """The argmax token at every step until EOS or the sentence's maximum length (EOS forced)."""
    n = len(max_lengths)
    limits = torch.as_tensor(list(max_lengths))
    live = torch.arange(n)  # sentence index of each row
    tokens = torch.full((n,), bos_id, dtype=torch.long)
    outputs: list[list[int]] = [[] for _ in range(n)]
    scores = [0.0] * n
    done: list[Hypothesis | None] = [None] * n
    for t in range(1, int(limits.max()) + 1):
        log_probs, state = step_fn(tokens, state)  # (N, V)
        log_probs = _mask(log_probs, banned, eos_id, force_eos=limits[live] <= t)
        best, choice = log_probs.max(dim=-1)
        keep = []
        for row, (sentence, token, lp) in enumerate(
            zip(live.tolist(), choice.tolist(), best.tolist(), strict=True)
        ):
            scores[sentence] += lp
            if token == eos_id:
                done[sentence] = Hypothesis(
                    outputs[sentence],
                    scores[sentence] / length_penalty(t, alpha, form),
                    scores[sentence],
                )
            else:
                outputs[sentence].append(token)
                keep.append(row)
        if not keep:
            break
        keep_rows = torch.tensor(keep)
        if len(keep) < len(live):
            state.reorder(keep_rows, 1)
        live, tokens = live[keep_rows], choice[keep_rows]
    return [h for h in done if h is not None]


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
) -> list[list[Hypothesis]]:
    """Batched beam search; returns the `nbest` best hypotheses of each sentence, best first.

    `state` must describe the n sentences, one row each; the first step expands it to k rows per
    sentence. Per step a sentence's continuations (beam score + log-probability over its beams ×
    V) are sorted best first, ties to the lower (beam, token), and the first 2k ranked; an EOS
    continuation is finished if it ranks within the top k (so beam 1 is greedy), the first k
    others live on. A sentence stops once it has k finished hypotheses and no live one can beat
    the worst of them, even under the most favourable length penalty, lp(max length)
    (early_stopping "bound", tensor2tensor's: the paper's "terminate early when possible"), or
    under lp(current length) (early_stopping "current", HF generate's default heuristic); or as
    soon as it has k (early_stopping "k_finished", fairseq's and CTranslate2's rule).

    Longer than 60 lines because one step is one indivisible algorithm over shared tensors
    (expand, rank, finish, keep alive, drop finished sentences, reorder the state); its separable
    parts are helpers (_mask, _collect_finished, _done).
    """
    if early_stopping not in ("bound", "current", "k_finished"):
        raise ValueError(f"early_stopping {early_stopping!r}: unknown rule")
    n, k = len(max_lengths), beam_size
    limits = torch.as_tensor(list(max_lengths))
    live = torch.arange(n)  # sentence index of each live sentence
    width = 1  # rows per live sentence: one before the first step, k after it
    tokens = torch.full((n,), bos_id, dtype=torch.long)
    history = torch.empty(n, 0, dtype=torch.long)  # (N·width, t) outputs so far
    beam_scores = torch.zeros(n, 1)
    finished: list[list[Hypothesis]] = [[] for _ in range(n)]
    for t in range(1, int(limits.max()) + 1):
        log_probs, state = step_fn(tokens, state)  # (N·width, V)
        log_probs = _mask(
            log_probs, banned, eos_id, force_eos=(limits[live] <= t).repeat_interleave(width)
        )
        vocab = log_probs.size(-1)
        candidates = (beam_scores.reshape(-1, 1) + log_probs).view(len(live), -1)  # (N, w·V)
        top_scores, top_index = candidates.sort(dim=-1, descending=True, stable=True)
        top_scores, top_index = top_scores[:, : 2 * k], top_index[:, : 2 * k]
        missing = 2 * k - top_scores.size(1)  # a vocabulary smaller than 2k: -inf ones
        top_scores = torch.cat([top_scores, torch.full((len(live), missing), -math.inf)], dim=1)
        top_index = torch.cat([top_index, torch.zeros(len(live), missing, dtype=torch.long)], 1)
        top_beam, top_token = top_index // vocab, top_index % vocab
        is_eos = top_token == eos_id
        _collect_finished(
            finished, live, history, top_scores, top_beam, is_eos, t, k, width, alpha, form
        )
        # The first k non-EOS continuations live on (each beam has one EOS: at most k of 2k).
        order = torch.tensor(
            [[j for j in range(2 * k) if not row[j]][:k] for row in is_eos.tolist()]
        )
        beam_scores = top_scores.gather(1, order)
        source_row = (torch.arange(len(live))[:, None] * width + top_beam.gather(1, order)).view(
            -1
        )  # (N·k,)
        tokens = top_token.gather(1, order).view(-1)
        history = torch.cat([history[source_row], tokens[:, None]], dim=1)
        width = k
        # Sentences that are done leave the batch; the rest of the state follows its beams.
        keep = [
            i
            for i, s in enumerate(live.tolist())
            if not _done(
                finished[s], beam_scores[i], k, int(limits[s]), t, alpha, form, early_stopping
            )
        ]
        if not keep:
            break
        keep_t = torch.tensor(keep)
        rows = (keep_t[:, None] * k + torch.arange(k)).view(-1)
        state.reorder(source_row[rows], k)
        live, beam_scores, tokens, history = (
            live[keep_t],
            beam_scores[keep_t],
            tokens[rows],
            history[rows],
        )
    return [sorted(f, key=lambda h: h.score, reverse=True)[:nbest] for f in finished]


def _mask(
    log_probs: torch.Tensor, banned: Sequence[int], eos_id: int, force_eos: torch.Tensor
) -> torch.Tensor:
    """Never emit `banned` ids (pad, bos); rows at their maximum length may only emit EOS."""
    log_probs = log_probs.float()
    if banned:
        log_probs[:, list(banned)] = -math.inf
    if force_eos.any():
        eos = log_probs[force_eos, eos_id].clone()
        log_probs[force_eos] = -math.inf
        log_probs[force_eos, eos_id] = eos
    return log_probs


def _collect_finished(
    finished: list[list[Hypothesis]],
    live: torch.Tensor,
    history: torch.Tensor,
    top_scores: torch.Tensor,
    top_beam: torch.Tensor,
    is_eos: torch.Tensor,
    t: int,
    k: int,
    width: int,
    alpha: float,
    form: str,
) -> None:
    """EOS continuations ranked within the top k of their sentence become finished hypotheses."""
    penalty = length_penalty(t, alpha, form)
    for i, j in (is_eos[:, :k] & (top_scores[:, :k] > -math.inf)).nonzero().tolist():
        raw = float(top_scores[i, j])
        output = history[i * width + int(top_beam[i, j])].tolist()
        pool = finished[int(live[i])]
        pool.append(Hypothesis(output, raw / penalty, raw))
        if len(pool) > k:  # only the best k can be returned or bound the search
            pool.sort(key=lambda h: h.score, reverse=True)
            del pool[k:]


def _done(
    pool: list[Hypothesis],
    alive_scores: torch.Tensor,
    k: int,
    limit: int,
    t: int,
    alpha: float,
    form: str,
    early_stopping: str,
) -> bool:
    best_alive = float(alive_scores.max())
    if t >= limit or best_alive == -math.inf:  # nothing left that could still finish
        return True
    if len(pool) < k:
        return False
    if early_stopping == "k_finished":
        return True
    # Log-probabilities only fall, and lp grows with length: lp(limit) is the best any live
    # hypothesis can still get, so that bound is exact; lp(t) assumes it finishes now.
    horizon = limit if early_stopping == "bound" else t
    return best_alive / length_penalty(horizon, alpha, form) <= min(h.score for h in pool)
