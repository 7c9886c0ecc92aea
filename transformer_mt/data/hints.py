"""Term hints: a source's terms followed by their translations in tags, so that the model learns
to copy a hint into its output (Dinu et al., 2019: inline "append" annotation) and a glossary
costs nothing at translation time (glossary.mode hint, auto).

    append:  der <t> Hund </t> <tr> dog </tr> bellt        replace:  der <tr> dog </tr> bellt

The four tags are user-defined symbols of the tokenizer (never split; never produced: search
bans them). A hint is the target word as the reference writes it, or with data.terms.lemma its
lemma (simplemma's offline data), so that the model learns to inflect it (Bergmanis & Pinnis,
2021). The same annotation serves training and translation: `annotate` writes the text, the
tokenizer encodes it.

In training (data.terms), a pair's candidates are the dictionary's entries found in its source
whose target its reference uses; they are found once per corpus and dictionary and cached beside
the encoded corpus (an Arrow file, memory-mapped, verified). Each epoch, a pair with candidates
gets hints with probability data.terms.annotate, each of its terms with probability
data.terms.span_share (at least one), all drawn from (train.seed, epoch, pair): a resumed run
and every rank see the same hints. Only training sources are annotated, never validation or test.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from transformer_mt.common import files
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, TermsConfig
from transformer_mt.data import glossary as glossaries
from transformer_mt.data.tokenizer import HINT_TAGS

logger = logging.getLogger(__name__)

TAGS = HINT_TAGS  # term start, term end, hint start, hint end
VERSION = 1  # of the candidates' cache entries


def annotate(text: str, spans: Sequence[tuple[int, int, str]], style: str) -> str:
    """`text` with each (start, end, hint) span (characters, in order, not overlapping) hinted."""
    out, at = [], 0
    for start, end, hint in spans:
        out.append(text[at:start])
        if style == "append":
            out.append(f"{TAGS[0]} {text[start:end]} {TAGS[1]} {TAGS[2]} {hint} {TAGS[3]}")
        else:
            out.append(f"{TAGS[2]} {hint} {TAGS[3]}")
        at = end
    out.append(text[at:])
    return "".join(out)


@functools.lru_cache(maxsize=8)
def _lemmatizer(lang: str) -> Callable[[str], str]:
    try:
        import simplemma
    except ImportError:
        raise TmtError("data.terms.lemma needs simplemma (the terms extra): pip install"
                       " 'transformer_mt[terms]'") from None  # fmt: skip
    from transformer_mt.common import languages

    code = languages.canonical(lang) or lang
    try:
        simplemma.lemmatize("test", lang=code)
    except ValueError:
        raise TmtError(f"data.terms.lemma: simplemma has no {lang!r} data") from None
    return lambda word: simplemma.lemmatize(word, lang=code)


def hint(target: str, lemma: bool, lang: str) -> str:
    """The hint for a target term: as written, or each word's lemma."""
    if not lemma:
        return target
    lemmatize = _lemmatizer(lang)
    return " ".join(lemmatize(word) if word.isalpha() else word for word in target.split())


def glossary_spans(
    text: str, matches: Sequence[glossaries.Match], lemma: bool, lang: str
) -> list[tuple[int, int, str]]:
    """The spans a translation's glossary hints (every entry matched; its first alternative)."""
    return [(m.start, m.end, hint(m.entry.targets[0], lemma, lang)) for m in matches]


# --- training: the candidates of each pair, cached; the hints of an epoch -----------------------


def candidates(
    pairs: Any, dictionary: glossaries.Glossary, terms: TermsConfig, tgt_lang: str
) -> pa.Table:
    """(row, text, starts, ends, hints) of each pair (`pairs`: a dataset of src and tgt, in the
    encoded table's order) with a dictionary term whose target its reference uses."""
    rows, texts, starts, ends, found = [], [], [], [], []
    row = 0
    for batch in pairs.select_columns(["src", "tgt"]).iter(batch_size=10_000):
        for src, tgt in zip(batch["src"], batch["tgt"], strict=True):
            kept = []
            for match in dictionary.match(src or ""):
                alternative = glossaries.used(match.entry, tgt or "")
                if alternative is not None:
                    target = match.entry.targets[alternative]
                    kept.append((match.start, match.end, hint(target, terms.lemma, tgt_lang)))
            if kept:
                rows.append(row)
                texts.append(src)
                starts.append([k[0] for k in kept])
                ends.append([k[1] for k in kept])
                found.append([k[2] for k in kept])
            row += 1
    return pa.table({
        "row": pa.array(rows, pa.int64()), "text": pa.array(texts, pa.string()),
        "starts": pa.array(starts, pa.list_(pa.int32())),
        "ends": pa.array(ends, pa.list_(pa.int32())),
        "hints": pa.array(found, pa.list_(pa.string())),
    })  # fmt: skip


