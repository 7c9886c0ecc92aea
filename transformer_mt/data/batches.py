"""From raw parallel text to batches: encoded cache, filters, token-bucket batches.

Encoding happens once per (data, tokenizer) and is cached as Arrow files that are memory-mapped on
later runs; filters are applied to the cached lengths (milliseconds), so changing a filter never
re-encodes. Every pair a filter removes is counted under that filter's name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from transformer_mt.common import exits, files, textio
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, DataConfig
from transformer_mt.data import corpus, filters, hints
from transformer_mt.data.sampler import ShapeBuckets, TokenBucketSampler
from transformer_mt.data.tokenizer import (
    READ_TOKENS,
    Tokenizer,
    encode_heads,
    language_token_id,
    load_or_train_tokenizer,
)

logger = logging.getLogger(__name__)

ENCODING_VERSION = 2  # bump when the encoded layout changes: old caches are then ignored


# --- the pipeline ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FilterCounts:
    """What happened to each pair of a split, in filter order (a pair counts in the first hit)."""

    read: int  # pairs read from the source
    invalid_utf8: int  # dropped: invalid UTF-8 under encoding_errors=skip
    clean: int  # dropped by the clean section's filters (data.clean; PreparedData.cleaned: which)
    empty: int  # dropped: a side is empty or whitespace-only (no subword tokens)
    too_long: int  # dropped: a side has more than data.max_len tokens
    ratio: int  # dropped: the longer side exceeds data.max_len_ratio × the shorter
    kept: int
    replaced: int  # kept, with invalid UTF-8 replaced by U+FFFD (encoding_errors=replace)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PreparedData:
    tokenizer: Tokenizer
    train: EncodedSplit  # every training corpus, concatenated (train.groups: which one)
    valid: EncodedSplit
    # by config key: "data.train" (all corpora), "data.valid", and "data.train[i]" per corpus
    counts: dict[str, FilterCounts]
    corpora: list[corpus.RawSplit]  # the training corpora, in data.train's order
    # data.clean: by corpus key, the pairs each clean filter removed (filters.FILTERS); else {}
    cleaned: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)


def prepare_data(cfg: Config, tokenizer: Tokenizer | None = None) -> PreparedData:
    """Read, tokenize (training the joint model unless one is given), encode, filter the splits."""
    cache = cache_root(cfg.data)
    # What the user sets to move it: TMT_CACHE where that chose it, else data.cache_dir.
    from_environment = not cfg.data.cache_dir and os.environ.get("TMT_CACHE")
    textio.check_directory(cache, "TMT_CACHE" if from_environment else "data.cache_dir")
    try:
        return _prepare(cfg, tokenizer, cache)
    except OSError as err:  # reading errors are TmtErrors already: this is the cache's disk
        reason, code = exits.write_failed(err)
        fix = "free some space or set" if code == exits.NO_ROOM else "set"
        raise TmtError(
            f"{cache}: cannot write the data cache ({reason}); {fix} data.cache_dir to another"
            " directory",
            exit_code=code,
        ) from None


def _prepare(cfg: Config, tokenizer: Tokenizer | None, cache: Path) -> PreparedData:
    # Scratch and staging entries of runs that were killed: hidden names, older than a day (a
    # live build is younger than that). They never look complete: meta.json is written last.
    leftovers = (".work.*", ".clean.*", "encoded/.*", "tokenizers/.*", "cleaned/.*")
    files.remove_leftovers(cache, leftovers, older_than_s=86_400)
    corpora = corpus.open_training(cfg.data)
    valid = corpus.open_split(cfg.data, "data.valid")
    splits = {split.key: split for split in [*corpora, valid]}
    with _work_dir(cache) as work:
        raw: dict[str, Any] = {}  # raw Arrow datasets, built only on a cold cache
        cleaner = _Cleaner.of(cfg)
        # data.clean: each training pair's reason code, judged (or read from the cache) first
        codes = (
            {s.key: cleaner.codes(s, cache, cfg.data.num_proc) for s in corpora} if cleaner else {}
        )

        def load(key: str) -> Any:
            if key not in raw:
                logger.info("reading %s (%s)", key, splits[key].origin)
                raw[key] = splits[key].load(work / key)
                if key in codes:  # the tokenizer and the encoding see the kept pairs only
                    raw[key] = raw[key].select(np.flatnonzero(codes[key] == filters.KEPT))
            return raw[key]

        symbols = hints.TAGS if cfg.data.terms.annotate else ()  # term hints' tags
        if tokenizer is None:
            tokenizer = load_or_train_tokenizer(cfg.tokenizer, corpora, load, cache, symbols)
        tokenizer.start_id(cfg.model.decoder_start)  # a Marian tokenizer has no <s>: one line
        corpora, valid = _language_tags(cfg, tokenizer, corpora, valid)
        splits = {split.key: split for split in [*corpora, valid]}
        _check_tags(tokenizer, corpora)
        encoded, counts, cleaned = {}, {}, {}
        for key, split in splits.items():
            training = split is not valid  # validation is never cleaned
            judged = codes.get(key)
            table = _encoded_table(split, tokenizer, load, cache, cfg.data.num_proc,
                                   cleaner.digest if judged is not None else "")  # fmt: skip
            encoded[key], counts[key] = _filtered(table, cfg.data, training, judged)
            if judged is not None:
                cleaned[key] = _removed_by_filter(judged)
        found = _hint_candidates(cfg, corpora, load, cache, cleaner, tokenizer, encoded)
    _check_kept(corpora, counts)
    if corpora[0].key != "data.train":  # data.train is a list (of one corpus, or several)
        total = {
            name: sum(getattr(counts[split.key], name) for split in corpora)
            for name in FilterCounts.__dataclass_fields__
        }
        counts = {"data.train": FilterCounts(**total), **counts}  # all corpora first
        train = EncodedSplit.concatenate(
            [encoded[split.key] for split in corpora], [split.weight for split in corpora]
        )
        if cleaned:
            cleaned["data.train"] = {name: sum(c[name] for c in cleaned.values())
                                     for name in filters.FILTERS}  # fmt: skip
    else:
        train = encoded["data.train"]
    if found is not None:  # term hints: the training split's only
        train.hints = _term_hints(cfg, corpora, tokenizer, encoded, found)
    return PreparedData(tokenizer, train, encoded["data.valid"], counts, corpora, cleaned)


def _check_kept(corpora: Sequence[corpus.RawSplit], counts: dict[str, FilterCounts]) -> None:
    for split in corpora:
        if counts[split.key].kept == 0:
            raise TmtError(
                f"{split.key} ({split.origin}): no pairs left after filtering: "
                + _describe(counts[split.key])
            )


def _hint_candidates(
    cfg: Config, corpora: Sequence[corpus.RawSplit], load: Any, cache: Path,
    cleaner: _Cleaner | None, tokenizer: Tokenizer, encoded: dict[str, EncodedSplit],
) -> list[pa.Table] | None:  # fmt: skip
    """data.terms: each training corpus's hint candidates (hints.py), found once and cached."""
    if not cfg.data.terms.annotate:
        return None
    missing = [tag for tag in hints.TAGS if tokenizer.tag_ids(tag) is None]
    if missing:
        raise TmtError(
            f"data.terms: the tokenizer has no {missing[0]} piece (a tokenizer tmt trains with"
            " data.terms has the hints' tags; a given one, or train.init_from's, must too)"
        )
    dictionary = hints.dictionary_of(cfg)
    found = []
    for split in corpora:
        key = hints.cache_key(split.fingerprint, dictionary, cfg.data.terms, cfg.data.tgt_lang,
                              cleaner.digest if cleaner else "")  # fmt: skip
        found.append(hints.cached_candidates(key, cache, lambda s=split: hints.candidates(
            load(s.key), dictionary, cfg.data.terms, cfg.data.tgt_lang)))  # fmt: skip
    return found


