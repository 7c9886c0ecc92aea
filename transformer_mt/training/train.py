"""The training procedure of §5, and the fault handling that makes it trustworthy.

train(cfg) reads as a story: resume point (or the model to fine-tune) -> tokenizer and data ->
model, Adam and the learning-rate schedule (planned for the budget, optim.schedule=budget) ->
restore -> run directory -> DDP -> loop (update, log, validate, save) -> final save, last records
and average.
Only rank 0 writes files and logs; every rank takes the same decisions at the same steps, because
each update begins and ends with a small collective that carries them. One update is step.py's
business; where the run stands and why it stops, progress.py's; where the run directory is laid
out, resumed and saved, run.py's; what a run exits with, exits.py's.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from transformer_mt.common import distributed, exits
from transformer_mt.common.distributed import DistInfo
from transformer_mt.common.exits import StopSignals, TmtError
from transformer_mt.common.faults import fault_point
from transformer_mt.config import Config
from transformer_mt.data import corpus
from transformer_mt.data.batches import PreparedData, prepare_data
from transformer_mt.data.tokenizer import Tokenizer
from transformer_mt.network import kernels
from transformer_mt.network.model import Transformer, count_parameters, parameter_count
from transformer_mt.runs import averaging, checkpoint, metrics, plot, run, train_state
from transformer_mt.runs.checkpoint import Checkpoint
from transformer_mt.training import device_defaults, dry_run, optim
from transformer_mt.training.feeder import Feeder, valid_batches
from transformer_mt.training.loss import Objective
from transformer_mt.training.optim import peak_lr
from transformer_mt.training.progress import (
    Progress,
    budget_spent,
    record_skip,
    stop_reason,
    track_best,
)
from transformer_mt.training.step import Optimization, Requests, StepStats, train_step, validate
from transformer_mt.translation import evaluate

logger = logging.getLogger(__name__)


def train(cfg: Config) -> dict[str, Any]:
    """Train (or resume) the run in cfg.train.out_dir; returns where it ended (with this rank)."""
    if cfg.train.tensorboard:
        metrics.require_tensorboard()  # before any work: a missing extra is a config error
    info = distributed.setup(cfg.train.device, cfg.train.distributed_timeout_s)
    dry_run.check_before_training(cfg, info.device, world_size=info.world_size)  # before writing
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
    vocab = tokenizer.vocab_size, tokenizer.source_vocab_size
    size = dry_run.training_bytes(cfg, *vocab)
    what = f"training a model of {parameter_count(cfg.model, *vocab):,} parameters"
    with distributed.allocating(what, size, info.device):
        if saved is not None:  # the same model settings: run.resume refuses others
            model = saved.model.to(info.device)
        else:
            model = Transformer(cfg.model, vocab[0], tokenizer.pad_id, vocab[1],
                                tokenizer.source_pad_id).to(info.device)  # fmt: skip
    if parent is not None and saved is None:  # its own dropout may differ: built from cfg
        model.load_state_dict(parent.state_dict)
        logger.info("fine-tuning %s (step %d) from step 0", parent.path, parent.step)
    opt = Optimization.build(model, cfg, info.device)  # bf16_weights: the model made bf16
    # Dropout and any other randomness: a stream per rank, reproducible from the seed.
    torch.manual_seed(cfg.train.seed + info.rank)
    random.seed(cfg.train.seed + info.rank)
    np.random.seed(cfg.train.seed + info.rank)
    if saved is None:
        return model, opt, Progress(), None
    state, window = train_state.restore(
        saved.train_state or {}, opt.optimizer, opt.scheduler, opt.scaler, rank=info.rank,
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
        # What the config leaves to the device, chosen (a resumed run keeps its own) and saved.
        self.cfg = cfg = device_defaults.resolve(
            cfg, info.device, info.world_size, saved.config if saved else None
        )
        # Fine-tuning starts from another model; once this run has a checkpoint, it resumes it.
        parent = run.init_model(cfg) if saved is None and cfg.train.init_from else None
        tokenizer = (saved or parent).tokenizer if (saved or parent) else None
        # Tokenizer and data: rank 0 fills the cache first, then the other ranks read it warm.
        self.data = _prepare_data_rank0_first(cfg, tokenizer, info)
        # What the data cannot do for this config, refused before anything is written.
        self.sampling = dry_run.check_prepared(cfg, self.data, info.world_size)
        self.model, self.opt, self.progress, window = _build(
            cfg, self.data.tokenizer, info, saved, parent
        )
        self.schedule = optim.budget_schedule(self.opt.scheduler)  # None: the paper's schedule
        optim.rebudget_resumed(self.schedule, saved.config if saved else None, cfg, info.is_main)
        # A run that ended writes nothing when run again, not even a trim of its last record.
        ended = saved is not None and budget_spent(self.progress, cfg, self.planned) is not None
        if info.is_main:
            size = _checkpoint_bytes(self.model, self.data)
            run.start(self.run_dir, cfg, self.data.tokenizer, self.step, size, finished=ended)
            _announce(cfg, self.model, self.data, info)
        # The training view of the model, compiled and/or DDP-wrapped; the raw one saves.
        if info.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        compiled = device_defaults.compiled(self.model, cfg, info.device)
        self.trained = distributed.wrap(compiled, info, device_defaults.grad_sync(cfg))
        # The loss: from the logits, or fused with the output projection (train.fused_loss).
        fused = device_defaults.fused_loss(cfg, info.device, self.model.vocab_size)
        projection = self.model.output_projection if fused else None
        self.objective = Objective(cfg.optim.label_smoothing, projection)
        self.graphs = device_defaults.graphs(self.trained, self.objective, cfg, info.device)
        self.feeder = Feeder(cfg, self.data, self.sampling, info)
        self.rate_from: tuple[int, float] | None = None  # (step, time) a time budget is timed from
        self._plan_steps(fresh=saved is None)
        self.valid_batches = valid_batches(self.data, cfg, info)
        heartbeat.beat(self.step)
        # Validation BLEU reads the raw validation text: scored exactly as tmt evaluate scores it.
        bleu = cfg.train.bleu_every
        self.valid_text = corpus.read_split(cfg.data, "data.valid") if bleu else None
        self.metrics = self._open_metrics(window, saved, parent)
        self.scores: tuple[int, dict[str, float]] = (-1, {})  # the newest validation's
        self.curves = plot.RunCurves(self.run_dir, cfg.train.curves and info.is_main)
        self.last_save_time = time.monotonic()
        self.last_saved_step = self.step if saved is not None else -1
        self.first_attempt = self.step + self.progress.skipped  # update attempts before this one

    def _open_metrics(
        self, window: dict | None, saved: Checkpoint | None, parent: Checkpoint | None
    ) -> metrics.MetricsLog:
        """The session's metrics log: the resumed window restored, then what this session starts
        from (a fine-tuning's parent; settings a forced resume changed)."""
        cfg = self.cfg
        log = metrics.MetricsLog(
            self.run_dir, self.info, max_steps=cfg.train.max_steps, step=self.step,
            tensorboard=cfg.train.tensorboard,
        )  # fmt: skip
        if window is not None:
            log.restore(window)
        if parent is not None:
            log.write(
                {"step": 0, "init_from": cfg.train.init_from, "init_checkpoint": str(parent.path),
                 "init_step": parent.step}
            )  # fmt: skip
        changed = run.drift(saved.config, cfg) if saved else []
        if changed:  # only with train.resume=force: run.resume refuses it otherwise
            log.write({"step": self.step, "config_changed": changed})
        return log

    @property
    def step(self) -> int:
        return self.progress.step

    def loop(self) -> str:
        """Updates until a budget, a signal, patience or divergence stops training; why it did."""
        with kernels.attention(self.cfg.model.attention_backend, self.info.device):
            return self._loop()

    def _loop(self) -> str:
        cfg, progress = self.cfg.train, self.progress
        stop = budget_spent(progress, self.cfg, self.planned)  # a finished run stays finished
        while stop is None:
            group = self.feeder.group(progress.epoch, progress.batch_index)
            if group is None:  # this rank's batches of the epoch ran out: the next epoch
                progress.epoch, progress.batch_index = progress.epoch + 1, 0
                if cfg.max_epochs and progress.epoch >= cfg.max_epochs:
                    stop = "max_epochs"
                continue
            stats, is_best = self._update(group)
            stop = stop_reason(progress, stats, self.cfg, self.planned)
            if stop in ("non_finite", "out_of_memory"):
                break  # nothing to save: the newest checkpoint is the last good state
            applied = stats.skipped is None
            periodic = applied and bool(cfg.save_every) and self.step % cfg.save_every == 0
            if periodic or stats.save or is_best or (stop and self.last_saved_step != self.step):
                self._save(is_best)
        return stop

    @property
    def planned(self) -> int:
        """The updates the time budget was planned to allow (optim.schedule=budget), or 0."""
        return self.schedule.total if self.schedule and self.schedule.timed else 0

    def _plan_steps(self, fresh: bool) -> None:
        """optim.schedule=budget: plan the updates of the step and epoch budgets, again when a
        resume changed them. A time budget is planned once its update rate is measured."""
        schedule, train_cfg = self.schedule, self.cfg.train
        if schedule is None:
            return
        batches = self.feeder.epoch_batches(self.progress.epoch)
        per_epoch = -(-len(batches) // train_cfg.update_freq)
        budget = optim.step_budget(train_cfg.max_steps, train_cfg.max_epochs, per_epoch)
        scheduler = self.opt.scheduler
        if not schedule.fit_steps(budget, after=0 if fresh else scheduler.last_epoch + 1):
            return
        if fresh:  # the first update's rate was set before the plan existed
            for group in self.opt.optimizer.param_groups:
                group["lr"] = schedule(scheduler.last_epoch)
        if self.info.is_main:
            logger.info(
                "learning rate planned for %d updates: warmup %d, peak %.3g, then down to zero",
                schedule.total, schedule.warmup, schedule.peak,
            )  # fmt: skip

    def _time_plan(self, now: float) -> int:
        """Rank 0's plan of a time budget when one is due (BudgetSchedule.time_plan_due), timed
        from the end of the session's first update (its one-off costs, ~10 s of CUDA's start on
        an H200, cut a plan to 41 updates of 1,153) or the last plan; 0 otherwise, other ranks."""
        budget_s = self.cfg.train.max_minutes * 60
        if self.schedule is None or not budget_s or not self.info.is_main:
            return 0
        if self.rate_from is None:
            if self.step + self.progress.skipped == self.first_attempt:  # the first to come
                return 0
            self.rate_from = (self.step, now)
        elapsed = self.progress.elapsed_s + now - self.session_start
        return self.schedule.time_plan_due(budget_s, elapsed, self.step, self.rate_from, now)

    def _replan(self, planned: int) -> None:
        """Continue the schedule with rank 0's plan of the time budget, agreed at this update."""
        first, restart = self.schedule.continue_with(
            planned, after=self.opt.scheduler.last_epoch + 1
        )
        if restart:  # the next plan's rate is timed from here (BudgetSchedule.continue_with)
            self.rate_from = (self.step, time.monotonic())
        self.metrics.write({"step": self.step, "planned_updates": planned})
        fault_point("plan", 1 if first else 2)
        what = "at the rate measured" if first else "at the rate since, so that the decay fits"
        self.metrics.show(
            f"learning rate planned for {planned} updates (the time budget {what}):"
            f" warmup {self.schedule.warmup}, decay from {self.schedule.decay_start}"
        )

    def _update(self, group: list[np.ndarray]) -> tuple[StepStats, bool]:
        """One update attempt over `group`, then its logging and validation; (stats, new best)."""
        cfg, progress, info = self.cfg, self.progress, self.info
        micro = self.feeder.micro_batches(progress.epoch, progress.batch_index, group)
        # Stop and save requests (signals, rank 0's clock) are agreed on inside the step.
        now = time.monotonic()
        out_of_time = (
            0 < cfg.train.max_minutes * 60 <= progress.elapsed_s + now - self.session_start
        )
        save_due = 0 < cfg.train.save_every_minutes * 60 <= now - self.last_save_time
        requests = Requests(
            stop=self.signals.received or ("max_minutes" if out_of_time else None),
            save=info.is_main and save_due,
            plan=self._time_plan(now),
        )
        attempt = progress.step + progress.skipped + 1  # skipped updates count
        stats = train_step(
            self.trained, micro, self.opt, cfg, info, attempt=attempt, requests=requests,
            objective=self.objective, graphs=self.graphs,
        )  # fmt: skip
        if stats.plan:  # every rank continues the schedule with rank 0's plan of the time
            self._replan(stats.plan)
        if stats.skipped == "stopped":  # a stopped step used none of its batches
            return stats, False
        progress.batch_index += len(group)
        if stats.skipped is not None:
            record_skip(progress, stats, self.metrics, micro)
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
            self.metrics.flush(progress.step, progress.epoch, shapes=self._shapes())
        return stats, track_best(progress, self._validate(), cfg)

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
            self.curves.draw()
        return scores

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
            weights = opt.master.state_dict() if opt.master else self.model.state_dict()
            run.save(
                self.run_dir, self.cfg, weights, self.data.tokenizer.model_bytes,
                state, step=self.step, epoch=progress.epoch, is_best=is_best,
                scores=scores if scored_step == self.step else None,
                protect=[self.resumed_from] if self.resumed_from else [],
            )  # fmt: skip
        fault_point("after_save", self.step)
        self.last_save_time, self.last_saved_step = time.monotonic(), self.step

    def finish(self, stop: str) -> dict[str, Any]:
        """The final save (a stop at an epoch's end), the final average, and the summary."""
        self.feeder.close()
        saved = self.last_saved_step >= 0
        newest = run.checkpoint_dir(self.run_dir, self.last_saved_step) if saved else "none"
        if stop not in ("non_finite", "out_of_memory") and self.last_saved_step != self.step:
            self._save(is_best=False)  # before the last record: its sums are in the checkpoint
        self._last_records(stop)
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
        self.metrics.close()
        self.curves.draw(final=True)  # the last records too
        averaged = None if stop in exits.SIGNAL_EXIT else self._average()
        if self.info.is_main:
            logger.info("stopped at step %d (%s)", self.step, stop)
            if self.graphs is not None:
                logger.info(self.graphs.describe())
            optim.warn_if_undecayed(self.schedule, self.step, stop)
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

    def _shapes(self) -> int:
        """The distinct batch shapes of this epoch, every rank's (data.bucketing bounds them)."""
        return self.feeder.shapes(self.progress.epoch)

    def _last_records(self, stop: str) -> None:
        """The record of the updates since the last one (a run seldom stops on a log step), then
        the last record of a session that trained: why it stopped (a run run again after its end
        writes nothing). Every rank calls this: flush all-reduces."""
        progress = self.progress
        if progress.step + progress.skipped > self.first_attempt:  # a session that trained
            if self.metrics.updates:
                shapes = self._shapes()
                self.metrics.flush(progress.step, progress.epoch, partial=True, shapes=shapes)
            self.metrics.write({"step": progress.step, "epoch": progress.epoch, "stop": stop})

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


def _prepare_data_rank0_first(
    cfg: Config, tokenizer: Tokenizer | None, info: DistInfo
) -> PreparedData:
    if not info.is_main:
        distributed.barrier(info)  # wait for rank 0 to build the caches
    data = prepare_data(cfg, tokenizer)
    if info.is_main:
        distributed.barrier(info)
    return data


def _announce(cfg: Config, model: Transformer, data: PreparedData, info: DistInfo) -> None:
    """The run's size, peak learning rate, data and attention kernels at start (rank 0):
    schedules confuse."""
    optim_cfg = cfg.optim
    when = f"at step {optim_cfg.warmup_steps}"
    if optim_cfg.schedule == "budget":
        when = (
            f"after {optim_cfg.warmup_fraction:g} of the budget"
            if optim_cfg.warmup_fraction
            else f"at step {optim_cfg.warmup_steps} (or sooner, to fit the budget)"
        )
    logger.info(
        "model: %s parameters; peak lr %.3g %s; %d/%d train/valid pairs; %s × %d",
        f"{count_parameters(model):,}", peak_lr(cfg.model, optim_cfg), when, len(data.train),
        len(data.valid), info.device.type, info.world_size,
    )  # fmt: skip
    chosen = kernels.attention_kernels(cfg.model.attention_backend, info.device)
    order = " > ".join(k.name.lower() for k in chosen) if chosen else "PyTorch's choice"
    logger.info("attention kernels: %s (model.attention_backend=%s)", order,
                cfg.model.attention_backend)  # fmt: skip
    if info.distributed:
        sync = device_defaults.grad_sync(cfg)
        how = "inside" if sync == "overlapped" else "after"
        logger.info("%d ranks average their gradients %s the backward pass (train.grad_sync=%s)",
                    info.world_size, how, sync)  # fmt: skip


def _checkpoint_bytes(model: Transformer, data: PreparedData) -> int:
    """About how large a checkpoint is: float32 weights and Adam's two moments, the tokenizer."""
    weights = sum(p.numel() * 4 for p in model.parameters())
    return 3 * weights + len(data.tokenizer.model_bytes)