def cached_candidates(key: str, cache: Path, make: Callable[[], pa.Table]) -> pa.Table:
    """The candidates of one corpus: read from the cache (memory-mapped, checked against the
    SHA-256 recorded when written), else made and written."""
    path = cache / "hints" / f"{key}.arrow"
    record = path.with_suffix(".sha256")
    if path.is_file() and record.is_file():
        try:
            if files.sha256_plain(path) == files.read_plain(record, limit=128).decode():
                return pa.ipc.open_file(pa.memory_map(str(path))).read_all()
            logger.warning("%s does not match its SHA-256: finding the candidates again", path)
        except (OSError, ValueError, pa.ArrowException) as err:
            logger.warning("%s unreadable (%s): finding the candidates again", path, err)
    table = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    with files.atomic_file(path) as handle, pa.ipc.new_file(handle, table.schema) as writer:
        writer.write_table(table)
    files.atomic_write(record, files.sha256_file(path).encode())
    return pa.ipc.open_file(pa.memory_map(str(path))).read_all()


def cache_key(corpus_fingerprint: str, dictionary: glossaries.Glossary, terms: TermsConfig,
              tgt_lang: str, cleaned_by: str) -> str:  # fmt: skip
    named = json.dumps([corpus_fingerprint, dictionary.sha256, terms.lemma, tgt_lang, cleaned_by,
                        VERSION])  # fmt: skip
    return hashlib.sha256(named.encode()).hexdigest()[:32]


@dataclass
class TermHints:
    """data.terms at training time: the candidates of every training pair (by its row in the
    encoded table), and each epoch's hints: which pairs and terms, their sources' ids and how
    many tokens they add (what the batches are packed by: a hinted batch keeps within
    data.max_tokens)."""

    terms: TermsConfig
    seed: int
    max_len: int
    tokenizer: Any
    table: pa.Table  # candidates, all corpora (rows in the concatenated encoded table)
    index: np.ndarray  # (rows,) the candidate row of each encoded row, -1 for none
    prefixes: list[list[int]]  # each corpus's tag ids (a tagged corpus's sources start with them)
    _extra: tuple[int, np.ndarray] | None = None  # (epoch, its added tokens): the last asked for

    @classmethod
    def build(cls, cfg: Config, tokenizer: Any, table: pa.Table, index: np.ndarray,
              prefixes: list[list[int]]) -> TermHints:  # fmt: skip
        return cls(cfg.data.terms, cfg.train.seed, cfg.data.max_len, tokenizer, table, index,
                   prefixes)  # fmt: skip

    def hinted(
        self, positions: np.ndarray, rows: np.ndarray, groups: np.ndarray | None, epoch: int
    ) -> dict[int, np.ndarray]:
        """{i: source ids} of the pairs at `positions` (their encoded `rows`) that get hints in
        `epoch`: drawn from (train.seed, epoch, position), a pair with probability
        data.terms.annotate, each of its terms with data.terms.span_share (at least one); a
        hinted source longer than data.max_len is left without its hints."""
        picks, texts = [], []
        pairs = zip(np.asarray(positions).tolist(), np.asarray(rows).tolist(), strict=True)
        for i, (position, row) in enumerate(pairs):
            j = int(self.index[row])
            if j < 0:
                continue
            draw = np.random.default_rng([self.seed, epoch, position, 0x7E])
            if draw.random() >= self.terms.annotate:
                continue
            spans = list(zip(self.table.column("starts")[j].as_py(),
                             self.table.column("ends")[j].as_py(),
                             self.table.column("hints")[j].as_py(), strict=True))  # fmt: skip
            chosen = [s for s in spans if draw.random() < self.terms.span_share]
            chosen = chosen or [spans[int(draw.integers(len(spans)))]]
            picks.append((i, position))
            texts.append(annotate(self.table.column("text")[j].as_py(), chosen, self.terms.style))
        out = {}
        encoded = self.tokenizer.encode(texts, side="source") if texts else []
        for (i, position), ids in zip(picks, encoded, strict=True):
            prefix = self.prefixes[int(groups[position])] if groups is not None else []
            if len(prefix) + len(ids) <= self.max_len:
                out[i] = np.asarray([*prefix, *ids], dtype=np.int64)
        return out

    def annotate(
        self,
        src_ids: list[np.ndarray],
        positions: Sequence[int] | np.ndarray,
        rows: np.ndarray,
        groups: np.ndarray | None,
        epoch: int,
    ) -> list[np.ndarray]:
        """This epoch's sources of the pairs at `positions`: hinted where drawn, else as given."""
        out = list(src_ids)
        for i, ids in self.hinted(np.asarray(positions), rows, groups, epoch).items():
            out[i] = ids
        return out

    def extra(self, rows: np.ndarray, groups: np.ndarray | None, lengths: np.ndarray,
              epoch: int) -> np.ndarray:  # fmt: skip
        """(N,) the tokens each pair's source gains in `epoch` (`rows`: the split's encoded rows
        by position; `lengths`: its sources' lengths), from the same draws as its batches."""
        if self._extra is not None and self._extra[0] == epoch:
            return self._extra[1]
        extra = np.zeros(len(rows), dtype=np.int64)
        with_terms = np.flatnonzero(self.index[rows] >= 0)
        for i, ids in self.hinted(with_terms, rows[with_terms], groups, epoch).items():
            position = with_terms[i]
            extra[position] = len(ids) - lengths[position]
        self._extra = (epoch, extra)
        return extra


