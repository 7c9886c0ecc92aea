"""Where a run stands (what train_state.pt keeps of the trainer), and the loop's small
decisions: a new best validation, why a run stops, a skipped update."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from transformer_mt.config import Config
from transformer_mt.data.batches import Batch
from transformer_mt.runs import metrics
from transformer_mt.training.step import StepStats

logger = logging.getLogger(__name__)


@dataclass
class Progress:
    """Where training stands; everything here goes into train_state.pt."""

    step: int = 0  # optimizer updates done
    epoch: int = 0
    batch_index: int = 0  # next batch of `epoch` on this rank
    elapsed_s: float = 0.0  # training time of earlier sessions of this run
    best_value: float | None = None  # best train.best_metric so far (loss: lowest, BLEU: highest)
    best_step: int = 0
    stale_validations: int = 0  # validations since best_value last improved (train.patience)
    skipped: int = 0  # updates skipped (non-finite, fp16 overflow, out of memory)
    nonfinite_run: int = 0  # consecutive non-finite updates (train.nonfinite_patience)
    oom_run: int = 0  # consecutive updates out of memory (train.oom_patience)


def track_best(progress: Progress, scores: dict[str, float], cfg: Config) -> bool:
    """Update the best value of train.best_metric; True when this validation is the new best."""
    value = scores.get(cfg.train.best_metric)
    if value is None:
        return False
    higher_is_better = cfg.train.best_metric == "val_bleu"
    best = progress.best_value
    if best is None or (value > best if higher_is_better else value < best):
        progress.best_value, progress.best_step = value, progress.step
        progress.stale_validations = 0
        return True
    progress.stale_validations += 1
    return False


def budget_spent(progress: Progress, cfg: Config, planned: int) -> str | None:
    """Why a resumed run has nothing left to do, or None: checked before the first update, so
    the same command run again after a run ended (or after a kill following its final save)
    trains nothing more."""
    train_cfg = cfg.train
    if train_cfg.max_steps and progress.step >= train_cfg.max_steps:
        return "max_steps"
    if train_cfg.max_epochs and progress.epoch >= train_cfg.max_epochs:
        return "max_epochs"
    if train_cfg.max_minutes and progress.elapsed_s >= train_cfg.max_minutes * 60:
        return "max_minutes"
    if planned and progress.step >= planned:
        return "max_minutes"
    if train_cfg.patience and progress.stale_validations >= train_cfg.patience:
        return "patience"
    return None


def stop_reason(progress: Progress, stats: StepStats, cfg: Config, planned: int) -> str | None:
    if progress.nonfinite_run >= cfg.train.nonfinite_patience:
        return "non_finite"
    if progress.oom_run >= cfg.train.oom_patience:
        return "out_of_memory"
    if stats.stop in ("sigterm", "sigint"):
        return stats.stop
    if cfg.train.max_steps and progress.step >= cfg.train.max_steps:
        return "max_steps"
    if stats.stop:
        return stats.stop
    if planned and progress.step >= planned:  # the updates the time budget was planned for
        return "max_minutes"
    if cfg.train.patience and progress.stale_validations >= cfg.train.patience:
        return "patience"
    return None


def record_skip(
    progress: Progress, stats: StepStats, log: metrics.MetricsLog, micro: list[Batch]
) -> None:
    progress.skipped += 1
    if stats.skipped == "non_finite":
        progress.nonfinite_run += 1
    if stats.skipped == "oom":
        progress.oom_run += 1
    logger.warning(
        "update after step %d skipped on every rank (%s); batches %s",
        progress.step, stats.skipped, [tuple(b.src.shape) for b in micro],
    )  # fmt: skip
    record = {"step": progress.step, "skipped": stats.skipped, "epoch": progress.epoch}
    log.write({**record, "batch_index": progress.batch_index})


def format_summary(summary: dict[str, Any]) -> str:
    """What `tmt train` prints for people: where the run stopped, its best and its average."""
    lines = [
        f"stopped at step {summary['step']} ({summary['stop']}), epoch {summary['epoch']},"
        f" {summary['skipped_updates']} updates skipped",
        f"checkpoint: {summary['checkpoint']}",
    ]
    if summary["best_value"] is not None:
        lines.append(
            f"best {summary['best_metric']}: {summary['best_value']:.4f}"
            f" at step {summary['best_step']}"
        )
    if "average" in summary:
        average = summary["average"]
        scores = "".join(f", {k} {v:.2f}" for k, v in average.items() if k.startswith("val_"))
        lines.append(f"average: {average['path']} ({average['checkpoints']} checkpoints{scores})")
    return "\n".join(lines)
