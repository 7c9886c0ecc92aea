"""Deterministic fault points for tests: a run fails exactly where a test says, not by timing.

Set TMT_FAULT to "POINT@N:ACTION" (several separated by ","). Code calls `fault_point(POINT, N)`
at named places; when POINT and N match, ACTION happens. Unset, every call is a dictionary lookup
that returns None.

Points:
    step        after optimizer update N (N counts updates, from 1)
    after_save  after checkpoint N is complete (N is its step)
    loss        in the N-th update attempt (skipped ones count): `nan` poisons the loss, `oom`
                runs out of memory
    saveS_bytes while writing checkpoint S (e.g. save8_bytes), once N bytes of it are written
    chunk       after translation chunk N (from 1) is committed (tmt translate -i FILE -o FILE)
    plan        once a time budget is planned (optim.schedule=budget); N is 1
    glossary_write  while tmt serve stores its N-th glossary: written, not yet renamed into place
    swap        after the N-th file of a set replaced together is renamed in (tmt clean's outputs)
    terms_chunk after tmt terms commits its N-th chunk of counts (from 1)

Actions:
    kill    SIGKILL this process: a crash or power loss, no cleanup, no flush
    exit    os._exit(3): the process vanishes without a traceback
    raise   raise FaultInjected (an exception inside the trainer)
    hang    sleep for an hour: a stalled rank
    sigterm send SIGTERM to this process (as a scheduler preempting the job would)
    sigint  send SIGINT to this process (as Ctrl-C would)
    oom     raise torch.OutOfMemoryError
    enospc  raise OSError(ENOSPC): the disk is full
    nan     returned to the caller, which makes its value non-finite

An action may name one rank, "exit@rank1": only the process whose RANK is 1 acts. TMT_FAULT_RANK=R
restricts all faults to rank R.
"""

from __future__ import annotations

import errno
import os
import signal
import time


class FaultInjected(RuntimeError):
    """Raised by the `raise` action."""


def _plan() -> dict[tuple[str, int], str]:
    """{(point, number): action} for this process's rank."""
    rank = os.environ.get("RANK", "0")
    only_rank = os.environ.get("TMT_FAULT_RANK")
    plan = {}
    for item in filter(None, os.environ.get("TMT_FAULT", "").split(",")):
        where, _, action = item.partition(":")
        point, _, number = where.partition("@")
        action, _, target = action.strip().partition("@rank")
        if (target and target != rank) or (only_rank is not None and only_rank != rank):
            continue
        plan[(point.strip(), int(number))] = action
    return plan


def planned(point: str) -> list[int]:
    """The numbers TMT_FAULT plans for `point` on this process (e.g. byte offsets of a save)."""
    if "TMT_FAULT" not in os.environ:
        return []
    return sorted(n for p, n in _plan() if p == point)


def fault_point(point: str, number: int) -> str | None:
    """Carry out the fault planned for (point, number), if any; returns the action, which the
    caller carries out itself for `nan`."""
    if "TMT_FAULT" not in os.environ:
        return None
    action = _plan().get((point, number))
    if action is None:
        return None
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "exit":
        os._exit(3)
    elif action == "raise":
        raise FaultInjected(f"fault injected at {point}@{number}")
    elif action == "hang":
        time.sleep(3600)
    elif action in ("sigterm", "sigint"):
        os.kill(os.getpid(), signal.SIGTERM if action == "sigterm" else signal.SIGINT)
    elif action == "oom":
        import torch

        raise torch.OutOfMemoryError(f"fault injected at {point}@{number}: out of memory")
    elif action == "enospc":
        raise OSError(errno.ENOSPC, "No space left on device (fault injected)")
    elif action != "nan":
        raise ValueError(f"TMT_FAULT: unknown action {action!r} in {point}@{number}")
    return action