# --- fine-tuning a model whose tokenizer lacks the tags ------------------------------------------


def with_tags(tokenizer: Any, state_dict: dict[str, torch.Tensor], seed: int) -> tuple[Any, dict]:
    """A parent model (train.init_from: an imported OPUS-MT model, a tmt model trained without
    hints) and its tokenizer grown by the tags it lacks: new ids after the last, each with an
    embedding row drawn from a normal with the mean and spread (per dimension) of the existing
    rows, as transformers' resize_token_embeddings starts new tokens, so that a tag reads as a
    token of the model and its output logit as an ordinary one's; an output bias starts at the
    lowest of the others (the tags are never targets). Every existing weight is kept exactly."""
    grown = tokenizer.with_symbols(TAGS)
    if grown is tokenizer:
        return tokenizer, state_dict
    generator = torch.Generator().manual_seed(seed)
    out = dict(state_dict)
    sides = [("embedding.weight", "target"), ("source_embedding.weight", "source")]
    for name, side in sides:
        if name not in state_dict:  # a shared embedding: the source's is the target's
            continue
        old = state_dict[name]  # (V, D)
        size = grown.vocab_size if side == "target" else grown.source_vocab_size
        extra = size - old.shape[0]
        if extra <= 0:  # separate vocabularies: the tags are the source's only
            continue
        mean, std = old.float().mean(0), old.float().std(0)
        rows = mean + std * torch.randn(extra, old.shape[1], generator=generator)
        out[name] = torch.cat([old, rows.to(old.dtype)])
        if side == "target":
            out["output_projection.weight"] = out[name]  # tied (§3.4)
            bias = state_dict.get("output_projection.bias")
            if bias is not None:
                out["output_projection.bias"] = torch.cat([bias, bias.min().repeat(extra)])
    return grown, out


def dictionary_of(cfg: Config) -> glossaries.Glossary:
    """data.terms.dictionary, read as a glossary of the config's pair."""
    terms = cfg.data.terms
    try:
        return glossaries.load(terms.dictionary, pair=(cfg.data.src_lang, cfg.data.tgt_lang))
    except TmtError as err:
        raise TmtError(f"data.terms.dictionary: {err}") from None


def trained_with_hints(cfg: Config) -> bool:
    """Whether a model's config says it was trained with term hints (its checkpoint keeps it)."""
    return bool(cfg.data.terms.annotate and cfg.data.terms.dictionary)
