"""The training procedure of §5, and the fault handling that makes it trustworthy.

train(cfg) reads as a story: resume point (or the model to fine-tune) -> tokenizer and data ->
model, Adam and the Noam schedule -> restore -> run directory -> DDP -> loop (update, log, validate,
save) -> final save and average.
Only rank 0 writes files and logs; every rank takes the same decisions at the same steps, because
each update begins and ends with a small collective that carries them. One update is step.py's
business; where the run directory is laid out, resumed and saved, run.py's; how a run stops and
what it exits with, exits.py's.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from transformer_mt import (
    averaging,
    checkpoint,
    corpus,
    distributed,
    dry_run,
    evaluate,
    exits,
    metrics,
    plot,
    run,
    train_state,
)
from transformer_mt.checkpoint import Checkpoint
from transformer_mt.config import Config
from transformer_mt.data import Batch, PreparedData, prepare_data
from transformer_mt.distributed import DistInfo
from transformer_mt.exits import StopSignals, TmtError
from transformer_mt.faults import fault_point
from transformer_mt.model import Transformer, count_parameters, parameter_count
from transformer_mt.optim import build_optimizer, peak_lr
from transformer_mt.step import Optimization, Requests, StepStats, train_step, validate
from transformer_mt.tokenizer import Tokenizer

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


def train(cfg: Config) -> dict[str, Any]:
    """Train (or resume) the run in cfg.train.out_dir; returns where it ended (with this rank)."""
    if cfg.train.tensorboard:
        metrics.require_tensorboard()  # before any work: a missing extra is a config error
    info = distributed.setup(cfg.train.device, cfg.train.distributed_timeout_s)
    dry_run.check_before_training(cfg, info.device)  # before anything is written
    heartbeat = distributed.Heartbeat(info)
    lock = run.RunLock(Path(cfg.train.out_dir))
    # The handlers stay installed while a failure is reported and the group torn down: torchrun
    # sends SIGTERM to the survivors of a dead rank, which must not kill them mid-report.
    with StopSignals() as signals:
        try:
            lock.take(info)  # rank 0 holds it; every rank learns whether it could
            session = _Session(cfg, info, signals, heartbeat)
            return session.finish(session.loop())
        except RuntimeError as err:
            if info.distributed and distributed.is_collective_failure(err):
                reason = str(err).strip().splitlines()[0][:200]
                message = f"a collective failed: {heartbeat.report()}: {reason}"
                logger.error(message)
                raise TmtError(message, exit_code=exits.LOST_RANK) from None
            raise
        finally:
            lock.release()
            distributed.cleanup()


def _build(
    cfg: Config,
    tokenizer: Tokenizer,
    info: DistInfo,
    saved: Checkpoint | None,
    parent: Checkpoint | None = None,
) -> tuple[Transformer, Optimization, Progress, dict[str, Any] | None]:
    """The model, Adam and the schedule, the same initial weights on every rank: the `parent`'s
    when fine-tuning (with a fresh optimizer, schedule and data position); when resuming, the
    checkpoint's model (built when it was read) with the saved optimizer, schedule, scaler, RNG
    states and data position."""
    torch.manual_seed(cfg.train.seed)
    size = dry_run.training_bytes(cfg, tokenizer.vocab_size)
    what = f"training a model of {parameter_count(cfg.model, tokenizer.vocab_size):,} parameters"
    with distributed.allocating(what, size, info.device):
        if saved is not None:  # the same model settings: run.resume refuses others
            model = saved.model.to(info.device)
        else:
            model = Transformer(cfg.model, tokenizer.vocab_size, tokenizer.pad_id)
            model = model.to(info.device)
    optimizer, scheduler = build_optimizer(
        model, cfg.model, cfg.optim, fused=info.device.type == "cuda"
    )
    scaler = torch.amp.GradScaler(info.device.type, enabled=cfg.train.precision == "fp16")
    opt = Optimization(optimizer, scheduler, scaler)
    # Dropout and any other randomness: a stream per rank, reproducible from the seed.
    torch.manual_seed(cfg.train.seed + info.rank)
    random.seed(cfg.train.seed + info.rank)
    np.random.seed(cfg.train.seed + info.rank)
    if saved is None:
        if parent is not None:  # its own dropout may differ: built from cfg, its weights loaded
            model.load_state_dict(parent.state_dict)
            logger.info("fine-tuning %s (step %d) from step 0", parent.path, parent.step)
        return model, opt, Progress(), None
    state, window = train_state.restore(
        saved.train_state or {}, optimizer, scheduler, scaler, rank=info.rank,
        world_size=info.world_size, where=saved.path / checkpoint.STATE_FILE,
    )  # fmt: skip
    try:
        progress = Progress(**state)
    except TypeError as err:
        raise TmtError(f"{saved.path}: its training progress cannot be restored ({err})") from None
    logger.info(
        "resuming %s at step %d (epoch %d, batch %d)",
        saved.path, progress.step, progress.epoch, progress.batch_index,
    )  # fmt: skip
    return model, opt, progress, window


class _Session:
    """One session of a run, from its resume point to where it stops."""

    def __init__(
        self, cfg: Config, info: DistInfo, signals: StopSignals, heartbeat: distributed.Heartbeat
    ) -> None:
        self.cfg, self.info, self.signals, self.heartbeat = cfg, info, signals, heartbeat
        self.session_start = time.monotonic()
        self.run_dir = Path(cfg.train.out_dir)
        # Resume point: the newest checkpoint that reads, refused if it holds another model.
        saved = run.resume(self.run_dir, cfg)
        self.resumed_from = saved.path if saved else None
        # Fine-tuning starts from another model; once this run has a checkpoint, it resumes it.
        parent = run.init_model(cfg) if saved is None and cfg.train.init_from else None
        tokenizer = (saved or parent).tokenizer if (saved or parent) else None
        # Tokenizer and data: rank 0 fills the cache first, then the other ranks read it warm.
        self.data = _prepare_data_rank0_first(cfg, tokenizer, info)
        _check_validation_split(cfg, self.data, info)
        self.model, self.opt, self.progress, window = _build(
            cfg, self.data.tokenizer, info, saved, parent
        )
        if info.is_main:
            size = _checkpoint_bytes(self.model, self.data)
            run.start(self.run_dir, cfg, self.data.tokenizer, step=self.step, checkpoint_bytes=size)
            logger.info(
                "model: %s parameters; peak lr %.3g at step %d; %d/%d train/valid pairs; %s × %d",
                f"{count_parameters(self.model):,}", peak_lr(cfg.model, cfg.optim),
                cfg.optim.warmup_steps, len(self.data.train), len(self.data.valid),
                info.device.type, info.world_size,
            )  # fmt: skip
        # The training view of the model, compiled and/or DDP-wrapped; the raw one saves.
        if info.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        compiled = torch.compile(self.model) if cfg.train.compile else self.model
        self.trained = distributed.wrap(compiled, info)
        self.sampler = self.data.train.sampler(
            cfg.data.max_tokens, cfg.train.seed, info.rank, info.world_size
        )
        self.epoch_batches: tuple[int, list[np.ndarray]] = (-1, [])
        self.valid_batches = _valid_batches(self.data, cfg, info)
        heartbeat.beat(self.step)
        # Validation BLEU reads the raw validation text: scored exactly as tmt evaluate scores it.
        bleu = cfg.train.bleu_every
        self.valid_text = corpus.read_split(cfg.data, "data.valid") if bleu else None
        self.metrics = metrics.MetricsLog(
            self.run_dir, info, max_steps=cfg.train.max_steps, step=self.step,
            tensorboard=cfg.train.tensorboard,
        )  # fmt: skip
        if window is not None:
            self.metrics.restore(window)
        if parent is not None:
            self.metrics.write(
                {"step": 0, "init_from": cfg.train.init_from, "init_checkpoint": str(parent.path),
                 "init_step": parent.step}
            )  # fmt: skip
        self.scores: tuple[int, dict[str, float]] = (-1, {})  # the newest validation's
        self.curves = cfg.train.curves and info.is_main
        changed = run.drift(saved.config, cfg) if saved else []
        if changed:  # only with train.resume=force: run.resume refuses it otherwise
            self.metrics.write({"step": self.step, "config_changed": changed})
        self.last_save_time = time.monotonic()
        self.last_saved_step = self.step if saved is not None else -1

    @property
    def step(self) -> int:
        return self.progress.step

    def loop(self) -> str:
        """Updates until a budget, a signal, patience or divergence stops training; why it did."""
        cfg, progress = self.cfg.train, self.progress
        stop = _budget_spent(progress, self.cfg)  # a finished run, run again, stays finished
        while stop is None:
            group = self._next_group()
            if group is None:  # this rank's batches of the epoch ran out: the next epoch
                progress.epoch, progress.batch_index = progress.epoch + 1, 0
                if cfg.max_epochs and progress.epoch >= cfg.max_epochs:
                    stop = "max_epochs"
                continue
            stats, is_best = self._update(group)
            stop = _stop_reason(progress, stats, self.cfg)
            if stop in ("non_finite", "out_of_memory"):
                break  # nothing to save: the newest checkpoint is the last good state
            applied = stats.skipped is None
            periodic = applied and bool(cfg.save_every) and self.step % cfg.save_every == 0
            if periodic or stats.save or is_best or (stop and self.last_saved_step != self.step):
                self._save(is_best)
        return stop

    def _next_group(self) -> list[np.ndarray] | None:
        """The batches of the next update (train.update_freq of them), None at the epoch's end."""
        epoch, index = self.progress.epoch, self.progress.batch_index
        if self.epoch_batches[0] != epoch:
            self.epoch_batches = (epoch, self.sampler.epoch_batches(epoch))
        batches = self.epoch_batches[1]
        return batches[index : index + self.cfg.train.update_freq] if index < len(batches) else None

    def _update(self, group: list[np.ndarray]) -> tuple[StepStats, bool]:
        """One update attempt over `group`, then its logging and validation; (stats, new best)."""
        cfg, progress, info = self.cfg, self.progress, self.info
        micro = [self.data.train.batch(b, self.data.tokenizer).to(info.device) for b in group]
        # Stop and save requests (signals, rank 0's clock) are agreed on inside the step.
        now = time.monotonic()
        out_of_time = (
            0 < cfg.train.max_minutes * 60 <= progress.elapsed_s + now - self.session_start
        )
        save_due = 0 < cfg.train.save_every_minutes * 60 <= now - self.last_save_time
        requests = Requests(
            stop=self.signals.received or ("max_minutes" if out_of_time else None),
            save=info.is_main and save_due,
        )
        attempt = progress.step + progress.skipped + 1  # skipped updates count
        stats = train_step(
            self.trained, micro, self.opt, cfg, info, attempt=attempt, requests=requests
        )
        if stats.skipped == "stopped":  # a stopped step used none of its batches
            return stats, False
        progress.batch_index += len(group)
        if stats.skipped is not None:
            _record_skip(progress, stats, self.metrics, micro)
            return stats, False
        progress.step += 1
        progress.nonfinite_run = progress.oom_run = 0
        self.heartbeat.beat(progress.step)
        self.metrics.update(
            loss=stats.loss_sum, nll=stats.nll_sum, tokens=stats.tokens, real=stats.real_tokens,
            padded=stats.padded_tokens, lr=stats.lr,
        )  # fmt: skip
        fault_point("step", progress.step)
        if progress.step % cfg.train.log_every == 0:
            self.metrics.flush(progress.step, progress.epoch)
        return stats, _track_best(progress, self._validate(), cfg)

    def _validate(self) -> dict[str, float]:
        """Validation loss and BLEU when due at this step ({} otherwise), logged and shown."""
        cfg, step, scores = self.cfg, self.step, {}
        if self.valid_batches and cfg.train.valid_every and step % cfg.train.valid_every == 0:
            scores |= validate(self.model, self.valid_batches, cfg, self.info)
        if self.valid_text and step % cfg.train.bleu_every == 0:
            sources, references = self.valid_text
            scores |= evaluate.validation_bleu(
                self.model, self.data.tokenizer, cfg, self.info, sources=sources,
                references=references,
            )  # fmt: skip
        if scores:
            self.metrics.write({"step": step, **scores})
            shown = ("val_loss", "val_ppl", "val_bleu", "val_chrf")
            figures = "  ".join(f"{k} {scores[k]:.3f}" for k in shown if k in scores)
            self.metrics.show(f"step {step}: {figures}")
            self.scores = (step, scores)
            self._draw_curves()
        return scores

    def _draw_curves(self) -> None:
        """OUT_DIR/curves.png from metrics.jsonl (rank 0); a failed plot never stops training."""
        if not self.curves:
            return
        try:
            plot.draw_curves([self.run_dir], self.run_dir / plot.RUN_CURVES)
        except plot.NoMatplotlib:
            self.curves = False
            logger.info("curves.png is not drawn: pip install 'transformer_mt[plot]' for it")
        except (TmtError, OSError) as err:
            logger.warning("curves.png not drawn: %s", err)

    def _save(self, is_best: bool) -> None:
        """A checkpoint of this step: every rank's RNG states gathered, rank 0 writes."""
        progress, opt, now = self.progress, self.opt, time.monotonic()
        progress.elapsed_s, self.session_start = progress.elapsed_s + now - self.session_start, now
        mine = {"rng": train_state.capture_rng(), "metrics": self.metrics.window()}
        ranks = distributed.gather_to_main(mine, self.info)
        if self.info.is_main:
            state = train_state.collect(
                opt.optimizer, opt.scheduler, opt.scaler, ranks, progress.__dict__.copy()
            )
            scored_step, scores = self.scores
            run.save(
                self.run_dir, self.cfg, self.model.state_dict(), self.data.tokenizer.model_bytes,
                state, step=self.step, epoch=progress.epoch, is_best=is_best,
                scores=scores if scored_step == self.step else None,
                protect=[self.resumed_from] if self.resumed_from else [],
            )  # fmt: skip
        fault_point("after_save", self.step)
        self.last_save_time, self.last_saved_step = time.monotonic(), self.step

    def finish(self, stop: str) -> dict[str, Any]:
        """The final save (a stop at an epoch's end), the final average, and the summary."""
        saved = self.last_saved_step >= 0
        newest = run.checkpoint_dir(self.run_dir, self.last_saved_step) if saved else "none"
        if stop == "non_finite":
            raise TmtError(
                f"training diverged: {self.progress.nonfinite_run} consecutive non-finite updates"
                f" after step {self.step} (each skipped, train.nonfinite_patience); newest"
                f" checkpoint: {newest}",
                exit_code=exits.DIVERGED,
            )
        if stop == "out_of_memory":
            data, train_cfg = self.cfg.data, self.cfg.train
            raise TmtError(
                f"out of memory on {self.progress.oom_run} consecutive updates after step"
                f" {self.step} (each skipped, train.oom_patience): batches of data.max_tokens="
                f"{data.max_tokens} × train.update_freq={train_cfg.update_freq} do not fit on"
                f" {self.info.device}; lower data.max_tokens; newest checkpoint: {newest}"
            )
        if self.last_saved_step != self.step:
            self._save(is_best=False)
        self.metrics.close()
        self._draw_curves()  # the last records too
        averaged = None if stop in exits.SIGNAL_EXIT else self._average()
        if self.info.is_main:
            logger.info("stopped at step %d (%s)", self.step, stop)
        progress = self.progress
        return {
            "step": progress.step,
            "epoch": progress.epoch,
            "stop": stop,
            "skipped_updates": progress.skipped,
            "best_metric": self.cfg.train.best_metric,
            "best_value": progress.best_value,
            "best_step": progress.best_step,
            "checkpoint": str(run.checkpoint_dir(self.run_dir, self.last_saved_step)),
            **({"average": averaged} if averaged else {}),
            "rank": self.info.rank,
        }

    def _average(self) -> dict[str, Any] | None:
        """§6.1: average the newest train.average_last checkpoints into OUT_DIR/average and report
        its validation BLEU (rank 0 works, the others wait)."""
        n, result = self.cfg.train.average_last, None
        if n and self.info.is_main:
            averaging.check_destination(self.run_dir / run.AVERAGE, overwrite=True)
            mean = averaging.newest(self.run_dir, n, allow_fewer=True)
            mean = averaging.write(mean, self.run_dir / run.AVERAGE)
            result = {"path": str(mean.path), "checkpoints": len(mean.sources)}
            if self.valid_text and mean.model is not None:
                solo = DistInfo(rank=0, world_size=1, local_rank=0, device=self.info.device)
                sources, references = self.valid_text
                result |= evaluate.validation_bleu(
                    mean.model.to(self.info.device), mean.tokenizer, self.cfg, solo,
                    sources=sources, references=references,
                )  # fmt: skip
            logger.info("averaged %d checkpoints into %s %s", len(mean.sources), mean.path, result)
        if n:
            distributed.barrier(self.info)
        return result


