"""How a tmt command ends: its exit codes, the error a user can act on, and the stop signals.

Exit codes:
    0    done
    1    a distributed job lost a rank (any other exit 1 with a traceback is a bug)
    2    bad input: config, data, checkpoint, command-line option
    3    training diverged (train.nonfinite_patience consecutive non-finite updates)
    4    no room: a write found the disk full, a quota, a file-size limit or an I/O error
    130  stopped by SIGINT, after saving the last completed step
    143  stopped by SIGTERM, after saving the last completed step
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

LOST_RANK = 1
BAD_INPUT = 2
DIVERGED = 3
NO_ROOM = 4
# The errors of a write that found no room: disk full, quota, file size, I/O (exit NO_ROOM).
NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})
# Runs stopped by a signal exit like a shell would report them: 128 + the signal number.
SIGNAL_EXIT = {"sigterm": 128 + signal.SIGTERM, "sigint": 128 + signal.SIGINT}
# A signalled run that reaches no step boundary within this time exits unsaved; torchrun sends
# SIGKILL 30 s after SIGTERM, so this leaves room for the last save and a clean exit.
SIGNAL_GRACE_S = 25.0


def write_failed(err: BaseException) -> tuple[str, int]:
    """Why a write failed, in words, and its exit code: NO_ROOM where the disk had no room
    (NO_ROOM_ERRNOS, or torch's writer's RuntimeError, which says no more), BAD_INPUT where the
    place was the user's choice to fix: a file on the way, no permission, a read-only disk."""
    if not isinstance(err, OSError):
        return first_line(err), NO_ROOM
    return err.strerror or first_line(err), NO_ROOM if err.errno in NO_ROOM_ERRNOS else BAD_INPUT


def first_line(err: BaseException) -> str:
    """An error's message on one line: its first (torch's and C++'s messages run to pages), or
    its type's name when it has none."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class TmtError(Exception):
    """A failure the user can act on: the CLI prints it on one line and exits with `exit_code`.

    A library function names what it was given by its parameter's name, never by a command-line
    flag its caller may not have typed: `param` is the parameter the message is about (the message
    then reads "output out.txt: exists; ..."), and each name in `mentions` is written "{name}" in
    the message. `render` writes them as the caller knows them; the CLI writes its flags ("--output
    out.txt: exists; add --overwrite to replace it"), str() the parameter names."""

    def __init__(
        self,
        message: str,
        exit_code: int = BAD_INPUT,
        param: str | None = None,
        mentions: Sequence[str] = (),
    ) -> None:
        self.message, self.exit_code = message, exit_code
        self.param, self.mentions = param, tuple(mentions)
        super().__init__(self.render(lambda name: name))

    def render(self, name_of: Callable[[str], str]) -> str:
        """The message, each parameter it names written as name_of(parameter)."""
        text = self.message
        for name in self.mentions:
            text = text.replace("{" + name + "}", name_of(name))
        return f"{name_of(self.param)} {text}" if self.param else text

    def __reduce__(self) -> tuple[Any, ...]:  # sent between ranks whole, not as its text alone
        return (type(self), (self.message, self.exit_code, self.param, self.mentions))


def user_error(err: BaseException, name_of: Callable[[str], str] = str) -> tuple[str, int] | None:
    """The one line and exit code a command ends with for `err`: bad input (a TmtError, its
    parameters written as name_of writes them) or an OSError (named by its file; a write that
    found no room exits NO_ROOM). None where the traceback is wanted instead: any other
    exception (a bug), a broken pipe (Python's own quiet exit), or TMT_DEBUG=1 in the
    environment."""
    if os.environ.get("TMT_DEBUG"):
        return None
    if isinstance(err, TmtError):
        return err.render(name_of), err.exit_code
    if isinstance(err, OSError) and not isinstance(err, BrokenPipeError):
        where = f"{err.filename}: " if err.filename else ""
        reason, code = write_failed(err)
        return where + reason, code
    return None


def run_script(main: Callable[[], Any]) -> Any:
    """A script's main(), ended as a tmt command ends on bad input: "SCRIPT: error: ..." on one
    line of stderr (as argparse names it) and its exit code (user_error), not a traceback."""
    try:
        return main()
    except (TmtError, OSError) as err:
        ended = user_error(err)
        if ended is None:
            raise
        print(f"{os.path.basename(sys.argv[0])}: error: {ended[0]}", file=sys.stderr)
        raise SystemExit(ended[1]) from None


# How often a main thread that waits (for a request, a line, a thread) wakes. Python runs a
# signal's handler on the main thread only, between bytecodes: a signal the kernel handed to
# another thread (its C handler ran there) waited for whatever the main thread waited for, with
# no timeout, however long (a server ignored SIGTERM for 75 s). Waking to find nothing costs
# nothing.
SIGNAL_POLL_S = 0.25


class StopSignals:
    """SIGTERM and SIGINT only set a flag: training stops at the next step boundary (every rank
    agrees through the step's collective), saves that step and exits 143 or 130. A second signal,
    or no step boundary within SIGNAL_GRACE_S, exits at once without saving."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._timer is not None:
            self._timer.cancel()

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None:  # asked twice: stop now
            os._exit(128 + signum)
        self.received = "sigterm" if signum == signal.SIGTERM else "sigint"
        self._timer = threading.Timer(SIGNAL_GRACE_S, self._expire, (signum,))
        self._timer.daemon = True
        self._timer.start()

    def _expire(self, signum: int) -> None:
        logger.error(
            "%s: no step boundary within %.0f s; exiting unsaved", self.received, SIGNAL_GRACE_S
        )
        os._exit(128 + signum)
