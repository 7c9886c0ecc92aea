"""Search on toy step functions: exhaustive oracle, greedy vs beam, batching, lengths, EOS."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_mt.network.search import Hypothesis, beam_search, greedy, length_penalty, sample

PAD, BOS, EOS = 0, 1, 2
WORDS = (3, 4, 5)
V = 6


class ToyState:
    """Rows remember (sentence id, tokens so far); the toy model's distribution depends on both."""

    def __init__(self, sentences: list[int]) -> None:
        self.rows = [(s, ()) for s in sentences]
        self.places = list(range(len(sentences)))  # each row's sentence, by its place in the batch

    def reorder(self, index: torch.Tensor, beam: int) -> None:
        self.rows = [self.rows[i] for i in index.tolist()]
        self.places = [self.places[i] for i in index.tolist()]
        # search.SearchState: `beam` rows a sentence, the sentences in their order (the decoder
        # cache relies on it to know, without reading the device, that all stay).
        groups = [set(self.places[g : g + beam]) for g in range(0, len(self.places), beam)]
        assert all(len(group) == 1 for group in groups), groups
        order = [min(group) for group in groups]
        assert order == sorted(set(order)), order


def toy_log_probs(sentence: int, prefix: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((seed, sentence, prefix)) % 2**31)
    return torch.log_softmax(torch.randn(V, generator=g) * 2, dim=-1)


def toy_step(seed: int = 0, table: dict | None = None, log_probs_of=toy_log_probs):
    """A step function over ToyState rows: log_probs_of(sentence, prefix, seed), or `table`."""
    calls = []

    def step(tokens: torch.Tensor, state: ToyState) -> tuple[torch.Tensor, ToyState]:
        rows = []
        for i, token in enumerate(tokens.tolist()):
            sentence, prefix = state.rows[i]
            prefix = (*prefix, token) if token != BOS else prefix
            state.rows[i] = (sentence, prefix)
            if table is not None:
                rows.append(table.get(prefix, table["default"]))
            else:
                rows.append(log_probs_of(sentence, prefix, seed))
        calls.append(len(rows))
        return torch.stack(rows), state

    step.calls = calls  # type: ignore[attr-defined]
    return step


def sequence_score(sentence: int, output: tuple[int, ...], seed: int) -> float:
    """log p(output + EOS) under the toy model."""
    total, prefix = 0.0, ()
    for token in (*output, EOS):
        total += float(toy_log_probs(sentence, prefix, seed)[token])
        prefix = (*prefix, token)
    return total


def all_outputs(max_len: int) -> list[tuple[int, ...]]:
    """Every output a search may return: words then EOS, |Y| = len + 1 <= max_len."""
    return [seq for n in range(max_len) for seq in itertools.product(WORDS, repeat=n)]


@pytest.mark.parametrize(
    ("alpha", "form"), [(0.0, "gnmt"), (0.6, "gnmt"), (1.0, "power"), (2.0, "gnmt")]
)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_wide_beam_equals_exhaustive_search(alpha: float, form: str, seed: int) -> None:
    max_len = 3
    outputs = all_outputs(max_len)  # 1 + 3 + 9 = 13 sequences
    k = len(outputs)
    scored = sorted(
        (
            (sequence_score(0, y, seed) / length_penalty(len(y) + 1, alpha, form), y)
            for y in outputs
        ),
        reverse=True,
    )
    result = beam_search(
        toy_step(seed),
        ToyState([0]),
        [max_len],
        BOS,
        EOS,
        k,
        alpha,
        form,
        nbest=5,
        banned=(PAD, BOS),
    )[0]
    assert tuple(result[0].tokens) == scored[0][1]
    assert [tuple(h.tokens) for h in result] == [y for _, y in scored[:5]]
    for h in result:  # scores are the model's: raw log-probability and its normalisation
        assert h.log_prob == pytest.approx(sequence_score(0, tuple(h.tokens), seed), abs=1e-5)
        assert h.score == pytest.approx(
            h.log_prob / length_penalty(len(h.tokens) + 1, alpha, form), abs=1e-5
        )


