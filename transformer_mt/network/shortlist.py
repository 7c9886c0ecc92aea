"""Lexical shortlists (Marian's and Firefox Translations' speed-up of small CPU models): for each
source piece the target pieces it is likely to be translated into, and the corpus's most frequent
target pieces. Decoding with one (decode.shortlist) scores a sentence's outputs over its own
candidates only: `first` frequent pieces, the `best` translations of each of its source pieces,
</s>, and the pieces of its prefix and glossary entries (decoding.py); the output projection is
computed over the union of a batch's sets, and each row is masked to its own sentence's, so a
line's translation never depends on its neighbours (Marian and CTranslate2 take the union per
batch).

p(target piece | source piece) comes from word alignments of the pieces: eflomal's (the terms
extra) where it installs, else a built-in IBM model 1 (5 EM iterations); the file says which.

The file (shortlist.npz beside the model, or any path) holds three integer arrays and a JSON
header with the model's fingerprint and the arrays' SHA-256: it is verified on every load and
refused for another model, when damaged, or when it names pieces outside the vocabulary.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import math
import time
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from transformer_mt.common import files
from transformer_mt.common.exits import TmtError
from transformer_mt.data import aligner as aligner_module

FILE_NAME = "shortlist.npz"  # in the model's directory: what decode.shortlist=auto reads
FORMAT, VERSION = "tmt-shortlist", 1
# A side of more tokens is no sentence to align (a file without line breaks, a page of markup): its
# pair is left out, as clean-corpus-n leaves it out before fast_align.
ALIGN_TOKENS = 1024
IBM1_ITERATIONS = 5


@dataclass(frozen=True)
class Shortlist:
    frequent: np.ndarray  # (first,) target ids, most frequent first
    offsets: np.ndarray  # (source vocabulary + 1,): piece s's translations are targets[o[s]:o[s+1]]
    targets: np.ndarray  # target ids, each source piece's best first
    header: dict[str, Any]  # fingerprint, vocabulary sizes, first, best, min_prob, aligner, ...

    def candidates(self, source: Sequence[int]) -> np.ndarray:
        """The sorted target ids a sentence of these source ids may output (its </s>, prefix
        and glossary pieces are the caller's to add)."""
        parts = [self.frequent] + [
            self.targets[self.offsets[s] : self.offsets[s + 1]]
            for s in set(source)
            if 0 <= s < len(self.offsets) - 1
        ]
        return np.unique(np.concatenate(parts))

    def size(self) -> float:
        """The mean number of translations a source piece has."""
        return len(self.targets) / max(len(self.offsets) - 1, 1)


# --- building -----------------------------------------------------------------------------------


def build(
    pairs: Iterable[tuple[list[int], list[int]]],
    source_vocab: int,
    target_vocab: int,
    never: Sequence[int],
    first: int,
    best: int,
    min_prob: float,
    aligner: str = "auto",
) -> tuple[Shortlist, dict[str, Any]]:
    """A shortlist from (source ids, target ids) pairs (of at most ALIGN_TOKENS a side); `never`
    are ids no output may be (pad, bos, tags). aligner: "eflomal", "ibm1", or "auto" (eflomal
    where it installs)."""
    start = time.monotonic()
    pairs = [(s, t) for s, t in pairs if 0 < len(s) <= ALIGN_TOKENS and 0 < len(t) <= ALIGN_TOKENS]
    if not pairs:
        raise TmtError("no sentence pairs to build a shortlist from")
    links, name = _align(pairs, aligner)
    joint: collections.Counter[tuple[int, int]] = collections.Counter()
    for (source, target), found in zip(pairs, links, strict=True):
        joint.update((source[i], target[j]) for i, j in found)
    per_source: collections.Counter[int] = collections.Counter()
    for (s, _), n in joint.items():
        per_source[s] += n
    banned = set(never)
    ranked: dict[int, list[tuple[float, int]]] = collections.defaultdict(list)
    for (s, t), n in joint.items():
        p = n / per_source[s]
        if t not in banned and p >= min_prob:
            ranked[s].append((-p, t))
    offsets, targets = np.zeros(source_vocab + 1, dtype=np.int64), []
    for s in range(source_vocab):
        chosen = [t for _, t in sorted(ranked.get(s, []))[:best]]
        targets += chosen
        offsets[s + 1] = offsets[s] + len(chosen)
    counts = collections.Counter(t for _, target in pairs for t in target if t not in banned)
    frequent = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:first]]
    header = {"first": first, "best": best, "min_prob": min_prob, "aligner": name,
              "pairs": len(pairs), "source_vocab": source_vocab,
              "target_vocab": target_vocab}  # fmt: skip
    table = Shortlist(
        np.array(frequent, dtype=np.int32), offsets, np.array(targets, dtype=np.int32), header
    )
    report = {"pairs": len(pairs), "aligner": name, "first": len(frequent),
              "mean_translations": round(table.size(), 1),
              "seconds": round(time.monotonic() - start, 1)}  # fmt: skip
    return table, report