def _term_hints(
    cfg: Config, corpora: Sequence[corpus.RawSplit], tokenizer: Tokenizer,
    encoded: dict[str, EncodedSplit], found: list[pa.Table],
) -> hints.TermHints:  # fmt: skip
    """The training split's hints: the corpora's candidates in the concatenated table's rows."""
    sizes = [len(encoded[split.key]._src) for split in corpora]
    offsets = np.cumsum([0, *sizes])
    index = np.full(int(offsets[-1]), -1, dtype=np.int64)
    tables, at = [], 0
    for table, offset in zip(found, offsets[:-1], strict=True):
        rows = _int64_numpy(table.column("row")) if table.num_rows else np.zeros(0, np.int64)
        index[rows + offset] = np.arange(at, at + table.num_rows)
        tables.append(table.drop_columns(["row"]))
        at += table.num_rows
    prefixes = [list(tokenizer.tag_ids(split.tag) or []) if split.tag else [] for split in corpora]
    return hints.TermHints.build(cfg, tokenizer, pa.concat_tables(tables), index, prefixes)


@dataclass(frozen=True)
class _Cleaner:
    """data.clean: the clean section's rules, and what names them in a cache key (the settings,
    the languages, the validation and test sentences kept out)."""

    rules: filters.Rules
    digest: str

    @classmethod
    def of(cls, cfg: Config) -> _Cleaner | None:
        if not cfg.data.clean:
            return None
        if cfg.clean.langid:  # a language the identifier does not know: said before any work
            filters.Identify().check(cfg.data.src_lang, cfg.data.tgt_lang)
        rules, notes = filters.eval_sets(cfg)
        for note in notes:
            logger.warning("data.clean: %s", note)
        named = json.dumps([dataclasses.asdict(cfg.clean), rules.src_lang, rules.tgt_lang,
                            sorted(rules.eval_sources), sorted(rules.eval_targets),
                            filters.RULES_VERSION])  # fmt: skip
        return cls(rules, hashlib.sha256(named.encode()).hexdigest())

    def codes(self, split: corpus.RawSplit, cache: Path, num_proc: int) -> np.ndarray:
        """Each pair's reason code (filters.KEPT: kept), judged once per (content, rules) and
        cached as cleaned/KEY.npy beside its SHA-256 (verified when read back)."""
        key = hashlib.sha256(f"{split.fingerprint}|{self.digest}".encode()).hexdigest()[:32]
        path, record = cache / "cleaned" / f"{key}.npy", cache / "cleaned" / f"{key}.sha256"
        try:
            if files.sha256_plain(path) == files.read_plain(record, limit=64).decode():
                return np.load(path, allow_pickle=False)
            logger.warning("%s does not match its SHA-256: judging the pairs again", path)
        except (OSError, ValueError):
            pass  # not there yet (or unreadable): judged below
        logger.info("cleaning %s (data.clean)", split.key)
        found = [c for _, c in filters.reasons(split.pairs(filters.CHUNK), self.rules, num_proc)]
        judged = np.concatenate([np.zeros(0, np.int8), *found])
        staging = _mkdir(cache / "cleaned") / f".{key}.{os.getpid()}.npy"
        np.save(staging, judged)
        files.atomic_write(record, files.sha256_file(staging).encode())
        os.replace(
            staging, path
        )  # after its record: a kill between leaves a mismatch, judged again
        return judged