def test_greedy_can_be_worse_than_beam() -> None:
    # First token: 3 (p 0.6) or 4 (p 0.4). After 3 the best is EOS at only 0.4 (total 0.24); after
    # 4, EOS is near certain (0.396). Greedy commits to 3; a beam of 2 keeps 4 and finds the better.
    log = math.log
    table = {
        (): torch.tensor([-1e9, -1e9, log(1e-3), log(0.6), log(0.4 - 1e-3), -1e9]),
        (3,): torch.tensor([-1e9, -1e9, log(0.4), log(0.3), log(0.3), -1e9]),
        (4,): torch.tensor([-1e9, -1e9, log(0.99), log(0.005), log(0.005), -1e9]),
        "default": torch.log_softmax(torch.zeros(V), dim=-1),
    }
    g = greedy(toy_step(table=table), ToyState([0]), [5], BOS, EOS, banned=(PAD, BOS))[0]
    b = beam_search(
        toy_step(table=table), ToyState([0]), [5], BOS, EOS, 2, alpha=0.0, banned=(PAD, BOS)
    )[0][0]
    assert g.tokens == [3] and b.tokens == [4]
    assert b.log_prob > g.log_prob


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 6), max_len=st.integers(1, 8))
def test_beam_one_equals_greedy(seed: int, n: int, max_len: int) -> None:
    limits = [max_len + i % 3 for i in range(n)]
    g = greedy(toy_step(seed), ToyState(list(range(n))), limits, BOS, EOS, banned=(PAD, BOS))
    b = beam_search(
        toy_step(seed), ToyState(list(range(n))), limits, BOS, EOS, 1, alpha=0.0, banned=(PAD, BOS)
    )
    assert [h.tokens for h in g] == [hyps[0].tokens for hyps in b]
    assert [h.log_prob for h in g] == pytest.approx([hyps[0].log_prob for hyps in b], abs=1e-5)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_beam_one_with_length_penalty_never_scores_below_greedy(seed: int) -> None:
    # With α > 0 beam search optimises score / lp(|Y|): beam 1 keeps greedy's output as a candidate
    # and may only replace it with a better-normalised one.
    g = greedy(toy_step(seed), ToyState([0]), [8], BOS, EOS, banned=(PAD, BOS), alpha=0.6)[0]
    b = beam_search(toy_step(seed), ToyState([0]), [8], BOS, EOS, 1, alpha=0.6, banned=(PAD, BOS))[
        0
    ][0]
    assert b.score >= g.score - 1e-6


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 5), n=st.integers(2, 5))
def test_batched_equals_one_by_one(seed: int, k: int, n: int) -> None:
    limits = [3 + 2 * (i % 3) for i in range(n)]
    together = beam_search(
        toy_step(seed),
        ToyState(list(range(n))),
        limits,
        BOS,
        EOS,
        k,
        0.6,
        nbest=k,
        banned=(PAD, BOS),
    )
    for i in range(n):
        alone = beam_search(
            toy_step(seed),
            ToyState([i]),
            [limits[i]],
            BOS,
            EOS,
            k,
            0.6,
            nbest=k,
            banned=(PAD, BOS),
        )[0]
        assert [h.tokens for h in together[i]] == [h.tokens for h in alone]
        assert [h.score for h in together[i]] == pytest.approx([h.score for h in alone], abs=1e-5)
    g_together = greedy(
        toy_step(seed), ToyState(list(range(n))), limits, BOS, EOS, banned=(PAD, BOS)
    )
    for i in range(n):
        assert (
            g_together[i].tokens
            == greedy(toy_step(seed), ToyState([i]), [limits[i]], BOS, EOS, banned=(PAD, BOS))[
                0
            ].tokens
        )


