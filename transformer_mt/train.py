"""Training runs: the dry run and the one training loop (§5).

train(cfg) reads as a story: distributed setup -> resume point -> tokenizer and data -> model ->
optimizer and schedule -> restore -> DDP -> loop (accumulate, step, log, validate, save) -> final
save. Only rank 0 writes files and logs; every rank takes the same decisions at the same steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from transformer_mt import checkpoint, distributed, evaluate
from transformer_mt.config import Config, TmtError, to_dict, to_yaml
from transformer_mt.data import Batch, EncodedSplit, PreparedData, padding_efficiency, prepare_data
from transformer_mt.distributed import DistInfo
from transformer_mt.faults import fault_point
from transformer_mt.loss import label_smoothed_nll
from transformer_mt.model import Transformer, count_parameters
from transformer_mt.optim import build_optimizer, peak_lr
from transformer_mt.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Sections that define the model: a run directory cannot resume with different values.
_FIXED_SECTIONS = ("model", "tokenizer")


def dry_run(cfg: Config) -> dict[str, Any]:
    """Everything before the first step, reported: config, filter counts, vocab, batches."""
    data = prepare_data(cfg)
    sampler = data.train.sampler(cfg.data.max_tokens, cfg.train.seed)
    batches = sampler.epoch_batches(0)
    model = Transformer(cfg.model, data.tokenizer.vocab_size, data.tokenizer.pad_id)
    efficiency = padding_efficiency(batches, sampler.src_lengths, sampler.tgt_lengths)
    summary = {
        "pairs": len(data.train),
        "valid_pairs": len(data.valid),
        "vocab_size": data.tokenizer.vocab_size,
        "parameters": count_parameters(model),
        "batches": len(batches),
        "padding_efficiency": round(efficiency, 4),
        "filters": {key.removeprefix("data."): c.as_dict() for key, c in data.counts.items()},
    }
    print("# resolved config")
    print(to_yaml(cfg), end="")
    print("# data")
    for key, counts in data.counts.items():
        print(f"{key}: " + ", ".join(f"{name} {n}" for name, n in counts.as_dict().items()))
    print(f"vocab_size: {summary['vocab_size']}")
    print(f"parameters: {summary['parameters']:,}")
    print(f"batches per epoch: {summary['batches']} (max_tokens {cfg.data.max_tokens})")
    print(f"padding efficiency: {summary['padding_efficiency']:.4f}")
    print(json.dumps(summary))
    return summary


# Runs stopped by a signal exit like a shell would report them: 128 + the signal number.
EXIT_CODES = {"sigterm": 128 + signal.SIGTERM, "sigint": 128 + signal.SIGINT}
# A signalled run that reaches no step boundary within this time exits unsaved; torchrun sends
# SIGKILL 30 s after SIGTERM, so this leaves room for the last save and a clean exit.
_SIGNAL_GRACE_S = 25.0


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


@dataclass
class StepStats:
    loss_sum: float  # label-smoothed loss summed over this rank's target tokens
    nll_sum: float
    tokens: int  # this rank's target tokens
    global_tokens: int
    real_tokens: int  # non-pad source + target tokens (padding efficiency)
    padded_tokens: int
    lr: float  # the learning rate this update used
    grad_norm: float
    skipped: str | None  # why no update was applied: "oom", "overflow", "non_finite", "stopped"
    stop: str | None  # a stop every rank agreed on: "sigterm", "sigint", "max_minutes"
    save: bool  # rank 0's clock asked for a checkpoint after this step


def train(cfg: Config) -> dict[str, Any]:
    """Train (or resume) the run in cfg.train.out_dir; returns where it ended (with this rank)."""
    info = distributed.setup(cfg.train.device, cfg.train.distributed_timeout_s)
    heartbeat = distributed.Heartbeat(info)
    # The handlers stay installed while a failure is reported and the group torn down: torchrun
    # sends SIGTERM to the survivors of a dead rank, which must not kill them mid-report.
    with _StopSignals() as signals:
        try:
            return _train(cfg, info, signals, heartbeat)
        except RuntimeError as err:
            if info.distributed and distributed.is_collective_failure(err):
                reason = str(err).strip().splitlines()[0][:200]
                message = f"a collective failed: {heartbeat.report()}: {reason}"
                logger.error(message)
                raise TmtError(message, exit_code=1) from None
            raise
        finally:
            distributed.cleanup()


def _train(
    cfg: Config, info: DistInfo, signals: _StopSignals, heartbeat: distributed.Heartbeat
) -> dict[str, Any]:
    run_dir = Path(cfg.train.out_dir)
    session_start = time.monotonic()

    # Resume point: the newest complete checkpoint of this run directory (shared by all ranks).
    if info.is_main:
        checkpoint.remove_leftovers(run_dir)
    distributed.barrier(info)
    resume = checkpoint.latest_valid(run_dir)
    saved = checkpoint.load_model(resume) if resume else None
    if saved is not None:
        _check_resumable(saved.config, cfg, resume)

    # Tokenizer and data: rank 0 fills the cache first, then the other ranks read it warm.
    tokenizer = Tokenizer(saved.tokenizer_bytes) if saved else None
    data = _prepare_data_rank0_first(cfg, tokenizer, info)
    tokenizer = data.tokenizer

    # Model, optimizer, schedule: the same initial weights on every rank.
    torch.manual_seed(cfg.train.seed)
    model = Transformer(cfg.model, tokenizer.vocab_size, tokenizer.pad_id).to(info.device)
    optimizer, scheduler = build_optimizer(
        model, cfg.model, cfg.optim, fused=info.device.type == "cuda"
    )
    scaler = torch.amp.GradScaler(info.device.type, enabled=cfg.train.precision == "fp16")
    _seed_rank(cfg.train.seed, info.rank)
    progress = Progress()
    if saved is not None:
        _load_weights(model, saved.state_dict, resume)
        progress = _restore(resume, optimizer, scheduler, scaler, info)
        logger.info(
            "resuming %s at step %d (epoch %d, batch %d)",
            resume,
            progress.step,
            progress.epoch,
            progress.batch_index,
        )
    if info.is_main:
        _start_run_dir(run_dir, cfg, tokenizer, progress.step, _checkpoint_bytes(model, tokenizer))
        logger.info(
            "model: %s parameters; peak lr %.3g at step %d; %d/%d train/valid pairs; %s × %d",
            f"{count_parameters(model):,}", peak_lr(cfg.model, cfg.optim), cfg.optim.warmup_steps,
            len(data.train), len(data.valid), info.device.type, info.world_size,
        )  # fmt: skip

    # The training view of the model: compiled and/or DDP-wrapped; raw `model` saves and validates.
    if info.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    trained = torch.compile(model) if cfg.train.compile else model
    if info.distributed:
        device_ids = [info.local_rank] if info.device.type == "cuda" else None
        trained = torch.nn.parallel.DistributedDataParallel(trained, device_ids=device_ids)

    sampler = data.train.sampler(cfg.data.max_tokens, cfg.train.seed, info.rank, info.world_size)
    valid_batches = _valid_batches(data, cfg, info)
    heartbeat.beat(progress.step)
    # Validation BLEU reads the raw validation text: scored exactly as tmt evaluate scores it.
    valid_text = evaluate.read_split(cfg, "data.valid") if cfg.train.bleu_every else None
    metrics = _MetricsLog(run_dir / "metrics.jsonl", enabled=info.is_main)
    window = _Window()
    bar = _progress_bar(cfg, progress.step, info)
    save = functools.partial(
        _save, run_dir, model, optimizer, scheduler, scaler, progress, cfg, tokenizer, info
    )
    last_save_time, last_saved_step = time.monotonic(), progress.step if saved is not None else -1
    stop_reason = None
    while stop_reason is None:
        # The next update's micro-batches; an epoch ends when this rank's batches run out.
        batches = sampler.epoch_batches(progress.epoch)
        if progress.batch_index >= len(batches):
            progress.epoch, progress.batch_index = progress.epoch + 1, 0
            if cfg.train.max_epochs and progress.epoch >= cfg.train.max_epochs:
                stop_reason = "max_epochs"
            continue
        group = batches[progress.batch_index : progress.batch_index + cfg.train.update_freq]
        micro = [data.train.batch(b, tokenizer).to(info.device) for b in group]

        # Stop and save requests (signals, rank 0's clock) are agreed on inside the step.
        now = time.monotonic()
        out_of_time = 0 < cfg.train.max_minutes * 60 <= progress.elapsed_s + now - session_start
        request = signals.received or ("max_minutes" if out_of_time else None)
        save_due = info.is_main and 0 < cfg.train.save_every_minutes * 60 <= now - last_save_time
        stats = train_step(
            trained,
            micro,
            optimizer,
            scheduler,
            scaler,
            cfg,
            info,
            tokenizer.pad_id,
            progress.step + progress.skipped + 1,  # the attempt: skipped updates count
            request,
            save_due,
        )
        if stats.skipped != "stopped":  # a stopped step used none of its batches
            progress.batch_index += len(group)

        is_best = False
        if stats.skipped is None:
            progress.step += 1
            progress.nonfinite_run = 0
            heartbeat.beat(progress.step)
            window.add(stats)
            bar.update(1)
            fault_point("step", progress.step)
            if progress.step % cfg.train.log_every == 0:
                record = window.flush(info, progress)
                metrics.write(record)
                bar.set_postfix(
                    loss=f"{record['loss']:.3f}",
                    lr=f"{record['lr']:.2e}",
                    tok_s=f"{record['tokens_per_s']:.0f}",
                    pad=f"{record['padding_efficiency']:.2f}",
                )
            scores: dict[str, float] = {}
            if (
                valid_batches
                and cfg.train.valid_every
                and progress.step % cfg.train.valid_every == 0
            ):
                scores |= validate(model, valid_batches, cfg, info, tokenizer.pad_id)
            if valid_text and progress.step % cfg.train.bleu_every == 0:
                scores |= validation_bleu(model, tokenizer, cfg, info, *valid_text)
            if scores:
                metrics.write({"step": progress.step, **scores})
                if info.is_main:  # the bar is hidden off a terminal: validation always shows
                    shown = ("val_loss", "val_ppl", "val_bleu", "val_chrf")
                    figures = "  ".join(f"{k} {scores[k]:.3f}" for k in shown if k in scores)
                    bar.write(f"tmt: step {progress.step}: {figures}", file=sys.stderr)
            is_best = _track_best(progress, scores, cfg)
        elif stats.skipped != "stopped":
            _record_skip(progress, stats, metrics, micro)

        stop_reason = _stop_reason(progress, stats, cfg)
        if stop_reason == "non_finite":
            break  # nothing to save: the newest checkpoint is the last good state
        periodic = (
            bool(cfg.train.save_every)
            and progress.step % cfg.train.save_every == 0
            and stats.skipped is None
        )
        if periodic or stats.save or is_best or (stop_reason and last_saved_step != progress.step):
            progress.elapsed_s, session_start = (
                progress.elapsed_s + time.monotonic() - session_start,
                time.monotonic(),
            )
            save(is_best=is_best, keep=resume)
            last_save_time, last_saved_step = time.monotonic(), progress.step
    if stop_reason == "non_finite":
        raise TmtError(
            f"training diverged: {progress.nonfinite_run} consecutive non-finite updates after step"
            f" {progress.step} (each skipped, train.nonfinite_patience); newest checkpoint:"
            f" {checkpoint.latest_valid(run_dir) or 'none'}",
            exit_code=3,
        )
    if last_saved_step != progress.step:  # stopped at an epoch boundary
        progress.elapsed_s += time.monotonic() - session_start
        save(is_best=False, keep=resume)
        last_saved_step = progress.step
    bar.close()
    averaged = (
        None
        if stop_reason in EXIT_CODES
        else _average_at_end(run_dir, model, tokenizer, cfg, info, valid_text)
    )
    if info.is_main:
        logger.info("stopped at step %d (%s)", progress.step, stop_reason)
    return {
        "step": progress.step,
        "epoch": progress.epoch,
        "stop": stop_reason,
        "skipped_updates": progress.skipped,
        "best_metric": cfg.train.best_metric,
        "best_value": progress.best_value,
        "best_step": progress.best_step,
        "checkpoint": str(run_dir / "checkpoints" / f"step_{last_saved_step:08d}"),
        **({"average": averaged} if averaged else {}),
        "rank": info.rank,
    }


def train_step(
    model: torch.nn.Module,
    micro: list[Batch],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    cfg: Config,
    info: DistInfo,
    pad_id: int,
    attempt: int = 1,
    request_stop: str | None = None,
    request_save: bool = False,
) -> StepStats:
    """One optimizer update over `micro` (update_freq micro-batches on this rank).

    The loss is summed over target tokens and divided by the global token count of the update, so
    the gradient is the same however tokens are split over micro-batches and ranks (DDP averages
    gradients over ranks, hence the factor world_size). An update whose gradients are not finite,
    or in which a rank ran out of memory, is skipped on every rank: no parameter, optimizer state or
    schedule changes.
    """
    # One small collective before the update: its token count, and the stop/save decisions.
    wanted = [
        sum(b.n_tokens for b in micro),
        request_stop == "max_minutes",
        request_stop == "sigterm",
    ]
    wanted += [request_stop == "sigint", request_save]
    control = torch.tensor(wanted, dtype=torch.float64, device=info.device)
    distributed.all_reduce_sum(control, info)
    global_tokens = int(control[0].item())
    lr = optimizer.param_groups[0]["lr"]
    stop = "sigterm" if control[2] > 0 else "sigint" if control[3] > 0 else None
    stop = stop or ("max_minutes" if control[1] > 0 else None)
    if stop is not None:  # agreed by every rank: stop before this update, its batches unused
        return StepStats(0.0, 0.0, 0, global_tokens, 0, 0, lr, 0.0, "stopped", stop, False)
    loss_sum = nll_sum = 0.0
    oom = False
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    for i, batch in enumerate(micro):
        last = i == len(micro) - 1
        no_sync = model.no_sync() if info.distributed and not last else contextlib.nullcontext()
        try:
            with no_sync:
                with torch.autocast(
                    info.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None
                ):
                    poison = fault_point("loss", attempt) if i == 0 else None
                    logits = model(batch.src, batch.tgt_in)
                    sums = label_smoothed_nll(
                        logits, batch.tgt_out, pad_id, cfg.optim.label_smoothing
                    )
                    loss = sums.loss * (info.world_size / global_tokens)
                    if poison == "nan":
                        loss = loss * float("nan")
                scaler.scale(loss).backward()
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if not _is_out_of_memory(err):
                raise
            oom = True
            logits = sums = loss = None
            logger.warning(
                "out of memory on a batch of %s source, %s target tokens",
                tuple(batch.src.shape),
                tuple(batch.tgt_out.shape),
            )
            if info.device.type == "cuda":
                torch.cuda.empty_cache()
            if last and info.distributed:  # the other ranks wait in this backward's all-reduce
                _join_gradient_sync(model, batch, scaler, autocast_dtype, info)
            continue
        loss_sum += sums.loss.item()
        nll_sum += sums.nll.item()
    # A second small collective, so every rank reaches the same verdict on this update.
    flags = torch.tensor([float(oom), float(not math.isfinite(loss_sum))], device=info.device)
    any_oom, any_nonfinite_loss = (distributed.all_reduce_sum(flags, info) > 0).tolist()
    scaler.unscale_(optimizer)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    skipped = None
    if any_oom:
        skipped = "oom"
    elif any_nonfinite_loss or not torch.isfinite(norm):
        # With fp16 a finite loss and infinite gradients is the GradScaler's overflow: normal.
        skipped = "overflow" if scaler.is_enabled() and not any_nonfinite_loss else "non_finite"
    if skipped is None:
        if cfg.optim.clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), cfg.optim.clip_norm, norm)
        scaler.step(optimizer)
        scheduler.step()
    scaler.update()  # lowers the fp16 loss scale after an overflow
    optimizer.zero_grad(set_to_none=True)
    real = sum(int((b.src != pad_id).sum()) + b.n_tokens for b in micro)
    padded = sum(b.src.numel() + b.tgt_out.numel() for b in micro)
    return StepStats(
        loss_sum,
        nll_sum,
        wanted[0],
        global_tokens,
        real,
        padded,
        lr,
        float(norm),
        skipped,
        stop,
        control[4].item() > 0,
    )


@torch.no_grad()
def validate(
    model: Transformer, batches: list[Batch], cfg: Config, info: DistInfo, pad_id: int
) -> dict[str, float]:
    """Validation loss and perplexity over the validation split (batches sharded over ranks)."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=info.device)
    for batch in batches:
        out = label_smoothed_nll(
            model(batch.src, batch.tgt_in), batch.tgt_out, pad_id, cfg.optim.label_smoothing
        )
        sums += torch.stack([out.loss.double(), out.nll.double(), out.n_tokens.double()])
    distributed.all_reduce_sum(sums, info)
    model.train(was_training)
    loss, nll, tokens = sums.tolist()
    return {
        "val_loss": loss / tokens,
        "val_nll": nll / tokens,
        "val_ppl": math.exp(min(nll / tokens, 100.0)),
    }


