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
- `Lock`: one holder of a path at a time (an flock on a lock file that names its holder).
- `split_lines`: bytes split on b"\\n" only, one trailing b"\\r" dropped: Python's text mode would
  also split on a lone "\\r", and `str.splitlines` on nine separators, which misaligns corpora that
  `wc -l` calls equal.
- The names of tmt's own files, defined once here, below every module that writes them and the one
  output check (textio.check_output) that keeps every command from writing over them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from transformer_mt.common import faults

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


def creation_mode() -> int:
    """The mode a file created by open() gets under this process's umask (0o666 & ~umask): what
    tmt's atomic writes give their files too (mkstemp's are 0o600, unreadable to others)."""
    with _UMASK_LOCK:  # the umask can only be read by setting it: briefly, under a lock
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


_UMASK_LOCK = threading.Lock()


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary handle whose content replaces `path` only once the block ends without an error;
    on an error the temporary file is removed and `path` keeps what it had. The file gets the
    mode a new file gets under the umask."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    os.fchmod(fd, creation_mode())
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
def open_plain(
    path: Path, limit: int | None = None, follow_links: bool = False
) -> Iterator[BinaryIO]:
    """A binary handle on the plain file at `path`, opened without following a symbolic link or
    waiting on a FIFO (a naive read of one hangs, or of a device never ends): NotPlainFile for
    anything else, or for a file over `limit` bytes. `follow_links`: a link is followed when it
    leads to a plain file (what another tool wrote: a Hugging Face cache's snapshot links into
    its blobs); one that leads to a FIFO, a device or round in circles is still refused."""
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.ELOOP:
            what = "a symbolic link that leads round in circles" if follow_links else (
                "a symbolic link")  # fmt: skip
            raise NotPlainFile(errno.ELOOP, what, str(path)) from None
        raise
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotPlainFile(errno.EINVAL, "not a plain file", str(path))
        if limit is not None and info.st_size > limit:
            too_big = f"{info.st_size} bytes, larger than it can be ({limit})"
            raise NotPlainFile(errno.EFBIG, too_big, str(path))
        yield handle


def read_plain(path: Path, limit: int | None = None, follow_links: bool = False) -> bytes:
    """The bytes of a plain file (open_plain's rules)."""
    with open_plain(path, limit, follow_links) as handle:
        return handle.read()


def sha256_plain(path: Path, follow_links: bool = False) -> str:
    """SHA-256 of a plain file (open_plain's rules), read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open_plain(path, follow_links=follow_links) as handle:
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


def replace_together(pairs: list[tuple[Path, Path]]) -> None:
    """Put each (staged file, final path) of one directory in place, all or nothing: a journal
    first (".swap-PID.json": the names, and which finals existed), each final renamed aside
    (".old-NAME-PID"), each staged file renamed in, the journal removed (the commit), the old
    ones removed. An exception on the way puts everything back at once; a kill leaves the journal,
    and `recover_together` puts everything back at the next start."""
    root, pid = pairs[0][1].parent, os.getpid()
    journal = root / f".swap-{pid}.json"
    entries = [{"final": f.name, "staged": s.name, "existed": f.exists()} for s, f in pairs]
    atomic_write(journal, json.dumps(entries).encode())
    try:
        for number, (staged, final) in enumerate(pairs, 1):
            if final.exists():
                os.rename(final, root / f".old-{final.name}-{pid}")
            os.rename(staged, final)
            faults.fault_point("swap", number)
        fsync_dir(root)
        journal.unlink()  # the commit
        fsync_dir(root)
    except BaseException:
        _undo(root, entries, pid)
        raise
    for _, final in pairs:
        (root / f".old-{final.name}-{pid}").unlink(missing_ok=True)


def recover_together(root: Path) -> None:
    """Undo the replace_together of a process no longer running that left its journal (it died
    before the commit): every final as it was, the staged files gone."""
    for journal in root.glob(".swap-*.json"):
        pid = journal.name[len(".swap-") : -len(".json")]
        if not pid.isdigit() or _running(int(pid)):
            continue
        try:
            entries = json.loads(read_plain(journal, limit=1 << 20))
        except (OSError, ValueError, RecursionError):
            continue  # not a journal tmt wrote whole: left alone
        _undo(root, entries, int(pid))


def _undo(root: Path, entries: list[dict], pid: int) -> None:
    for entry in reversed(entries):
        final, staged = root / entry["final"], root / entry["staged"]
        old = root / f".old-{entry['final']}-{pid}"
        if old.exists():
            os.replace(old, final)
        elif not entry["existed"] and not staged.exists():
            final.unlink(missing_ok=True)  # it was renamed in: there was none before
        staged.unlink(missing_ok=True)
    (root / f".swap-{pid}.json").unlink(missing_ok=True)
    fsync_dir(root)


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


class Busy(Exception):
    """Another process holds the lock: `holder` is what it wrote there (pid, host, since)."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path}: held by {holder or 'another process'}")
        self.path, self.holder = path, holder or "another process"


