"""`tmt terms`: a term dictionary from the training data, its source words and phrases with the
target words and phrases they align to, and how often (the glossary's TSV with a count column:
what data.terms.dictionary reads, what a person can edit into a glossary).

    tmt terms -c CONFIG -o terms.tsv [-m MODEL]

data.train is read as `tmt train` reads it, in chunks of data.terms.chunk_pairs pairs, each
aligned word by word: by eflomal where it is installed (the terms extra; Mozilla's translation
pipeline aligns with it), forward and reverse, symmetrised by grow-diag; else, with -m, by a
trained model's cross-attention (tmt translate --alignment word); else refused in one line.
From each chunk's links come the phrase pairs consistent with them (at most
data.terms.max_words words a side, starting and ending with no word among the
data.terms.skip_common most frequent of its side) and their counts, committed to
FILE.tmt-terms/ one chunk at a time (its counts, then a record of their SHA-256): a killed run
resumes after the last committed chunk, and a committed chunk is verified, not trusted.
Memory holds one chunk and the counts, not the corpus (past a bound, the rarest counts are
dropped: bounded()). The dictionary keeps, per source phrase seen data.terms.min_count times, the
targets with p(target | source) >= data.terms.min_prob, the likeliest first, as alternatives.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from transformer_mt.common import files, finished, languages, textio
from transformer_mt.common.exits import TmtError
from transformer_mt.common.faults import fault_point
from transformer_mt.config import Config, to_dict
from transformer_mt.data import aligner, corpus
from transformer_mt.data import glossary as glossaries

logger = logging.getLogger("tmt")

WORK_SUFFIX = ".tmt-terms"
FORMAT = 1
_MAX_COUNTS = 1_000_000  # distinct phrase pairs kept (about 300 MB) before the rarest are dropped
# A side of more words is no sentence to align (a file without line breaks, a page of markup): its
# pair is left out, as clean-corpus-n leaves it out before fast_align. Its words are not even read
# past ALIGN_WORDS · 64 characters: a 50 MB line took 24 s and 2.3 GB.
ALIGN_WORDS = 1024
Links = aligner.Links


def build(cfg: Config, output: Path, model: str | None = None, overwrite: bool = False) -> dict:
    """Align data.train and write the dictionary to `output`; the report."""
    textio.check_output(output, overwrite=True)  # a file of its own: never a directory
    with textio.OutputLock(output):
        corpora = corpus.open_training(cfg.data)
        inputs = [path for split in corpora for path in corpus.input_files(split)]
        aligner = _aligner(cfg, model)
        work = output.with_name(output.name + WORK_SUFFIX)
        identity = {"format": FORMAT, "corpora": [s.fingerprint for s in corpora],
                    "terms": to_dict(cfg)["data"]["terms"], "aligner": aligner.name}  # fmt: skip
        kind = None if overwrite else _finished_before(work, identity, output)
        if kind == "done":  # the same command after it finished: nothing to do
            return {"output": str(output), "done": True, "entries": _entries_in(output),
                    "pairs": None, "aligner": aligner.name, "resumed_chunks": 0,
                    "seconds": 0.0}  # fmt: skip
        textio.check_output(output, inputs, overwrite=overwrite)
        finished.forget(work)
        _open_work(work, identity, overwrite)
        start, resumed = time.monotonic(), 0
        totals: collections.Counter[tuple[str, str]] = collections.Counter()
        freq: list[collections.Counter[str]] = [collections.Counter(), collections.Counter()]
        pairs = 0
        for number, chunk in enumerate(_chunks(corpora, cfg.data.terms.chunk_pairs)):
            counted = _read_chunk(work, number)
            if counted is None:
                counted = _count(chunk, aligner, cfg)
                _commit(work, number, counted)
                fault_point("terms_chunk", number + 1)
            else:
                resumed += 1
            pairs += len(chunk)
            for side in (0, 1):
                freq[side].update(counted["words"][side])
            for source, target, n in counted["pairs"]:
                totals[(source, target)] += n
            totals = bounded(totals, _MAX_COUNTS)
        if not pairs:  # nothing to align: an empty dictionary would only mislead
            shutil.rmtree(work, ignore_errors=True)
            origins = ", ".join(split.origin for split in corpora)
            raise TmtError(f"data.train ({origins}): no pairs to align; tmt terms wrote nothing")
        entries = _dictionary(totals, freq, cfg)
        if not entries:
            logger.warning("%s: no phrase pair reached data.terms.min_count %d (and min_prob"
                           " %g) in %d pairs: the dictionary has no entries", output,
                           cfg.data.terms.min_count, cfg.data.terms.min_prob, pairs)  # fmt: skip
        header = (f"# tmt terms: {len(entries)} entries from {pairs} pairs of data.train;"
                  f" aligner: {aligner.name}; {json.dumps(identity['terms'])}\n")  # fmt: skip
        text = header + "".join(f"{s}\t{' | '.join(t)}\t{n}\n" for s, t, n in entries)
        files.atomic_write(output, text.encode("utf-8"))
        # The dictionary is whole: the chunks go, the record of what was made stays.
        files.clear_directory(work)
        finished.mark_done(work, identity, [output])
    return {"output": str(output), "done": False, "entries": len(entries), "pairs": pairs,
            "aligner": aligner.name, "resumed_chunks": resumed,
            "seconds": round(time.monotonic() - start, 1)}  # fmt: skip


def _finished_before(work: Path, identity: dict[str, Any], output: Path) -> str | None:
    """ "done" when this very dictionary was made before (common/finished.py), said in the log;
    one made from other corpora, settings or aligner is refused, naming what differs."""
    kind, recorded = finished.state(work, identity, [output])
    if kind == "other":
        differ = [key for key in identity if recorded.get(key) != identity[key]]
        raise TmtError(f"{output}: a dictionary tmt terms made from other {', '.join(differ)};"
                       " run that command (it is done), or add {overwrite} to make it again",
                       mentions=["overwrite"])  # fmt: skip
    if kind == "done":
        logger.info("%s: done: this dictionary (corpora, settings, aligner) was made before;"
                    " nothing written", output)  # fmt: skip
    return kind


def _entries_in(output: Path) -> int:
    """Entries of a dictionary tmt terms wrote (its lines but the header)."""
    with open(output, "rb") as handle:
        return sum(1 for line in handle if line.strip() and not line.startswith(b"# "))


def format_report(report: dict[str, Any]) -> str:
    if report.get("done"):
        return f"{report['output']}: done before: {report['entries']} entries (nothing written)"
    return (f"{report['output']}: {report['entries']} entries from {report['pairs']} pairs"
            f" ({report['aligner']}; {report['resumed_chunks']} chunks committed before,"
            f" {report['seconds']} s)")  # fmt: skip


def bounded(
    counts: collections.Counter[tuple[str, str]], limit: int
) -> collections.Counter[tuple[str, str]]:
    """`counts` within `limit` entries: past it, the rarest are dropped (seen once, then twice,
    ...) until half the limit is left, as lossy counting does (Manku & Motwani, 2002): a pair
    frequent enough to become an entry survives; the memory is the limit's, not the corpus's."""
    if len(counts) <= limit:
        return counts
    floor = 1
    while len(counts) > limit // 2:
        counts = collections.Counter({k: v for k, v in counts.items() if v > floor})
        floor += 1
    return counts


# --- aligners ----------------------------------------------------------------------------------


class _ModelAligner:
    """A trained model's word alignments of each pair (teacher-forced cross-attention)."""

    def __init__(self, model: str) -> None:
        from transformer_mt.translation import translate

        self.translator = translate.load_translator(model, ["decode.alignment=word"])
        self.name = f"tmt --alignment word of {self.translator.origin}"

    def align(self, source: list[list[str]], target: list[list[str]]) -> list[Links]:
        from transformer_mt.network import alignment

        tok = self.translator.tokenizer
        sources = tok.encode([" ".join(s) for s in source], side="source")
        targets = tok.encode([" ".join(t) for t in target], side="target")
        found = alignment.align(self.translator.model, tok, sources, targets,
                                self.translator.config.decode.alignment_layer,
                                self.translator.device)  # fmt: skip
        return [set(alignment.to_words(tok, s, t, pairs))
                for s, t, pairs in zip(sources, targets, found, strict=True)]  # fmt: skip