def test_maximum_length_forces_eos_and_banned_ids_never_appear() -> None:
    # A model that never wants EOS and loves PAD and BOS; sentence 0 may be 1 token long, sentence 1 4.
    table = {"default": torch.log_softmax(torch.tensor([9.0, 9.0, -20.0, 1.0, 0.5, 0.0]), dim=-1)}
    greedy_out = greedy(
        toy_step(table=table), ToyState([0, 1]), [1, 4], BOS, EOS, banned=(PAD, BOS)
    )
    beam_out = beam_search(
        toy_step(table=table),
        ToyState([0, 1]),
        [1, 4],
        BOS,
        EOS,
        3,
        0.6,
        banned=(PAD, BOS),
    )
    for short, long in ((greedy_out[0], greedy_out[1]), (beam_out[0][0], beam_out[1][0])):
        assert short.tokens == []  # |Y| = 1: only the forced EOS fits
        assert len(long.tokens) == 3  # |Y| = 4: three words, then the forced EOS
        assert not {PAD, BOS, EOS} & set(long.tokens)


def test_search_stops_early_when_nothing_can_beat_the_finished() -> None:
    eos_first = {"default": torch.log_softmax(torch.tensor([0.0, 0.0, 8.0, 0.0, 0.0, 0.0]), dim=-1)}
    step = toy_step(table=eos_first)
    out = beam_search(step, ToyState([0]), [60], BOS, EOS, 4, 0.6, banned=(PAD, BOS))
    assert out[0][0].tokens == []
    assert len(step.calls) < 10  # far fewer steps than the maximum length of 60
    step = toy_step(table=eos_first)
    greedy(step, ToyState([0]), [60], BOS, EOS, banned=(PAD, BOS))
    assert len(step.calls) == 1


def test_finished_sentences_leave_the_batch() -> None:
    # Sentence 0 may have 1 token, sentence 1 up to 6: the first step feeds one row per sentence
    # (all beams start alike), later steps only sentence 1's 3 beams.
    step = toy_step(seed=5)
    beam_search(step, ToyState([0, 1]), [1, 6], BOS, EOS, 3, 0.6, banned=(PAD, BOS))
    assert step.calls[0] == 2 and len(step.calls) > 1 and all(c == 3 for c in step.calls[1:])


def test_length_penalty_forms() -> None:
    assert length_penalty(7, 0.6) == pytest.approx(((5 + 7) / 6) ** 0.6)
    assert length_penalty(7, 0.6, "power") == pytest.approx(7**0.6)
    assert length_penalty(7, 0.0) == 1.0 == length_penalty(7, 0.0, "power")
    with pytest.raises(ValueError, match="length penalty form"):
        length_penalty(3, 0.6, "wu")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(2, 4))
def test_current_length_early_stopping_is_never_better_and_never_longer(seed: int, k: int) -> None:
    # "bound" and "current" follow the same trajectory until "current" stops a sentence; "bound"
    # only searches on, so its best can only be at least as good, at the price of more steps.
    sentences, limits = [0, 1, 2], [9, 5, 12]
    runs = {}
    for rule in ("bound", "current"):
        step = toy_step(seed=seed)
        state = ToyState(sentences)
        hyps = beam_search(
            step, state, limits, BOS, EOS, k, 0.6, banned=(PAD, BOS), early_stopping=rule
        )
        runs[rule] = ([h[0].score for h in hyps], sum(step.calls))
    (bound_scores, bound_rows), (current_scores, current_rows) = runs["bound"], runs["current"]
    assert current_rows <= bound_rows
    assert all(c <= b + 1e-9 for c, b in zip(current_scores, bound_scores, strict=True))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(2, 4))
