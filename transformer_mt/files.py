"""The file primitives every reader and writer of tmt shares (stdlib only).

- `atomic_file` / `atomic_write`: a file appears complete under its name or not at all (temporary
  file beside it, fsync, rename, directory fsync). Every file tmt writes goes through it.
- `fsync_dir`: make a rename or a new directory entry durable.
- `swap_into_place` / `recover`: a complete staging directory renamed to its final name, replacing
  what is there; and the clean-up after a swap a kill interrupted.
- `sha256_file`: a streaming SHA-256 of a file of any size.
- `open_plain` / `read_plain` / `sha256_plain`: what tmt reads back, refused unless it is a plain
  file (no link, FIFO or device: reading one could hang).
- `remove_leftovers`: sweep what killed writers left behind (hidden staging names).
- `split_lines`: bytes split on b"\\n" only, one trailing b"\\r" dropped: Python's text mode would
  also split on a lone "\\r", and `str.splitlines` on nine separators, which misaligns corpora that
  `wc -l` calls equal.
- The names of tmt's own files, defined once here, below every module that writes them and the one
  output check (textio.check_output) that keeps every command from writing over them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

TEMP_SUFFIX = ".tmp"  # temporary files of atomic writes: ".NAME.XXXXXX.tmp" beside NAME

# --- the names of tmt's own files ----------------------------------------------------------------
MANIFEST_FILE = "manifest.json"  # a checkpoint directory's commit marker (checkpoint.py)
CHECKPOINTS = "checkpoints"  # the directory of a run's training checkpoints (run.py)
CONFIG_FILE = "config.yaml"  # a run's resolved config (run.py)
TOKENIZER_FILE = "tokenizer.model"  # a run's sentencepiece model (run.py)
METRICS_FILE = "metrics.jsonl"  # a run's metrics log (metrics.py)
LOCK_FILE = ".lock"  # the holder of a run directory or a file job (run.RunLock)
RUN_FILES = (CONFIG_FILE, TOKENIZER_FILE, METRICS_FILE, LOCK_FILE)  # a run directory's own files
JOB_SUFFIX = ".tmt-job"  # OUT.tmt-job/: the committed chunks of a file job into OUT (bulk.py)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary handle whose content replaces `path` only once the block ends without an error;
    on an error the temporary file is removed and `path` keeps what it had."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically: readers never see a partial file."""
    with atomic_file(path) as handle:
        handle.write(data)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class NotPlainFile(OSError):
    """What tmt reads back must be a plain file of a sane size: not a link, a FIFO or a device."""


@contextlib.contextmanager
def open_plain(path: Path, limit: int | None = None) -> Iterator[BinaryIO]:
    """A binary handle on the plain file at `path`, opened without following a symbolic link or
    waiting on a FIFO (a naive read of one hangs, or of a device never ends): NotPlainFile for
    anything else, or for a file over `limit` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise NotPlainFile(errno.ELOOP, "a symbolic link", str(path)) from None
        raise
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotPlainFile(errno.EINVAL, "not a plain file", str(path))
        if limit is not None and info.st_size > limit:
            too_big = f"{info.st_size} bytes, larger than it can be ({limit})"
            raise NotPlainFile(errno.EFBIG, too_big, str(path))
        yield handle


def read_plain(path: Path, limit: int | None = None) -> bytes:
    """The bytes of a plain file (open_plain's rules)."""
    with open_plain(path, limit) as handle:
        return handle.read()


def sha256_plain(path: Path) -> str:
    """SHA-256 of a plain file (open_plain's rules), read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open_plain(path) as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks (raises OSError)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def swap_into_place(staging: Path, final: Path) -> None:
    """Rename a complete staging directory to its final name, replacing what is there (renamed
    aside to ".old-NAME-PID" first, removed last: `recover` puts it back if a kill comes between
    the two renames), and make the renames durable."""
    root, name = final.parent, final.name
    previous = None
    if final.exists():
        previous = root / f".old-{name}-{os.getpid()}"
        os.rename(final, previous)
    os.rename(staging, final)
    fsync_dir(root)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)


def recover(root: Path, live_writers: bool, names: Collection[str] = ()) -> None:
    """Clean up after swaps into `root` that were interrupted: a staging directory (".tmp-NAME-PID")
    is removed; a directory renamed aside by swap_into_place (".old-NAME-PID") is put back when
    NAME is missing (the kill came between the two renames), else removed. With live_writers,
    leftovers of processes still running on this host are left alone; with `names`, only the
    leftovers of those names (a directory tmt does not own may hold others' files)."""
    for path in [*root.glob(".tmp-*"), *root.glob(".old-*")]:
        name, _, pid = path.name[len(".tmp-") :].rpartition("-")
        if not name or not pid.isdigit() or (live_writers and _running(int(pid))):
            continue
        if names and name not in names:
            continue
        if path.name.startswith(".old-") and not (root / name).exists():
            os.rename(path, root / name)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    fsync_dir(root)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_leftovers(root: Path, patterns: Iterable[str], older_than_s: float = 0.0) -> None:
    """Remove what matches `patterns` under `root` (files or directories, never following links)
    and is older than `older_than_s`: hidden staging names that a killed writer left behind."""
    cutoff = time.time() - older_than_s
    for pattern in patterns:
        for path in root.glob(pattern):
            with contextlib.suppress(OSError):
                if older_than_s and path.lstat().st_mtime >= cutoff:
                    continue  # young enough to belong to a live writer
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()


def split_lines(handle: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of a binary stream without their b"\\n" and one trailing b"\\r"."""
    for line in handle:
        line = line[:-1] if line.endswith(b"\n") else line
        yield line[:-1] if line.endswith(b"\r") else line