def _aligner(cfg: Config, model: str | None) -> Any:
    if model:
        return _ModelAligner(model)
    try:
        return aligner.Eflomal()
    except ImportError:
        raise TmtError("tmt terms needs an aligner: pip install 'transformer_mt[terms]' (eflomal),"
                       " or give -m a trained model of this pair to align with its attention"
                       ) from None  # fmt: skip


# --- counting ----------------------------------------------------------------------------------


def _chunks(corpora: Sequence[corpus.RawSplit], size: int) -> Iterator[list[tuple[str, str]]]:
    """data.train's pairs in chunks of `size` (a chunk never spans two corpora)."""
    for split in corpora:
        buffer: list[tuple[str, str]] = []
        for block in split.pairs(min(size, 20_000), as_trained=True):
            buffer += block
            while len(buffer) >= size:
                yield buffer[:size]
                buffer = buffer[size:]
        if buffer:
            yield buffer


def _words(text: str) -> list[str]:
    """The words of `text` as the dictionary counts them; none of a text of more than
    ALIGN_WORDS (unread past what they could hold)."""
    if len(text) > 64 * ALIGN_WORDS:
        return []
    words = [glossaries.plain(w) for w, _, _ in glossaries.words(text)]
    return words if len(words) <= ALIGN_WORDS else []


