"""Adam with the paper's warmup-then-inverse-square-root learning rate (§5.3), or a schedule that
fits the run's budget (optim.schedule=budget)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

import torch

from transformer_mt.config import Config, ModelConfig, OptimConfig

logger = logging.getLogger(__name__)

# How far a time budget's plan must move before it is made again, or before a longer one
# postpones the decay: at 10 % a steady run re-planned at almost every window, as a validation
# or a checkpoint fell in it or not.
PLAN_MOVE = 0.15


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
    """optim.schedule=budget: warmup-stable-decay (Hägele et al., 2024; MiniCPM's WSD) fitted to
    the run's planned updates. The paper's linear warmup to its peak (lr_scale · d_model^-0.5 ·
    warmup_steps^-0.5) over warmup_steps, or over the first 1 - decay_fraction of a shorter plan
    (the same peak, reached sooner), the peak held, and a linear decay to zero over the last
    decay_fraction of the plan. optim.warmup_fraction > 0 warms up over that fraction of the plan
    instead; decay_fraction 1 - warmup_fraction is a linear decay from the peak (fairseq's
    polynomial_decay, HF's linear). Before a plan exists (a time budget whose update rate is
    being measured), the ramp is the paper's; a plan made at update k0 continues from the rate
    of k0 to the peak, so the learning rate never jumps in warmup.

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
        self.retimed = False  # ... checked again where its decay starts
        self.rewarm = 0  # a longer plan made in its decay: the update it is back at the peak

    def plan(self, total: int, after: int) -> None:
        """Plan `total` updates; updates up to `after` keep the rates they had. A longer plan
        made once the decay began (a resume with a larger budget) warms up again to the peak,
        over a tenth of the updates it adds (warmup_steps at most), rather than holding the
        decayed rate: at the end of a plan that rate is 0."""
        decayed = 0 < self.total < total and after > self.decay_start
        rewarming = self.rewarm > after  # a plan made again on the way back up keeps its peak
        self.start, self.start_lr = after, self.lr(after) if after > 0 else 0.0
        self.total = max(int(total), 1)
        if decayed:
            self.rewarm = after + max(1, min(self.warmup_steps, (self.total - after) // 10))
        elif not rewarming:
            self.rewarm = 0
        self.rewarm = min(self.rewarm, self.total)

    @property
    def warmup(self) -> int:
        """The update the peak is reached at. Measured at 630 updates of the Multi30k preset
        (docs/benchmarks.md): a fast warmup to that peak (a tenth of the plan) leaves the run
        behind the paper's schedule; the paper's ramp, with room kept for the decay, ahead."""
        if self.rewarm > self.start:
            return self.rewarm
        if self.fraction:
            return max(round(self.fraction * self.total), 1)
        return max(min(self.warmup_steps, self._decay_from_plan()), 1)

    def _decay_from_plan(self) -> int:
        return self.total - round(self.decay_fraction * self.total)

    @property
    def decay_start(self) -> int:
        """The last update at the peak (or at the rate the plan was made at); the decay follows."""
        top_step = self.warmup if self.warmup > self.start else self.start
        return max(self._decay_from_plan(), top_step)

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
        top = self.peak if warmup > self.start else self.start_lr
        decay_from = self.decay_start
        if step <= decay_from:
            return top
        return top * max(self.total + 1 - step, 0) / (self.total + 1 - decay_from)

    def __call__(self, epoch: int) -> float:  # LambdaLR's argument: updates done so far
        return self.lr(epoch + 1)

    def fit_steps(self, budget: int, after: int) -> bool:
        """Plan the updates of the step and epoch budgets (`step_budget`), again when a resume
        changed them; False when there is none or it is the one planned (a resume keeps its
        plan). A time budget's plan stays within them."""
        if not budget or budget == self.steps_budget:
            return False
        self.steps_budget = budget
        self.plan(min(budget, self.total) if self.timed else budget, after=after)
        return True

    def time_plan_due(
        self, budget_s: float, elapsed_s: float, step: int, since: tuple[int, float], now: float
    ) -> int:
        """A time budget's plan, or 0 when none is due: made once the rate since `since` (step,
        time) is measured; then, until its decay, made again whenever the rate since the last
        plan, measured over a tenth of the budget at least, would end the run more than 15 % of
        the plan sooner or later (less moves with a validation or a checkpoint in the window;
        the first updates can be far slower than the rest: on a GPU every batch shape met for
        the first time costs ~0.3 s, and the first plan, timed on them, left 30 % of a
        96-second budget unused). In the warmup, a plan that grows is made on 20 updates over
        1 % of the budget: the warmup then follows the rate as it rises, where a peak reached on
        the plan of the first, slow updates came at update 250 of 3,400 (a clock profile of
        train.cuda_graphs, tests/test_promises3.py). Once more two updates before its decay
        (agreed during the first, applied from the second, still at the peak) at the rate since
        the last plan, which includes the validations and checkpoints the first measure did not
        see; sooner, when the clock would stop the run before its decay began. After that (and
        in a resumed session) the clock may cut off at most a quarter of the decay, at the rate
        since the plan before that check (the caller keeps its `since`: a validation in the few
        updates after the check would time the rate at a fraction of the real one; 5 updates at
        least), or the plan is made again, shorter: the run ends in its decay, not at its peak,
        even when validations cost more than measured."""
        done = step - since[0]
        if done < 5:
            return 0
        rate = done / max(now - since[1], 1e-9)
        if not self.timed:
            due = not measuring(self, budget_s, elapsed_s, step)
        else:
            reach = step + rate * (budget_s - elapsed_s)  # where the clock would stop the run
            if self.steps_budget:  # or the step budget, sooner
                reach = min(reach, self.steps_budget)
            if not self.retimed:  # the check before the decay, or the clock stops it before
                off = reach < self.decay_start or abs(reach - self.total) > PLAN_MOVE * self.total
                measured = now - since[1] >= 0.1 * budget_s
                warming = (step < self.warmup and reach > self.total and done >= 20
                           and now - since[1] >= 0.01 * budget_s)  # fmt: skip
                due = step + 2 >= self.decay_start or (off and (measured or warming))
            else:  # then the clock may cut off at most a quarter of the decay
                due = reach < self.total - 0.25 * (self.total - self.decay_start)
        return time_plan(self, budget_s, elapsed_s, step, rate) if due else 0

    def continue_with(self, planned: int, after: int) -> tuple[bool, bool]:
        """Continue with rank 0's plan of the time budget from update `after`. A later plan
        whose decay starts now is the check before the decay (retimed): after it, plans only
        shorten. One that moves the decay further off (the rate grew: on a GPU the first
        updates, CUDA's start and every new batch shape, are the slowest; a first plan timed on
        them ended a 96-second budget after 55 s) keeps the run at its peak, planned again as
        the rate moves. Returns (whether this is the first plan, whether the next plan's rate is
        timed from here): not from the check before the decay, since a validation in the few
        updates after it would time the decay's rate at a fraction of the real one and cut the
        run short; time_plan_due's `since` stays the plan's before."""
        first, before, was_due = not self.timed, self.total, after + 2 >= self.decay_start
        self.plan(planned, after=after)
        postponed = planned > (1 + PLAN_MOVE) * before  # a move time_plan_due acts on
        at_decay = not first and (was_due or after + 2 >= self.decay_start) and not postponed
        checking = at_decay and not self.retimed
        self.timed, self.retimed = True, self.retimed or at_decay
        return first, not checking

    def rebudget(self, before_s: float, budget_s: float) -> bool:
        """A resumed session's time budget (seconds, 0: none) against the one of the session
        that saved the plan: when it was removed or changed, a timed plan no longer holds and is
        made again (the step budget's at once, the time budget's once the rate is measured);
        True then."""
        if not self.timed or budget_s == before_s:
            return False
        self.timed = self.retimed = False
        self.steps_budget = 0  # fit_steps plans the step budget again, if there is one
        return True


def rebudget_resumed(
    schedule: BudgetSchedule | None, saved: Config | None, cfg: Config, is_main: bool
) -> None:
    """A resumed run whose time budget changed plans its learning rate again (BudgetSchedule.
    rebudget), saying so on the main rank."""
    if schedule is None or saved is None:
        return
    before, now = saved.train.max_minutes, cfg.train.max_minutes
    if schedule.rebudget(before * 60, now * 60) and is_main:
        logger.info(
            "train.max_minutes %g -> %g: the learning rate planned for %d updates is planned"
            " again", before, now, schedule.total,
        )  # fmt: skip


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    model_cfg: ModelConfig,
    cfg: OptimConfig,
    fused: bool = False,
) -> tuple[torch.optim.Adam, torch.optim.lr_scheduler.LambdaLR]:
    """Adam(β1, β2, ε) over `params` (a model's, or its float32 masters: train.precision=
    bf16_weights) and a LambdaLR whose factor is the absolute learning rate (base lr 1).

    LambdaLR evaluates its function at 0 before the first update, so update k (1-based) uses
    noam_lr(k) through `epoch + 1`.
    """
    optimizer = torch.optim.Adam(
        params, lr=1.0, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None
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
    the step budget. Made early in the run, then once more where its decay would start, at the
    rate since (validation and checkpoints included), so that the decay fits the time left."""
    planned = steps + max(int(rate * (budget_s - elapsed_s)), 1)
    return min(planned, schedule.steps_budget) if schedule.steps_budget else planned


def measuring(schedule: BudgetSchedule, budget_s: float, elapsed_s: float, step: int) -> bool:
    """Whether a time budget's rate is still being measured: over its first 5 %, and no longer
    than half the warmup (of warmup_fraction of the time, or of warmup_steps updates), so that
    the plan is made during the warmup."""
    if schedule.fraction:
        return elapsed_s < min(0.05, schedule.fraction / 2) * budget_s
    return elapsed_s < 0.05 * budget_s and step < schedule.warmup_steps // 2


def warn_if_undecayed(schedule: BudgetSchedule | None, step: int, stop: str) -> None:
    """Say so when the clock stopped a budget schedule before its decay had done its work
    (a plan is made after 5 updates: a budget that holds fewer has none)."""
    if schedule is None or stop != "max_minutes" or step >= schedule.total > 0:
        return
    rate = schedule.lr(step)
    if rate > 0.25 * schedule.peak:
        logger.warning(
            "the clock stopped the run at update %d at learning rate %.3g (%.0f %% of the peak),"
            " before its planned decay (%s): train.max_minutes is too short for a plan to fit, or"
            " the machine slowed down; its checkpoints are not annealed",
            step, rate, 100 * rate / schedule.peak,
            f"to update {schedule.total}" if schedule.total else "none was planned",
        )  # fmt: skip
