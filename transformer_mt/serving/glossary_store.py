"""The server's stored glossaries (POST /v1/glossaries, DeepL's shape): one file each in
serve.glossary_dir, written atomically, verified whenever read.

    <glossary_dir>/<id>.json        {"glossary_id", "name", "source_lang", "target_lang",
                                     "entries_format", "entries", "creation_time",
                                     "entry_count", "sha256"}

A glossary is written whole under a staging name (".tmp-<id>.json-<pid>"), synced, then renamed:
a kill mid-write leaves the other glossaries whole, and the staging file of a writer that is no
longer running is swept at the next start (files.recover). One server holds the directory (its
.lock, an flock the kernel releases when the holder dies, however it dies): a second server
given the same serve.glossary_dir is refused at its start, naming the holder, since one could
delete what the other stores. The directory is read when asked (a file read once and kept while
its size and time are the same). `sha256` is of the file's other fields in canonical
JSON: a file that does not match it, or does not parse as a glossary, is skipped with a warning
naming it (never trusted, never deleted). A glossary serves the pair it was made for: another
pair's is refused when a request names it. Limits: serve.max_glossaries glossaries in the
directory, serve.max_glossary_bytes bytes of entries each.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import re
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformer_mt.common import faults, files, languages
from transformer_mt.common.exits import TmtError
from transformer_mt.config import GlossaryConfig, ServeConfig
from transformer_mt.data import glossary as glossaries

logger = logging.getLogger("tmt.serve")

_FIELDS = ("glossary_id", "name", "source_lang", "target_lang", "entries_format", "entries",
           "creation_time", "entry_count")  # fmt: skip
_MAX_NAME = 1024
LOCK_FILE = ".lock"  # held by the one server that uses the directory
_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class StoreError(Exception):
    """A request the store refuses: an HTTP status and one line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class Stored:
    record: dict[str, Any]  # the file's fields
    glossary: glossaries.Glossary

    def info(self) -> dict[str, Any]:
        """What DeepL answers for a glossary (v2's fields, v3's dictionaries)."""
        r = self.record
        return {
            "glossary_id": r["glossary_id"], "name": r["name"], "ready": True,
            "source_lang": r["source_lang"], "target_lang": r["target_lang"],
            "creation_time": r["creation_time"], "entry_count": r["entry_count"],
            "dictionaries": [{"source_lang": r["source_lang"], "target_lang": r["target_lang"],
                              "entry_count": r["entry_count"]}],
        }  # fmt: skip


def default_dir() -> Path:
    """<cache>/glossaries, the cache being $TMT_CACHE or ~/.cache/transformer_mt (as data's)."""
    root = os.environ.get("TMT_CACHE") or str(Path.home() / ".cache" / "transformer_mt")
    return Path(root) / "glossaries"


