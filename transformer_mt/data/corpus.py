"""Parallel text from every source, as a `datasets.Dataset` with string columns `src` and `tgt`.

Text files (plain or .gz, also TSV and JSONL) are read as bytes: a line ends at b"\\n" only, so a
lone "\\r", U+2028 or U+0085 stays inside its line; one trailing "\\r" and a UTF-8 BOM at the start
of a file are stripped. Invalid UTF-8 follows `data.encoding_errors`: strict (an error naming
file:line), replace (U+FFFD; the pair is kept and counted) or skip (the pair is dropped and
counted). Files are streamed into Arrow, so no split is ever held as Python strings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from itertools import zip_longest
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformer_mt.common import files, textio
from transformer_mt.common.exits import TmtError, first_line
from transformer_mt.config import DataConfig

if TYPE_CHECKING:
    import datasets

BUNDLED_DIR = Path(str(resources.files("transformer_mt") / "multi30k"))
MULTI30K_SPLITS = ("train", "val", "test_2016_flickr")
MULTI30K_LANGS = ("en", "de", "fr")


@dataclass(frozen=True)
class RawSplit:
    """One split of parallel text: where it comes from, a fingerprint of its content, its loader."""

    key: str  # the config key that names it, e.g. "data.train"
    origin: str  # for messages: the files or dataset it is read from
    fingerprint: str  # SHA-256 over the content and everything that changes how it is read
    cfg: DataConfig
    location: str  # the split name, prefix or file path from the config
    weight: float = 1.0  # a training corpus of a mixture: its share of each epoch
    tag: str = ""  # ... and the tag prepended to its sources

    def pairs(self, chunk: int, as_trained: bool = False) -> Iterator[list[tuple[str, str]]]:
        """The split's (source, target) pairs in chunks, streamed: text sources are read line by
        line (no Arrow copy), datasets sources from their Arrow data. `as_trained`: without the
        lines data.encoding_errors=skip leaves out of training."""
        if self.cfg.source in ("hf", "hf_disk"):
            for batch in self.load(Path()).iter(batch_size=chunk):
                yield list(zip(batch["src"], batch["tgt"], strict=True))
            return
        gen, kwargs = self._generator()
        records = gen(**kwargs, cfg=self.cfg)
        skip = as_trained and self.cfg.encoding_errors == "skip"
        while block := list(itertools.islice(records, chunk)):
            yield [(r["src"], r["tgt"]) for r in block if not (skip and r["invalid"])]

    def _generator(self) -> tuple[Any, dict[str, str]]:
        if self.cfg.source in ("multi30k", "files"):
            src, tgt = _parallel_paths(self.cfg, self.key, self.location)
            return _generate_parallel, {"src_path": str(src), "tgt_path": str(tgt)}
        if self.cfg.source == "tsv":
            return _generate_tsv, {"path": self.location}
        return _generate_jsonl, {"path": self.location}

    def load(self, work_dir: Path) -> datasets.Dataset:
        """The split as a Dataset: `src`, `tgt` and, for text files, an `invalid` flag column."""
        quiet_datasets()  # tmt reports its own progress; datasets' bars would interleave with it
        source = self.cfg.source
        if source in ("hf", "hf_disk"):
            return _text_columns(_load_hf(self.cfg, self.key, self.location), self.cfg, self.origin)
        import datasets

        gen, kwargs = self._generator()
        kwargs["cfg"] = self.cfg
        features = datasets.Features(
            {
                "src": datasets.Value("string"),
                "tgt": datasets.Value("string"),
                "invalid": datasets.Value("bool"),
            }
        )  # explicit, so an empty file gives an empty dataset rather than a schema error
        try:
            return datasets.Dataset.from_generator(
                gen, gen_kwargs=kwargs, cache_dir=str(work_dir), features=features
            )
        except datasets.exceptions.DatasetGenerationError as err:
            if isinstance(err.__cause__, TmtError | OSError):  # OSError: writing the Arrow file
                raise err.__cause__ from None
            raise
        except ValueError as err:  # from_generator cannot make zero rows: an empty file
            if "corresponds to no data" not in str(err):
                raise
            return datasets.Dataset.from_dict(
                {"src": [], "tgt": [], "invalid": []}, features=features
            )


def input_files(split: RawSplit) -> list[Path]:
    """The files a split is read from (none for a datasets source): what no output may be."""
    if split.cfg.source in ("multi30k", "files"):
        return list(_parallel_paths(split.cfg, split.key, split.location))
    if split.cfg.source in ("tsv", "jsonl"):
        return [Path(split.location)]
    return []


def quiet_datasets() -> None:
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


def open_training(cfg: DataConfig) -> list[RawSplit]:
    """The training corpora: data.train as one split, or each corpus of its list (keys
    "data.train[0]", ...), read with the data section's settings where it sets none."""
    if isinstance(cfg.train, str):
        return [open_split(cfg, "data.train")]
    corpora = []
    for index, corpus in enumerate(cfg.train):
        view = dataclasses.replace(
            cfg,
            source=corpus.source or cfg.source,
            path=corpus.path or cfg.path,
            hf_config=corpus.hf_config or cfg.hf_config,
            src_field=corpus.src_field or cfg.src_field,
            tgt_field=corpus.tgt_field or cfg.tgt_field,
            train=corpus.split,
        )
        split = open_split(view, f"data.train[{index}]", corpus.split)
        corpora.append(dataclasses.replace(split, weight=corpus.weight, tag=corpus.tag))
    return corpora


