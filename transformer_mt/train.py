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
import random
import sys
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


@dataclass
class StepStats:
    loss_sum: float  # label-smoothed loss summed over this rank's target tokens
    nll_sum: float
    tokens: int  # this rank's target tokens
    global_tokens: int
    real_tokens: int  # non-pad source + target tokens (padding efficiency)
    padded_tokens: int
    lr: float  # the learning rate this update used
    stop: bool  # some rank asked to stop after this step
    save: bool  # rank 0's clock asked for a checkpoint after this step


def train(cfg: Config) -> dict[str, Any] | None:
    """Train (or resume) the run in cfg.train.out_dir; rank 0 returns where it ended."""
    info = distributed.setup(cfg.train.device, cfg.train.distributed_timeout_s)
    try:
        return _train(cfg, info)
    finally:
        distributed.cleanup()


def _train(cfg: Config, info: DistInfo) -> dict[str, Any] | None:
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
        model.load_state_dict(saved.state_dict)
        progress = _restore(resume, optimizer, scheduler, scaler, info)
        logger.info(
            "resuming %s at step %d (epoch %d, batch %d)",
            resume,
            progress.step,
            progress.epoch,
            progress.batch_index,
        )
    if info.is_main:
        _start_run_dir(run_dir, cfg, tokenizer, progress.step)
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
        trained = torch.nn.parallel.DistributedDataParallel(
            trained, device_ids=[info.local_rank] if info.device.type == "cuda" else None
        )

    sampler = data.train.sampler(cfg.data.max_tokens, cfg.train.seed, info.rank, info.world_size)
    valid_batches = _valid_batches(data, cfg, info)
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

        # Time decisions are rank 0's clock, agreed on inside the step's collective.
        now = time.monotonic()
        elapsed = progress.elapsed_s + now - session_start
        out_of_time = 0 < cfg.train.max_minutes * 60 <= elapsed
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
            out_of_time,
            save_due,
        )
        progress.step += 1
        progress.batch_index += len(group)
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
        if valid_batches and cfg.train.valid_every and progress.step % cfg.train.valid_every == 0:
            scores |= validate(model, valid_batches, cfg, info, tokenizer.pad_id)
        if valid_text and progress.step % cfg.train.bleu_every == 0:
            scores |= validation_bleu(model, tokenizer, cfg, info, *valid_text)
        if scores:
            metrics.write({"step": progress.step, **scores})
        is_best = _track_best(progress, scores, cfg)
        if cfg.train.max_steps and progress.step >= cfg.train.max_steps:
            stop_reason = "max_steps"
        elif stats.stop:
            stop_reason = "max_minutes"
        elif cfg.train.patience and progress.stale_validations >= cfg.train.patience:
            stop_reason = "patience"
        periodic = bool(cfg.train.save_every) and progress.step % cfg.train.save_every == 0
        if periodic or stats.save or is_best or (stop_reason and last_saved_step != progress.step):
            progress.elapsed_s, session_start = (
                progress.elapsed_s + time.monotonic() - session_start,
                time.monotonic(),
            )
            save(is_best=is_best, keep=resume)
            last_save_time, last_saved_step = time.monotonic(), progress.step
    if last_saved_step != progress.step:  # stopped at an epoch boundary
        progress.elapsed_s += time.monotonic() - session_start
        save(is_best=False, keep=resume)
        last_saved_step = progress.step
    bar.close()
    averaged = _average_at_end(run_dir, model, tokenizer, cfg, info, valid_text)
    if not info.is_main:
        return None
    logger.info("stopped at step %d (%s)", progress.step, stop_reason)
    return {
        "step": progress.step,
        "epoch": progress.epoch,
        "stop": stop_reason,
        "best_metric": cfg.train.best_metric,
        "best_value": progress.best_value,
        "best_step": progress.best_step,
        "checkpoint": str(run_dir / "checkpoints" / f"step_{last_saved_step:08d}"),
        **({"average": averaged} if averaged else {}),
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
    request_stop: bool = False,
    request_save: bool = False,
) -> StepStats:
    """One optimizer update over `micro` (update_freq micro-batches on this rank).

    The loss is summed over target tokens and divided by the global token count of the update, so
    the gradient is the same however tokens are split over micro-batches and ranks (DDP averages
    gradients over ranks, hence the factor world_size).
    """
    local_tokens = sum(b.n_tokens for b in micro)
    control = torch.tensor(
        [local_tokens, float(request_stop), float(request_save)],
        dtype=torch.float64,
        device=info.device,
    )
    distributed.all_reduce_sum(control, info)  # one small collective: token count and decisions
    global_tokens = int(control[0].item())
    lr = optimizer.param_groups[0]["lr"]
    loss_sum = nll_sum = 0.0
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    for i, batch in enumerate(micro):
        last = i == len(micro) - 1
        no_sync = model.no_sync() if info.distributed and not last else contextlib.nullcontext()
        with no_sync:
            with torch.autocast(
                info.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None
            ):
                logits = model(batch.src, batch.tgt_in)
                sums = label_smoothed_nll(logits, batch.tgt_out, pad_id, cfg.optim.label_smoothing)
            scaler.scale(sums.loss * (info.world_size / global_tokens)).backward()
        loss_sum += sums.loss.item()
        nll_sum += sums.nll.item()
    scaler.unscale_(optimizer)
    if cfg.optim.clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_norm)
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    real = sum(int((b.src != pad_id).sum()) + b.n_tokens for b in micro)
    padded = sum(b.src.numel() + b.tgt_out.numel() for b in micro)
    stop, save = control[1].item() > 0, control[2].item() > 0
    return StepStats(loss_sum, nll_sum, local_tokens, global_tokens, real, padded, lr, stop, save)


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
        available = len(
            [p for p in checkpoint.list_checkpoints(run_dir) if checkpoint.verify(p) is None]
        )
        paths = checkpoint.last_checkpoints(run_dir, min(cfg.train.average_last, available))
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
        path = checkpoint.save(
            run_dir,
            progress.step,
            cfg,
            model.state_dict(),
            tokenizer.model_bytes,
            train_state,
            {"epoch": progress.epoch},
        )
        if is_best:
            checkpoint.set_best(run_dir, path)
        checkpoint.prune(run_dir, cfg.train.keep_last, protect={keep} if keep else set())
    fault_point("after_save", progress.step)


def _start_run_dir(run_dir: Path, cfg: Config, tokenizer: Tokenizer, step: int) -> None:
    """Resolved config and tokenizer beside the checkpoints; metrics past the resume step dropped
    (those steps are about to be trained again)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    tokenizer.save(run_dir / "tokenizer.model")
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        kept = [line for line in metrics.read_text().splitlines() if _record_step(line) <= step]
        tmp = metrics.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(metrics)


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
