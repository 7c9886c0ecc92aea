"""What training reports as it goes: OUT_DIR/metrics.jsonl (one JSON object per log step,
validation, skipped update and event), the progress bar, and the same curves as TensorBoard events
(train.tensorboard). plot.py draws metrics.jsonl; a resumed run drops the records past its step.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from transformer_mt.common import distributed, exits, files
from transformer_mt.common.distributed import DistInfo
from transformer_mt.common.exits import TmtError

logger = logging.getLogger(__name__)

METRICS_FILE = files.METRICS_FILE  # OUT_DIR/metrics.jsonl


def trim(run_dir: Path, step: int) -> None:
    """Drop the records past `step` from a run's metrics log: a resume trains those steps again.
    The partial record a session wrote when it stopped at `step` goes too: the checkpoint holds
    its sums, so the resumed run's next record covers those updates as an uninterrupted run's
    does (the record of why it stopped stays). A line that does not read as a record of a step
    (torn by a kill, or damaged: said) is dropped."""
    path = run_dir / METRICS_FILE
    if path.exists() or path.is_symlink():
        lines = read_log(path)
        steps = [_record_step(line) for line in lines]
        warn_damaged(path, lines, "dropped", steps)
        kept = [line for line, at in zip(lines, steps, strict=True)
                if at < step or _kept_at(line, step)]  # fmt: skip
        files.atomic_write(path, "".join(line + "\n" for line in kept).encode())


def warn_damaged(path: Path, lines: list[str], done: str, steps: list[int] | None = None) -> None:
    """A warning naming the lines of a metrics log (read_log's `lines`) that do not read as a
    record of a step (`steps`: each line's, if the caller has read them), and what was `done`
    with them; a torn last line (no newline after it: a write a kill cut short) is no damage,
    and is not named."""
    steps = steps if steps is not None else [_record_step(line) for line in lines]
    damaged = [n for n, (line, at) in enumerate(zip(lines, steps, strict=True), 1)
               if line and at == sys.maxsize]  # fmt: skip
    if damaged and damaged[-1] == len(lines):
        damaged.pop()
    if damaged:
        listed = ", ".join(map(str, damaged[:5])) + (", ..." if len(damaged) > 5 else "")
        logger.warning("%s: %d damaged line%s %s (%s %s)", path, len(damaged),
                       "s" * (len(damaged) > 1), done, "lines" if len(damaged) > 1 else "line",
                       listed)  # fmt: skip


def read_log(path: Path) -> list[str]:
    """The lines of a metrics log (invalid UTF-8 replaced), refused in one line unless it is the
    plain file tmt writes (a FIFO or a link in its place would hang or mislead the reader)."""
    try:
        return files.read_plain(path).decode("utf-8", "replace").split("\n")
    except files.NotPlainFile as err:
        raise TmtError(
            f"{path}: {err.strerror}; tmt writes its metrics log as a plain file"
        ) from None


def _kept_at(line: str, step: int) -> bool:
    try:
        record = json.loads(line)
        return int(record["step"]) == step and record.get("partial") is not True
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError):
        return False


def _record_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
        return sys.maxsize  # a torn last line from a kill, a damaged one: dropped


class MetricsLog:
    """What training reports: metrics.jsonl (rank 0 writes one JSON object per line, flushed as
    written) and the progress bar (rank 0 shows it), with the sums of the updates since the last
    record, which `flush` all-reduces over ranks (every rank calls it at the same steps)."""

    def __init__(
        self, run_dir: Path, info: DistInfo, max_steps: int, step: int, tensorboard: bool = False
    ) -> None:
        from tqdm import tqdm

        self.info = info
        self.handle = None
        self.events = None  # a TensorBoard SummaryWriter (train.tensorboard), rank 0's
        if info.is_main and tensorboard:
            self.events = _summary_writer(run_dir / "tensorboard", step)
        if info.is_main:
            try:
                self.handle = open(run_dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115
            except OSError as err:
                reason, code = exits.write_failed(err)
                raise TmtError(f"{run_dir / METRICS_FILE}: cannot write ({reason})",
                               exit_code=code) from None  # fmt: skip
        self.bar = tqdm(
            total=max_steps or None, initial=step, disable=not info.is_main or None,
            unit="step", dynamic_ncols=True, file=sys.stderr,
        )  # fmt: skip
        self._reset()

    def _reset(self) -> None:
        self.loss = self.nll = 0.0  # sums over this rank's target tokens
        self.tokens = self.real_tokens = self.padded_tokens = 0
        self.lr = 0.0
        self.updates = 0  # applied updates since the last record
        self.start = time.monotonic()

    def update(
        self, loss: float, nll: float, tokens: int, real: int, padded: int, lr: float
    ) -> None:
        """One applied update: its sums on this rank, and the learning rate it used."""
        self.loss += loss
        self.nll += nll
        self.tokens += tokens
        self.real_tokens += real
        self.padded_tokens += padded
        self.lr = lr
        self.updates += 1
        self.bar.update(1)

    def flush(
        self, step: int, epoch: int, partial: bool = False, shapes: int | None = None
    ) -> dict[str, Any]:
        """The record of the updates since the last one (all ranks), written and shown; a
        `partial` one, of fewer than train.log_every updates, is the last of a session. `shapes`:
        the distinct batch shapes of the epoch (batch_shapes; a GPU pays for each)."""
        sums = [self.loss, self.nll, self.tokens]
        totals = torch.tensor(sums, dtype=torch.float64, device=self.info.device)
        loss, nll, tokens = distributed.all_reduce_sum(totals, self.info).tolist()
        record = {
            "step": step,
            "epoch": epoch,
            "loss": loss / tokens,
            "nll": nll / tokens,
            "ppl": math.exp(min(nll / tokens, 100.0)),
            "lr": self.lr,
            "tokens_per_s": tokens / max(time.monotonic() - self.start, 1e-9),
            "padding_efficiency": self.real_tokens / self.padded_tokens,
            **({"batch_shapes": shapes} if shapes is not None else {}),
            **({"partial": True, "updates": self.updates} if partial else {}),
        }
        self._reset()
        self.write(record)
        self.bar.set_postfix(
            loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}",
            tok_s=f"{record['tokens_per_s']:.0f}", pad=f"{record['padding_efficiency']:.2f}",
        )  # fmt: skip
        return record

    def write(self, record: dict[str, Any]) -> None:
        if self.handle is None:
            return
        if self.events is not None:  # the curves: update records and validations
            for name, value in record.items():
                if name in _TRAIN_CURVES or name.startswith("val_"):
                    group = "valid" if name.startswith("val_") else "train"
                    self.events.add_scalar(f"{group}/{name}", value, record["step"])
        try:
            self.handle.write(json.dumps(record) + "\n")
            self.handle.flush()
        except OSError as err:
            reason, code = exits.write_failed(err)
            raise TmtError(
                f"{self.handle.name}: cannot write ({reason}); the checkpoints written so far"
                " are intact",
                exit_code=code,
            ) from None

    def window(self) -> dict[str, Any]:
        """This rank's sums since the last record: saved with each checkpoint, so the first
        record after a resume covers the same updates as in an uninterrupted run."""
        sums = {"loss": self.loss, "nll": self.nll, "tokens": self.tokens, "lr": self.lr}
        sums["updates"] = self.updates
        counts = {"real_tokens": self.real_tokens, "padded_tokens": self.padded_tokens}
        return {**sums, **counts, "seconds": time.monotonic() - self.start}

    def restore(self, window: dict[str, Any]) -> None:
        self.loss, self.nll, self.tokens = window["loss"], window["nll"], window["tokens"]
        self.real_tokens, self.padded_tokens = window["real_tokens"], window["padded_tokens"]
        self.lr, self.start = window["lr"], time.monotonic() - window["seconds"]
        self.updates = window.get("updates", 1 if window["tokens"] else 0)  # older tmt: unsaved

    def show(self, message: str) -> None:
        """A line on stderr past the bar (which is hidden off a terminal), from rank 0."""
        if self.info.is_main:
            self.bar.write(f"tmt: {message}", file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
        if self.events is not None:
            self.events.close()
        if self.handle is not None:
            self.handle.close()


_TRAIN_CURVES = ("loss", "nll", "ppl", "lr", "tokens_per_s", "padding_efficiency")


def require_tensorboard() -> Any:
    """TensorBoard's SummaryWriter class, or a one-line error naming the extra to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise TmtError(
            "train.tensorboard=true needs the tensorboard package:"
            " pip install 'transformer_mt[tensorboard]' (or set train.tensorboard=false)"
        ) from None
    return SummaryWriter


def _summary_writer(log_dir: Path, step: int) -> Any:
    """TensorBoard's writer; events past `step` (a resume) are purged from what it shows, as
    metrics.jsonl drops them."""
    return require_tensorboard()(str(log_dir), purge_step=step or None, flush_secs=30)