def _removed_by_filter(codes: np.ndarray) -> dict[str, int]:
    counts = np.bincount(codes.astype(np.int64), minlength=len(filters.FILTERS) + 1)
    return {name: int(counts[i + 1]) for i, name in enumerate(filters.FILTERS)}


def cache_root(cfg: DataConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir)
    if os.environ.get("TMT_CACHE"):
        return Path(os.environ["TMT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "transformer_mt"


def _language_tags(
    cfg: Config,
    tokenizer: Tokenizer,
    corpora: Sequence[corpus.RawSplit],
    valid: corpus.RawSplit,
) -> tuple[list[corpus.RawSplit], corpus.RawSplit]:
    """decode.target_lang xxx: a multi-target model reads >>xxx<< first, so its training and
    validation sources start with it too, where a corpus has no tag of its own."""
    lang = cfg.decode.target_lang
    if not lang:
        return list(corpora), valid
    language_token_id(tokenizer, lang)  # one line when the model has no such token
    tagged = [s if s.tag else dataclasses.replace(s, tag=f">>{lang}<<") for s in corpora]
    return tagged, dataclasses.replace(valid, tag=f">>{lang}<<")


def _check_tags(tokenizer: Tokenizer, corpora: Sequence[corpus.RawSplit]) -> None:
    """A tag must be one piece of the vocabulary, or the model would not see it as one token."""
    for split in corpora:
        if split.tag and tokenizer.tag_ids(split.tag) is None:
            raise TmtError(
                f"{split.key}.tag={split.tag!r}: not a piece of the tokenizer"
                " (a tokenizer tmt trains with this tag has it; a given tokenizer.model_path or"
                " the model of train.init_from must have been trained with it)"
            )


class _Encoder:
    """datasets.map function: text columns -> subword id columns (pickled to map workers). A tag
    is encoded as `tokenizer.encode(tag + " " + text)` would encode it: what `tmt translate`
    makes of a source line that starts with the tag."""

    def __init__(self, tokenizer: Tokenizer, tag: str = "") -> None:
        self.tokenizer = tokenizer
        self.tag_ids = tokenizer.tag_ids(tag) if tag else None

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        src = [text or "" for text in batch["src"]]
        tgt = [text or "" for text in batch["tgt"]]
        invalid = batch.get("invalid") or [False] * len(src)
        # A line past READ_TOKENS is encoded from a head that long and more: data.max_len drops
        # it all the same, and a 50 MB line took 2.6 GB to be encoded whole.
        src_ids = encode_heads(self.tokenizer, src, "source", READ_TOKENS)[0]
        if self.tag_ids is not None:  # an empty source stays empty: the filter drops it
            src_ids = [self.tag_ids + ids if ids else ids for ids in src_ids]
        return {
            "src_ids": src_ids,
            "tgt_ids": encode_heads(self.tokenizer, tgt, "target", READ_TOKENS)[0],
            "invalid": invalid,
        }


def _encoded_table(
    split: corpus.RawSplit, tokenizer: Tokenizer, load: Any, cache: Path, num_proc: int,
    cleaned_by: str = "",
) -> pa.Table:  # fmt: skip
    """The split's ids as a memory-mapped Arrow table, encoding it first on a cold cache (of the
    pairs data.clean kept, when `cleaned_by` names its rules)."""
    tagged = f"|tag:{split.tag}" if split.tag else ""
    cleaned = f"|clean:{cleaned_by}" if cleaned_by else ""
    key = hashlib.sha256(
        f"{split.fingerprint}|{tokenizer.sha256}|{ENCODING_VERSION}{tagged}{cleaned}".encode()
    ).hexdigest()[:32]
    final = cache / "encoded" / key
    meta_path = final / "meta.json"  # written last: its presence marks a complete entry
    if final.exists() or final.is_symlink():  # renamed into place whole: complete, unless altered
        try:
            return _read_entry(final)
        except (OSError, ValueError, KeyError, TypeError, RecursionError, pa.ArrowException) as err:
            logger.warning("data cache entry %s damaged (%s): rebuilding it", final, err)
            if final.is_dir() and not final.is_symlink():
                shutil.rmtree(final, ignore_errors=True)
            else:
                final.unlink(missing_ok=True)
    if not meta_path.is_file():
        dataset = load(split.key)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=_mkdir(cache / "encoded")))
        logger.info("encoding %s: %d pairs", split.key, len(dataset))
        arrow_files = _encode(dataset, _Encoder(tokenizer, split.tag), staging, key, num_proc)
        meta = {
            "origin": split.origin,
            "pairs": len(dataset),
            "files": arrow_files,
            "sha256": {name: files.sha256_file(staging / name) for name in arrow_files},
            "tokenizer": tokenizer.sha256,
        }
        files.atomic_write(staging / "meta.json", json.dumps(meta).encode())
        try:
            os.replace(staging, final)
        except OSError:  # another process finished the same entry first: use theirs
            shutil.rmtree(staging, ignore_errors=True)
    return _read_entry(final)


