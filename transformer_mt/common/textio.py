"""Text in and out: how every command reads lines and writes what it makes.

- Lines are bytes split on b"\\n" only (files.split_lines): a lone "\\r", U+2028 or U+0085 stays
  inside its line, as `wc -l` counts. Plain and gzip files; a UTF-8 BOM at the start of a file and
  one trailing "\\r" are stripped.
- `decode_line`: one line as text under a policy: strict (an error naming file:line), replace
  (U+FFFD), warn (replace, and say where), skip (an empty line).
- Streams: stdin or a file in (`open_input`, `stream_lines`, `waiting_chunks`), stdout, a device
  or a file out (`open_output`: a file appears complete or not at all).
- `check_output`: the one output check of every command that writes (translate, the file job,
  export, average, plot, import, clean): a path with a name of its own under a directory, never
  one of its inputs, never a file tmt manages, and an existing file or directory replaced only
  when asked (overwrite).
- `OutputLock`: one writer per output: a second command writing the same output is refused while
  the first runs.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
import os
import queue
import stat
import sys
import threading
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from transformer_mt.common import files
from transformer_mt.common.exits import NO_ROOM, NO_ROOM_ERRNOS, SIGNAL_POLL_S, TmtError

logger = logging.getLogger(__name__)

STDIO = "-"  # an input or output that is stdin or stdout
_BOM = b"\xef\xbb\xbf"


# --- reading -----------------------------------------------------------------------------------


def read_lines(path: Path) -> Iterator[bytes]:
    """The lines of a plain or .gz file as bytes (a BOM at the start stripped)."""
    opener = gzip.open if path.suffix == ".gz" else open
    lineno = 0
    try:
        with opener(path, "rb") as handle:
            for lineno, line in enumerate(files.split_lines(handle), 1):
                yield line[len(_BOM) :] if lineno == 1 and line.startswith(_BOM) else line
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise TmtError(f"{path}:{lineno + 1}: corrupt gzip data ({err})") from None
    except OSError as err:
        raise TmtError(f"{path}: cannot read: {err.strerror or err}") from None


def decode_line(
    line: bytes, where: str, lineno: int, errors: str = "strict", hint: str = ""
) -> tuple[str, bool]:
    """(text, invalid): one line as UTF-8 text. Invalid UTF-8 under `errors`: strict raises an
    error naming where:lineno (and `hint`), replace gives U+FFFD, warn replaces and logs where,
    skip gives ""."""
    try:
        return line.decode("utf-8"), False
    except UnicodeDecodeError as err:
        problem = f"{where}:{lineno}: invalid UTF-8 at byte offset {err.start}"
        if errors == "strict":
            raise TmtError(problem + hint) from None
        if errors == "warn":
            logger.warning("%s, replaced", problem)
        return ("" if errors == "skip" else line.decode("utf-8", "replace")), True


def regular_file(path: str | Path, param: str, pipes: bool = False) -> Path:
    """`path`, if it is a regular file (or a link to one), or with `pipes` a FIFO (what a shell's
    `<(command)` gives, for a file read once); else one line saying what it is: no such file, a
    directory, a FIFO, a device or a socket (the caller's parameter `param`)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise TmtError(f"{path}: no such file", param=param) from None
    except OSError as err:
        raise TmtError(f"{path}: {err.strerror or err}", param=param) from None
    if stat.S_ISREG(mode) or (pipes and stat.S_ISFIFO(mode)):
        return Path(path)
    kinds = [
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (a named pipe)"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
        (stat.S_ISSOCK, "a socket"),
    ]
    what = next((name for test, name in kinds if test(mode)), "not a regular file")
    raise TmtError(f"{path}: is {what}, expected a regular file", param=param)


def read_text_file(path: str | Path, param: str) -> list[str]:
    """Lines of a plain or .gz text file to score (strict UTF-8), which the caller's parameter
    `param` names; an empty file is an error: there would be nothing to score."""
    file = regular_file(path, param, pipes=True)
    lines = [
        decode_line(raw, str(file), n, "strict", hint=" (the file must be UTF-8)")[0]
        for n, raw in enumerate(read_lines(file), 1)
    ]
    if not lines:
        raise TmtError(f"{path}: empty file: nothing to score", param=param)
    return lines


def count_lines(path: str | Path, param: str = "input") -> int:
    """The lines of a file as stream_lines splits them (the last one without b"\\n" counts)."""
    try:
        with open(path, "rb") as handle:
            return sum(1 for _ in files.split_lines(handle))
    except OSError as err:
        raise TmtError(f"{path}: {err.strerror or err}", param=param) from None


@contextlib.contextmanager
def open_input(path: str, param: str = "input") -> Iterator[BinaryIO]:
    """stdin ("-") or the file at `path`, in binary.

    stdin is read through a reader of its own on fd 0, not sys.stdin's: a stream is read on a
    thread (waiting_chunks), and a thread blocked in a read holds its reader's lock, which
    Python, exiting on Ctrl-C, needed to close sys.stdin: it aborted ("Fatal Python error:
    _enter_buffered_busy", exit -6). closefd=False: fd 0 stays open, the reader is never
    closed by anyone (closing it would wait for that read)."""
    if path == STDIO:
        if sys.stdin is None:  # started with stdin closed (<&-)
            raise TmtError(f"{path}: stdin is closed; pipe the input in, or name a file",
                           param=param)  # fmt: skip
        try:
            fd = sys.stdin.fileno()
        except (OSError, ValueError):  # a stdin with no descriptor (a test's, in memory)
            yield sys.stdin.buffer
            return
        yield open(fd, "rb", closefd=False)  # noqa: SIM115
        return
    try:
        handle = open(path, "rb")  # noqa: SIM115
    except OSError as err:
        raise TmtError(f"{path}: {err.strerror or err}", param=param) from None
    with handle:
        yield handle


def stream_lines(source: BinaryIO, where: str) -> Iterator[str]:
    """The lines of a stream as text; invalid UTF-8 is replaced and reported, never dropped."""
    for lineno, line in enumerate(files.split_lines(source), 1):
        yield decode_line(line, where, lineno, "warn")[0]


def waiting_chunks(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    """Group lines: block for the first, then take only what is already waiting (a reader thread
    fills a bounded queue), so no line waits for input that has not arrived yet."""
    waiting: queue.Queue[Any] = queue.Queue(maxsize=4 * size)
    end = object()

    def reader() -> None:
        try:
            for line in lines:
                waiting.put(line)
        finally:
            waiting.put(end)

    threading.Thread(target=reader, daemon=True).start()
    while True:
        first = _next(waiting)
        if first is end:
            return
        chunk = [first]
        while len(chunk) < size:
            try:
                item = waiting.get_nowait()
            except queue.Empty:
                break
            if item is end:
                yield chunk
                return
            chunk.append(item)
        yield chunk


def _next(waiting: queue.Queue[Any]) -> Any:
    """The queue's next item, waited for in steps (Ctrl-C's KeyboardInterrupt: SIGNAL_POLL_S)."""
    while True:
        try:
            return waiting.get(timeout=SIGNAL_POLL_S)
        except queue.Empty:
            continue


# --- writing -----------------------------------------------------------------------------------


def check_output(
    output: str | Path,
    inputs: Sequence[str | Path] = (),
    overwrite: bool = False,
    param: str = "output",
    directory: bool = False,
) -> None:
    """Refuse an output that is one of `inputs` (the same file by any name), a path tmt manages
    (a checkpoint's files, a run's own files), an existing file or non-empty directory without
    `overwrite`, or, for a file output (not `directory`), a directory: refused before any work,
    whatever `overwrite` says. stdout ("-"), a device and a FIFO are written as they are, never
    replaced."""
    if str(output) == STDIO:
        return
    path = Path(output)
    check_path(output, param)
    if not directory and path.is_dir():
        raise TmtError(f"{output}: is a directory; name a file to write", param=param)
    for source in inputs:
        if str(source) != STDIO and _same_path(path, Path(source)):
            raise TmtError(f"{output}: is the input file; choose another output", param=param)
    managed = managed_by_tmt(path)
    if managed:
        raise TmtError(f"{output}: {managed}; choose another output", param=param)
    # An empty directory holds nothing to lose: it is filled without asking.
    replaced = path.is_file() or (path.is_dir() and not path.is_symlink() and any(path.iterdir()))
    if replaced and not overwrite:
        raise TmtError(
            f"{output}: exists; add {{overwrite}} to replace it",
            param=param,
            mentions=["overwrite"],
        )


def check_path(output: str | Path, param: str = "output") -> None:
    """Refuse, in one line, an output path that names nothing of its own ("", ".", "..", "/") or
    lies under something that is not a directory (a regular file on its way)."""
    text = str(output)
    name = os.path.basename(os.path.normpath(text)) if text else ""
    if name in ("", ".", "..") or text.endswith(os.sep + ".") or text in (os.sep,):
        raise TmtError(f"{text or repr(text)}: names no file or directory of its own; give the"
                       " output a name", param=param)  # fmt: skip
    for parent in Path(os.path.abspath(text)).parents:
        if parent.exists():
            if not parent.is_dir():
                raise TmtError(f"{text}: the output's parent {parent} is not a directory",
                               param=param)  # fmt: skip
            break


class OutputLock:
    """The one writer of an output: ".NAME.lock" beside it, held while a command writes it (an
    flock, released when the command ends, however it ends; removed on a clean end). A second
    command writing the same output is refused, naming the first."""

    def __init__(self, output: str | Path, param: str = "output", own: bool = False) -> None:
        """`own`: a file tmt keeps in a model's directory (a shortlist beside the model), which
        the refusal of outputs inside directories tmt manages does not concern."""
        path = Path(os.path.abspath(str(output)))
        self.output, self.param, self.own = output, param, own
        self.lock = files.Lock(path.parent / f".{path.name}.lock", remove=True)
        self.made: list[Path] = []  # directories made to hold the output

    def __enter__(self) -> OutputLock:
        check_path(self.output, self.param)
        managed = None if self.own else managed_by_tmt(Path(self.output))
        if managed:  # refused before the lock's file touches a directory tmt manages
            raise TmtError(f"{self.output}: {managed}; choose another output", param=self.param)
        try:
            self.made = files.make_directories(self.lock.path.parent)
            self.lock.acquire()
        except files.Busy as err:
            raise TmtError(
                f"{self.output}: another tmt is writing it ({err.holder}); wait for it"
                " to end, or choose another output",
                param=self.param,
            ) from None
        except OSError as err:
            files.remove_made(self.made)
            raise TmtError(f"{self.output}: cannot write there ({err.strerror or err})",
                           param=self.param) from None  # fmt: skip
        return self

    def __exit__(self, error: type[BaseException] | None, *exc: object) -> None:
        self.lock.release()
        if error is not None:  # a refused or failed command leaves no directory it made empty
            files.remove_made(self.made)


def _same_path(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def managed_by_tmt(path: Path) -> str | None:
    """What `path` is when tmt manages it (in a checkpoint or a run's checkpoints/, a run's own
    file, in a file job's directory), else None: no command writes its output over one, and
    retention or a finished job would delete what was written there."""
    path = Path(path).absolute()
    if (path.parent / files.MANIFEST_FILE).exists() or path.parent.name == files.CHECKPOINTS:
        return f"inside the checkpoint directory {path.parent}"
    if path.name in files.RUN_FILES and (path.parent / files.CHECKPOINTS).is_dir():
        return f"a file of the run directory {path.parent}"
    if path.parent.name.endswith(files.JOB_SUFFIX):
        return f"inside the translation job directory {path.parent}"
    return None


def check_directory(path: Path, key: str) -> None:
    """Refuse a directory that config key `key` names for tmt to write into (a run, a cache)
    when it is a checkpoint or lies where tmt manages files, or is not a directory."""
    named = f"{key} {path}" if key.startswith("-") else f"{key}={path}"  # a flag or a setting
    if Path(path).exists() and not Path(path).is_dir():
        raise TmtError(f"{named}: exists and is not a directory; choose another directory")
    managed = managed_by_tmt(path)
    if (Path(path) / files.MANIFEST_FILE).exists():
        managed = "a checkpoint directory"
    if managed:
        raise TmtError(f"{named}: {managed}; choose another directory")


@contextlib.contextmanager
def open_output(path: str, param: str = "output") -> Iterator[TextIO]:
    """stdout ("-"), a device or FIFO as it is; a file through the atomic path (a temporary beside
    it, renamed into place when the block ends without an error, removed if it does not). A write
    that finds no room is an error naming `path` with exit code NO_ROOM."""
    if path == STDIO:
        yield sys.stdout
        return
    target = Path(path)
    direct = target.exists() and not target.is_file()  # /dev/stdout, /dev/full, a FIFO, ...
    if not direct:  # temporaries of killed writers into this file (a live one is younger)
        pattern = f".{target.name}.*{files.TEMP_SUFFIX}"
        files.remove_leftovers(target.parent, [pattern], older_than_s=86_400)
    try:
        with contextlib.ExitStack() as stack:
            try:
                if direct:
                    text = stack.enter_context(open(target, "w", encoding="utf-8", newline="\n"))
                else:
                    raw = stack.enter_context(files.atomic_file(target))
                    text = io.TextIOWrapper(raw, encoding="utf-8", newline="\n")
            except OSError as err:
                raise TmtError(f"{path}: {err.strerror or err}", param=param) from None
            try:
                yield text
            except BaseException:
                if not direct:
                    with contextlib.suppress(OSError, ValueError):
                        text.detach()  # the atomic file then removes its temporary
                raise
            if not direct:
                text.detach()  # flushes; the atomic file fsyncs and renames it into place
    except OSError as err:  # a full disk, a quota, an I/O error: the old content is kept
        if err.errno not in NO_ROOM_ERRNOS:
            raise
        raise TmtError(
            f"{path}: cannot write ({err.strerror or err})", exit_code=NO_ROOM, param=param
        ) from None
