"""What a finished resumable job leaves behind: one rule for every resumable command.

`tmt train` run again on a run that ended says it is done and writes nothing; so does a file job
of `tmt translate` and `tmt terms`: when a job finishes, its work directory keeps done.json, the
job's identity (inputs, model, settings) and the SHA-256 of each output it wrote. The same command
again finds it (`state`): the same identity and the outputs as written is "done" (nothing to do);
another identity, while the outputs are still as written, is "other" (the caller refuses in one
line naming what differs, --overwrite starts again); outputs changed or gone since, or no record,
is a new job. The record is verified, never trusted: a damaged one is no record.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformer_mt.common import files

DONE_FILE = "done.json"


def mark_done(work: Path, identity: dict[str, Any], outputs: Sequence[Path]) -> None:
    """Record in `work` that the job of `identity` finished, having written `outputs`."""
    record = {"identity": identity, "outputs": {str(p): files.sha256_file(p) for p in outputs}}
    files.atomic_write(work / DONE_FILE, json.dumps(record, indent=1).encode())


def state(
    work: Path, identity: dict[str, Any], outputs: Sequence[Path]
) -> tuple[str | None, dict[str, Any]]:
    """("done", identity) when `work` records this job finished and its outputs are as it wrote
    them; ("other", the recorded identity) for another job's finished outputs, still as written;
    (None, {}) otherwise."""
    path = work / DONE_FILE
    if not path.is_file():
        return None, {}
    try:
        record = json.loads(files.read_plain(path, limit=1 << 20))
        recorded, written = record["identity"], record["outputs"]
        if not isinstance(recorded, dict) or not isinstance(written, dict):
            return None, {}
        if set(written) != {str(p) for p in outputs}:
            return None, {}
        for output in outputs:
            if not output.is_file() or files.sha256_plain(output) != written[str(output)]:
                return None, {}  # changed or gone since: not this record's any more
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None, {}
    return ("done", recorded) if recorded == identity else ("other", recorded)


def forget(work: Path) -> None:
    """The record gone (a job that starts again)."""
    (work / DONE_FILE).unlink(missing_ok=True)