def _read_entry(final: Path) -> pa.Table:
    """A warm cache needs pyarrow only: the Arrow streams that datasets.map wrote, mapped, each
    first checked against the SHA-256 that meta.json recorded (what tmt wrote is verified)."""
    meta = json.loads(files.read_plain(final / "meta.json", limit=1 << 20))
    names, digests = meta["files"], meta["sha256"]
    if not all(isinstance(n, str) and n == Path(n).name and n not in ("", "..") for n in names):
        raise ValueError("meta.json names files outside its entry")
    for name in names:
        if files.sha256_plain(final / name) != digests[name]:
            raise ValueError(f"{name} does not match the SHA-256 recorded when it was written")
    parts = [pa.ipc.open_stream(pa.memory_map(str(final / name))).read_all() for name in names]
    table = pa.concat_tables(parts)
    if table.num_rows != meta["pairs"]:
        raise ValueError(f"{table.num_rows} pairs, meta.json says {meta['pairs']}")
    return table


def _encode(dataset: Any, encoder: _Encoder, staging: Path, key: str, num_proc: int) -> list[str]:
    """Encode the raw split into Arrow files in `staging` (datasets.map); their names. Never
    more processes than this machine has CPUs: data.num_proc is a wish, not a fork count."""
    import datasets

    cpus = os.cpu_count() or 1
    if num_proc > cpus:
        logger.info("data.num_proc=%d: this machine has %d CPUs; encoding with %d processes",
                    num_proc, cpus, cpus)  # fmt: skip
        num_proc = cpus

    features = datasets.Features(
        {
            "src_ids": datasets.Sequence(datasets.Value("int32")),
            "tgt_ids": datasets.Sequence(datasets.Value("int32")),
            "invalid": datasets.Value("bool"),
        }
    )
    if len(dataset) == 0:  # map writes no file for an empty split
        empty = pa.Table.from_pylist([], schema=features.arrow_schema)
        with (
            pa.OSFile(str(staging / "ids.arrow"), "wb") as sink,
            pa.ipc.new_stream(sink, empty.schema) as out,
        ):
            out.write_table(empty)
        return ["ids.arrow"]
    encoded = dataset.map(
        encoder,
        batched=True,
        batch_size=1000,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=dataset.column_names,
        features=features,
        cache_file_name=str(staging / "ids.arrow"),
        new_fingerprint=key,
    )
    return [Path(f["filename"]).name for f in encoded.cache_files]


