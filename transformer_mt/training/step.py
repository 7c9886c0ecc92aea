"""One optimizer update (§5.3, §5.4) and the fault handling inside it.

An update takes train.update_freq micro-batches on each rank. It begins with a small collective that
agrees on its global token count and on any rank's request to stop or save, accumulates the
label-smoothed loss (divided by the global token count) through forward and backward passes, and
ends with a second collective on its verdict: applied everywhere (unscale, clip, Adam, schedule) or,
if any rank ran out of memory or saw a non-finite value, skipped everywhere with nothing changed.
The ranks' gradients are averaged by DDP inside the last backward pass, or, with
train.grad_sync=after_backward (CUDA graphs), by one more collective after it.

The host waits for the device once an update, for that verdict (and the loss, read with it): token
counts come from the host's batches, the losses add up on the device, and one process needs no
collective for its requests.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass

import torch

from transformer_mt.common import distributed
from transformer_mt.common.distributed import DistInfo
from transformer_mt.common.faults import fault_point
from transformer_mt.config import Config
from transformer_mt.data.batches import Batch
from transformer_mt.network.model import Transformer
from transformer_mt.training.graphs import MicroBatchGraphs
from transformer_mt.training.loss import Objective, label_smoothed_nll
from transformer_mt.training.master_weights import MasterWeights
from transformer_mt.training.optim import build_optimizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Optimization:
    """§5.3 Adam, its learning-rate schedule, the fp16 loss scaler (disabled otherwise), and
    with train.precision=bf16_weights the float32 master weights Adam updates."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    master: MasterWeights | None = None

    @classmethod
    def build(cls, model: torch.nn.Module, cfg: Config, device: torch.device) -> Optimization:
        """What tmt train updates `model` with (float32 on `device`): Adam (fused on CUDA) over
        its parameters, or with bf16_weights over float32 masters of them, the model made bf16."""
        master = MasterWeights(model) if cfg.train.precision == "bf16_weights" else None
        optimizer, scheduler = build_optimizer(
            master.params if master else model.parameters(), cfg.model, cfg.optim,
            fused=device.type == "cuda",
        )  # fmt: skip
        scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
        return cls(optimizer, scheduler, scaler, master)

    @functools.cached_property
    def params(self) -> list[torch.nn.Parameter]:
        """Adam's own list of parameters, made once (walking the modules again cost ~0.15 ms a
        time): its groups never change, and loading a state keeps their tensors."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @property
    def model_params(self) -> list[torch.nn.Parameter]:
        """The parameters backward writes gradients into, which the ranks average: Adam's own,
        or the bf16 ones its masters stand for."""
        return self.master.model_params if self.master is not None else self.params


@dataclass(frozen=True)
class Requests:
    """What this rank asks of the next update; granted if any rank asks."""

    stop: str | None = None  # "sigterm", "sigint" (a signal), "max_minutes" (the time budget)
    save: bool = False  # rank 0's clock: a time-based checkpoint is due
    plan: int = 0  # rank 0's clock: the updates the time budget allows (optim.schedule=budget)


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
    plan: int = 0  # the updates rank 0 planned for the time budget, agreed at this step; 0: none


def train_step(
    model: torch.nn.Module,
    micro: list[Batch],
    opt: Optimization,
    cfg: Config,
    info: DistInfo,
    attempt: int = 1,
    requests: Requests = Requests(),  # frozen: a shared default is safe
    objective: Objective | None = None,
    graphs: MicroBatchGraphs | None = None,
) -> StepStats:
    """One optimizer update over `micro` (update_freq micro-batches on this rank) of `objective`
    (by default the label-smoothed loss from the logits), its micro-batches replayed from
    `graphs` where given (train.cuda_graphs: `objective` is then theirs).

    The loss is summed over target tokens and divided by the global token count of the update, so
    the gradient is the same however tokens are split over micro-batches and ranks (the ranks'
    gradients are averaged, by DDP in the backward or after it: train.grad_sync; hence the factor
    world_size). An update whose gradients are not finite, or in which a rank ran out of memory,
    is skipped on every rank: no parameter, optimizer state or schedule changes.
    """
    tokens = sum(b.n_tokens for b in micro)
    global_tokens, stop, save, plan = _agree(tokens, requests, info)
    lr = opt.optimizer.param_groups[0]["lr"]
    if stop is not None:  # agreed by every rank: stop before this update, its batches unused
        return StepStats(
            loss_sum=0.0, nll_sum=0.0, tokens=0, global_tokens=global_tokens, real_tokens=0,
            padded_tokens=0, lr=lr, grad_norm=0.0, skipped="stopped", stop=stop, save=False,
        )  # fmt: skip
    objective = objective or Objective(cfg.optim.label_smoothing)
    sums, oom = _accumulate(
        model, micro, opt.scaler, objective, info, global_tokens=global_tokens, attempt=attempt,
        precision=cfg.train.precision, graphs=graphs,
    )  # fmt: skip
    if info.distributed and not distributed.syncs_in_backward(model):  # grad_sync=after_backward
        distributed.average_gradients(opt.model_params, info)
    skipped, norm, loss_sum, nll_sum = _apply(
        opt, cfg, info, sums=sums, oom=oom, keep_grads=graphs is not None
    )
    real = sum(b.source_tokens + b.n_tokens for b in micro)
    padded = sum(b.src.numel() + b.tgt_out.numel() for b in micro)
    return StepStats(
        loss_sum=loss_sum, nll_sum=nll_sum, tokens=tokens, global_tokens=global_tokens,
        real_tokens=real, padded_tokens=padded, lr=lr, grad_norm=norm, skipped=skipped, stop=None,
        save=save, plan=plan,
    )  # fmt: skip


def _agree(tokens: int, requests: Requests, info: DistInfo) -> tuple[int, str | None, bool, int]:
    """The update's first collective: its global token count, whether any rank asks to stop
    (a signal, the time budget) or to save, and rank 0's plan of the time budget, so that every
    rank decides the same at this step."""
    if not info.distributed:  # nothing to agree on: no tensor, no wait for the device
        return tokens, requests.stop, requests.save, requests.plan
    wanted = [tokens, requests.stop == "max_minutes", requests.stop == "sigterm"]
    wanted += [requests.stop == "sigint", requests.save, requests.plan]
    control = torch.tensor(wanted, dtype=torch.float64, device=info.device)
    distributed.all_reduce_sum(control, info)
    stop = "sigterm" if control[2] > 0 else "sigint" if control[3] > 0 else None
    stop = stop or ("max_minutes" if control[1] > 0 else None)
    return int(control[0].item()), stop, control[4].item() > 0, int(control[5].item())


def _accumulate(
    model: torch.nn.Module,
    micro: list[Batch],
    scaler: torch.amp.GradScaler,
    objective: Objective,
    info: DistInfo,
    global_tokens: int,
    attempt: int,
    precision: str,
    graphs: MicroBatchGraphs | None = None,
) -> tuple[torch.Tensor, bool]:
    """Forward and backward of every micro-batch (DDP averages the ranks' gradients in the last one;
    with train.grad_sync=after_backward train_step does after them);
    returns this rank's loss and NLL sums (float64, on the device: not waited for) and whether it
    ran out of memory."""
    sums_of_rank = torch.zeros(2, dtype=torch.float64, device=info.device)
    oom = False
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    # One autocast region for the whole update: autocast keeps each weight's low-precision copy
    # until its outermost region ends, so a weight is cast once an update, not once a micro-
    # batch. The backward passes run with autocast off, as PyTorch advises, in a nested region
    # that keeps those copies.
    with torch.autocast(info.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        for i, batch in enumerate(micro):
            oom |= _forward_backward(model, batch, scaler, objective, info, global_tokens,
                                     attempt if i == 0 else None, i == len(micro) - 1,
                                     sums_of_rank, graphs)  # fmt: skip
    return sums_of_rank, oom


def _forward_backward(
    model: torch.nn.Module,
    batch: Batch,
    scaler: torch.amp.GradScaler,
    objective: Objective,
    info: DistInfo,
    global_tokens: int,
    attempt: int | None,
    last: bool,
    sums_of_rank: torch.Tensor,
    graphs: MicroBatchGraphs | None = None,
) -> bool:
    """One micro-batch's forward (in the caller's autocast region) and backward, its loss and
    NLL sums added to `sums_of_rank`; whether it ran out of memory. `attempt`: the update's
    attempt at its first micro-batch (its fault point), else None. With `graphs`, the micro-
    batch's graph replayed (its shape's first one run and recorded)."""
    device = info.device.type
    in_backward = distributed.syncs_in_backward(model)  # DDP: its last backward all-reduces
    no_sync = model.no_sync() if in_backward and not last else contextlib.nullcontext()
    try:
        with no_sync:
            poison = fault_point("loss", attempt) if attempt is not None else None
            if graphs is not None and poison is None:
                # Its sums are read below, before another graph replays: they share memory.
                loss_sum, nll_sum = graphs.forward_backward(batch, info.world_size / global_tokens)
            else:
                # The logits, or the last states for the fused loss to project.
                out = model(batch.src, batch.tgt_in, project=objective.wants_logits)
                sums = objective(out, batch.tgt_out, batch.pad_id)
                loss = sums.loss * (info.world_size / global_tokens)
                if poison == "nan":
                    loss = loss * float("nan")
                with torch.autocast(device, enabled=False):
                    scaler.scale(loss).backward()
                loss_sum, nll_sum = sums.loss.detach(), sums.nll
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not distributed.is_out_of_memory(err):
            raise
        out = sums = loss = None
        logger.warning(
            "out of memory on a batch of %s source, %s target tokens",
            tuple(batch.src.shape), tuple(batch.tgt_out.shape),
        )  # fmt: skip
        if info.device.type == "cuda":
            torch.cuda.empty_cache()
        if last and in_backward:  # the other ranks wait in this backward's all-reduce
            out = model(batch.src[:1, :1], batch.tgt_in[:1, :1])
            with torch.autocast(device, enabled=False):
                scaler.scale(out.float().sum() * 0.0).backward()  # joins it; the update is skipped
        return True
    sums_of_rank += torch.stack([loss_sum.double(), nll_sum.double()])
    return False


def _apply(
    opt: Optimization,
    cfg: Config,
    info: DistInfo,
    sums: torch.Tensor,
    oom: bool,
    keep_grads: bool = False,
) -> tuple[str | None, float, float, float]:
    """The update's second collective, so that every rank reaches the same verdict; then the
    update (unscale, clip, Adam, schedule) or, if any rank saw a problem, its skip everywhere.
    With master weights, their gradients are the model's in float32, and an applied update is
    rounded into the model's weights.
    `keep_grads`: the gradients are zeroed in place, not freed (CUDA graphs add into them).
    Returns (why it was skipped or None, the gradient norm, this rank's loss and NLL sums): the
    update's one wait for the device, since the verdict is needed before Adam."""
    if opt.master is not None:
        opt.master.gather_grads()
    opt.scaler.unscale_(opt.optimizer)
    params = opt.params
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=info.device)
    ran_out = torch.full((), float(oom), device=info.device)
    flags = torch.stack([ran_out, (~sums[0].isfinite()).float()])
    distributed.all_reduce_sum(flags, info)
    verdict = torch.cat([flags.double(), sums, norm.detach().double().reshape(1)]).tolist()
    any_oom, any_nonfinite_loss = verdict[0] > 0, verdict[1] > 0
    loss_sum, nll_sum, norm_value = verdict[2:]
    skipped = None
    if any_oom:
        skipped = "oom"
    elif any_nonfinite_loss or not math.isfinite(norm_value):
        # With fp16 a finite loss and infinite gradients is the GradScaler's overflow: normal.
        skipped = "overflow" if opt.scaler.is_enabled() and not any_nonfinite_loss else "non_finite"
    if skipped is None:
        if cfg.optim.clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, cfg.optim.clip_norm, norm)
        opt.scaler.step(opt.optimizer)
        opt.scheduler.step()
        if opt.master is not None:
            opt.master.scatter_weights()
    opt.scaler.update()  # lowers the fp16 loss scale after an overflow
    if opt.master is not None:  # the masters' gradients: kept, the next update overwrites them
        opt.master.zero_model_grads(set_to_none=not keep_grads)
    else:
        opt.optimizer.zero_grad(set_to_none=not keep_grads)
    return skipped, norm_value, loss_sum, nll_sum


# --- validation loss -------------------------------------------------------------------------


@torch.no_grad()
def validate(
    model: Transformer, batches: list[Batch], cfg: Config, info: DistInfo
) -> dict[str, float]:
    """Validation loss and perplexity over the validation split (batches sharded over ranks)."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=info.device)
    for batch in batches:
        out = label_smoothed_nll(
            model(batch.src, batch.tgt_in), batch.tgt_out, batch.pad_id, cfg.optim.label_smoothing
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