class Lock:
    """One holder of `path` (a lock file, made if missing) at a time: an flock, which the kernel
    releases when the holder dies, however it dies; the file names the holder ("pid 12 on host
    since 10:00:00"). `remove` (for lock files beside an output): the file is removed on release,
    and an acquire that finds it removed or replaced under it (a release between its open and its
    flock) tries again, so two processes never hold two files of one name."""

    def __init__(self, path: Path, remove: bool = False) -> None:
        self.path, self.remove = Path(path), remove
        self.fd: int | None = None
        self.locked = False  # held by flock (False: a filesystem without locks, or not yet)
        self.previous = ""  # who held it last, when it was taken over after a crash

    def acquire(self) -> None:
        """Take the lock, or raise Busy; an OSError where the file cannot be made."""
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise Busy(self.path, holder) from None
            except OSError:  # a filesystem without locks: the caller is told by `locked`
                self.fd, self.previous = fd, holder
                self.locked = False
                return
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # released and removed under us: take the new file
        else:
            raise Busy(self.path, "processes that keep taking and releasing it")
        me = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode(), 0)
        self.fd, self.previous, self.locked = fd, holder, True

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if self.remove:
                self.path.unlink()  # while held: a waiter then sees it gone and retries
            else:
                os.ftruncate(self.fd, 0)  # a clean end leaves no holder behind
        os.close(self.fd)  # releases the flock
        self.fd = None


def make_directories(directory: Path) -> list[Path]:
    """`directory` and its missing parents made; those it made, outermost first, so that a command
    that then fails takes them away again (remove_made): a refusal leaves no trace."""
    directory = Path(directory)
    missing = [path for path in (*reversed(directory.parents), directory) if not path.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    return missing


def remove_made(made: Sequence[Path]) -> None:
    """The directories make_directories made, innermost first, as long as each is empty: what
    anyone put in one since keeps it and those above it."""
    for path in reversed(made):
        try:
            path.rmdir()
        except FileNotFoundError:  # gone already
            continue
        except OSError:  # not empty: it and those above it stay
            return


def clear_directory(directory: Path, keep: Collection[str] = ()) -> None:
    """Every entry of `directory` removed but those named in `keep` (a link as a link: what it
    points to stays)."""
    for entry in directory.iterdir():
        if entry.name in keep:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def foreign_entries(directory: Path, ours: Collection[str]) -> list[str]:
    """The entries of `directory` that are not among `ours` (what tmt wrote there, as its own
    record lists it): what --overwrite must never delete."""
    return sorted(entry.name for entry in directory.iterdir() if entry.name not in ours)


def split_lines(handle: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of a binary stream without their b"\\n" and one trailing b"\\r"."""
    for line in handle:
        line = line[:-1] if line.endswith(b"\n") else line
        yield line[:-1] if line.endswith(b"\r") else line