def _filtered(
    table: pa.Table, cfg: DataConfig, training: bool, codes: np.ndarray | None = None
) -> tuple[EncodedSplit, FilterCounts]:
    """Apply the filters to the cached lengths; count each removed pair under its first filter
    (data.clean's first: `codes`, of the pairs read, of which the table holds the kept ones)."""
    src_len = _int64_numpy(pc.list_value_length(table.column("src_ids")))
    tgt_len = _int64_numpy(pc.list_value_length(table.column("tgt_ids")))
    invalid = _int64_numpy(table.column("invalid")).astype(bool)
    removed = np.zeros(len(src_len), dtype=bool)
    counts = {}

    def apply(name: str, hit: np.ndarray) -> None:
        counts[name] = int((hit & ~removed).sum())
        removed[:] |= hit

    longer, shorter = np.maximum(src_len, tgt_len), np.minimum(src_len, tgt_len)
    apply("invalid_utf8", invalid if cfg.encoding_errors == "skip" else np.zeros_like(removed))
    apply("empty", shorter == 0)
    apply("too_long", longer > cfg.max_len)
    # The ratio filter cleans training data only: validation pairs are kept as they are.
    apply("ratio", (longer > cfg.max_len_ratio * shorter) if training else np.zeros_like(removed))
    rows = np.flatnonzero(~removed)
    replaced = int((invalid & ~removed).sum()) if cfg.encoding_errors == "replace" else 0
    split = EncodedSplit(table, rows, src_lengths=src_len[rows], tgt_lengths=tgt_len[rows])
    cleaned_out = int((codes != filters.KEPT).sum()) if codes is not None else 0
    return split, FilterCounts(read=len(src_len) + cleaned_out, **counts, clean=cleaned_out,
                               kept=len(rows), replaced=replaced)  # fmt: skip


