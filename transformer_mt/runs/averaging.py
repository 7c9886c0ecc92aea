"""Checkpoint averaging (§6.1: "the last 5 checkpoints" for base models, the last 20 for big):
which checkpoints (named ones, a run's newest N, or its N best by a validation score), their
element-wise mean, and the averaged model written as a self-contained model directory.

Checkpoints are read one at a time as they are averaged: the first is read whole (its tokenizer
parsed, its model built), each other one is verified to hold the same model and added to the sums
without a second parse or build. Memory holds the sums and one checkpoint. Sums are float64, so N
copies of a checkpoint average back to it bitwise. `tmt average` is one call (average_into); the
same choice of checkpoints (choose) serves every command that takes a model.

A model directory may also hold the shortlist `tmt shortlist` made for it (shortlist.npz): a
file tmt wrote there, so an average may replace the directory. It is kept when the new average
is the same model (a finished run run again), and dropped with a warning when it is not (the
shortlist names the model it was made for and would be refused).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from transformer_mt.common import exits, files, textio
from transformer_mt.common.exits import TmtError
from transformer_mt.network.shortlist import FILE_NAME as SHORTLIST_FILE
from transformer_mt.runs import checkpoint, run
from transformer_mt.runs.checkpoint import HIGHER_IS_BETTER, Checkpoint

logger = logging.getLogger(__name__)


# --- which checkpoints -------------------------------------------------------------------------


def choose(
    models: Sequence[str | Path],
    last: int | None = None,
    best: int | None = None,
    by: str | None = None,
) -> Checkpoint | None:
    """The average that `last` (a run's newest N) or `best` (its N best by `by`) asks for, of the
    one run directory in `models`; None when neither is asked for (the models are used as named).
    The rules every command that takes a model shares; 0 is no number of checkpoints (it read as
    not asked, so `--last 0` decoded the run's best checkpoint without a word)."""
    for name, count in (("last", last), ("best", best)):
        if count is not None and count < 1:
            raise TmtError(
                f"{{{name}}} {count}: expected a number of checkpoints >= 1", mentions=[name]
            )
    if last is not None and best is not None:
        raise TmtError("{last} and {best}: choose one", mentions=["last", "best"])
    if by and best is None:
        raise TmtError("{by} ranks the checkpoints of {best} N", mentions=["by", "best"])
    if last is None and best is None:
        return None
    if len(models) != 1:
        raise TmtError(
            f"{len(models)} models: {{{'last' if last else 'best'}}} takes one run directory",
            mentions=["last" if last else "best"],
        )
    run_dir = Path(models[0])
    return newest(run_dir, last) if last is not None else best_of(run_dir, best or 0, by)


def newest(run_dir: Path, n: int, allow_fewer: bool = False) -> Checkpoint:
    """The average of the newest `n` checkpoints of a run that read (broken ones are reported and
    skipped); with allow_fewer, of as many as there are (at least 1)."""
    _require_run(run_dir)
    mean, taken = _average(reversed(run.list_checkpoints(run_dir, links=True)), limit=n,
                           skip_broken=True)  # fmt: skip
    if mean is None or (taken < n and not allow_fewer):
        raise TmtError(f"{run_dir}: {taken} complete checkpoints, {n} asked for")
    return mean


def best_of(run_dir: Path, n: int, by: str | None = None) -> Checkpoint:
    """The average of the `n` best checkpoints of a run by the validation score `by` that they
    carry (default: scored_metric); broken ones are reported and skipped."""
    _require_run(run_dir)
    by = by or scored_metric(run_dir)
    if by not in HIGHER_IS_BETTER:
        raise TmtError(f"{by}: expected one of {', '.join(HIGHER_IS_BETTER)}", param="by")
    ranked = checkpoint.ranked_by(run.list_checkpoints(run_dir, links=True), by)
    if len(ranked) < n:
        raise TmtError(
            f"{run_dir}: {n} checkpoints with {by} asked for, {len(ranked)} carry it (a"
            " checkpoint carries the scores of a validation at its step; train.keep_best keeps"
            " the best ones)"
        )
    for path, value in ranked[:n]:
        logger.info("%s: %s %.4f", path.name, by, value)
    mean, taken = _average((path for path, _ in ranked), limit=n, skip_broken=True)
    if mean is None or taken < n:
        raise TmtError(f"{run_dir}: {n} checkpoints with {by} asked for, {taken} read")
    return mean


def scored_metric(run_dir: Path) -> str:
    """What best-N averaging ranks a run's checkpoints by unless told: val_bleu when they carry
    it (the run measured BLEU at checkpoint steps), else val_loss."""
    carried = {name for path in run.list_checkpoints(run_dir, links=True)
               for name in checkpoint.scores(path)}  # fmt: skip
    return "val_bleu" if "val_bleu" in carried else "val_loss"


def _require_run(run_dir: Path) -> None:
    if not (run_dir / run.CHECKPOINTS).is_dir():
        raise TmtError(f"{run_dir}: not a run directory (no {run.CHECKPOINTS}/)")


# --- the mean ----------------------------------------------------------------------------------


def average(paths: Iterable[str | Path]) -> Checkpoint:
    """The average of the checkpoints at `paths` (each must read), with the newest one's config
    and step; its model holds the mean (on the CPU)."""
    mean, _ = _average(map(Path, paths))
    if mean is None:
        raise TmtError("no checkpoints to average")
    return mean


def _average(
    paths: Iterable[Path], limit: int = 0, skip_broken: bool = False
) -> tuple[Checkpoint | None, int]:
    """The mean of the first `limit` (0: all) checkpoints of `paths` that read, and how many that
    was; with skip_broken, one that does not read is reported and passed over."""
    first: Checkpoint | None = None
    sums: dict[str, torch.Tensor] = {}
    newest_read: Checkpoint | None = None  # the config and step of the average
    sources: list[tuple[int, str]] = []
    for path in paths:
        try:
            saved = checkpoint.read(path, average_with=first)
        except TmtError as err:
            if not skip_broken:
                raise
            logger.warning("skipping checkpoint %s: %s", path, err)
            continue
        if first is None:
            first = saved
        for name, tensor in saved.state_dict.items():
            sums[name] = sums[name] + tensor.double() if name in sums else tensor.double()
        if newest_read is None or saved.step >= newest_read.step:
            newest_read = saved
        sources.append((saved.step, str(saved.path)))
        if len(sources) == limit:
            break
    if first is None or newest_read is None or first.model is None:
        return None, 0
    # The first checkpoint's model (built when it was read) takes the mean.
    first.model.load_state_dict({name: total / len(sources) for name, total in sums.items()})
    mean = Checkpoint(
        path=newest_read.path, step=newest_read.step, config=newest_read.config,
        tokenizer=first.tokenizer, state_dict=first.model.state_dict(), model=first.model,
        sources=tuple(path for _, path in sorted(sources)),
    )  # fmt: skip
    return mean, len(sources)


# --- the averaged model on disk ----------------------------------------------------------------


def check_destination(
    output: Path, overwrite: bool = False, inputs: Sequence[str | Path] = ()
) -> None:
    """An average goes to a new or empty directory, or replaces an averaged model with
    `overwrite`; never a training checkpoint (its training state would be lost), nor anything
    that is not a model, nor an input or a file tmt manages (textio.check_output)."""
    if output.is_symlink() or (output.exists() and not output.is_dir()):
        raise TmtError(f"{output}: exists and is not a model directory; choose another output")
    if (output / checkpoint.MANIFEST_FILE).exists():
        try:
            listed = checkpoint.read_manifest(output)["files"]
        except TmtError:
            listed = {checkpoint.STATE_FILE: "unreadable"}
        if checkpoint.STATE_FILE in listed:
            raise TmtError(
                f"{output}: a training checkpoint; averaging into it would destroy its training"
                " state; choose another output"
            )
        ours = {*listed, checkpoint.MANIFEST_FILE}
        table = output / SHORTLIST_FILE  # tmt shortlist's file (a regular file, as it writes it)
        if table.is_file() and not table.is_symlink():
            ours.add(SHORTLIST_FILE)
        foreign = files.foreign_entries(output, ours)
        if foreign:
            raise TmtError(f"{output}: holds {foreign[0]}, which tmt did not write there: an"
                           " average replaces only its own files; move it, or choose another"
                           " output")  # fmt: skip
    elif output.is_dir() and any(output.iterdir()):
        raise TmtError(f"{output}: exists and is not a checkpoint; choose another output")
    textio.check_output(output, inputs, overwrite, directory=True)


def _kept_shortlist(output: Path) -> tuple[bytes, str] | None:
    """(the bytes of the shortlist in the model directory `output`, the SHA-256 of the model.pt
    it sits beside), or None when there is none or no readable manifest to tie it to."""
    path = output / SHORTLIST_FILE
    if not path.is_file() or path.is_symlink():
        return None
    try:
        model_sha256 = checkpoint.read_manifest(output)["files"][checkpoint.MODEL_FILE]
        return path.read_bytes(), model_sha256
    except (TmtError, KeyError, OSError):
        return None


def write(mean: Checkpoint, output: Path) -> Checkpoint:
    """Write an average as a self-contained model directory at `output` (atomically, replacing
    what is there: check_destination first); returns it as written. The model's shortlist there
    is kept if the model is the same (_kept_shortlist)."""
    info = {"averaged": list(mean.sources)}
    shortlist = _kept_shortlist(output)
    try:
        checkpoint.write(
            output, mean.step, mean.config, state_dict=mean.state_dict,
            tokenizer_bytes=mean.tokenizer_bytes, info=info,
        )  # fmt: skip
    except (OSError, RuntimeError) as err:  # disk full, quota, I/O (torch: RuntimeError)
        reason, code = exits.write_failed(err)
        raise TmtError(
            f"{output}: writing the averaged model failed ({reason}); nothing was left there",
            exit_code=code,
        ) from None
    if shortlist is not None:
        table, model_sha256 = shortlist
        if checkpoint.read_manifest(output)["files"].get(checkpoint.MODEL_FILE) == model_sha256:
            files.atomic_write(output / SHORTLIST_FILE, table)
        else:
            logger.warning("%s: made for the model this average replaced, so not kept: make it"
                           " again with tmt shortlist -m %s", output / SHORTLIST_FILE,
                           output)  # fmt: skip
    return Checkpoint(
        path=output, step=mean.step, config=mean.config, tokenizer=mean.tokenizer,
        state_dict=mean.state_dict, model=mean.model, sources=mean.sources,
    )  # fmt: skip


def average_into(
    models: Sequence[str | Path],
    output: Path,
    last: int | None = None,
    best: int | None = None,
    by: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """`tmt average`: the named checkpoints, or a run's newest `last` or `best` N by `by`,
    averaged into a self-contained model at `output` (replacing an averaged model there only with
    `overwrite`). What was written."""
    if not models:
        raise TmtError("no checkpoints to average: name them, or one run directory with {last} N"
                       " or {best} N", mentions=["last", "best"])  # fmt: skip
    textio.check_path(output)
    with textio.OutputLock(output):  # one writer: the checks hold while it writes
        check_destination(output, overwrite, models)
        if best and not by:
            by = scored_metric(Path(models[0]))
        mean = choose(models, last, best, by)
        if mean is None:
            for model in map(Path, models):
                if (model / run.CHECKPOINTS).is_dir():
                    raise TmtError(
                        f"{model}: a run directory; average its newest checkpoints with"
                        " {last} N or its best with {best} N", mentions=["last", "best"],
                    )  # fmt: skip
            mean = average(models)
        written = write(mean, output)
    return {
        "output": str(written.path),
        "averaged": list(written.sources),
        **({"by": by} if best else {}),
    }


def format_report(report: dict[str, Any]) -> str:
    """`average_into`'s report for people: which checkpoints went into which file."""
    names = ", ".join(Path(p).name for p in report["averaged"])
    ranked = f" (the best by {report['by']})" if "by" in report else ""
    count = len(report["averaged"])
    return f"averaged {count} checkpoints{ranked} into {report['output']}: {names}"