def _count(chunk: list[tuple[str, str]], aligner: Any, cfg: Config) -> dict[str, Any]:
    """A chunk's phrase pairs and their counts, and each side's word counts."""
    source = [_words(s) for s, _ in chunk]
    target = [_words(t) for _, t in chunk]
    kept = [i for i, (s, t) in enumerate(zip(source, target, strict=True)) if s and t]
    links = aligner.align([source[i] for i in kept], [target[i] for i in kept])
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    limit = cfg.data.terms.max_words
    for i, found in zip(kept, links, strict=True):
        for pair in phrases(source[i], target[i], found, limit):
            counts[pair] += 1
    words = [collections.Counter(w for s in side for w in s) for side in (source, target)]
    return {"pairs": [[s, t, n] for (s, t), n in sorted(counts.items())],
            "words": [dict(words[0]), dict(words[1])]}  # fmt: skip


def phrases(
    source: list[str], target: list[str], links: Links, limit: int
) -> Iterator[tuple[str, str]]:
    """The phrase pairs of one pair consistent with its links (Och & Ney's rule: no link leaves
    the box), at most `limit` words a side, without unaligned words at their edges."""
    aligned_src = collections.defaultdict(list)
    for i, j in links:
        aligned_src[i].append(j)
    for i1 in range(len(source)):
        for i2 in range(i1, min(i1 + limit, len(source))):
            js = [j for i in range(i1, i2 + 1) for j in aligned_src.get(i, ())]
            if not js or i1 not in aligned_src or i2 not in aligned_src:
                continue
            j1, j2 = min(js), max(js)
            if j2 - j1 + 1 > limit:
                continue
            if any(j1 <= j <= j2 and not i1 <= i <= i2 for i, j in links):
                continue
            yield glossaries.join(source[i1 : i2 + 1]), glossaries.join(target[j1 : j2 + 1])


# --- the record of committed chunks -------------------------------------------------------------


