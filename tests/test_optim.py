"""Adam + Noam: the paper's formula at a few steps, the peak, the shape, the scheduler wiring; the
schedule planned for a budget: its shape, a plan made mid-warmup, its state through a resume."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from transformer_mt.config import ModelConfig, OptimConfig
from transformer_mt.training.optim import (
    BudgetSchedule,
    build_optimizer,
    measuring,
    noam_lr,
    peak_lr,
    time_plan,
)


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (1, 512**-0.5 * 4000**-1.5),  # 1.7469e-07
        (2000, 512**-0.5 * 2000 * 4000**-1.5),
        (4000, 512**-0.5 * 4000**-0.5),  # the peak, 6.9877e-04
        (16000, 512**-0.5 * 16000**-0.5),
        (100000, 1.3975e-04),
    ],
)
def test_noam_values(step: int, expected: float) -> None:
    assert noam_lr(step, 512, 4000) == pytest.approx(expected, rel=1e-4)


def test_step_zero_is_safe_and_scale_multiplies() -> None:
    assert noam_lr(0, 512, 4000) == noam_lr(1, 512, 4000)
    assert noam_lr(300, 256, 100, scale=2.0) == pytest.approx(2 * noam_lr(300, 256, 100))


def test_peak_is_at_warmup() -> None:
    assert peak_lr(ModelConfig(), OptimConfig()) == pytest.approx(6.9877e-4, rel=1e-4)
    values = [noam_lr(s, 512, 4000) for s in range(1, 20000, 7)]
    assert max(values) == pytest.approx(noam_lr(4000, 512, 4000), rel=1e-3)


@given(step=st.integers(1, 50_000), warmup=st.integers(1, 10_000))
def test_increasing_before_warmup_decreasing_after(step: int, warmup: int) -> None:
    if step < warmup:
        assert noam_lr(step + 1, 512, warmup) > noam_lr(step, 512, warmup)
    else:
        assert noam_lr(step + 1, 512, warmup) < noam_lr(step, 512, warmup)


def test_update_k_uses_noam_k_and_adam_hyperparameters() -> None:
    model = torch.nn.Linear(3, 3)
    optimizer, scheduler = build_optimizer(
        model.parameters(), ModelConfig(d_model=64), OptimConfig(warmup_steps=10)
    )
    group = optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9
    for k in range(1, 25):
        assert group["lr"] == pytest.approx(noam_lr(k, 64, 10))
        model(torch.randn(2, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def budget(fraction: float = 0.1, total: int = 0, decay: float = 0.2) -> BudgetSchedule:
    schedule = BudgetSchedule(
        ModelConfig(d_model=128),
        OptimConfig(lr_scale=2.0, warmup_steps=800, warmup_fraction=fraction, decay_fraction=decay),
    )
    if total:
        schedule.plan(total, after=0)
    return schedule


def test_budget_schedule_warms_up_to_the_papers_peak_holds_it_then_decays_to_zero() -> None:
    schedule = budget(total=630)
    peak = 2 * 128**-0.5 * 800**-0.5  # the preset's Noam peak, ≈ 0.0063
    assert schedule.warmup == 63
    rates = [schedule.lr(k) for k in range(1, 640)]
    assert rates[0] == pytest.approx(peak / 63) and rates[62] == pytest.approx(peak)
    assert all(a < b for a, b in itertools.pairwise(rates[:63]))  # linear warmup
    assert rates[62:504] == [rates[62]] * 442  # the peak, held up to 630 - 126
    steps = [b - a for a, b in itertools.pairwise(rates[503:630])]
    assert all(s < 0 for s in steps) and max(steps) == pytest.approx(min(steps))  # linear decay
    assert rates[629] == pytest.approx(peak / 127)  # the last update still learns a little
    assert rates[630:] == [0.0] * 9  # past the plan: nothing
    # decay_fraction 1 - warmup_fraction: a linear decay all the way from the peak
    linear = [budget(total=630, decay=0.9).lr(k) for k in range(63, 631)]
    steps = [b - a for a, b in itertools.pairwise(linear)]
    assert linear[0] == pytest.approx(peak) and max(steps) == pytest.approx(min(steps))
    assert max(steps) < 0


def test_by_default_the_budget_schedule_warms_up_as_the_paper_and_fits_its_decay() -> None:
    peak = 2 * 128**-0.5 * 800**-0.5
    # A long budget: the paper's ramp to its peak at warmup_steps, held to 2,100 - 420, then down.
    long = budget(fraction=0.0, total=2100)
    rates = [long.lr(k) for k in range(1, 2102)]
    assert long.warmup == 800
    assert rates[:800] == pytest.approx([noam_lr(k, 128, 800, 2.0) for k in range(1, 801)])
    assert rates[799:1680] == [peak] * 881 and rates[1680] < peak and rates[2100] == 0.0
    # A budget shorter than the paper's warmup: the same peak, reached at 630 - 126 so that the
    # decay keeps its fifth of the plan.
    short = budget(fraction=0.0, total=630)
    rates = [short.lr(k) for k in range(1, 632)]
    assert short.warmup == 504 and rates[503] == pytest.approx(peak) and max(rates) == rates[503]
    assert all(a < b for a, b in itertools.pairwise(rates[:504]))
    assert all(a > b for a, b in itertools.pairwise(rates[503:631])) and rates[630] == 0.0
    assert budget(fraction=0.0, total=1).lr(1) > 0  # the smallest plan still learns


def test_a_time_budget_is_planned_within_half_the_warmup() -> None:
    paper = budget(fraction=0.0)  # warmup_steps 800: measured over 5 % and under 400 updates
    assert measuring(paper, budget_s=600, elapsed_s=29, step=399)
    assert not measuring(paper, budget_s=600, elapsed_s=29, step=400)
    assert not measuring(paper, budget_s=600, elapsed_s=30, step=10)
    tenth = budget(fraction=0.04)  # warmup over 4 % of the time: measured over its first half
    assert measuring(tenth, budget_s=600, elapsed_s=11, step=10_000)
    assert not measuring(tenth, budget_s=600, elapsed_s=12, step=1)


@given(
    after=st.integers(1, 400),
    more=st.integers(1, 5000),
    fraction=st.one_of(st.just(0.0), st.floats(0.01, 0.5)),
)
def test_a_plan_made_mid_run_continues_from_the_rate_in_use(
    after: int, more: int, fraction: float
) -> None:
    # A time budget is planned once its rate is measured: until then the paper's ramp; the plan
    # starts from the rate of the update it is made at, so nothing jumps.
    schedule = budget(fraction)
    before = [schedule.lr(k) for k in range(1, after + 1)]
    assert before == [noam_lr(k, 128, 800, 2.0) for k in range(1, after + 1)]
    total = after + more
    schedule.plan(total, after=after)
    assert schedule.lr(after) == before[-1]
    rates = [schedule.lr(k) for k in range(after, total + 2)]
    rising = schedule.warmup > after
    top = max(rates)
    if rising:
        assert top == pytest.approx(schedule.peak)
        assert rates[1] - rates[0] < schedule.peak / (schedule.warmup - after) + 1e-12
    else:  # a plan made after its warmup would have ended decays from the rate in use
        assert top == before[-1]
    assert rates[-1] == 0.0 and all(r >= 0 for r in rates)


@given(
    total=st.integers(50, 3000),
    into=st.floats(0.0, 1.5),
    more=st.integers(1, 5000),
    fraction=st.one_of(st.just(0.0), st.floats(0.01, 0.5)),
)
def test_a_longer_plan_made_in_the_decay_warms_up_again_to_the_peak(
    total: int, into: float, more: int, fraction: float
) -> None:
    """A resume with a larger budget after the decay began (at the end of a plan the rate is
    0): back to the peak over a tenth of the updates added (warmup_steps at most), from the
    rate in use, then the plan's hold and decay to zero."""
    schedule = budget(fraction, total=total)
    decay_start = schedule.decay_start
    after = min(decay_start + 1 + round(into * (total - decay_start)), total + 10)
    before, longer = schedule.lr(after), max(after, total) + more
    schedule.plan(longer, after=after)
    rates = [schedule.lr(k) for k in range(after, longer + 2)]
    assert rates[0] == before  # nothing jumps
    assert schedule.warmup == after + max(1, min(800, (longer - after) // 10))
    assert max(rates) == pytest.approx(schedule.peak) and rates[-1] == 0.0
    assert all(b >= a for a, b in itertools.pairwise(rates[: schedule.warmup - after + 1]))
    # Planned again on the way back up (the time budget's next plan): the peak is still reached.
    if schedule.warmup > after + 1:
        midway = after + 1
        schedule.plan(longer + 7, after=midway)
        top = max(schedule.lr(k) for k in range(midway, longer + 9))
        assert top == pytest.approx(schedule.peak)


def test_a_timed_plan_is_made_again_when_a_resume_changes_the_time_budget() -> None:
    schedule = budget()
    schedule.plan(500, after=40)
    schedule.timed, schedule.retimed, schedule.steps_budget = True, True, 2000
    assert not schedule.rebudget(600.0, 600.0)  # the same budget: the plan holds
    assert schedule.timed and schedule.total == 500
    assert schedule.rebudget(600.0, 900.0)  # longer: timed again from the rate measured
    assert not schedule.timed and not schedule.retimed and schedule.steps_budget == 0
    assert schedule.fit_steps(2000, after=500) and schedule.total == 2000  # the step budget's
    assert not schedule.rebudget(900.0, 0.0)  # an untimed plan has nothing to make again


def test_the_plan_travels_in_the_schedulers_state() -> None:
    model = torch.nn.Linear(3, 3)
    cfg = OptimConfig(schedule="budget", warmup_steps=10)
    scheduler = build_optimizer(model.parameters(), ModelConfig(d_model=64), cfg)[1]
    schedule = scheduler.lr_lambdas[0]
    schedule.plan(50, after=3)
    schedule.timed, schedule.steps_budget = True, 80
    state = scheduler.state_dict()
    restored = build_optimizer(model.parameters(), ModelConfig(d_model=64), cfg)[1]
    restored.load_state_dict(state)
    plan = restored.lr_lambdas[0]
    assert vars(plan) == vars(schedule) and plan.lr(20) == schedule.lr(20)
    # ... plain values only: train_state.pt is read with weights_only=True
    assert all(isinstance(v, int | float | bool) for v in state["lr_lambdas"][0].values())


def test_a_time_plan_is_the_measured_rate_times_the_time_left_within_the_step_budget() -> None:
    schedule = budget()
    assert time_plan(schedule, budget_s=600, elapsed_s=30, steps=60, rate=2.0) == 60 + 1140
    schedule.steps_budget = 1000
    assert time_plan(schedule, budget_s=600, elapsed_s=30, steps=60, rate=2.0) == 1000