def validation_bleu(
    model: Transformer,
    tokenizer: Tokenizer,
    cfg: Config,
    info: DistInfo,
    sources: list[str],
    references: list[str],
) -> dict[str, float]:
    """BLEU and chrF of the validation split, decoded through evaluate.translate_text (the tmt
    evaluate path) with beam train.bleu_beam_size; each rank translates every world_size-th line."""
    decode = dataclasses.replace(cfg.decode, beam_size=cfg.train.bleu_beam_size, nbest=1)
    translator = evaluate.Translator(
        model, tokenizer, dataclasses.replace(cfg, decode=decode), info.device, "training"
    )
    was_training = model.training
    model.eval()
    mine = evaluate.translate_text(translator, sources[info.rank :: info.world_size])
    model.train(was_training)
    shards = distributed.gather_to_main(mine, info)
    figures = torch.zeros(2, dtype=torch.float64, device=info.device)
    if info.is_main:
        hypotheses = [
            shards[i % info.world_size][i // info.world_size] for i in range(len(sources))
        ]
        result = evaluate.score(hypotheses, references)
        figures += torch.tensor(
            [result["bleu"], result["chrf"]], dtype=torch.float64, device=info.device
        )
    distributed.all_reduce_sum(figures, info)  # rank 0's figures everywhere: the same decisions
    return {"val_bleu": figures[0].item(), "val_chrf": figures[1].item()}


# --- helpers -----------------------------------------------------------------------------------


class _StopSignals:
    """SIGTERM and SIGINT only set a flag: the loop stops at the next step boundary (every rank
    agrees through the step's collective), saves that step and exits 143 or 130. A second signal,
    or no step boundary within _SIGNAL_GRACE_S, exits at once without saving."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> _StopSignals:
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
        self._timer = threading.Timer(_SIGNAL_GRACE_S, self._expire, (signum,))
        self._timer.daemon = True
        self._timer.start()

    def _expire(self, signum: int) -> None:
        logger.error(
            "%s: no step boundary within %.0f s; exiting unsaved", self.received, _SIGNAL_GRACE_S
        )
        os._exit(128 + signum)


def _is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err)
    return "DefaultCPUAllocator: not enough memory" in text or "can't allocate memory" in text


def _join_gradient_sync(
    model: torch.nn.Module, batch: Batch, scaler: torch.amp.GradScaler, dtype: Any, info: DistInfo
) -> None:
    """A rank that ran out of memory in the synchronising micro-batch still takes part in DDP's
    gradient all-reduce, with a one-token forward whose loss is zero; the update is skipped."""
    with torch.autocast(info.device.type, dtype=dtype, enabled=dtype is not None):
        out = model(batch.src[:1, :1], batch.tgt_in[:1, :1])
    scaler.scale(out.float().sum() * 0.0).backward()


def _record_skip(
    progress: Progress, stats: StepStats, metrics: _MetricsLog, micro: list[Batch]
) -> None:
    progress.skipped += 1
    if stats.skipped == "non_finite":
        progress.nonfinite_run += 1
    shapes = [tuple(b.src.shape) for b in micro]
    logger.warning(
        "update after step %d skipped on every rank (%s); batches %s",
        progress.step,
        stats.skipped,
        shapes,
    )
    metrics.write(
        {
            "step": progress.step,
            "skipped": stats.skipped,
            "epoch": progress.epoch,
            "batch_index": progress.batch_index,
        }
    )


def _stop_reason(progress: Progress, stats: StepStats, cfg: Config) -> str | None:
    if progress.nonfinite_run >= cfg.train.nonfinite_patience:
        return "non_finite"
    if stats.stop in ("sigterm", "sigint"):
        return stats.stop
    if cfg.train.max_steps and progress.step >= cfg.train.max_steps:
        return "max_steps"
    if stats.stop:
        return stats.stop
    if cfg.train.patience and progress.stale_validations >= cfg.train.patience:
        return "patience"
    return None


def _load_weights(
    model: Transformer, state_dict: dict[str, torch.Tensor], path: Path | None
) -> None:
    """Refuse weights of another shape before any compute, naming the parameters that differ."""
    expected = model.state_dict()
    differ = [f"{name} unexpected" for name in state_dict if name not in expected]
    for name, tensor in expected.items():
        found = tuple(state_dict[name].shape) if name in state_dict else "missing"
        if found != tuple(tensor.shape):
            differ.append(f"{name} {found} vs {tuple(tensor.shape)}")
    if differ:
        raise TmtError(f"{path}: weights do not fit this model: {'; '.join(differ[:4])}")
    model.load_state_dict(state_dict)


def _checkpoint_bytes(model: Transformer, tokenizer: Tokenizer) -> int:
    """About how large a checkpoint is: weights and Adam's two moments, plus the tokenizer."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters()) + len(
        tokenizer.model_bytes
    )