def _align(
    pairs: list[tuple[list[int], list[int]]], aligner: str
) -> tuple[list[set[tuple[int, int]]], str]:
    """Links (source index, target index) per pair, and the aligner's name."""
    if aligner in ("auto", "eflomal"):
        try:
            found = aligner_module.eflomal_aligner()
        except ImportError:
            if aligner == "eflomal":
                raise TmtError("eflomal is not installed: pip install 'transformer_mt[terms]',"
                               " or --aligner ibm1") from None  # fmt: skip
        else:
            words = [([str(i) for i in s], [str(i) for i in t]) for s, t in pairs]
            links = found.align([s for s, _ in words], [t for _, t in words])
            return links, found.name + " over pieces"
    return ibm1(pairs), f"IBM model 1 ({IBM1_ITERATIONS} iterations, built in; eflomal not used)"


def ibm1(
    pairs: list[tuple[list[int], list[int]]], iterations: int = IBM1_ITERATIONS
) -> list[set[tuple[int, int]]]:
    """IBM model 1 (Brown et al. 1993) by EM over every (source, target) co-occurrence, in
    arrays: each target piece linked to its likeliest source piece (a NULL source absorbs pieces
    with no counterpart and is never linked)."""
    null = -1
    sent, src, tgt, tgt_pos, src_pos = [], [], [], [], []
    for n, (source, target) in enumerate(pairs):
        source = [null, *source]
        for j, t in enumerate(target):
            for i, s in enumerate(source):
                sent.append(n)
                src.append(s)
                tgt.append(t)
                tgt_pos.append(j)
                src_pos.append(i - 1)
    src_a, tgt_a = np.array(src, dtype=np.int64), np.array(tgt, dtype=np.int64)
    keys, key_of = np.unique((src_a + 1) * (tgt_a.max() + 1) + tgt_a, return_inverse=True)
    # One group per target occurrence: its row's sentence and target position.
    occurrence = np.unique(np.array(sent) * 100_000 + np.array(tgt_pos), return_inverse=True)[1]
    source_of_key = keys // (tgt_a.max() + 1)
    prob = np.ones(len(keys))
    for _ in range(iterations):
        weight = prob[key_of]
        share = weight / np.bincount(occurrence, weight)[occurrence]
        expected = np.bincount(key_of, share, minlength=len(keys))
        totals = np.bincount(source_of_key, expected)
        prob = expected / totals[source_of_key]
    score = prob[key_of]
    order = np.lexsort((-score, occurrence))  # per occurrence, the likeliest source first
    first_of = order[np.r_[True, occurrence[order][1:] != occurrence[order][:-1]]]
    links: list[set[tuple[int, int]]] = [set() for _ in pairs]
    for row in first_of.tolist():
        if src_pos[row] >= 0:
            links[sent[row]].add((src_pos[row], tgt_pos[row]))
    return links


