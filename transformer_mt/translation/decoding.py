"""A Translator's lines to hypotheses: token batches by length, one search per batch, the
output in input order; or CTranslate2's decoding of the same batches (decode.engine).

search.py knows nothing of the model: `_step_function` gives it one decoder step over each
model's cache (an ensemble's mean of probabilities: ensemble.py). An empty line gives no
hypotheses without running the model (with a target prefix: the prefix alone, score 0); a line
or prefix longer than the model's positions is truncated with a warning. Out of memory is one
line naming the settings that lower it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from transformer_mt.common import distributed
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config
from transformer_mt.data import glossary as glossaries
from transformer_mt.data import hints
from transformer_mt.data.sampler import TokenBucketSampler
from transformer_mt.data.tokenizer import Tokenizer
from transformer_mt.network import alignment, constraints, ensemble, kernels
from transformer_mt.network.beam_graphs import graphed_beam_search
from transformer_mt.network.candidates import Candidates
from transformer_mt.network.decoder_graphs import DecoderGraphs
from transformer_mt.network.model import DecoderCache, Transformer, make_src_mask
from transformer_mt.network.search import (
    Hypothesis,
    SearchState,
    StepFn,
    beam_search,
    greedy,
    line_uniforms,
    sample,
)
from transformer_mt.network.shortlist import Shortlist
from transformer_mt.translation import batch_budget, ct2
from transformer_mt.translation.decode_checks import check_engine
from transformer_mt.translation.sources import (
    constrained_limits,
    max_positions,
    output_limits,
    readable,
    source_ids,
)

logger = logging.getLogger(__name__)


class Decodable(Protocol):
    """What decoding reads of a Translator (translate.py)."""

    model: Transformer | None
    ensemble: tuple[Transformer, ...]
    weights: tuple[float, ...]
    tokenizer: Tokenizer
    config: Config
    device: torch.device
    engine: Any
    glossary: glossaries.Glossary | None
    shortlist: Shortlist | None


class _DecodeState:
    """What search.py needs from the model: the decoder cache and source mask, reorderable, and
    with a shortlist each sentence's candidates (allowed (B, U): candidates.py)."""

    def __init__(
        self, cache: DecoderCache, src_mask: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> None:
        self.cache, self.src_mask, self.allowed = cache, src_mask, allowed

    def reorder(self, index: torch.Tensor, beam: int) -> None:
        # A search keeps its sentences in their order (search.SearchState).
        sentences = self.cache.reorder(index.to(self.src_mask.device), beam, in_order=True)
        if sentences is not None:  # the source mask is per sentence, like the cross K/V
            self.src_mask = self.src_mask.index_select(0, sentences)
            if self.allowed is not None:
                self.allowed = self.allowed.index_select(0, sentences)


@torch.inference_mode()
def translate_lines(
    translator: Decodable,
    lines: Sequence[str],
    first_line: int = 0,
    prefixes: Sequence[str] | None = None,
    matches: Sequence[Sequence[glossaries.Match]] | None = None,
    scores: bool = True,
    lines_at: Sequence[int] | None = None,
) -> list[list[Hypothesis]]:
    """The n-best hypotheses (token ids) of each line, in input order; [] for an empty line.
    `first_line`: the index of lines[0] in the whole input (it seeds each line's sampling, and
    warnings name lines by it); `lines_at`: each line's index there instead, for lines that
    are not consecutive in it (a rank's share of the validation lines; a server's batch of
    several requests, each line's index in its own);
    `prefixes`: a target prefix for each line ("" for none) that every output starts with;
    `matches`: the glossary entries each line matched (default: the translator's glossary's),
    obeyed as glossary.mode says (_obey), each hypothesis telling which it uses (.terms);
    `scores` false: the caller reads no scores, which greedy search then need not compute
    (nan; greedy_from_logits)."""
    if translator.engine is not None:  # decoding options may have changed since the load
        check_engine(translator.config, translator.device)
    if prefixes is not None and len(prefixes) != len(lines):
        raise TmtError(f"{len(prefixes)} target prefixes for {len(lines)} lines: give one a line")
    if matches is not None and len(matches) != len(lines):
        raise TmtError(f"{len(matches)} glossary matches for {len(lines)} lines")
    if lines_at is not None and len(lines_at) != len(lines):
        raise TmtError(f"{len(lines_at)} line indices for {len(lines)} lines")
    at = list(lines_at) if lines_at is not None else range(first_line, first_line + len(lines))
    if matches is None:  # else the caller read them (output_and_report)
        lines = readable(translator, lines, at)
    if matches is None and translator.glossary is not None:
        matches = translator.glossary.match_lines(lines)
    mode = translator.config.glossary.mode
    hinted = matches is not None and mode in ("hint", "auto") and any(matches)
    ids = source_ids(translator, _hinted(translator, lines, matches) if hinted else lines,
                     at=at)  # fmt: skip
    forced = (source_ids(translator, prefixes, "prefix", at) if prefixes
              else [[] for _ in lines])  # fmt: skip
    # empty input: empty output (or its prefix alone), no model call
    results = [[Hypothesis(p, 0.0, 0.0)] if p else [] for p in forced]
    todo = [i for i, seq in enumerate(ids) if seq]
    _decode_all(translator, ids, forced, todo, at, results, scores=scores)
    if matches is not None and any(matches):
        _obey(translator, ids, forced, todo, results, matches, at)
    return results


def _hinted(
    translator: Decodable, lines: Sequence[str], matches: Sequence[Sequence[glossaries.Match]]
) -> list[str]:
    """The lines with their glossary entries written in as hints (glossary.mode hint, auto), as
    the model was trained to read them (its data.terms: the style, lemmas or not)."""
    terms, target = translator.config.data.terms, translator.config.data.tgt_lang
    return [
        hints.annotate(line, hints.glossary_spans(line, found, terms.lemma, target), terms.style)
        if found else line
        for line, found in zip(lines, matches, strict=True)
    ]  # fmt: skip


def _decode_all(
    translator: Decodable,
    ids: list[list[int]],
    forced: list[list[int]],
    todo: list[int],
    at: Sequence[int],
    results: list[list[Hypothesis]],
    terms: dict[int, constraints.Terms] | None = None,
    scores: bool = True,
) -> None:
    """results[i] = the hypotheses of line i for each i in `todo`, decoded in batches of
    decode.max_tokens source tokens (fewer with constraints, `terms` by line: their beam is
    wider); `at`: each line's index in the whole input (its sampling seed)."""
    if not todo:
        return
    decode = translator.config.decode
    lengths = np.array([len(ids[i]) + 1 for i in todo])
    budget = batch_budget.batch_tokens(translator)
    if terms is not None:  # the same rows a batch: glossary.beam rows a sentence, not beam_size
        budget = budget * decode.beam_size // max(translator.config.glossary.beam, 1)
    budget = max(budget, int(lengths.max()))
    sampler = TokenBucketSampler(
        src_lengths=lengths, tgt_lengths=lengths, max_tokens=budget, seed=0, shuffle=False
    )
    with kernels.attention(translator.config.model.attention_backend, translator.device):
        for batch in sampler.epoch_batches(0):
            chosen = [todo[j] for j in batch]
            sources = [ids[i] for i in chosen]
            line_ids, prefix = [at[i] for i in chosen], [forced[i] for i in chosen]
            batch_terms = [terms[i] for i in chosen] if terms is not None else None
            try:
                hypotheses = _translate_batch(
                    translator, sources, line_ids, prefix, batch_terms, scores=scores
                )
            except (torch.OutOfMemoryError, RuntimeError, MemoryError) as err:
                if not distributed.is_out_of_memory(err):
                    raise
                raise _out_of_memory(translator, sources) from None
            if decode.alignment != "none":
                hypotheses = _aligned(translator, sources, hypotheses)
            for index, hyps in zip(chosen, hypotheses, strict=True):
                results[index] = hyps


def _obey(
    translator: Decodable,
    ids: list[list[int]],
    forced: list[list[int]],
    todo: list[int],
    results: list[list[Hypothesis]],
    matches: Sequence[Sequence[glossaries.Match]],
    at: Sequence[int],
) -> None:
    """The glossary step (glossary.mode): each hypothesis of a line with matches learns which
    entries its text uses; with strict, a line one of whose outputs misses an entry is decoded
    again by constrained beam search (glossary.beam), which puts every entry in. An output that
    already uses every entry is kept: the model's own best, which a constrained search could at
    most equal (its outputs are a subset of the search space). A line without matches is left
    exactly as it was decoded. An entry strict could not place says why (the report's `missed`,
    and a warning naming the line), as does a line given fewer than nbest hypotheses."""
    tok, cfg = translator.tokenizer, translator.config
    strict = cfg.glossary.mode in ("strict", "auto")  # auto: strict after hints
    with_terms = [i for i in todo if matches[i]]
    first = {
        i: [constraints.used_alternatives(tok, matches[i], h) for h in results[i]]
        for i in with_terms
    }
    redo = [i for i in with_terms if strict and not all(-1 not in u for u in first[i])]
    terms = {i: constraints.compile_terms(tok, matches[i]) for i in redo}
    again = [i for i in redo if any(terms[i])]  # an entry the model cannot write stays out
    if again:
        _decode_all(_torch_side(translator), ids, forced, again, at, results,
                    {i: [t for t in terms[i] if t] for i in again})  # fmt: skip
    for i in with_terms:
        annotated = []
        for j, h in enumerate(results[i]):
            uses = (constraints.used_alternatives(tok, matches[i], h) if i in terms
                    else first[i][j])  # fmt: skip
            annotated.append(dataclasses.replace(h, terms=tuple(
                (alt, i in again and alt >= 0, "" if alt >= 0 or i not in terms
                 else _why_missed(translator, ids[i], forced[i], terms[i], e))
                for e, alt in enumerate(uses)
            )))  # fmt: skip
        results[i] = annotated
        _warn_misses(translator, at[i] + 1, matches[i], annotated, i in again)


def _why_missed(
    translator: Decodable, source: list[int], prefix: list[int], terms: constraints.Terms,
    entry: int,
) -> str:  # fmt: skip
    """Why strict's output does not hold entry `entry` of a line (`terms`: every entry's
    alternatives as the model writes them, [] for one it cannot)."""
    if not terms[entry]:
        return "its target has a piece the model's vocabulary cannot write"
    writable = [t for t in terms if t]
    limit = constrained_limits(translator, [source], [prefix] if prefix else [], [writable])[0]
    need = len(prefix) + sum(min(map(len, alternatives)) for alternatives in writable)
    if need >= limit:
        return (
            f"no room: its terms take {need} tokens and an output of this line at most"
            f" {limit - 1} (model.max_positions {max_positions(translator)})"
        )
    return f"the constrained search (glossary.beam {translator.config.glossary.beam}) found none"


def _warn_misses(
    translator: Decodable, line: int, matches: Sequence[glossaries.Match],
    hyps: list[Hypothesis], again: bool,
) -> None:  # fmt: skip
    """A warning for each entry strict could not place in the line's best output, and for a
    line whose n-best came back shorter than decode.nbest."""
    if not hyps:
        return
    for match, (_, _, why) in zip(matches, hyps[0].terms or (), strict=True):
        if why:
            logger.warning("glossary: line %d: %r -> %r not placed: %s", line,
                           match.entry.source, match.entry.target, why)  # fmt: skip
    nbest = translator.config.decode.nbest
    if again and len(hyps) < nbest:
        logger.warning("glossary: line %d: %d of %d hypotheses hold every entry (the constrained"
                       " search found no more)", line, len(hyps), nbest)  # fmt: skip


def _torch_side(translator: Decodable) -> Decodable:
    """The translator decoded by tmt's own engine: itself, or, for CTranslate2, its PyTorch model
    where it has one (constrained decoding is tmt's; translate.py keeps the model for it)."""
    if translator.engine is None:
        return translator
    if translator.model is None:
        raise TmtError(
            "glossary.mode=strict with decode.engine=ctranslate2: the lines that need"
            " constrained decoding are decoded by tmt's engine, from the tmt model, which was not"
            " loaded; load the model with the glossary, or use glossary.mode=check"
        )
    device = next(translator.model.parameters()).device
    return dataclasses.replace(translator, engine=None, device=device)  # type: ignore[type-var]


def _aligned(
    translator: Decodable, sources: list[list[int]], hypotheses: list[list[Hypothesis]]
) -> list[list[Hypothesis]]:
    """The hypotheses with their alignments to their sources (alignment.py), in subwords or
    words (decode.alignment), by the first model of an ensemble."""
    decode, tok = translator.config.decode, translator.tokenizer
    assert translator.model is not None  # check_engine: alignments need the PyTorch model
    each_source = [x for x, hyps in zip(sources, hypotheses, strict=True) for _ in hyps]
    pairs = iter(alignment.align(
        translator.model, tok, each_source, [h.tokens for hyps in hypotheses for h in hyps],
        decode.alignment_layer, translator.device,
    ))  # fmt: skip
    aligned = []
    for source, hyps in zip(sources, hypotheses, strict=True):
        found = []
        for h in hyps:
            pairs_of_h = next(pairs)
            if decode.alignment == "word":
                pairs_of_h = alignment.to_words(tok, source, h.tokens, pairs_of_h)
            found.append(dataclasses.replace(h, alignment=pairs_of_h))
        aligned.append(found)
    return aligned


def _out_of_memory(translator: Decodable, sources: list[list[int]]) -> TmtError:
    decode = translator.config.decode
    k = decode.nbest if decode.sampling != "none" else decode.beam_size
    return TmtError(
        f"decoding {len(sources)} sentences of up to {max(map(len, sources))} tokens, {k} rows"
        f" each, ran out of memory on {translator.device}: lower decode.max_tokens"
        f" ({batch_budget.batch_tokens(translator)}) or decode.beam_size ({decode.beam_size})"
    )


def _translate_batch(
    translator: Decodable,
    sources: list[list[int]],
    line_ids: Sequence[int],
    prefixes: list[list[int]],
    terms: list[constraints.Terms] | None = None,
    scores: bool = True,
) -> list[list[Hypothesis]]:
    """Encode a batch of sources once and search over the decoder: sampling, greedy, beam, or
    constrained beam search when `terms` are given (one Terms per source); greedy's scores
    only if `scores`."""
    model, tok, decode = translator.model, translator.tokenizer, translator.config.decode
    prefixes = prefixes if any(prefixes) else []  # none: the search's plain path
    if translator.engine is not None:
        limits = output_limits(translator, sources, prefixes)
        return ct2.decode(translator.engine, tok, sources, limits, decode, prefixes,
                          use_vmap=decode.shortlist != "none")  # fmt: skip
    assert model is not None
    samples = decode.nbest if decode.sampling != "none" else 1
    if samples > 1:  # N independent samples of a line are N rows of the same source
        sources = [seq for seq in sources for _ in range(samples)]
        prefixes = [seq for seq in prefixes for _ in range(samples)]
    src = torch.full((len(sources), max(map(len, sources)) + 1), tok.source_pad_id,
                     dtype=torch.long)  # fmt: skip
    for row, seq in enumerate(sources):
        src[row, : len(seq)] = torch.tensor(seq)
        src[row, len(seq)] = tok.source_eos_id
    logits = not scores and greedy_from_logits(translator)
    start = tok.start_id(translator.config.model.decoder_start)
    shortlist = translator.shortlist and Candidates.of_batch(
        translator.shortlist, tok, sources, prefixes, terms, start, translator.device)  # fmt: skip
    step, state = _step_function(translator, src.to(translator.device), not logits, shortlist)
    if shortlist is not None:  # the search's ids: indices into the batch's candidates
        hypotheses = _search(translator, step, state, sources, line_ids,
                             shortlist.search_ids(tok, start, prefixes), terms, logits)  # fmt: skip
        return shortlist.restore(hypotheses)
    return _search(translator, step, state, sources, line_ids,
                   (start, tok.eos_id, tok.never_output, prefixes), terms, logits)  # fmt: skip


def _search(
    translator: Decodable,
    step: StepFn,
    state: SearchState,
    sources: list[list[int]],
    line_ids: Sequence[int],
    ids: tuple[int, int, Sequence[int], list[list[int]]],
    terms: list[constraints.Terms] | None,
    logits: bool,
) -> list[list[Hypothesis]]:
    """The search decode.* asks for over `step`: ids = (start, eos, banned, prefixes) in the
    step's token ids."""
    model, tok, decode = translator.model, translator.tokenizer, translator.config.decode
    assert model is not None
    start, eos, banned, prefixes = ids
    samples = decode.nbest if decode.sampling != "none" else 1
    common = {"bos_id": start, "eos_id": eos, "banned": banned,
              "alpha": decode.length_penalty, "form": decode.length_penalty_form,
              "device": translator.device, "prefixes": prefixes,
              "forced_eos": decode.forced_eos}  # fmt: skip
    limits = output_limits(translator, sources, prefixes)
    if terms is not None:
        return constraints.constrained_beam_search(
            step, state, constrained_limits(translator, sources, prefixes, terms), terms,
            beam_size=max(translator.config.glossary.beam, decode.nbest),
            continues=constraints.word_continuations(tok).to(translator.device), nbest=decode.nbest,
            early_stopping=decode.early_stopping, **common,
        )  # fmt: skip
    if decode.sampling != "none":
        uniforms = torch.stack([
            line_uniforms(decode.seed, line, j, model.cfg.max_positions)
            for line in line_ids for j in range(samples)
        ])  # fmt: skip
        hypotheses = sample(
            step, state, limits, uniforms=uniforms, method=decode.sampling,
            temperature=decode.temperature, **common,
        )  # fmt: skip
        return [hypotheses[i : i + samples] for i in range(0, len(hypotheses), samples)]
    if decode.beam_size == 1:
        return [[h] for h in greedy(step, state, limits, logits=logits, **common)]
    if isinstance(state, DecoderGraphs):  # every step of the search one CUDA graph
        return graphed_beam_search(state, limits, beam_size=decode.beam_size, nbest=decode.nbest,
                                   early_stopping=decode.early_stopping, **common)  # fmt: skip
    return beam_search(
        step, state, limits, beam_size=decode.beam_size, nbest=decode.nbest,
        early_stopping=decode.early_stopping, **common,
    )  # fmt: skip


def greedy_from_logits(translator: Decodable) -> bool:
    """Whether greedy search may pick its tokens from the raw logits (search.logits_argmax: the
    same tokens, no log-softmax over the vocabulary per step) when its caller reads no scores:
    greedy search of one model, one hypothesis a line."""
    decode = translator.config.decode
    return (
        decode.beam_size == 1 and decode.sampling == "none" and decode.nbest == 1
        and not translator.ensemble
    )  # fmt: skip


def _step_function(
    translator: Decodable,
    src: torch.Tensor,
    normalise: bool = True,
    shortlist: Candidates | None = None,
) -> tuple[StepFn, SearchState]:
    """The search's step function and state over a batch of sources (B, S), encoded once by each
    model: its log-probabilities (unless not `normalise`: its logits, one model only), or an
    ensemble's mean of probabilities (ensemble.py); with a shortlist, over its candidates."""
    src_mask = make_src_mask(src, translator.tokenizer.source_pad_id)
    models = [m for m in (translator.model, *translator.ensemble) if m is not None]
    if _records_graphs(translator.config, src.device, len(models), shortlist is not None):
        graphs = DecoderGraphs(models[0], models[0].encode(src, src_mask), src_mask,
                               normalise=normalise, record=True)  # fmt: skip
        return (lambda tokens, s: (s.step(tokens), s)), graphs
    allowed = shortlist.allowed if shortlist is not None else None
    # One decoder row per sentence; beam search makes k (B·k), the source stays (B, S, D).
    states = [_DecodeState(m.start_cache(m.encode(src, src_mask)), src_mask, allowed)
              for m in models]  # fmt: skip
    projections = {id(m): shortlist.project(m) for m in models} if shortlist else {}

    def log_probs(model: Transformer, tokens: torch.Tensor, s: _DecodeState) -> torch.Tensor:
        if shortlist is None:
            logits = model.decode(tokens[:, None], None, s.src_mask, s.cache)[:, 0]  # (N, V)
        else:
            assert s.allowed is not None
            logits = shortlist.logits(model, tokens, s.src_mask, s.cache, s.allowed,
                                      projections[id(model)])  # fmt: skip
        return F.log_softmax(logits.float(), dim=-1) if normalise else logits.float()

    if len(models) == 1:
        return (lambda tokens, s: (log_probs(models[0], tokens, s), s)), states[0]
    log_weights = torch.tensor(translator.weights, device=src.device).log()

    def step(
        tokens: torch.Tensor, s: ensemble.EnsembleState
    ) -> tuple[torch.Tensor, ensemble.EnsembleState]:
        each = [log_probs(m, tokens, one) for m, one in zip(models, s.states, strict=True)]
        return ensemble.mean_log_probs(each, log_weights), s

    return step, ensemble.EnsembleState(states)


_NO_GRAPHS_LOGGED: set[str] = set()


def _records_graphs(cfg: Config, device: torch.device, models: int, shortlist: bool) -> bool:
    """Whether decode.cuda_graphs=on records the decoder's step here; where it cannot, why is
    logged once a process."""
    if cfg.decode.cuda_graphs != "on":
        return False
    why = ("a " + device.type + " has no CUDA graphs" if device.type != "cuda"
           else "an ensemble's steps are not recorded" if models > 1
           else "a shortlist's steps are not recorded" if shortlist else "")  # fmt: skip
    if why and why not in _NO_GRAPHS_LOGGED:
        _NO_GRAPHS_LOGGED.add(why)
        logger.info("decode.cuda_graphs=on: %s; decoding without them", why)
    return not why
