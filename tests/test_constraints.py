"""Constrained beam search on toy step functions: the exhaustive oracle over every output that
holds the terms, batching, prefixes, a term the model would never say, a beam of one."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_search import BOS, EOS, PAD, WORDS, ToyState, all_outputs, sequence_score, toy_step

from transformer_mt.network.automaton import Automata
from transformer_mt.network.constraints import constrained_beam_search
from transformer_mt.network.search import beam_search, length_penalty

V = 6


def holds(output: tuple[int, ...], terms, continues=()) -> bool:
    """Whether `output` holds an alternative of every entry, no term (newly met) followed by a
    token in `continues`: the rule constrained_beam_search keeps, written plainly."""
    met: set[int] = set()
    for i in range(len(output)):
        ended = {
            e for e, alternatives in enumerate(terms) for a in alternatives
            if len(a) <= i + 1 and tuple(output[i + 1 - len(a) : i + 1]) == tuple(a)
        }  # fmt: skip
        if ended - met and i + 1 < len(output) and output[i + 1] in continues:
            return False
        met |= ended
    return met == set(range(len(terms)))


def exhaustive(sentence: int, max_len: int, terms, seed: int, alpha: float, continues=()):
    scored = [
        (sequence_score(sentence, y, seed) / length_penalty(len(y) + 1, alpha), y)
        for y in all_outputs(max_len)
        if holds(y, terms, continues)
    ]
    return sorted(scored, key=lambda item: -item[0])


def search(terms_per_sentence, max_len, seed, k, alpha=0.6, nbest=1, continues=None, **kw):
    n = len(terms_per_sentence)
    return constrained_beam_search(
        toy_step(seed), ToyState(list(range(n))), [max_len] * n, terms_per_sentence, BOS, EOS,
        beam_size=k, continues=continues, alpha=alpha, nbest=nbest, banned=(PAD, BOS),
        **kw,
    )  # fmt: skip


TERMS = [
    [[[4]]],  # one one-token term
    [[[5, 3]]],  # a term of two tokens
    [[[4]], [[5, 3]]],  # two terms, in either order
    [[[5, 5], [3]]],  # an entry with two alternatives
    [[[3, 4]], [[4, 5]]],  # overlapping terms: 3 4 5 holds both
]


@pytest.mark.parametrize("terms", TERMS)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_wide_constrained_beam_equals_exhaustive_search(terms, seed: int, alpha: float) -> None:
    max_len = 5  # outputs of up to 4 words: 121 sequences
    want = exhaustive(0, max_len, terms, seed, alpha)
    assert want, "the oracle has outputs to choose from"
    result = search([terms], max_len, seed, k=130, alpha=alpha, nbest=3)[0]
    assert [tuple(h.tokens) for h in result] == [y for _, y in want[:3]]
    for h in result:
        assert h.log_prob == pytest.approx(sequence_score(0, tuple(h.tokens), seed), abs=1e-5)


@pytest.mark.parametrize("seed", [0, 3])
def test_a_term_ends_as_a_whole_word(seed: int) -> None:
    # Token 3 continues a word: after a term is met it may not come next (EOS or another may).
    terms = [[[4]], [[5]]]
    continues = torch.zeros(V, dtype=torch.bool)
    continues[3] = True
    want = exhaustive(0, 5, terms, seed, 0.6, continues=(3,))
    result = search([terms], 5, seed, k=130, continues=continues)[0]
    assert tuple(result[0].tokens) == want[0][1]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_every_beam_holds_the_terms(k: int) -> None:
    terms = [[[[4]], [[5, 3]]], [[[3, 3]]], [[[5]], [[4]], [[3]]]]
    results = search(terms, 12, 0, k=k)
    for sentence_terms, hyps in zip(terms, results, strict=True):
        assert hyps and holds(tuple(hyps[0].tokens), sentence_terms)


@pytest.mark.parametrize(("k", "n"), [(4, 3), (6, 5)])
def test_batched_equals_one_by_one(k: int, n: int) -> None:
    terms = [TERMS[i % len(TERMS)] for i in range(n)]
    batched = search(terms, 9, 7, k=k, nbest=2)
    for i in range(n):
        alone = constrained_beam_search(
            toy_step(7), ToyState([i]), [9], [terms[i]], BOS, EOS, beam_size=k,
            nbest=2, banned=(PAD, BOS),
        )[0]  # fmt: skip
        assert [(h.tokens, h.score) for h in alone] == [(h.tokens, h.score) for h in batched[i]]


def test_a_term_the_model_would_never_say_is_said() -> None:
    # Token 5 has probability ~e^-30 everywhere; the constrained output still holds it.
    def unlikely(sentence, prefix, seed):
        logits = torch.tensor([0.0, 0.0, 1.0, 2.0, 1.5, -30.0])
        return torch.log_softmax(logits, dim=-1)

    plain = beam_search(toy_step(log_probs_of=unlikely), ToyState([0]), [6], BOS, EOS, 4,
                        banned=(PAD, BOS))[0][0]  # fmt: skip
    assert 5 not in plain.tokens
    hyps = constrained_beam_search(
        toy_step(log_probs_of=unlikely), ToyState([0]), [6], [[[[5]]]], BOS, EOS, beam_size=4,
        banned=(PAD, BOS),
    )[0]  # fmt: skip
    assert 5 in hyps[0].tokens


def test_terms_and_a_prefix() -> None:
    terms = [[[5, 5]]]
    result = search([terms], 6, 2, k=130, prefixes=[[4, 3]])[0][0]
    assert result.tokens[:2] == [4, 3] and holds(tuple(result.tokens), terms)
    want = [y for _, y in exhaustive(0, 6, terms, 2, 0.6) if y[:2] == (4, 3)]
    assert tuple(result.tokens) == want[0]


def test_without_room_the_best_unmet_output_comes_back() -> None:
    # Three terms of two tokens cannot fit in 3 tokens: the search still answers.
    terms = [[[[3, 4]], [[4, 5]], [[5, 3]]]]
    hyps = search(terms, 4, 0, k=4)[0]
    assert len(hyps) == 1 and not holds(tuple(hyps[0].tokens), terms[0])
    assert len(hyps[0].tokens) == 3


def test_automaton_follows_aho_corasick() -> None:
    # Alternative 1 1 2 inside 1 1 1 2: the failure link keeps the match going.
    auto = Automata([[[[1, 1, 2]]]], vocab=V, device="cpu")
    node = auto.root.clone()
    for token in (1, 1, 1):
        node = auto.step(node, torch.tensor([[token]]))[:, 0]
    assert int(auto.depth[node]) == 2
    node = auto.step(node, torch.tensor([[2]]))[:, 0]
    assert bool(auto.completes[node][0, 0])
    # A token of no alternative goes back to the root.
    assert int(auto.step(node, torch.tensor([[5]]))[0, 0]) == int(auto.root[0])


def test_unique_outputs_and_scores_are_the_models() -> None:
    terms = [[[4]], [[3]]]
    result = search([terms], 6, 5, k=16, nbest=4)[0]
    outputs = [tuple(h.tokens) for h in result]
    assert len(set(outputs)) == len(outputs)
    for h in result:
        assert holds(tuple(h.tokens), terms)
        assert h.score == pytest.approx(h.log_prob / length_penalty(len(h.tokens) + 1, 0.6))
    assert [h.score for h in result] == sorted((h.score for h in result), reverse=True)


def test_oracle_is_not_vacuous() -> None:
    # The unconstrained best of these seeds misses the terms: the constraint changes the output.
    missed = 0
    for seed, terms in itertools.product(range(3), TERMS):
        best = max(all_outputs(5), key=lambda y: sequence_score(0, y, seed) / length_penalty(
            len(y) + 1, 0.6))  # fmt: skip
        missed += not holds(best, terms)
    assert missed >= 5
    assert math.isfinite(sequence_score(0, (4,), 0))
    assert WORDS == (3, 4, 5)


def wanders(sentence, prefix, seed):
    """A weak model: it says word 3 over and over and ends only near the limit; the terms'
    words are unlikely, one of them (5) about e^-12 everywhere."""
    logits = torch.tensor([0.0, 0.0, -4.0, 3.0, -2.0, -12.0])
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("terms", [[[[5, 5]]], [[[4]], [[5, 4, 5]]], [[[5, 5, 5], [4, 4]]]])
def test_a_weak_model_at_the_length_limit_still_writes_every_term(k: int, terms) -> None:
    """Issue 61, G1: the model would fill every position with 3 and meet the limit mid-term
    ("lad" for lady); the search keeps the room the terms need, with every beam width, the
    limit exactly as long as the shortest way to hold them (and longer)."""
    need = sum(min(len(a) for a in alternatives) for alternatives in terms)
    for limit in (need + 1, need + 3, 12):
        hyps = constrained_beam_search(
            toy_step(log_probs_of=wanders), ToyState([0]), [limit], [terms], BOS, EOS,
            beam_size=k, nbest=min(k, 2), banned=(PAD, BOS),
        )[0]  # fmt: skip
        assert hyps, (limit, k)
        for h in hyps:
            assert holds(tuple(h.tokens), terms), (limit, k, h.tokens)
            assert len(h.tokens) < limit


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 50), k=st.sampled_from([1, 2, 3]), slack=st.integers(0, 3),
    terms=st.lists(st.lists(st.lists(st.sampled_from(WORDS), min_size=1, max_size=3),
                            min_size=1, max_size=2), min_size=1, max_size=3),
)  # fmt: skip
def test_every_output_holds_its_terms_whenever_the_limit_has_room(seed, k, slack, terms) -> None:
    """Property: for any toy model, beam and terms, a limit with room for the shortest output
    that holds them gives outputs that all hold them."""
    shortest = min((len(y) for y in all_outputs(7) if holds(y, terms)), default=None)
    if shortest is None or shortest + 1 + slack > 7:
        return
    limit = shortest + 1 + slack
    for hyps in constrained_beam_search(
        toy_step(seed), ToyState([0, 1]), [limit, limit], [terms, terms], BOS, EOS,
        beam_size=k, nbest=k, banned=(PAD, BOS),
    ):  # fmt: skip
        assert hyps and all(holds(tuple(h.tokens), terms) for h in hyps)