def from_marian(path: Path, tok: Any, first: int, best: int) -> Shortlist:
    """Marian's text shortlist (lex.s2t: "target source probability" a line, pieces as text) as
    a table for tokenizer `tok`; the `first` most frequent targets are taken from the
    probabilities' mass."""
    source_vocab, target_vocab = tok.source_vocab_size, tok.vocab_size

    def piece_id(piece: str, side: str) -> int:  # -1 for a piece not in the vocabulary
        found = tok.piece_to_id(piece, side=side)
        return found if found >= 0 and tok.id_to_piece(found, side=side) == piece else -1

    ranked: dict[int, list[tuple[float, int]]] = collections.defaultdict(list)
    mass: collections.Counter[int] = collections.Counter()
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            fields = line.split()
            if not fields:
                continue
            try:
                target_piece, source_piece, p = fields[0], fields[1], float(fields[2])
            except (IndexError, ValueError):
                raise TmtError(f"{path}:{number}: expected 'target source probability'") from None
            ids = [piece_id(target_piece, "target"), piece_id(source_piece, "source")]
            if min(ids) < 0 or not math.isfinite(p):
                raise TmtError(f"{path}:{number}: {line.strip()!r}: a piece not in the model's"
                               " vocabulary, or a probability that is no number")  # fmt: skip
            ranked[ids[1]].append((-p, ids[0]))
            mass[ids[0]] += p
    offsets, targets = np.zeros(source_vocab + 1, dtype=np.int64), []
    for s in range(source_vocab):
        chosen = [t for _, t in sorted(ranked.get(s, []))[:best]]
        targets += chosen
        offsets[s + 1] = offsets[s] + len(chosen)
    frequent = [t for t, _ in sorted(mass.items(), key=lambda kv: (-kv[1], kv[0]))[:first]]
    header = {"first": first, "best": best, "aligner": f"Marian lex.s2t {path.name}",
              "source_vocab": source_vocab, "target_vocab": target_vocab}  # fmt: skip
    return Shortlist(
        np.array(frequent, dtype=np.int32), offsets, np.array(targets, dtype=np.int32), header
    )


# --- the file ----------------------------------------------------------------------------------


def _digest(table: Shortlist) -> str:
    digest = hashlib.sha256()
    for array in (table.frequent, table.offsets, table.targets):
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def save(table: Shortlist, path: Path, fingerprint: str) -> None:
    """Write the table for the model of this fingerprint, atomically."""
    header = {**table.header, "format": FORMAT, "version": VERSION, "model": fingerprint,
              "sha256": _digest(table)}  # fmt: skip
    buffer = io.BytesIO()
    np.savez(buffer, frequent=table.frequent, offsets=table.offsets, targets=table.targets,
             header=np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8))  # fmt: skip
    files.atomic_write(path, buffer.getvalue())


def load(path: Path, fingerprint: str, source_vocab: int, target_vocab: int) -> Shortlist:
    """The table in `path`, verified: its format, its arrays' SHA-256, made for this model
    (fingerprint), every id within the vocabularies; else a one-line TmtError naming the file."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in ("frequent", "offsets", "targets", "header")}
        header = json.loads(arrays.pop("header").tobytes().decode("utf-8"))
    except FileNotFoundError:
        raise TmtError(f"{path}: no such shortlist: make one with tmt shortlist -m MODEL") from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError, UnicodeDecodeError,
            RecursionError) as e:  # fmt: skip
        raise TmtError(f"{path}: not a readable tmt shortlist ({type(e).__name__})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TmtError(f"{path}: not a tmt shortlist")
    if header.get("version") != VERSION:
        raise TmtError(f"{path}: shortlist version {header.get('version')!r}, this tmt reads"
                       f" {VERSION}")  # fmt: skip
    table = Shortlist(arrays["frequent"], arrays["offsets"], arrays["targets"], header)
    if header.get("sha256") != _digest(table):
        raise TmtError(f"{path}: damaged (its arrays do not match their SHA-256): make it again")
    if header.get("model") != fingerprint:
        made_for = str(header.get("model"))[:12]
        raise TmtError(f"{path}: made for another model (fingerprint {made_for}, this one"
                       f" {fingerprint[:12]})")  # fmt: skip
    offsets, ids = table.offsets, np.concatenate([table.frequent, table.targets])
    shape_ok = len(offsets) == source_vocab + 1 and offsets[0] == 0
    if not shape_ok or offsets[-1] != len(table.targets) or bool((np.diff(offsets) < 0).any()):
        raise TmtError(f"{path}: its table does not fit this model's source vocabulary")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= target_vocab):
        raise TmtError(f"{path}: names target ids outside this model's {target_vocab} pieces")
    return table