def _track_best(progress: Progress, scores: dict[str, float], cfg: Config) -> bool:
    """Update the best value of train.best_metric; True when this validation is the new best."""
    value = scores.get(cfg.train.best_metric)
    if value is None:
        return False
    higher_is_better = cfg.train.best_metric == "val_bleu"
    best = progress.best_value
    if best is None or (value > best if higher_is_better else value < best):
        progress.best_value, progress.best_step, progress.stale_validations = (
            value,
            progress.step,
            0,
        )
        return True
    progress.stale_validations += 1
    return False


def _average_at_end(
    run_dir: Path,
    model: Transformer,
    tokenizer: Tokenizer,
    cfg: Config,
    info: DistInfo,
    valid_text: Any,
) -> dict[str, Any] | None:
    """§6.1: average the newest train.average_last checkpoints into OUT_DIR/average and report
    its validation BLEU (rank 0 works, the others wait)."""
    if not cfg.train.average_last:
        return None
    result = None
    if info.is_main:
        paths = checkpoint.last_checkpoints(run_dir, cfg.train.average_last, allow_fewer=True)
        written = checkpoint.write_average(paths, run_dir / "average")
        result = {"path": str(written), "checkpoints": len(paths)}
        if valid_text:
            averaged = Transformer(cfg.model, tokenizer.vocab_size, tokenizer.pad_id).to(
                info.device
            )
            averaged.load_state_dict(checkpoint.load_model(written).state_dict)
            solo = DistInfo(0, 1, info.local_rank, info.device)
            result |= validation_bleu(averaged, tokenizer, cfg, solo, *valid_text)
        logger.info("averaged %d checkpoints into %s %s", len(paths), written, result)
    distributed.barrier(info)
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


