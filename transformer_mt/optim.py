"""Adam with the paper's warmup-then-inverse-square-root learning rate (§5.3)."""

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
    schedule = functools.partial(
        _noam_factor, d_model=model_cfg.d_model, warmup=cfg.warmup_steps, scale=cfg.lr_scale
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def _noam_factor(epoch: int, d_model: int, warmup: int, scale: float) -> float:
    return noam_lr(epoch + 1, d_model=d_model, warmup_steps=warmup, scale=scale)