def _open_work(work: Path, identity: dict[str, Any], overwrite: bool) -> None:
    """FILE.tmt-terms/: an earlier run's chunks are reused when they come from the same corpora,
    settings and aligner; another's are refused (or, with overwrite, removed)."""
    state = work / "state.json"
    if state.exists():
        try:
            found = json.loads(files.read_plain(state, limit=1 << 20))
        except (OSError, ValueError, RecursionError):
            found = None
        if found != identity:
            if not overwrite:
                raise TmtError(f"{work}: an unfinished tmt terms of other corpora, settings or"
                               " aligner; run it as it was to finish it, or add {overwrite}",
                               mentions=["overwrite"])  # fmt: skip
            shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    files.remove_leftovers(work, [f".*{files.TEMP_SUFFIX}"])
    files.atomic_write(state, json.dumps(identity).encode())


def _chunk_path(work: Path, number: int) -> Path:
    return work / f"{number:06d}.json"


def _commit(work: Path, number: int, counted: dict[str, Any]) -> None:
    data = json.dumps(counted, ensure_ascii=False).encode()
    files.atomic_write(_chunk_path(work, number), data)
    files.atomic_write(_chunk_path(work, number).with_suffix(".sha256"),
                       hashlib.sha256(data).hexdigest().encode())  # fmt: skip


def _read_chunk(work: Path, number: int) -> dict[str, Any] | None:
    """A committed chunk's counts, when its record says they are whole; else None (counted
    again, and said so when they were there but changed)."""
    path, record = _chunk_path(work, number), _chunk_path(work, number).with_suffix(".sha256")
    if not record.is_file():
        return None
    try:
        data = files.read_plain(path)
        if hashlib.sha256(data).hexdigest() != files.read_plain(record, limit=128).decode():
            raise ValueError("does not match its record")
        counted = json.loads(data)
        if not isinstance(counted, dict) or {"pairs", "words"} - set(counted):
            raise ValueError("not a chunk's counts")
        return counted
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as err:
        logger.warning("%s: %s; counting the chunk again", path, err)
        return None


# --- the dictionary ----------------------------------------------------------------------------


def _dictionary(
    totals: collections.Counter[tuple[str, str]],
    freq: list[collections.Counter[str]],
    cfg: Config,
) -> list[tuple[str, list[str], int]]:
    """(source, its targets likeliest first, the count of the first) of each source phrase."""
    terms = cfg.data.terms
    common = [{w for w, _ in f.most_common(terms.skip_common)} for f in freq]

    def term_like(phrase: str, side: int) -> bool:
        words = [w for w, _, _ in glossaries.words(phrase)]
        edges = (words[0], words[-1])
        # One letter is no term, but one character of Chinese or Thai may be (狗, dog).
        return all((len(w) > 1 or languages.unspaced(w)) and any(c.isalpha() for c in w)
                   and w.casefold() not in common[side] and w not in common[side]
                   for w in edges)  # fmt: skip

    # Case set aside (a glossary matches so): each phrase's most frequent form stands for it.
    forms: dict[tuple[int, str], collections.Counter[str]] = collections.defaultdict(
        collections.Counter)  # fmt: skip
    pairs: collections.Counter[tuple[str, str]] = collections.Counter()
    for (source, target), n in totals.items():
        if "|" in source + target or not (term_like(source, 0) and term_like(target, 1)):
            continue
        forms[(0, source.casefold())][source] += n
        forms[(1, target.casefold())][target] += n
        pairs[(source.casefold(), target.casefold())] += n
    by_source: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    for (source, target), n in pairs.items():
        by_source[source].append((forms[(1, target)].most_common(1)[0][0], n))
    entries = []
    for source, found in sorted(by_source.items()):
        total = sum(n for _, n in found)
        if total < terms.min_count:
            continue
        ranked = sorted(found, key=lambda item: (-item[1], item[0]))
        targets = [t for t, n in ranked if n >= terms.min_count and n / total >= terms.min_prob]
        if targets:
            surface = forms[(0, source)].most_common(1)[0][0]
            entries.append((surface, list(dict.fromkeys(targets))[:3], ranked[0][1]))
    return entries