def _valid_batches(data: PreparedData, cfg: Config, info: DistInfo) -> list[Batch]:
    valid: EncodedSplit = data.valid
    if len(valid) < info.world_size:
        return []
    sampler = valid.sampler(
        cfg.data.max_tokens, cfg.train.seed, info.rank, info.world_size, shuffle=False
    )
    return [valid.batch(b, data.tokenizer).to(info.device) for b in sampler.epoch_batches(0)]


def _seed_rank(seed: int, rank: int) -> None:
    """Dropout and any other randomness: a stream per rank, reproducible from the seed."""
    torch.manual_seed(seed + rank)
    random.seed(seed + rank)
    np.random.seed(seed + rank)


def _check_resumable(saved: Config, cfg: Config, path: Path | None) -> None:
    """Refuse to resume with another model or tokenizer; allow new budgets and schedules."""
    old, new = to_dict(saved), to_dict(cfg)
    differ = [f"{s}.{k}" for s in _FIXED_SECTIONS for k in new[s] if old[s][k] != new[s][k]]
    if differ:
        raise TmtError(
            f"{cfg.train.out_dir}: holds a run with other settings"
            f" ({', '.join(differ)} differ from {path});"
            " use a new train.out_dir or the saved values"
        )
    changed = [
        f"{s}.{k}"
        for s in new
        if s not in _FIXED_SECTIONS
        for k in new[s]
        if old[s][k] != new[s][k]
    ]
    if changed:
        logger.warning("resuming with changed settings: %s", ", ".join(changed))