def open_split(cfg: DataConfig, key: str, location: str | None = None) -> RawSplit:
    """Locate the split that config key `key` ("data.train", ...) names; fingerprint its content."""
    if location is None:
        location = getattr(cfg, key.removeprefix("data."))
    if not isinstance(location, str):
        raise TmtError(
            f"{key} is a mixture of {len(location)} corpora; name one file instead"
            " (e.g. tmt evaluate -i FILE --ref FILE)"
        )
    reading = json.dumps(
        [cfg.source, cfg.src_lang, cfg.tgt_lang, cfg.src_field, cfg.tgt_field, cfg.encoding_errors]
    )
    if cfg.source in ("hf", "hf_disk"):
        dataset = _load_hf(cfg, key, location)
        origin = f"{cfg.path}[{location}]"
        content = dataset._fingerprint  # datasets' own content fingerprint of the cached Arrow data
    else:
        if cfg.source in ("multi30k", "files"):
            paths = _parallel_paths(cfg, key, location)
        else:
            paths = (_existing_file(location, key),)
        origin = " + ".join(str(p) for p in paths)
        content = "".join(_file_digest(p) for p in paths)
    fingerprint = hashlib.sha256(f"{reading}|{location}|{content}".encode()).hexdigest()
    return RawSplit(key=key, origin=origin, fingerprint=fingerprint, cfg=cfg, location=location)


def read_split(cfg: DataConfig, key: str) -> tuple[list[str], list[str]]:
    """Raw source and reference text of the split that config key `key` names ("data.test")."""
    split = open_split(cfg, key)
    with tempfile.TemporaryDirectory(prefix="tmt-eval-") as work:
        dataset = split.load(Path(work))
        return [s or "" for s in dataset["src"]], [t or "" for t in dataset["tgt"]]


# --- text files --------------------------------------------------------------------------------

_HINT = " (set data.encoding_errors=replace or skip to accept such lines)"


def _generate_parallel(src_path: str, tgt_path: str, cfg: DataConfig) -> Iterator[dict[str, Any]]:
    src_lines, tgt_lines = textio.read_lines(Path(src_path)), textio.read_lines(Path(tgt_path))
    for lineno, (src, tgt) in enumerate(zip_longest(src_lines, tgt_lines), 1):
        if src is None or tgt is None:
            longer = tgt_lines if src is None else src_lines
            count = lineno + sum(1 for _ in longer)
            src_n, tgt_n = (lineno - 1, count) if src is None else (count, lineno - 1)
            raise TmtError(
                f"line counts differ: {src_path} has {src_n} lines, {tgt_path} has {tgt_n}"
            )
        src_text, src_bad = textio.decode_line(
            src, src_path, lineno, errors=cfg.encoding_errors, hint=_HINT
        )
        tgt_text, tgt_bad = textio.decode_line(
            tgt, tgt_path, lineno, errors=cfg.encoding_errors, hint=_HINT
        )
        yield _record(src_text, tgt_text, src_bad or tgt_bad)


