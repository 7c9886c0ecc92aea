"""Deterministic fault points for tests: a run fails exactly where a test says, not by timing.

Set TMT_FAULT to "POINT@STEP:ACTION" (several separated by ","). The trainer calls
`fault_point(POINT, step)` at named places; when POINT and STEP match, ACTION happens:

    kill   SIGKILL this process (a crash or power loss: no cleanup, no flush)
    exit   os._exit(3) (the process vanishes without a traceback)
    raise  raise FaultInjected (an exception inside the trainer)
    hang   sleep for an hour (a stalled rank)

Points: "step" (after optimizer step STEP), "after_save" (after checkpoint STEP is complete).
With TMT_FAULT_RANK=R only rank R (the RANK variable) acts. Unset, nothing happens.
"""

from __future__ import annotations

import os
import signal
import time


class FaultInjected(RuntimeError):
    """Raised by the `raise` action."""


def _plan() -> dict[tuple[str, int], str]:
    plan = {}
    for item in filter(None, os.environ.get("TMT_FAULT", "").split(",")):
        where, _, action = item.partition(":")
        point, _, step = where.partition("@")
        plan[(point.strip(), int(step))] = action.strip()
    return plan


def fault_point(point: str, step: int) -> None:
    """Do nothing unless TMT_FAULT names this point and step (and this rank, if restricted)."""
    action = _plan().get((point, step)) if "TMT_FAULT" in os.environ else None
    if action is None:
        return
    only_rank = os.environ.get("TMT_FAULT_RANK")
    if only_rank is not None and only_rank != os.environ.get("RANK", "0"):
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "exit":
        os._exit(3)
    elif action == "raise":
        raise FaultInjected(f"fault injected at {point}@{step}")
    elif action == "hang":
        time.sleep(3600)
    else:
        raise ValueError(f"TMT_FAULT: unknown action {action!r} (kill, exit, raise, hang)")