def test_k_finished_stops_once_k_hypotheses_finished(seed: int, k: int) -> None:
    # fairseq's and CTranslate2's rule: on the same trajectory, never more steps than "current",
    # and every sentence that stopped before its limit holds k finished hypotheses.
    sentences, limits = [0, 1, 2], [9, 5, 12]
    rows = {}
    for rule in ("current", "k_finished"):
        step = toy_step(seed=seed)
        hyps = beam_search(step, ToyState(sentences), limits, BOS, EOS, k, 0.6, nbest=k,
                           banned=(PAD, BOS), early_stopping=rule)  # fmt: skip
        rows[rule] = sum(step.calls)
    assert rows["k_finished"] <= rows["current"]
    assert all(len(h) == k for h in hyps)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 4),
    width=st.integers(1, 4),
    vocab=st.sampled_from([1, 3, 6, 7, 64, 130, 192, 257]),
    count=st.integers(1, 10),
    ties=st.sampled_from(["none", "few values", "-inf", "zeros"]),
    seed=st.integers(0, 10_000),
)
def test_best_continuations_equal_a_stable_sort_of_all(rows, width, vocab, count, ties, seed):
    # The block-wise top of search.py against its definition: all w·V continuations of each
    # sentence sorted best first, ties to the lower index; fewer than `count` padded with -inf.
    from transformer_mt.network.search import _best_continuations

    g = torch.Generator().manual_seed(seed)
    log_probs = torch.randn(rows * width, vocab, generator=g)
    if ties == "few values":
        log_probs = torch.randint(-2, 1, log_probs.shape, generator=g).float()
    elif ties == "-inf":
        log_probs[torch.rand(log_probs.shape, generator=g) < 0.8] = -math.inf
    elif ties == "zeros":  # -0.0 and 0.0 are equal, as the floats compare
        log_probs = torch.where(torch.rand(log_probs.shape, generator=g) < 0.5, -0.0, 0.0)
    beam_scores = -torch.rand(rows, width, generator=g).round(decimals=1)
    scores, index = _best_continuations(log_probs, beam_scores, count)
    everything = (beam_scores.reshape(-1, 1) + log_probs).view(rows, -1)
    expected, expected_index = everything.sort(dim=-1, descending=True, stable=True)
    kept = min(count, width * vocab)
    assert torch.equal(index[:, :kept], expected_index[:, :kept])
    assert torch.equal(scores[:, :kept], expected[:, :kept])
    assert scores.shape == (rows, count) and bool((scores[:, kept:] == -math.inf).all())


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.sampled_from([1, 7, 127, 128, 130, 192, 257, 8000]),
    ties=st.sampled_from(["none", "few values", "-inf", "zeros"]),
    seed=st.integers(0, 10_000),
)
def test_row_max_equals_torch_max(rows, vocab, ties, seed):
    # Greedy's block-wise argmax against torch's: the same maxima, the first of equal indices.
    from transformer_mt.network.search import row_max

    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, vocab, generator=g)
    if ties == "few values":
        values = torch.randint(-2, 1, values.shape, generator=g).float()
    elif ties == "-inf":
        values[torch.rand(values.shape, generator=g) < 0.8] = -math.inf
    elif ties == "zeros":
        values = torch.where(torch.rand(values.shape, generator=g) < 0.5, -0.0, 0.0)
    best, index = row_max(values)
    expected = values.max(dim=-1)
    assert torch.equal(best, expected.values) and torch.equal(index, expected.indices)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.sampled_from([2, 7, 127, 128, 130, 257, 8000, 58101]),
    case=st.sampled_from(["plain", "near ties", "ties", "-inf", "large"]),
    seed=st.integers(0, 10_000),
)
def test_logits_argmax_picks_what_log_softmax_picks(rows, vocab, case, seed):
    # Greedy's argmax from raw logits (issue 49's exact saving) against today's: the argmax of the
    # log-probabilities, first of equal ones, including logits a few ulps apart, which
    # log_softmax's rounding may merge into a tie.
    from transformer_mt.network.search import logits_argmax, row_max

    g = torch.Generator().manual_seed(seed)
    scale = {"large": 30.0, "near ties": 0.3}.get(case, 3.0)  # small logits, V large: merges
    logits = torch.randn(rows, vocab, generator=g) * scale
    if case == "near ties":  # runners-up 1-3 ulps under each row's maximum, before and after it
        best = logits.max(dim=-1)
        for row in range(rows):
            value = best.values[row]
            for step, at in enumerate(torch.randint(0, vocab, (3,), generator=g).tolist()):
                if at != best.indices[row]:
                    below = value
                    for _ in range(step + 1):
                        below = torch.nextafter(below, torch.tensor(-math.inf))
                    logits[row, at] = below
    elif case == "ties":
        logits = torch.randint(-2, 1, logits.shape, generator=g).float()
    elif case == "-inf":
        logits[torch.rand(logits.shape, generator=g) < 0.9] = -math.inf
        logits[:, -1] = 0.5  # a finite value in every row, as EOS is never banned
    expected = row_max(torch.log_softmax(logits, dim=-1))[1]
    assert torch.equal(logits_argmax(logits.clone()), expected)


