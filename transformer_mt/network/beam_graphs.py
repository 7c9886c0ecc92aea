"""Beam search whose every step is one CUDA graph (decode.cuda_graphs=on, beam search).

decoder_graphs.py records the decoder's step; search.py's beam search around it still launches
~100 kernels a step and waits for the GPU twice (has a hypothesis ended; which sentences are
done). Here the whole step is recorded: the decoder, the ranking of continuations, the finished
pools, the stopping test, the cache following the surviving beams. For that it keeps fixed
shapes, as the decoder's step does:

- a finished sentence stays in the batch, its rows computed and ignored (`alive` false: it adds
  no hypothesis), until the live ones fit a smaller bucket of sentences (decoder_graphs.py's
  keys): then the live ones are gathered to the front, the one look at the device that moves
  anything;
- the step's number lives on the device and each replay advances it; its length penalties are
  a table computed as search.py computes them (the same float64 values);
- the host learns how many sentences are alive one step late, from a copy that the next step's
  kernels overlap, so it never waits for the GPU inside the loop; the step after the last
  sentence is done is computed and changes nothing;
- steps where a token may be forced (a prefix, a sentence at its maximum length) are another
  key: the forcing is recorded only where it can apply.

The outputs are search.beam_search's (the same hypotheses, scores and order; over other rows a
matrix product may round otherwise): candidates that differ are -inf ones, which neither search
keeps or finishes (search._best_continuations).
Without recording (the CPU) the same steps run eagerly: tests/test_decoder_graphs.py compares
them with beam_search; tests/test_gpu.py replays them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from transformer_mt.network.decoder_graphs import DecoderGraphs
from transformer_mt.network.search import (
    STOPPING_RULES,
    Hypothesis,
    _best_continuations,
    _done,
    _Finished,
    _Forcing,
    _mask,
    length_penalty,
)


def graphed_beam_search(
    graphs: DecoderGraphs,
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
    """search.beam_search over `graphs` (a batch's decoder steps of fixed shapes, one row a
    sentence, nothing decoded yet), each step a CUDA graph where graphs.record."""
    if early_stopping not in STOPPING_RULES:
        raise ValueError(f"early_stopping {early_stopping!r}: expected one of {STOPPING_RULES}")
    search = _Search(graphs, max_lengths, bos_id, eos_id, beam_size, alpha, form, banned,
                     early_stopping, device, prefixes, forced_eos)  # fmt: skip
    return search.run(nbest)


class _Search:
    """The search's state in buffers of the current key's shape (m slots of sentences, w rows a
    slot), updated in place by each step; the sentences' constants and pools with one row more
    (index n), where the slots past the live sentences point."""

    def __init__(
        self, graphs: DecoderGraphs, max_lengths: Sequence[int], bos_id: int, eos_id: int,
        beam_size: int, alpha: float, form: str, banned: Sequence[int], early_stopping: str,
        device: torch.device | str, prefixes: Sequence[Sequence[int]], forced_eos: str,
    ) -> None:  # fmt: skip
        self.graphs, self.eos_id, self.k = graphs, eos_id, beam_size
        self.early_stopping, self.forced_eos = early_stopping, forced_eos
        self.forcing = _Forcing(max_lengths, prefixes, eos_id, device)
        n, self.steps = len(max_lengths), self.forcing.steps
        self.n = n
        limits = self.forcing.limits.tolist()
        self.limits = torch.tensor([*limits, 1], device=device)  # (n + 1,)
        self.bound_lp = torch.tensor(  # lp(max length), as Python computes it ("bound")
            [float(length_penalty(x, alpha, form)) for x in [*limits, 1]],
            dtype=torch.float64, device=device,
        )  # fmt: skip
        # lp(t) of every step t, as Python computes it: (steps + 2,), [0] unused
        self.penalties = torch.tensor(
            [1.0] + [float(length_penalty(t, alpha, form)) for t in range(1, self.steps + 2)],
            dtype=torch.float64, device=device,
        )  # fmt: skip
        longest = self.forcing.longest
        self.prefix = torch.full((n + 1, longest + 1), -1, dtype=torch.long, device=device)
        self.prefix[:n, :longest] = self.forcing.prefix  # a column of -1 after the longest
        self.banned = torch.tensor(list(banned), dtype=torch.long, device=device)
        self.finished = _Finished(n + 1, beam_size, self.steps, device)
        self.t = torch.ones(1, dtype=torch.long, device=device)  # the step about to run
        self.live = torch.arange(n, device=device)  # (m,) the sentence in each slot
        self.alive = torch.ones(n, dtype=torch.bool, device=device)
        self.beam_scores = torch.zeros(n, 1, device=device)  # (m, w)
        self.history = torch.zeros(n, self.steps, dtype=torch.long, device=device)  # (m·w, T)
        self.count = torch.zeros(1, dtype=torch.long, device=device)  # alive sentences
        self.arange = torch.arange(n, device=device)
        graphs.cache.tokens.fill_(bos_id)
        self.graph: torch.cuda.CUDAGraph | None = None  # the current key's
        self.key: tuple | None = None

    def run(self, nbest: int) -> list[list[Hypothesis]]:
        """The steps until no sentence is alive (known one step late) or the longest maximum
        length; the first eagerly (it widens each sentence's one row to k), the others replayed
        from each key's graph."""
        g, device = self.graphs, self.t.device
        self._commit_first(*self._step(forcing=self.forcing.any_at(1)))
        cuda = device.type == "cuda"
        counts = [torch.zeros(1, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        alive_then = self.n  # alive sentences after step t - 2, as last read
        self.steps_run, self.rows_run = 1, self.n  # steps, and rows they computed (profiling)
        for t in range(2, self.steps + 1):
            if alive_then == 0:
                break
            sentences = g._key(alive_then, self.k, t)[0]
            if sentences < len(self.live):
                self._gather_alive(t)
            key = (*g._key(len(self.live), self.k, t), self.forcing.any_at(t))
            if key[:3] != g.key:  # more positions
                g.length = t - 1
                g._refit(key[:3], len(g.cache.tokens))
            if key != self.key:
                self.key, self.graph = key, None
                if g.can_record():
                    self.graph = g._recorded(lambda f=key[3]: self._commit(*self._step(f)))
            if self.graph is not None:
                self.graph.replay()
                g.replays += 1
            else:
                self._commit(*self._step(key[3]))
            self.steps_run, self.rows_run = self.steps_run + 1, self.rows_run + len(g.cache.tokens)
            counts[t % 2].copy_(self.count, non_blocking=cuda)
            if cuda:
                events[t % 2].record()
                events[(t - 1) % 2].synchronize()  # the step before: this one runs meanwhile
            alive_then = int(counts[(t - 1) % 2]) if t > 2 else self.n
        return self.finished.best(nbest)[: self.n]

    # --- one step ---------------------------------------------------------------------------

    def _step(self, forcing: bool) -> tuple[torch.Tensor, ...]:
        """search.beam_search's step at step self.t over the slots: the decoder, its forced
        tokens where `forcing`, the best continuations, the pools, the stopping test. Returns
        (rows the survivors come from (m·k,), their tokens (m·k,), scores (m, k), histories
        (m·k, T), alive (m,)), committed by _commit; nothing here looks at the device."""
        g, k, t = self.graphs, self.k, self.t
        width, live = g.width, self.live
        g.cache.position.copy_(t - 1)
        g._forward()
        log_probs = _mask(F.log_softmax(g.logits.float(), dim=-1), self.banned, None)  # (m·w, V)
        if forcing:
            log_probs = self._forced(log_probs, t, width)
        m, vocab = len(live), log_probs.size(-1)
        top_scores, top_index = _best_continuations(log_probs, self.beam_scores, 2 * k, True)
        top_beam, top_token = top_index // vocab, top_index % vocab
        is_eos = top_token == self.eos_id
        # EOS continuations of a live sentence ranked within its top k are finished.
        ends = is_eos[:, :k] & (top_scores[:, :k] > -math.inf) & self.alive[:, None]  # (m, k)
        rows = self.arange[:m, None] * width + top_beam[:, :k]  # (m, k)
        penalty = self.penalties.index_select(0, t)  # (1,)
        self.finished.add(live, ends, top_scores[:, :k].double(), penalty, self.history[rows],
                          t - 1, settled=True)  # fmt: skip
        order = is_eos.to(torch.uint8).sort(dim=-1, stable=True).indices[:, :k]  # (m, k)
        beam_scores = top_scores.gather(1, order)
        source_row = (self.arange[:m, None] * width + top_beam.gather(1, order)).view(-1)
        tokens = top_token.gather(1, order).view(-1)  # (m·k,)
        history = self.history.index_select(0, source_row)
        history.index_copy_(1, t - 1, tokens[:, None])
        horizon_lp = (self.bound_lp[live] if self.early_stopping == "bound"
                      else penalty if self.early_stopping == "current" else None)  # fmt: skip
        done = _done(self.finished, live, beam_scores, self.limits[live], t, k, horizon_lp)
        return source_row, tokens, beam_scores, history, self.alive & ~done

    def _forced(self, log_probs: torch.Tensor, t: torch.Tensor, width: int) -> torch.Tensor:
        """search._mask's forcing and _Forcing.zero_eos at step t (on the device): a row with a
        forced token (its prefix's, or EOS at its maximum length) may emit it only."""
        limits = self.limits[self.live]  # (m,)
        at = (t - 1).clamp(max=self.prefix.size(1) - 1)
        prefix = self.prefix.index_select(1, at)[:, 0][self.live]  # (m,); -1 past it
        forced = torch.where(prefix >= 0, prefix, torch.where(limits <= t, self.eos_id, -1))
        forced = forced[:, None].expand(-1, width).reshape(-1)  # (m·w,): no look at its size
        choice = forced.clamp(min=0)[:, None]
        only = torch.full_like(log_probs, -math.inf).scatter_(
            1, choice, log_probs.gather(1, choice)
        )
        log_probs = torch.where((forced >= 0)[:, None], only, log_probs)
        if self.forced_eos == "zero":  # the EOS forced at the maximum length scores 0
            ended = (limits <= t)[:, None].expand(-1, width).reshape(-1)
            log_probs[:, self.eos_id] = log_probs[:, self.eos_id].masked_fill(ended, 0.0)
        return log_probs

    def _commit(self, source_row: torch.Tensor, tokens: torch.Tensor, beam_scores: torch.Tensor,
                history: torch.Tensor, alive: torch.Tensor) -> None:  # fmt: skip
        """The step's results into the state, in place (a graph's inputs are its outputs); the
        decoder's cache follows the surviving beams (every position: the step is on the device).

        Gathered, then copied back: two copies of the cache a step where gathering into a spare
        and swapping it in takes one, but then each key needs a graph for each of the two
        buffers, and a recording costs about an eager step of the host's time: with ~6 keys in
        a batch of ~33 steps (Multi30k), more than the copy saves on a GPU."""
        kv = self.graphs.cache.kv  # (L, 2, m·k, H, P, K)
        kv.copy_(kv.index_select(2, source_row))
        self.graphs.cache.tokens.copy_(tokens)
        self.beam_scores.copy_(beam_scores)
        self.history.copy_(history)
        self.alive.copy_(alive)
        self.count.copy_(alive.sum())
        self.t += 1

    def _commit_first(self, source_row: torch.Tensor, tokens: torch.Tensor,
                      beam_scores: torch.Tensor, history: torch.Tensor,
                      alive: torch.Tensor) -> None:  # fmt: skip
        """The first step's results: each sentence's one row becomes k (new buffers)."""
        g = self.graphs
        g.length, g.width = 1, self.k
        g._refit(g._key(self.n, self.k, 2), len(source_row), source_row)
        g.cache.tokens[: len(tokens)].copy_(tokens)  # the step's own, not the rows' before it
        self.beam_scores, self.history, self.alive = beam_scores, history, alive
        self.t += 1

    # --- shapes ------------------------------------------------------------------------------

    def _gather_alive(self, t: int) -> None:
        """The live sentences gathered into the front slots of a smaller bucket (the one look at
        the device that moves anything): the decoder's buffers, the state, padding slots that
        point past the sentences and are not alive."""
        g, k = self.graphs, self.k
        kept = self.alive.nonzero().squeeze(1)  # (m',)
        rows = (kept[:, None] * k + torch.arange(k, device=kept.device)).view(-1)
        g.length = t - 1
        key = g._key(len(kept), k, t)
        g._refit(key, len(rows), rows, kept)
        slots, taken = key[0], len(kept)
        self.live = self._padded(self.live[kept], slots, self.n)
        self.alive = self._padded(self.alive[kept], slots, False)
        self.beam_scores = self._padded(self.beam_scores[kept], slots, -math.inf)
        self.history = self._padded(self.history[rows], slots * k, 0)
        assert len(self.live) == slots and taken <= slots

    @staticmethod
    def _padded(x: torch.Tensor, size: int, fill: float | int | bool) -> torch.Tensor:
        """x (r, ...) with rows of `fill` after it, to `size` rows."""
        return torch.cat([x, x.new_full((size - len(x), *x.shape[1:]), fill)])
