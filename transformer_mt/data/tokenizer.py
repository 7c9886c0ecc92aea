"""The joint sentencepiece vocabulary (§5.1): trained on source + target, carried as model bytes.

The model bytes travel with every run and checkpoint, so one file turns raw text into ids and back.
Special ids (pad, unk, bos, eos) are read from the model, never assumed. A model is trained once
per (training data, tokenizer config) and cached: <cache>/tokenizers/<key>.model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import random
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import sentencepiece as spm

from transformer_mt.common import files, languages
from transformer_mt.common.exits import TmtError
from transformer_mt.config import TokenizerConfig
from transformer_mt.data.marian_tokenizer import (
    HINT_TAGS,
    MarianTokenizer,
    is_marian,
    load_processor,
)

if TYPE_CHECKING:
    from transformer_mt.data.corpus import RawSplit

logger = logging.getLogger(__name__)


# sentencepiece encodes and decodes a list on a pool of threads it starts for each call: for a
# few lines that costs 10-20x the work (8 lines: 3.7 ms against 48 us one by one), which the
# server pays on every request and streaming translation on every small batch.
_POOLED = 256


def load(model_bytes: bytes, origin: str = "tokenizer") -> Tokenizer | MarianTokenizer:
    """A model's tokenizer from its bytes: tmt's joint sentencepiece model, or the two models and
    vocabulary of an imported Marian model (marian_tokenizer.py), which say what they are."""
    if is_marian(model_bytes):
        return MarianTokenizer(model_bytes, origin)
    return Tokenizer(model_bytes, origin)


# A piece of a vocabulary is at most 16 characters (sentencepiece's max_sentencepiece_length) and
# takes at least one, so a line's first `limit` tokens lie in its first 16 · limit characters,
# whitespace aside. A longer line is encoded from a head of 64 characters a position, cut at a
# space (where sentencepiece's segmentation starts afresh), doubled while it gives fewer than
# limit + _HEAD_TOKENS tokens (whitespace and marks the normalisation removes): a line of 2 * 10^8
# characters took 9 GB and 40 s to be encoded whole, for its first 127 tokens (a training corpus
# reads heads of READ_TOKENS: a line past any data.max_len is dropped whatever its length).
READ_TOKENS = 65_536  # model.max_positions at most: a longer line is never trained on
_HEAD_CHARS = 64
_HEAD_TOKENS = 64  # tokens past the limit that a head must give (those by its cut may differ)
_SPACE_BEFORE_END = re.compile(r"\s\S*\Z")


def encode_heads(
    tokenizer: Any, texts: list[str], side: str, limit: int
) -> tuple[list[list[int]], list[bool]]:
    """The ids of each text, or of a head of it that holds its first `limit` tokens and more (those
    the whole text's first); and whether each is the whole text's."""
    size = _HEAD_CHARS * (limit + _HEAD_TOKENS)
    ids = tokenizer.encode([head(text, size) for text in texts], side=side)
    whole = [len(text) <= size for text in texts]
    for i, text in enumerate(texts):
        grown = size
        while not whole[i] and len(ids[i]) < limit + _HEAD_TOKENS:
            grown *= 2
            ids[i] = tokenizer.encode([head(text, grown)], side=side)[0]
            whole[i] = len(text) <= grown
    return ids, whole


def head(text: str, size: int) -> str:
    """`text`'s first `size` characters, cut back to its last whitespace in their second half."""
    if len(text) <= size:
        return text
    first = text[:size]
    space = _SPACE_BEFORE_END.search(first, size // 2)
    return first[: space.start()] if space else first


def language_token_id(tokenizer: Tokenizer | MarianTokenizer, lang: str) -> int:
    """The id of >>lang<<, the token a multi-target model reads first (decode.target_lang),
    the language named in any form (de finds >>deu<<: languages.py), refused in one line naming
    the languages the model has."""
    code = language_code(tokenizer.language_codes, lang)
    if code is None:
        known = ", ".join(c[2:-2] for c in tokenizer.language_codes[:20])
        raise TmtError(
            f"decode.target_lang={lang}: the model has no >>{lang}<< token"
            + (f" (its target languages: {known})" if known else
               " (it translates into one language: leave decode.target_lang empty)")
        )  # fmt: skip
    return tokenizer.piece_to_id(code, side="source")


def language_code(codes: Sequence[str], lang: str) -> str | None:
    """Of a model's >>xxx<< tokens, the one of language `lang`: spelled so, else the one token of
    that language in another form (de, deu, ger); None when there is none, and a refusal naming
    them when several are (zh: >>zho_Hans<<, >>zho_Hant<<)."""
    if f">>{lang}<<" in codes:
        return f">>{lang}<<"
    if not languages.is_known(lang):
        return None
    found = [c for c in codes if languages.same_language(c[2:-2], lang)]
    if len(found) > 1:
        raise TmtError(f"{lang}: the model has {len(found)} tokens of that language"
                       f" ({', '.join(found[:6])}); name one")  # fmt: skip
    return found[0] if found else None


class Tokenizer:
    """A sentencepiece model: batch encode/decode and the special ids.

    Both sides share it (§5.1), so `side` arguments ("source", "target") change nothing here;
    they are there for the Marian tokenizer, whose sides differ."""

    kind = "sentencepiece"
    language_codes: tuple[str, ...] = ()

    def __init__(self, model_bytes: bytes, origin: str = "tokenizer") -> None:
        self.model_bytes = bytes(model_bytes)
        if is_marian(self.model_bytes):
            raise TmtError(f"{origin}: a Marian tokenizer, not one sentencepiece model")
        self._sp = load_processor(self.model_bytes, origin)
        self.vocab_size: int = self._sp.get_piece_size()
        self.source_vocab_size = self.vocab_size
        self.pad_id: int = self._sp.pad_id()
        self.unk_id: int = self._sp.unk_id()
        self.bos_id: int = self._sp.bos_id()
        self.eos_id: int = self._sp.eos_id()
        # One vocabulary for both sides: the source's padding and end are the target's (a Marian
        # tokenizer's may differ).
        self.source_pad_id, self.source_eos_id = self.pad_id, self.eos_id
        for name in ("pad", "bos", "eos"):
            if getattr(self, f"{name}_id") < 0:
                missing = (
                    f"the sentencepiece model has no <{name}> piece (train it with --{name}_id)"
                )
                raise TmtError(f"{origin}: {missing}")
        self.sha256: str = hashlib.sha256(self.model_bytes).hexdigest()
        self._merge_scores: dict[str, float] | None = None  # bpe_dropout's, built on first use
        self._tags: tuple[int, ...] | None = None  # the hint tags it has (never_output)

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        try:
            return cls(Path(path).read_bytes(), origin=str(path))
        except OSError as err:
            raise TmtError(f"{path}: cannot read tokenizer: {err.strerror or err}") from None

    def start_id(self, start: str) -> int:
        """The decoder's first input for model.decoder_start: <s> (bos) or <pad> (pad)."""
        return self.pad_id if start == "pad" else self.bos_id

    @property
    def never_output(self) -> tuple[int, ...]:
        """Ids a search never emits: padding, the start of a sentence, and term hints' tags
        (where the tokenizer has them as user-defined symbols)."""
        if self._tags is None:
            users = {p for p, _, kind in _model_pieces(self.model_bytes) if kind == 4}
            self._tags = tuple(self._sp.piece_to_id(t) for t in HINT_TAGS if t in users)
        return (self.pad_id, self.bos_id, *self._tags)

    def pieces(self, side: str = "target") -> list[str]:
        """Every piece, by id."""
        return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]

    def id_to_piece(self, token: int, side: str = "target") -> str:
        return self._sp.id_to_piece(token)

    def piece_to_id(self, piece: str, side: str = "target") -> int:
        return self._sp.piece_to_id(piece)

    def spm_bytes(self, side: str) -> bytes:
        return self.model_bytes

    def encode(self, texts: Sequence[str], side: str = "source") -> list[list[int]]:
        """Subword ids of each text, without bos/eos."""
        if len(texts) < _POOLED:
            return [self._sp.encode(text) for text in texts]
        return self._sp.encode(list(texts))

    @property
    def model_type(self) -> str:
        """ "unigram", "bpe", "word" or "char": the algorithm the model was trained with."""
        spec = dict(_proto_fields(self.model_bytes)).get(2, b"")  # ModelProto.trainer_spec
        kind = dict(_proto_fields(spec)).get(3, 1)  # TrainerSpec.model_type, UNIGRAM by default
        return {1: "unigram", 2: "bpe", 3: "word", 4: "char"}.get(kind, "unknown")

    def bpe_dropout(self, ids: Sequence[int], alpha: float, seed: int) -> list[int]:
        """BPE-dropout (Provilkov et al., 2020) of one encoded text: each word is merged again
        from its characters, the highest-scoring merge first as sentencepiece's bpe encoder
        does, each candidate merge skipped with probability alpha; alpha 0 gives back `ids`.
        Drawn with Python's generator seeded by `seed`: sentencepiece's own sampling cannot be
        seeded reproducibly across processes (0.2.3: the same seed draws differently)."""
        if self._merge_scores is None:
            self._merge_scores = _merge_scores(self.model_bytes)
        scores, draw = self._merge_scores, random.Random(seed).random
        out: list[int] = []
        word: list[str] = []
        for token in [*map(int, ids), -1]:  # -1 ends the last word
            piece = self._sp.id_to_piece(token) if token >= 0 else ""
            mergeable = token >= 0 and piece in scores
            if word and (not mergeable or piece.startswith("\u2581")):
                out += [self._sp.piece_to_id(p) for p in _drop_merges(word, scores, alpha, draw)]
                word = []
            if mergeable:
                word += list(piece)
            elif token >= 0:
                out.append(token)  # unknown, byte, control and user-defined pieces stay whole
        return out

    def with_symbols(self, symbols: Sequence[str]) -> Tokenizer:
        """This tokenizer with `symbols` it lacks appended as user-defined pieces (new ids after
        the last: every existing id keeps its piece), as sentencepiece's own guide grows a
        model's vocabulary; repeated fields of a protobuf message may follow any others."""
        have = {piece for piece, _, _ in _model_pieces(self.model_bytes)}
        new = [symbol for symbol in dict.fromkeys(symbols) if symbol not in have]
        if not new:
            return self
        return Tokenizer(self.model_bytes + b"".join(map(_proto_piece, new)), "tokenizer")

    def tag_ids(self, tag: str) -> list[int] | None:
        """The ids `encode` gives a line that is just `tag` (a word-start piece, then the tag),
        when the tag is one piece of the vocabulary; None when it is not."""
        piece = self._sp.piece_to_id(tag)  # the unknown id when it is no piece
        ids = self._sp.encode(tag)
        if piece == self.unk_id or ids[-1:] != [piece]:
            return None
        return ids if ids[:-1] in ([], [self._sp.piece_to_id("\u2581")]) else None

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Detokenized text of each id sequence (special ids are dropped)."""
        if not ids:  # sentencepiece would read [] as one empty sequence
            return []
        sequences = [list(map(int, seq)) for seq in ids]
        if len(sequences) < _POOLED:
            return [self._sp.decode(seq) for seq in sequences]
        return self._sp.decode(sequences)

    # Workers of datasets.map(num_proc > 1) receive the tokenizer pickled: send the bytes only.
    def __getstate__(self) -> dict[str, object]:
        return {"model_bytes": self.model_bytes}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["model_bytes"])  # type: ignore[misc, arg-type]


def _merge_scores(model_bytes: bytes) -> dict[str, float]:
    """The score of each normal piece of a sentencepiece model (bpe: its merge order, the higher
    first); unknown, control, user-defined (tags), unused and byte pieces never merge."""
    return {piece: score for piece, score, kind in _model_pieces(model_bytes) if kind == 1}


def _model_pieces(model_bytes: bytes) -> list[tuple[str, float, int]]:
    """(piece, score, type) of each piece: ModelProto field 1, read from the protobuf wire format
    (sentencepiece's Python API does not tell user-defined pieces apart; protobuf is optional)."""
    pieces = []
    for field, value in _proto_fields(model_bytes):
        if field == 1:
            entry = dict(_proto_fields(value))
            text = entry.get(1, b"").decode("utf-8")
            score = struct.unpack("<f", entry[2])[0] if 2 in entry else 0.0
            pieces.append((text, score, entry.get(3, 1)))
    return pieces


def _proto_piece(piece: str) -> bytes:
    """ModelProto field 1 holding a user-defined piece: SentencePiece {piece, score 0, type 4}."""
    text = piece.encode("utf-8")
    entry = b"\x0a" + _varint(len(text)) + text + b"\x15" + struct.pack("<f", 0.0) + b"\x18\x04"
    return b"\x0a" + _varint(len(entry)) + entry


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes([*out, value])


def _proto_fields(data: bytes) -> Iterator[tuple[int, Any]]:
    """(field number, value) of a protobuf message: varints as ints, 32-bit values as 4 bytes,
    length-delimited ones as bytes (64-bit ones skipped: ModelProto's pieces have none)."""
    at = 0

    def varint() -> int:
        nonlocal at
        value = shift = 0
        while True:
            byte = data[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while at < len(data):
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            yield field, varint()
        elif wire == 1:
            at += 8
        elif wire == 2:
            size = varint()
            yield field, data[at : at + size]
            at += size
        elif wire == 5:
            yield field, data[at : at + 4]
            at += 4
        else:
            raise ValueError(f"protobuf wire type {wire}")


def _drop_merges(
    chars: list[str], scores: dict[str, float], alpha: float, draw: Callable[[], float]
) -> list[str]:
    """One word's pieces: merge the best-scoring adjacent pair that is a piece, each candidate
    skipped with probability alpha, until none is left (a character that is no piece stays)."""
    symbols = list(chars)
    while True:
        best, at = -math.inf, -1
        for i in range(len(symbols) - 1):
            score = scores.get(symbols[i] + symbols[i + 1])
            if score is not None and score > best and draw() >= alpha:
                best, at = score, i
        if at < 0:
            return symbols
        symbols[at : at + 2] = [symbols[at] + symbols[at + 1]]


def train_tokenizer(
    sentences: Iterable[str], cfg: TokenizerConfig, tags: Sequence[str] = ()
) -> Tokenizer:
    """Train the joint model on an iterator of sentences (already sampled to cfg.max_sentences);
    each tag becomes a user-defined symbol: always one piece, wherever it appears."""
    buffer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=(s for s in sentences if s and not s.isspace()),
            model_writer=buffer,
            vocab_size=cfg.vocab_size,
            model_type=cfg.model_type,
            character_coverage=cfg.character_coverage,
            byte_fallback=cfg.byte_fallback,
            # The one place ids are chosen; everything else reads them from the model.
            pad_id=0,
            unk_id=1,
            bos_id=2,
            eos_id=3,
            user_defined_symbols=list(tags),
            input_sentence_size=cfg.max_sentences,
            shuffle_input_sentence=False,  # the caller samples deterministically
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise TmtError(_explain_training_error(str(err), cfg)) from None
    return Tokenizer(buffer.getvalue())


def load_or_train_tokenizer(
    cfg: TokenizerConfig,
    corpora: Sequence[RawSplit],
    load: Callable[[str], Any],
    cache: Path,
    symbols: Sequence[str] = (),
) -> Tokenizer:
    """The configured model_path, else the cached model for this data and config, else train one
    on the sentences of every training corpus, with the corpora's tags (and `symbols`: term
    hints' tags) as user-defined symbols."""
    if cfg.model_path:
        return Tokenizer.from_file(cfg.model_path)
    settings = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
    tags = sorted(({split.tag for split in corpora} | set(symbols)) - {""})
    content = "|".join(split.fingerprint for split in corpora)
    if tags:
        content += "|tags:" + json.dumps(tags)
    key = hashlib.sha256(f"{content}|{settings}".encode()).hexdigest()[:32]
    path = cache / "tokenizers" / f"{key}.model"
    record = path.with_suffix(".sha256")  # written after the model: the model's SHA-256
    if path.is_file() and record.is_file():
        try:
            cached = Tokenizer(files.read_plain(path), origin=str(path))
            if files.read_plain(record, limit=1 << 10).decode().strip() != cached.sha256:
                raise TmtError(f"{path}: does not match the SHA-256 recorded when it was written")
            logger.info("tokenizer: cached %s", path)
            return cached
        except (TmtError, OSError, UnicodeDecodeError) as err:
            logger.warning("cached tokenizer damaged (%s): rebuilding it", err)
    if len(corpora) == 1:
        dataset = load(corpora[0].key)
    else:
        import datasets

        dataset = datasets.concatenate_datasets([load(split.key) for split in corpora])
    logger.info("tokenizer: training %s, %d pieces", cfg.model_type, cfg.vocab_size)
    tokenizer = train_tokenizer(_sample_sentences(dataset, cfg.max_sentences), cfg, tags)
    files.atomic_write(path, tokenizer.model_bytes)
    files.atomic_write(record, tokenizer.sha256.encode())
    return tokenizer


def _sample_sentences(dataset: Any, max_sentences: int) -> Iterator[str]:
    """Source and target sentences; a seeded uniform sample of pairs when there are too many."""
    pairs = len(dataset)
    if 2 * pairs > max_sentences:
        rng = np.random.default_rng(0)  # fixed: the tokenizer depends on data and config only
        dataset = dataset.select(np.sort(rng.choice(pairs, max_sentences // 2, replace=False)))
    for batch in dataset.select_columns(["src", "tgt"]).iter(batch_size=10_000):
        yield from batch["src"]
        yield from batch["tgt"]


def _explain_training_error(message: str, cfg: TokenizerConfig) -> str:
    limit = re.search(
        r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", message
    )
    if limit:
        return (
            f"tokenizer.vocab_size={cfg.vocab_size} is too large for this corpus:"
            f" sentencepiece can build at most {limit.group(2)} pieces from it"
        )
    # sentencepiece's advice names its own flags; say it in tmt's settings.
    small = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", message)
    if small:
        fallback = " (256 byte pieces with tokenizer.byte_fallback)" if cfg.byte_fallback else ""
        return (
            f"tokenizer.vocab_size={cfg.vocab_size} is too small for this corpus: its characters"
            f" and special pieces{fallback} need at least {small.group(2)}; raise"
            " tokenizer.vocab_size, or lower tokenizer.character_coverage"
        )
    if "sentences_.empty()" in message or "no sentences" in message.lower():
        return "tokenizer: no training sentences (the training split is empty after filtering)"
    detail = message.strip().splitlines()[-1] if message.strip() else "unknown error"
    return f"tokenizer: sentencepiece training failed: {detail}"