def _restore(path: Path, optimizer, scheduler, scaler, info: DistInfo) -> Progress:
    state = checkpoint.load_train_state(path)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    if len(state["rng"]) == info.world_size:
        checkpoint.restore_rng(state["rng"][info.rank])
    else:  # another world size: the data order resumes exactly, the dropout streams cannot
        logger.warning(
            "checkpoint has %d ranks, this run %d: random streams restart",
            len(state["rng"]),
            info.world_size,
        )
    return Progress(**state["progress"])


def _save(
    run_dir: Path,
    model: Transformer,
    optimizer,
    scheduler,
    scaler,
    progress: Progress,
    cfg: Config,
    tokenizer: Tokenizer,
    info: DistInfo,
    *,
    is_best: bool,
    keep: Path | None,
) -> None:
    rng = distributed.gather_to_main(checkpoint.capture_rng(), info)  # every rank's streams
    if info.is_main:
        train_state = {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "rng": rng,
            "progress": progress.__dict__.copy(),
        }
        weights, spm, info_ = model.state_dict(), tokenizer.model_bytes, {"epoch": progress.epoch}
        try:
            path = checkpoint.save(run_dir, progress.step, cfg, weights, spm, train_state, info_)
        except (OSError, RuntimeError) as err:  # disk full, quota, I/O (torch: RuntimeError)
            strerror = err.strerror if isinstance(err, OSError) else None
            reason = strerror or str(err).strip().splitlines()[0]
            raise TmtError(
                f"saving checkpoint step {progress.step} failed ({reason}); nothing was left under"
                " its name and the checkpoints before it are intact",
                exit_code=4,
            ) from None
        if is_best:
            checkpoint.set_best(run_dir, path)
        checkpoint.prune(run_dir, cfg.train.keep_last, protect={path} | ({keep} if keep else set()))
    fault_point("after_save", progress.step)


