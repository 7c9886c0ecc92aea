"""The file primitives every reader and writer of tmt shares (stdlib only).

- `atomic_file` / `atomic_write`: a file appears complete under its name or not at all (temporary
  file beside it, fsync, rename, directory fsync). Every file tmt writes goes through it.
- `fsync_dir`: make a rename or a new directory entry durable.
- `sha256_file`: a streaming SHA-256 of a file of any size.
- `remove_leftovers`: sweep what killed writers left behind (hidden staging names).
- `split_lines`: bytes split on b"\\n" only, one trailing b"\\r" dropped: Python's text mode would
  also split on a lone "\\r", and `str.splitlines` on nine separators, which misaligns corpora that
  `wc -l` calls equal.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

TEMP_SUFFIX = ".tmp"  # temporary files of atomic writes: ".NAME.XXXXXX.tmp" beside NAME


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


def sha256_file(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks (raises OSError)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


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
