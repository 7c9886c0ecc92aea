"""Adam + Noam: the paper's formula at a few steps, the peak, the shape, the scheduler wiring."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from transformer_mt.config import ModelConfig, OptimConfig
from transformer_mt.optim import build_optimizer, noam_lr, peak_lr


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
        model, ModelConfig(d_model=64), OptimConfig(warmup_steps=10)
    )
    group = optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9
    for k in range(1, 25):
        assert group["lr"] == pytest.approx(noam_lr(k, 64, 10))
        model(torch.randn(2, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