def _start_run_dir(
    run_dir: Path, cfg: Config, tokenizer: Tokenizer, step: int, checkpoint_bytes: int
) -> None:
    """Resolved config and tokenizer beside the checkpoints; metrics past the resume step dropped
    (those steps are about to be trained again). Refuses to start without room for checkpoints:
    a new one is written beside the last, so twice a checkpoint's size must be free."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=run_dir).close()
    except OSError as err:
        raise TmtError(
            f"{run_dir}: cannot write there ({err.strerror or err})", exit_code=4
        ) from None
    free = shutil.disk_usage(run_dir).free
    if free < 2 * checkpoint_bytes:
        raise TmtError(
            f"{run_dir}: {free / 2**20:.0f} MiB free, but a checkpoint takes about"
            f" {checkpoint_bytes / 2**20:.0f} MiB and twice that must be free",
            exit_code=4,
        )
    try:
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        tokenizer.save(run_dir / "tokenizer.model")
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():
            kept = [line for line in metrics.read_text().splitlines() if _record_step(line) <= step]
            tmp = metrics.with_name(".metrics.jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(metrics)
    except OSError as err:
        raise TmtError(
            f"{run_dir}: cannot write the run's files ({err.strerror or err})", exit_code=4
        ) from None


def _record_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return sys.maxsize  # a torn last line from a kill: dropped


class _MetricsLog:
    """metrics.jsonl: one JSON object per line, flushed as written (rank 0 only)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.handle = open(path, "a", encoding="utf-8") if enabled else None  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        if self.handle is not None:
            self.handle.write(json.dumps(record) + "\n")
            self.handle.flush()