def _track_best(progress: Progress, scores: dict[str, float], cfg: Config) -> bool:
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


# --- the loop's small decisions ----------------------------------------------------------------


def _budget_spent(progress: Progress, cfg: Config) -> str | None:
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
    if train_cfg.patience and progress.stale_validations >= train_cfg.patience:
        return "patience"
    return None


def _stop_reason(progress: Progress, stats: StepStats, cfg: Config) -> str | None:
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
    if cfg.train.patience and progress.stale_validations >= cfg.train.patience:
        return "patience"
    return None


def _record_skip(
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


def _prepare_data_rank0_first(
    cfg: Config, tokenizer: Tokenizer | None, info: DistInfo
) -> PreparedData:
    if not info.is_main:
        distributed.barrier(info)  # wait for rank 0 to build the caches
    data = prepare_data(cfg, tokenizer)
    if info.is_main:
        distributed.barrier(info)
    return data


def _check_validation_split(cfg: Config, data: PreparedData, info: DistInfo) -> None:
    """Validation (loss, BLEU, the best checkpoint, early stopping) needs a validation split
    with a pair per rank at least: refuse to train without one rather than silently skip it."""
    if (cfg.train.valid_every or cfg.train.bleu_every) and len(data.valid) < info.world_size:
        counts = data.counts["data.valid"]
        raise TmtError(
            f"data.valid ({cfg.data.valid}): {len(data.valid)} pairs after filtering"
            f" ({counts.read} read), fewer than the {info.world_size} rank(s) that validate:"
            " validation, the best checkpoint and early stopping need it; fix the split, or set"
            " train.valid_every=0 and train.bleu_every=0 to train without them"
        )


def _valid_batches(data: PreparedData, cfg: Config, info: DistInfo) -> list[Batch]:
    if not cfg.train.valid_every or len(data.valid) < info.world_size:
        return []
    sampler = data.valid.sampler(
        cfg.data.max_tokens, cfg.train.seed, info.rank, info.world_size, shuffle=False
    )
    return [data.valid.batch(b, data.tokenizer).to(info.device) for b in sampler.epoch_batches(0)]


def _checkpoint_bytes(model: Transformer, data: PreparedData) -> int:
    """About how large a checkpoint is: weights and Adam's two moments, plus the tokenizer."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return 3 * weights + len(data.tokenizer.model_bytes)