def logits_step(seed: int):
    """toy_step's model, returning its logits (toy_log_probs before the log-softmax)."""

    def raw_logits(sentence: int, prefix: tuple[int, ...], seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((seed, sentence, prefix)) % 2**31)
        return torch.randn(V, generator=g) * 2

    return toy_step(seed, log_probs_of=raw_logits)


def test_greedy_from_logits_gives_greedy_tokens_and_no_scores() -> None:
    for seed in range(20):
        limits = [1, 4, 7]
        scored = greedy(toy_step(seed), ToyState([0, 1, 2]), limits, BOS, EOS, banned=(PAD, BOS))
        raw = greedy(
            logits_step(seed), ToyState([0, 1, 2]), limits, BOS, EOS, banned=(PAD, BOS), logits=True
        )
        assert [h.tokens for h in raw] == [h.tokens for h in scored]
        assert all(math.isnan(h.score) and math.isnan(h.log_prob) for h in raw)


def test_unknown_early_stopping_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="early_stopping"):
        beam_search(toy_step(), ToyState([0]), [5], BOS, EOS, 2, early_stopping="never")


# --- the same outputs as the search before its bookkeeping moved onto the device ---------------


def tied_log_probs(sentence: int, prefix: tuple[int, ...], seed: int) -> torch.Tensor:
    """Log-probabilities that take few distinct values: ties everywhere."""
    g = torch.Generator().manual_seed(hash((seed, sentence, prefix)) % 2**31)
    return torch.log_softmax(torch.randint(0, 3, (V,), generator=g).float(), -1)


def tied_step(seed: int):
    return toy_step(seed, log_probs_of=tied_log_probs)


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    k=st.integers(1, 5),
    alpha=st.sampled_from([0.0, 0.6, 1.0, 2.0]),
    form=st.sampled_from(["gnmt", "power"]),
    early_stopping=st.sampled_from(["bound", "current", "k_finished"]),
    ties=st.booleans(),
    data=st.data(),
)
def test_search_outputs_equal_the_reference(
    seed, lengths, k, alpha, form, early_stopping, ties, data
) -> None:
    import reference_search as reference

    nbest = data.draw(st.integers(1, k))
    make = tied_step if ties else toy_step
    results = []
    for module in (reference, __import__("transformer_mt.network.search", fromlist=["greedy"])):
        step, state = make(seed), ToyState(list(range(len(lengths))))
        if k == 1:
            found = module.greedy(step, state, lengths, BOS, EOS, (PAD, BOS), alpha, form)
            found = [[(h.tokens, h.score, h.log_prob)] for h in found]
        else:
            found = module.beam_search(
                step, state, lengths, BOS, EOS, k, alpha, form, nbest=nbest,
                banned=(PAD, BOS), early_stopping=early_stopping,
            )  # fmt: skip
            found = [[(h.tokens, h.score, h.log_prob) for h in hyps] for hyps in found]
        results.append((found, step.calls))
    assert results[0] == results[1]  # outputs, scores bit for bit, and the rows of every step


# --- sampling ------------------------------------------------------------------------------------


def sample_rows(method: str, temperature: float, sentences: list[int], uniforms: torch.Tensor,
                max_len: int = 6, seed: int = 0) -> list[Hypothesis]:  # fmt: skip
    return sample(toy_step(seed), ToyState(sentences), [max_len] * len(sentences), uniforms, BOS,
                  EOS, method, temperature, banned=(PAD, BOS))  # fmt: skip


@pytest.mark.parametrize(("method", "temperature"), [("topk:1", 1.0), ("full", 0.0),
                                                     ("topp:0.9", 1e-4), ("full", 1e-4)])  # fmt: skip