def _generate_tsv(path: str, cfg: DataConfig) -> Iterator[dict[str, Any]]:
    lines = enumerate(textio.read_lines(Path(path)), 1)
    fields = (cfg.src_field, cfg.tgt_field)
    if not any(fields):
        fields = ("0", "1")
    header: list[str] | None = None
    if not all(f.isdigit() for f in fields):
        _, first = next(lines, (1, b""))
        header = textio.decode_line(first, path, 1, errors="strict", hint=_HINT)[0].split("\t")
        for name in fields:
            if name not in header:
                raise TmtError(f"{path}:1: header has no column {name!r} (columns: {header})")
    columns = [header.index(f) if header is not None else int(f) for f in fields]
    width = len(header) if header is not None else None
    for lineno, line in lines:
        text, bad = textio.decode_line(line, path, lineno, errors=cfg.encoding_errors, hint=_HINT)
        if bad and cfg.encoding_errors == "skip":
            yield _record("", "", True)
            continue
        cells = text.split("\t")
        width = width or len(cells)  # without a header the first line fixes the column count
        if len(cells) != width or len(cells) <= max(columns):
            raise TmtError(
                f"{path}:{lineno}: expected {max(width, max(columns) + 1)} tab-separated columns,"
                f" found {len(cells)}"
            )
        yield _record(cells[columns[0]], cells[columns[1]], bad)


def _generate_jsonl(path: str, cfg: DataConfig) -> Iterator[dict[str, Any]]:
    for lineno, line in enumerate(textio.read_lines(Path(path)), 1):
        text, bad = textio.decode_line(line, path, lineno, errors=cfg.encoding_errors, hint=_HINT)
        if bad and cfg.encoding_errors == "skip":
            yield _record("", "", True)
            continue
        try:
            record = json.loads(text)
        except RecursionError:
            raise TmtError(f"{path}:{lineno}: JSON nested too deeply to read") from None
        except ValueError as err:  # JSONDecodeError, and a number too long to convert
            reason = err.msg if isinstance(err, json.JSONDecodeError) else str(err).split(";")[0]
            raise TmtError(f"{path}:{lineno}: invalid JSON: {reason}") from None
        if not isinstance(record, dict):
            raise TmtError(
                f"{path}:{lineno}: expected a JSON object, found {type(record).__name__}"
            )
        where = f"{path}:{lineno}"
        src = _json_text(record, cfg.src_field, cfg.src_lang, where)
        tgt = _json_text(record, cfg.tgt_field, cfg.tgt_lang, where)
        yield _record(src, tgt, bad)


def _json_text(record: dict[str, Any], field: str, lang: str, where: str) -> str:
    if field:
        container, name, hint = record, field, ""
    else:
        container = record.get("translation")
        name, hint = lang, " (or set data.src_field / data.tgt_field to read top-level fields)"
        if not isinstance(container, dict):
            raise TmtError(f'{where}: no "translation" object{hint}')
    if name not in container:
        raise TmtError(f"{where}: no field {name!r} (fields: {sorted(container)}){hint}")
    value = container[name]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TmtError(f"{where}: field {name!r} is {type(value).__name__}, expected a string")
    return value


def _record(src: str, tgt: str, invalid: bool) -> dict[str, Any]:
    return {"src": src, "tgt": tgt, "invalid": invalid}