@dataclass
class _Window:
    """Sums over the steps since the last log record."""

    stats: list[StepStats] = field(default_factory=list)
    start: float = field(default_factory=time.monotonic)

    def add(self, stats: StepStats) -> None:
        self.stats.append(stats)

    def flush(self, info: DistInfo, progress: Progress) -> dict[str, Any]:
        sums = torch.tensor(
            [
                sum(s.loss_sum for s in self.stats),
                sum(s.nll_sum for s in self.stats),
                sum(s.tokens for s in self.stats),
            ],
            dtype=torch.float64,
            device=info.device,
        )
        distributed.all_reduce_sum(sums, info)
        loss, nll, tokens = sums.tolist()
        seconds = max(time.monotonic() - self.start, 1e-9)
        record = {
            "step": progress.step,
            "epoch": progress.epoch,
            "loss": loss / tokens,
            "nll": nll / tokens,
            "ppl": math.exp(min(nll / tokens, 100.0)),
            "lr": self.stats[-1].lr,
            "tokens_per_s": tokens / seconds,
            "padding_efficiency": sum(s.real_tokens for s in self.stats)
            / sum(s.padded_tokens for s in self.stats),
        }
        self.stats, self.start = [], time.monotonic()
        return record


def _progress_bar(cfg: Config, step: int, info: DistInfo) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=cfg.train.max_steps or None,
        initial=step,
        disable=not info.is_main or None,
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
    )