class GlossaryStore:
    """The stored glossaries of a directory, for a server of one language pair."""

    def __init__(self, cfg: ServeConfig, settings: GlossaryConfig, pair: tuple[str, str]) -> None:
        self.directory = Path(cfg.glossary_dir) if cfg.glossary_dir else default_dir()
        self.cfg, self.settings, self.pair = cfg, settings, pair
        self._read: dict[str, tuple[tuple[int, int, int], Stored | None]] = {}
        self._mutex = threading.Lock()
        self._writes = 0  # glossaries written by this process (the fault point's number)
        self._lock = files.Lock(self.directory / LOCK_FILE)

    def open(self) -> None:
        """The directory made if need be and held (a second server is refused), the staging
        files of dead writers swept."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock.acquire()
            files.recover(self.directory, live_writers=True)
        except files.Busy as err:
            raise TmtError(f"serve.glossary_dir={self.directory}: in use by another server"
                           f" ({err.holder}); stop it, or give this one another"
                           " serve.glossary_dir") from None  # fmt: skip
        except OSError as err:
            self.close()
            raise TmtError(f"serve.glossary_dir={self.directory}: cannot write there"
                           f" ({err.strerror or err})") from None  # fmt: skip
        if not self._lock.locked:
            logger.warning("%s: cannot lock; make sure no other server uses it", self.directory)
        logger.info("%d stored glossaries in %s", len(self._all()), self.directory)

    def close(self) -> None:
        """The directory let go (the server has stopped)."""
        self._lock.release()

    # --- reading, verified -----------------------------------------------------------------

    def _all(self) -> dict[str, Stored]:
        """Every glossary in the directory now, by id (files read once while unchanged)."""
        found, seen = {}, set()
        for path in sorted(self.directory.glob("*.json")):
            seen.add(path.name)
            stored = self._file(path)
            if stored is not None:
                found[stored.record["glossary_id"]] = stored
        with self._mutex:
            for name in set(self._read) - seen:
                del self._read[name]
        return found

    def _file(self, path: Path) -> Stored | None:
        try:
            status = path.lstat()
        except OSError:
            return None
        key = (status.st_ino, status.st_size, status.st_mtime_ns)
        with self._mutex:
            cached = self._read.get(path.name)
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            stored: Stored | None = self._verified(path)
        except (OSError, ValueError, TmtError, KeyError, TypeError, RecursionError) as err:
            logger.warning(
                "%s: not a glossary tmt wrote, or damaged (%s): skipped",
                path,
                str(err).splitlines()[0] if str(err) else type(err).__name__,
            )
            stored = None
        with self._mutex:
            self._read[path.name] = (key, stored)
        return stored

    def _verified(self, path: Path) -> Stored:
        limit = 8 * self.cfg.max_glossary_bytes + 65536
        record = json.loads(files.read_plain(path, limit=limit))
        if not isinstance(record, dict) or set(record) != {*_FIELDS, "sha256"}:
            raise ValueError("not a stored glossary's fields")
        if record["sha256"] != _digest(record) or path.stem != record["glossary_id"]:
            raise ValueError("its content does not match its checksum")
        return Stored(record, self._compile(record, f"{path}: entries"))

    def _compile(self, record: dict[str, Any], name: str) -> glossaries.Glossary:
        pair = (record["source_lang"], record["target_lang"])  # its own pair
        return glossaries.parse(
            record["entries"], record["entries_format"], name, self.settings.case_sensitive,
            self.settings.max_source_words, pair,
        )  # fmt: skip

    # --- the endpoints' operations ---------------------------------------------------------

    def create(self, body: Any) -> dict[str, Any]:
        """A new glossary from a request body (DeepL's fields), on disk before it is answered."""
        record = self._record(body)
        try:
            compiled = self._compile(record, "entries")
        except TmtError as err:
            raise StoreError(400, str(err)) from None
        if compiled.skipped:
            logger.warning("glossary %r: %d entries skipped: a source of more than %d words"
                           " (glossary.max_source_words)", record["name"], compiled.skipped,
                           self.settings.max_source_words)  # fmt: skip
        record["entry_count"] = len(compiled)
        record["sha256"] = _digest(record)
        with self._mutex:
            count = len(list(self.directory.glob("*.json")))
            if count >= self.cfg.max_glossaries:
                raise StoreError(
                    413,
                    f"{count} glossaries are stored; at most"
                    f" {self.cfg.max_glossaries} (serve.max_glossaries)",
                )
            self._writes += 1
            written = self._writes
        final = self.directory / f"{record['glossary_id']}.json"
        staging = self.directory / f".tmp-{final.name}-{os.getpid()}"
        try:
            with open(staging, "wb") as handle:
                handle.write(json.dumps(record, ensure_ascii=False).encode())
                handle.flush()
                os.fsync(handle.fileno())
            faults.fault_point("glossary_write", written)
            os.rename(staging, final)
            files.fsync_dir(self.directory)
        except OSError as err:
            staging.unlink(missing_ok=True)
            raise StoreError(507, f"cannot store the glossary ({err.strerror or err})") from None
        return Stored(record, compiled).info()

    def _record(self, body: Any) -> dict[str, Any]:
        """A new glossary's fields from a request body, each checked."""
        if not isinstance(body, dict):
            raise StoreError(400, "the body is not a JSON object")
        allowed = {"name", "source_lang", "target_lang", "entries", "entries_format"}
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise StoreError(400, f"{unknown[0]}: unknown field")
        for key in ("name", "source_lang", "target_lang", "entries"):
            if not isinstance(body.get(key), str) or not body[key].strip():
                raise StoreError(400, f"{key}: missing (a non-empty string)")
        fmt = body.get("entries_format", "tsv")
        if fmt not in ("tsv", "csv"):
            raise StoreError(400, f"entries_format: {fmt!r}; expected tsv or csv")
        if len(body["name"]) > _MAX_NAME:
            raise StoreError(400, f"name: longer than {_MAX_NAME} characters")
        size = len(body["entries"].encode("utf-8", "surrogatepass"))
        if size > self.cfg.max_glossary_bytes:
            raise StoreError(413, f"entries: {size} bytes; at most {self.cfg.max_glossary_bytes}"
                                  " (serve.max_glossary_bytes)")  # fmt: skip
        for key in ("source_lang", "target_lang"):
            if not languages.is_known(body[key]):
                raise StoreError(400, f"{key}: unknown language code {body[key]!r}")
        self._check_pair(body["source_lang"], body["target_lang"])
        return {
            "glossary_id": str(uuid.uuid4()), "name": body["name"],
            "source_lang": body["source_lang"], "target_lang": body["target_lang"],
            "entries_format": fmt, "entries": body["entries"],
            "creation_time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        }  # fmt: skip

    def _check_pair(self, source: str, target: str) -> None:
        if not (languages.same_language(source, self.pair[0])
                and languages.same_language(target, self.pair[1])):  # fmt: skip
            raise StoreError(400, f"a glossary for {source}→{target}; the model translates"
                                  f" {self.pair[0]}→{self.pair[1]}")  # fmt: skip

    def list(self) -> list[dict[str, Any]]:
        return [g.info() for g in self._all().values()]

    def get(self, glossary_id: str) -> Stored:
        found = self._file(self._path(glossary_id))
        if found is None:
            raise StoreError(404, f"glossary_id {glossary_id!r}: no such glossary")
        return found

    def usable(self, glossary_id: str) -> glossaries.Glossary:
        """The glossary a translation request names, for this server's pair only."""
        stored = self.get(glossary_id)
        self._check_pair(stored.record["source_lang"], stored.record["target_lang"])
        return stored.glossary

    def entries(self, glossary_id: str) -> str:
        """The entries as TSV (DeepL's answer), whatever format they were given in."""
        stored = self.get(glossary_id)
        return "".join(f"{e.source}\t{e.target}\n" for e in stored.glossary.entries)

    def delete(self, glossary_id: str) -> None:
        path = self._path(glossary_id)
        try:
            path.unlink()
            files.fsync_dir(self.directory)
        except FileNotFoundError:
            raise StoreError(404, f"glossary_id {glossary_id!r}: no such glossary") from None
        except OSError as err:
            raise StoreError(507, f"cannot delete the glossary ({err.strerror or err})") from None

    def _path(self, glossary_id: str) -> Path:
        """The file of an id, which must be one tmt makes (a UUID), never a path."""
        if not _ID.fullmatch(glossary_id):
            raise StoreError(404, f"glossary_id {glossary_id[:64]!r}: no such glossary")
        return self.directory / f"{glossary_id}.json"


def _digest(record: dict[str, Any]) -> str:
    fields = {k: record[k] for k in _FIELDS if k in record}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