def _int64_numpy(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A null-free numeric or bool Arrow column as int64, read from its buffers: pyarrow's own
    to_numpy imports pandas, 0.3 s of a 0.05 s warm start."""
    parts = [np.zeros(0, dtype=np.int64)]
    for chunk in column.chunks if isinstance(column, pa.ChunkedArray) else [column]:
        chunk = pc.cast(chunk, pa.int64())
        parts.append(np.frombuffer(chunk.buffers()[1], np.int64, len(chunk), chunk.offset * 8))
    return np.concatenate(parts)


def _describe(counts: FilterCounts) -> str:
    return (
        f"{counts.read} read, {counts.invalid_utf8} invalid UTF-8 (data.encoding_errors),"
        f" {counts.clean} by data.clean,"
        f" {counts.empty} empty, {counts.too_long} over data.max_len,"
        f" {counts.ratio} over data.max_len_ratio"
    )


# --- encoded splits and batches ----------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """One padded batch. The shift between decoder input and output happens in `collate` only."""

    src: torch.Tensor  # (B, S) source ids + eos, right-padded
    tgt_in: torch.Tensor  # (B, T) bos + target ids: the decoder's input
    tgt_out: torch.Tensor  # (B, T) target ids + eos: what the decoder predicts
    pad_id: int
    # (source, target) non-pad tokens, counted by collate on the host: read off a GPU's tensors,
    # they would make the host wait for the GPU.
    counts: tuple[int, int] | None = None

    @property
    def n_tokens(self) -> int:
        """Non-pad target tokens: the loss normaliser."""
        return self.counts[1] if self.counts else int((self.tgt_out != self.pad_id).sum())

    @property
    def source_tokens(self) -> int:
        """Non-pad source tokens (a batch not made by collate: those that are not pad_id)."""
        return self.counts[0] if self.counts else int((self.src != self.pad_id).sum())

    def to(self, device: torch.device | str) -> Batch:
        """This batch on `device`, copied without waiting (from pinned memory to a GPU)."""
        device = torch.device(device)
        pin = device.type == "cuda" and not self.src.is_cuda

        def move(t: torch.Tensor) -> torch.Tensor:
            return (t.pin_memory() if pin else t).to(device, non_blocking=True)

        tensors = move(self.src), move(self.tgt_in), move(self.tgt_out)
        return Batch(*tensors, self.pad_id, self.counts)


def collate(
    src_seqs: Sequence[Sequence[int]],
    tgt_seqs: Sequence[Sequence[int]],
    pad_id: int,
    bos_id: int,
    eos_id: int,
    source_ids: tuple[int, int] | None = None,
    pad_to: tuple[int, int] = (0, 0),
) -> Batch:
    """src = x + eos; tgt_in = bos + y; tgt_out = y + eos; all right-padded with pad_id
    (`source_ids`: the source's own (pad, eos) where its vocabulary places them elsewhere) to the
    longest sequence, or to `pad_to` (source, target) columns where that is longer (a batch's
    bucket: data.bucketing). A sequence longer than its bucket (a BPE-dropout draw) pads to the
    next multiple of 8 instead, so that the shapes stay few."""
    n = len(src_seqs)
    src_pad, src_eos = source_ids or (pad_id, eos_id)
    src_width = _padded_width(max(map(len, src_seqs)) + 1, pad_to[0])
    tgt_width = _padded_width(max(map(len, tgt_seqs)) + 1, pad_to[1])
    src = np.full((n, src_width), src_pad, dtype=np.int64)
    tgt_in = np.full((n, tgt_width), pad_id, dtype=np.int64)
    tgt_out = tgt_in.copy()
    for i, (x, y) in enumerate(zip(src_seqs, tgt_seqs, strict=True)):
        src[i, : len(x)] = x
        src[i, len(x)] = src_eos
        tgt_in[i, 0] = bos_id
        tgt_in[i, 1 : len(y) + 1] = y
        tgt_out[i, : len(y)] = y
        tgt_out[i, len(y)] = eos_id
    counts = (sum(map(len, src_seqs)) + n, sum(map(len, tgt_seqs)) + n)  # + eos each
    tensors = torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out)
    return Batch(*tensors, pad_id, counts)


def _padded_width(longest: int, bucket: int) -> int:
    if not bucket:
        return longest
    return bucket if longest <= bucket else -(-longest // 8) * 8


class EncodedSplit:
    """The kept pairs of a split: lengths in memory, ids memory-mapped from the Arrow cache. The
    training split of a mixture holds every corpus; `groups` says which corpus a pair is from."""

    def __init__(
        self,
        table: pa.Table,
        rows: np.ndarray,
        src_lengths: np.ndarray,
        tgt_lengths: np.ndarray,
        groups: np.ndarray | None = None,
        weights: Sequence[float] = (),
    ):
        self._src = table.column("src_ids")
        self._tgt = table.column("tgt_ids")
        self.rows = rows  # (N,) Arrow row of each kept pair
        self.src_lengths = src_lengths  # (N,) subword tokens, specials excluded (a tag counts)
        self.tgt_lengths = tgt_lengths
        self.groups = groups  # (N,) the corpus of each pair; None: a single corpus
        self.weights = tuple(weights)  # each corpus' weight
        self.hints: hints.TermHints | None = None  # data.terms: the training split's hints

    @classmethod
    def concatenate(cls, parts: Sequence[EncodedSplit], weights: Sequence[float]) -> EncodedSplit:
        """One split of several corpora (zero-copy: the Arrow chunks are shared)."""
        offsets = np.cumsum([0] + [len(part._src) for part in parts])
        table = pa.table(
            {
                "src_ids": pa.chunked_array([c for p in parts for c in p._src.chunks]),
                "tgt_ids": pa.chunked_array([c for p in parts for c in p._tgt.chunks]),
            }
        )
        rows = [part.rows + offset for part, offset in zip(parts, offsets[:-1], strict=True)]
        return cls(
            table,
            np.concatenate(rows),
            src_lengths=np.concatenate([part.src_lengths for part in parts]),
            tgt_lengths=np.concatenate([part.tgt_lengths for part in parts]),
            groups=np.concatenate([np.full(len(part), i) for i, part in enumerate(parts)]),
            weights=weights,
        )

    def __len__(self) -> int:
        return len(self.rows)

    def ids(
        self, positions: Sequence[int] | np.ndarray
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Source and target ids of the pairs at `positions` (indices into the kept pairs)."""
        rows = np.ascontiguousarray(self.rows[np.asarray(positions)], dtype=np.int64)
        take = pa.Array.from_buffers(pa.int64(), len(rows), [None, pa.py_buffer(rows)])
        return _split_lists(self._src.take(take)), _split_lists(self._tgt.take(take))

    def batch(
        self,
        positions: Sequence[int] | np.ndarray,
        tokenizer: Tokenizer,
        sampling: SubwordSampling | None = None,
        epoch: int = 0,
        start: str = "bos",
        pad_to: tuple[int, int] = (0, 0),
    ) -> Batch:
        """The pairs at `positions` as a batch; `start`: model.decoder_start, the decoder's first
        input (<s>, or <pad> for Marian's models); `pad_to`: its (source, target) columns at
        least (TokenBucketSampler.batch_shape)."""
        src, tgt = self.ids(positions)
        if self.hints is not None:  # data.terms: this epoch's term hints
            rows = self.rows[np.asarray(positions)]
            src = self.hints.annotate(src, positions, rows, self.groups, epoch)
        if sampling is not None:  # data.subword_alpha: this epoch's segmentation of each pair
            src = sampling.resegment(src, positions, tokenizer, epoch, side=0)
            if sampling.both_sides:
                tgt = sampling.resegment(tgt, positions, tokenizer, epoch, side=1)
        return collate(
            src, tgt, pad_id=tokenizer.pad_id, bos_id=tokenizer.start_id(start),
            eos_id=tokenizer.eos_id, source_ids=(tokenizer.source_pad_id, tokenizer.source_eos_id),
            pad_to=pad_to,
        )  # fmt: skip

    def sampler(
        self,
        max_tokens: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        shapes: ShapeBuckets | None = None,
    ) -> TokenBucketSampler:
        """Batches over this split; +1 per side for eos (source, target) and bos (decoder input);
        `shapes`: their lengths padded to buckets (data.bucketing)."""
        src_extra = None
        if self.hints is not None:  # each epoch packed by its hinted sources' lengths
            src_extra = functools.partial(
                self.hints.extra, self.rows, self.groups, self.src_lengths
            )
        return TokenBucketSampler(
            src_lengths=self.src_lengths + 1, tgt_lengths=self.tgt_lengths + 1,
            max_tokens=max_tokens, seed=seed, rank=rank, world_size=world_size, shuffle=shuffle,
            groups=self.groups if shuffle else None, weights=self.weights, src_extra=src_extra,
            shapes=shapes,
        )  # fmt: skip


@dataclass(frozen=True)
class SubwordSampling:
    """data.subword_alpha: the words of training pairs merged afresh by BPE-dropout, each draw
    seeded by (train.seed, epoch, pair, side), so a resume or another rank draws the same."""

    alpha: float
    both_sides: bool
    seed: int
    max_len: int  # data.max_len: a longer draw keeps the cached segmentation

    @classmethod
    def of(cls, cfg: Config, tokenizer: Tokenizer) -> SubwordSampling | None:
        data = cfg.data
        if not data.subword_alpha:
            return None
        if tokenizer.model_type != "bpe":
            raise TmtError(
                f"data.subword_alpha={data.subword_alpha:g}: BPE-dropout needs a bpe tokenizer;"
                f" this one is {tokenizer.model_type} (tokenizer.model_type=bpe, or"
                " data.subword_alpha=0)"
            )
        both = data.subword_sides == "both"
        return cls(data.subword_alpha, both, seed=cfg.train.seed, max_len=data.max_len)

    def resegment(
        self,
        sequences: list[np.ndarray],
        positions: Sequence[int] | np.ndarray,
        tokenizer: Tokenizer,
        epoch: int,
        side: int,
    ) -> list[np.ndarray]:
        """This epoch's segmentation of each pair's side (`positions`: the pairs' indices)."""
        drawn = []
        for ids, position in zip(sequences, np.asarray(positions).tolist(), strict=True):
            key = f"{self.seed}/{epoch}/{position}/{side}".encode()
            seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
            sample = tokenizer.bpe_dropout(ids, self.alpha, seed)
            drawn.append(np.asarray(sample, dtype=np.int64) if len(sample) <= self.max_len else ids)
        return drawn


def _split_lists(column: pa.ChunkedArray) -> list[np.ndarray]:
    array = column.combine_chunks()
    offsets = _int64_numpy(array.offsets)
    return np.split(_int64_numpy(array.flatten()), offsets[1:-1] - offsets[0])


# --- files -------------------------------------------------------------------------------------


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _work_dir(cache: Path) -> Iterator[Path]:
    """A scratch directory for raw Arrow files, removed afterwards (also after an error)."""
    path = Path(tempfile.mkdtemp(prefix=".work.", dir=_mkdir(cache)))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
