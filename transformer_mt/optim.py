"""Adam with the paper's warmup-then-inverse-square-root learning rate (§5.3), or a schedule that
fits the run's budget (optim.schedule=budget)."""

from __future__ import annotations

import functools

import torch

from transformer_mt.config import ModelConfig, OptimConfig


def noam_lr(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """§5.3: lrate = d_model^-0.5 · min(step^-0.5, step · warmup^-1.5), steps counted from 1."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def peak_lr(model_cfg: ModelConfig, cfg: OptimConfig) -> float:
    return noam_lr(
        cfg.warmup_steps, d_model=model_cfg.d_model, warmup_steps=cfg.warmup_steps,
        scale=cfg.lr_scale,
    )  # fmt: skip


class BudgetSchedule:
    """optim.schedule=budget: a linear warmup over optim.warmup_fraction of the run's planned
    updates to the paper schedule's peak (lr_scale · d_model^-0.5 · warmup_steps^-0.5), the peak
    held, and a linear decay to zero over the last optim.decay_fraction of them: warmup-stable-
    decay (Hägele et al., 2024; MiniCPM's WSD). decay_fraction 1 - warmup_fraction is a linear
    decay from the peak (fairseq's polynomial_decay, HF's linear). Before a plan exists (a time
    budget whose update rate is being measured), the ramp is the paper's; a plan made at update
    k0 continues from the rate of k0 to the peak, so the learning rate never jumps in warmup.

    Its attributes are plain values: LambdaLR saves them in the scheduler's state (train_state.pt),
    so a resume continues the same plan bit for bit."""

    def __init__(self, model_cfg: ModelConfig, cfg: OptimConfig) -> None:
        self.peak = peak_lr(model_cfg, cfg)
        self.fraction, self.decay_fraction = cfg.warmup_fraction, cfg.decay_fraction
        self.d_model, self.warmup_steps = model_cfg.d_model, cfg.warmup_steps
        self.scale = cfg.lr_scale
        self.total = 0  # planned updates; 0 = no plan yet
        self.start, self.start_lr = 0, 0.0  # the update the plan starts from, and its rate
        self.steps_budget = 0  # the step budget (max_steps, max_epochs) the plan was made from
        self.timed = False  # the plan includes the measured time budget

    def plan(self, total: int, after: int) -> None:
        """Plan `total` updates; updates up to `after` keep the rates they had."""
        self.start, self.start_lr = after, self.lr(after) if after > 0 else 0.0
        self.total = max(int(total), 1)

    @property
    def warmup(self) -> int:
        return max(round(self.fraction * self.total), 1)

    def lr(self, step: int) -> float:
        """The learning rate of update `step` (counted from 1)."""
        if not self.total:
            return noam_lr(step, self.d_model, self.warmup_steps, self.scale)
        if step <= self.start:  # only `start` itself is asked: its rate was already in use
            return self.start_lr
        warmup = self.warmup
        if step <= warmup:  # from (start, start_lr) up to (warmup, peak)
            rise = (self.peak - self.start_lr) * (step - self.start) / (warmup - self.start)
            return self.start_lr + rise
        # The peak (or, for a plan made after its warmup would have ended, the rate it was made
        # at) until the last decay_fraction of the plan, then down to zero after its last update.
        top_step, top = (warmup, self.peak) if warmup > self.start else (self.start, self.start_lr)
        decay_from = max(self.total - round(self.decay_fraction * self.total), top_step)
        if step <= decay_from:
            return top
        return top * max(self.total + 1 - step, 0) / (self.total + 1 - decay_from)

    def __call__(self, epoch: int) -> float:  # LambdaLR's argument: updates done so far
        return self.lr(epoch + 1)


def build_optimizer(
    model: torch.nn.Module, model_cfg: ModelConfig, cfg: OptimConfig, fused: bool = False
) -> tuple[torch.optim.Adam, torch.optim.lr_scheduler.LambdaLR]:
    """Adam(β1, β2, ε) and a LambdaLR whose factor is the absolute learning rate (base lr 1).

    LambdaLR evaluates its function at 0 before the first update, so update k (1-based) uses
    noam_lr(k) through `epoch + 1`.
    """
    optimizer = torch.optim.Adam(
        model.parameters(), lr=1.0, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None
    )
    if cfg.schedule == "budget":
        schedule = BudgetSchedule(model_cfg, cfg)
    else:
        schedule = functools.partial(
            _noam_factor, d_model=model_cfg.d_model, warmup=cfg.warmup_steps, scale=cfg.lr_scale
        )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def budget_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR) -> BudgetSchedule | None:
    """The plan inside a scheduler of build_optimizer (optim.schedule=budget), or None."""
    schedule = scheduler.lr_lambdas[0]
    return schedule if isinstance(schedule, BudgetSchedule) else None


def _noam_factor(epoch: int, d_model: int, warmup: int, scale: float) -> float:
    return noam_lr(epoch + 1, d_model=d_model, warmup_steps=warmup, scale=scale)


def step_budget(max_steps: int, max_epochs: int, updates_per_epoch: int) -> int:
    """The updates the step and epoch budgets allow (the smaller), 0 when neither is set."""
    budgets = [max_steps] if max_steps else []
    if max_epochs:
        budgets.append(max_epochs * updates_per_epoch)
    return min(budgets, default=0)


def time_plan(
    schedule: BudgetSchedule, budget_s: float, elapsed_s: float, steps: int, rate: float
) -> int:
    """The updates of a time budget: those done plus the measured rate × the time left, within
    the step budget. Validation and checkpoints take part of the time left; a run the clock stops
    first ends in the last few percent of its decay, where the rate is near zero."""
    planned = steps + max(int(rate * (budget_s - elapsed_s)), 1)
    return min(planned, schedule.steps_budget) if schedule.steps_budget else planned


def measuring(schedule: BudgetSchedule, budget_s: float, elapsed_s: float) -> bool:
    """Whether a time budget's rate is still being measured: over its first 5 % (half the warmup
    when that is shorter), so that the plan is made during the warmup."""
    return elapsed_s < min(0.05, schedule.fraction / 2) * budget_s