def _parallel_paths(cfg: DataConfig, key: str, location: str) -> tuple[Path, Path]:
    if cfg.source == "multi30k":
        if location not in MULTI30K_SPLITS:
            raise TmtError(f"{key}={location!r}: Multi30k splits are {', '.join(MULTI30K_SPLITS)}")
        for lang_key, lang in (("data.src_lang", cfg.src_lang), ("data.tgt_lang", cfg.tgt_lang)):
            if lang not in MULTI30K_LANGS:
                raise TmtError(f"{lang_key}={lang!r}: Multi30k has {', '.join(MULTI30K_LANGS)}")
        prefix = str(BUNDLED_DIR / location)
    else:
        prefix = location
    return _prefixed_file(prefix, cfg.src_lang, key), _prefixed_file(prefix, cfg.tgt_lang, key)


def _prefixed_file(prefix: str, lang: str, key: str) -> Path:
    candidates = (Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz"))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    for candidate in candidates:
        if candidate.exists():  # there, but a directory, a FIFO or a device: say which
            try:
                textio.regular_file(candidate, key)
            except TmtError as err:
                raise TmtError(f"{key}: {err.message}") from None
    raise TmtError(f"{key}: neither {prefix}.{lang} nor {prefix}.{lang}.gz exists")


def _existing_file(location: str, key: str) -> Path:
    path = Path(location)
    if not path.exists():
        raise TmtError(f"{key}: no such file: {location}")
    try:
        return textio.regular_file(path, "")
    except TmtError as err:
        raise TmtError(f"{key}: {err}") from None


def _file_digest(path: Path) -> str:
    try:
        return files.sha256_file(path)
    except OSError as err:
        raise TmtError(f"{path}: cannot read: {err.strerror or err}") from None


# --- Hugging Face datasets ---------------------------------------------------------------------


def _load_hf(cfg: DataConfig, key: str, split: str) -> datasets.Dataset:
    import datasets

    if not cfg.path:
        raise TmtError(f"data.source={cfg.source} needs data.path (a dataset name or directory)")
    if cfg.source == "hf_disk":
        try:
            saved = datasets.load_from_disk(cfg.path)
        except (FileNotFoundError, ValueError) as err:
            raise TmtError(
                f"data.path={cfg.path!r}: not a saved dataset ({first_line(err)})"
            ) from None
        if not isinstance(saved, datasets.DatasetDict):
            raise TmtError(
                f"data.path={cfg.path!r}: holds one Dataset; save a DatasetDict with splits"
            )
        if split not in saved:
            raise TmtError(f"{key}={split!r}: {cfg.path} has splits {', '.join(saved)}")
        return saved[split]
    try:
        return datasets.load_dataset(cfg.path, cfg.hf_config or None, split=split)
    except Exception as err:  # load_dataset raises many types; all mean "cannot load this"
        where = f"data.path={cfg.path!r}" + (
            f" data.hf_config={cfg.hf_config!r}" if cfg.hf_config else ""
        )
        raise TmtError(f"{where} {key}={split!r}: cannot load: {first_line(err)}") from None


def _text_columns(dataset: datasets.Dataset, cfg: DataConfig, origin: str) -> datasets.Dataset:
    """Select the source and target text as columns `src`, `tgt` (zero-copy Arrow operations)."""
    if cfg.src_field or cfg.tgt_field:
        fields = (cfg.src_field, cfg.tgt_field)
        hint = ""
    else:
        if "translation" not in dataset.column_names:
            raise TmtError(
                f"{origin}: no 'translation' column (columns: {dataset.column_names});"
                " set data.src_field and data.tgt_field to read two text columns"
            )
        dataset = dataset.select_columns(["translation"]).flatten()
        fields = (f"translation.{cfg.src_lang}", f"translation.{cfg.tgt_lang}")
        hint = " (data.src_lang / data.tgt_lang)"
    for name in fields:
        if name not in dataset.column_names:
            raise TmtError(f"{origin}: no column {name!r}{hint}; columns: {dataset.column_names}")
        dtype = getattr(dataset.features[name], "dtype", None)
        if dtype not in ("string", "large_string"):
            raise TmtError(f"{origin}: column {name!r} holds {dtype or 'non-text'}, expected text")
    if fields[0] == fields[1]:
        raise TmtError(f"{origin}: data.src_field and data.tgt_field name the same column")
    return dataset.select_columns(list(fields)).rename_columns(
        dict(zip(fields, ("src", "tgt"), strict=True))
    )