def test_sampling_that_cannot_choose_is_greedy(method: str, temperature: float) -> None:
    sentences = list(range(40))
    expected = greedy(toy_step(), ToyState(sentences), [6] * 40, BOS, EOS, (PAD, BOS))
    uniforms = torch.rand(40, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    found = sample_rows(method, temperature, sentences, uniforms)
    assert [h.tokens for h in found] == [h.tokens for h in expected]
    assert [h.log_prob for h in found] == pytest.approx([h.log_prob for h in expected])


def truncated(log_probs: torch.Tensor, method: str, temperature: float) -> torch.Tensor:
    """The distribution a sampler must draw from, computed the plain way: tempered, pad and
    bos removed, truncated, renormalised."""
    probs = (log_probs.double() / temperature).exp()
    probs[[PAD, BOS]] = 0
    probs /= probs.sum()
    kind, _, value = method.partition(":")
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, token in enumerate(order.tolist()):
        if (kind == "topk" and rank >= int(value)) or (kind == "topp" and mass >= float(value)):
            break
        keep[token] = True
        mass += float(probs[token])
    probs = probs * keep
    return probs / probs.sum()


@pytest.mark.parametrize(
    ("method", "temperature"), [("full", 1.0), ("full", 0.7), ("topk:3", 1.0), ("topp:0.8", 1.3)]
)
def test_sampled_frequencies_match_the_truncated_distribution(
    method: str, temperature: float
) -> None:
    n = 20_000  # rows of one sentence; their first tokens are n draws from one distribution
    uniforms = torch.rand(n, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    found = sample_rows(method, temperature, [0] * n, uniforms, max_len=2)
    first = torch.tensor([h.tokens[0] if h.tokens else EOS for h in found])
    expected = truncated(toy_log_probs(0, (), 0), method, temperature)
    counts = torch.bincount(first, minlength=V).double()
    assert (counts[expected == 0] == 0).all()  # nothing outside the kept set, ever
    kept = expected > 0
    chi2 = float((((counts - n * expected) ** 2)[kept] / (n * expected[kept])).sum())
    # 99.9th percentile of chi-square with (kept - 1) <= 5 degrees of freedom: 20.5
    assert chi2 < 20.5, (counts.tolist(), (n * expected).tolist())


def test_a_sampled_row_depends_only_on_its_uniforms() -> None:
    sentences = list(range(12))
    uniforms = torch.rand(12, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    together = sample_rows("topp:0.9", 1.0, sentences, uniforms)
    alone = [sample_rows("topp:0.9", 1.0, [s], uniforms[s : s + 1])[0] for s in sentences]
    assert together == alone
    assert len({tuple(h.tokens) for h in together}) > 3  # not one path for all


# --- target prefixes -----------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 4))
def test_a_prefix_of_the_greedy_output_gives_the_greedy_output(seed: int, n: int) -> None:
    limits = [6 + i for i in range(n)]
    plain = greedy(toy_step(seed), ToyState(list(range(n))), limits, BOS, EOS, (PAD, BOS))
    for k in range(max(len(h.tokens) for h in plain) + 1):
        prefixes = [h.tokens[:k] for h in plain]
        forced = greedy(toy_step(seed), ToyState(list(range(n))), limits, BOS, EOS, (PAD, BOS),
                        prefixes=prefixes)  # fmt: skip
        assert forced == plain
        beam_one = beam_search(toy_step(seed), ToyState(list(range(n))), limits, BOS, EOS, 1,
                               alpha=0.0, banned=(PAD, BOS), prefixes=prefixes)  # fmt: skip
        assert [hyps[0].tokens for hyps in beam_one] == [h.tokens for h in plain]


@pytest.mark.parametrize("prefix", [(), (5,), (5, 5), (4, 3, 5)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_with_a_prefix_equals_exhaustive_search_over_its_completions(
    prefix: tuple[int, ...], seed: int
) -> None:
    # The oracle: every output that starts with the prefix, within the limit, ranked by the
    # toy model's normalised score (the prefix's log-probabilities count).
    max_len = 4
    outputs = [y for y in all_outputs(max_len) if y[: len(prefix)] == prefix]
    scored = sorted(((sequence_score(0, y, seed) / length_penalty(len(y) + 1, 0.6), y)
                     for y in outputs), reverse=True)  # fmt: skip
    result = beam_search(toy_step(seed), ToyState([0]), [max_len], BOS, EOS, len(outputs), 0.6,
                         nbest=4, banned=(PAD, BOS), prefixes=[prefix])[0]  # fmt: skip
    assert [tuple(h.tokens) for h in result] == [y for _, y in scored[:4]]
    for h in result:
        assert h.log_prob == pytest.approx(sequence_score(0, tuple(h.tokens), seed), abs=1e-5)


def test_an_unlikely_prefix_is_kept_and_the_limit_makes_room_for_it() -> None:
    # The model wants EOS first and never token 5; a prefix of three 5s over a limit of 2.
    table = {"default": torch.log_softmax(torch.tensor([0.0, 0.0, 9.0, 1.0, 0.5, -30.0]), dim=-1)}
    for search in (
        lambda **kw: [[h] for h in greedy(toy_step(table=table), ToyState([0, 1]), [2, 2], BOS,
                                          EOS, (PAD, BOS), **kw)],
        lambda **kw: beam_search(toy_step(table=table), ToyState([0, 1]), [2, 2], BOS, EOS, 3,
                                 banned=(PAD, BOS), nbest=3, **kw),
    ):  # fmt: skip
        found = search(prefixes=[(5, 5, 5), ()])
        assert [h.tokens for h in found[0]] == [[5, 5, 5]]  # the limit is the prefix + EOS
        assert found[1][0].tokens == []  # the other sentence is unchanged: EOS
        expected = 3 * float(table["default"][5]) + float(table["default"][EOS])
        assert found[0][0].log_prob == pytest.approx(expected, abs=1e-4)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 4), n=st.integers(2, 5))
def test_prefixes_batched_equal_one_by_one(seed: int, k: int, n: int) -> None:
    limits = [4 + i % 3 for i in range(n)]
    prefixes = [(WORDS[i % 3],) * (i % 3) for i in range(n)]  # (), (4,), (5, 5), ...
    together = beam_search(toy_step(seed), ToyState(list(range(n))), limits, BOS, EOS, k, 0.6,
                           nbest=k, banned=(PAD, BOS), prefixes=prefixes)  # fmt: skip
    for i in range(n):
        alone = beam_search(toy_step(seed), ToyState([i]), [limits[i]], BOS, EOS, k, 0.6,
                            nbest=k, banned=(PAD, BOS), prefixes=[prefixes[i]])[0]  # fmt: skip
        assert [h.tokens for h in together[i]] == [h.tokens for h in alone]
        assert all(tuple(h.tokens[: len(prefixes[i])]) == prefixes[i] for h in alone)


def test_samples_start_with_their_prefix() -> None:
    uniforms = torch.rand(30, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    prefixes = [(5, 3)] * 30
    found = sample(toy_step(), ToyState(list(range(30))), [6] * 30, uniforms, BOS, EOS,
                   banned=(PAD, BOS), prefixes=prefixes)  # fmt: skip
    assert all(h.tokens[:2] == [5, 3] for h in found)
    assert len({tuple(h.tokens) for h in found}) > 3  # the rest is still sampled


def test_a_beam_search_step_waits_for_the_device_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU every value read on the host waits for the queue to drain: a step reads whether
    a hypothesis finished and which sentences stay (a vocabulary of whole 64-token blocks, no
    prefix, before any maximum length); the set-up and the results are read once a search."""
    vocab, reads = 128, []
    table = torch.log_softmax(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)),
                              dim=-1)  # fmt: skip

    class Rows:
        def reorder(self, index: torch.Tensor, beam: int) -> None:
            pass

    def step(tokens: torch.Tensor, state: Rows) -> tuple[torch.Tensor, Rows]:
        return table[tokens], state  # on the device: no host read

    for name in ("__bool__", "__int__", "__float__", "item", "tolist", "nonzero"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    limit = 12
    out = beam_search(step, Rows(), [limit] * 3, BOS, EOS, 4, 0.6, banned=(PAD, BOS))
    steps = limit - 1  # before the forced EOS at each sentence's maximum length
    # Its set-up reads the maximum lengths once (the "bound" stopping rule's horizons).
    assert reads[0] == "tolist" and reads[1 : 1 + 2 * steps] == ["__bool__", "nonzero"] * steps
    assert len(out) == 3 and all(len(best[0].tokens) == limit - 1 for best in out), reads
