"""CUDA-only paths (bf16/fp16 autocast, fused Adam, TF32, NCCL): skipped on machines without a GPU."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from test_train import records, with_train

from transformer_mt.config import Config
from transformer_mt.training.train import train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_on_cuda(tiny_cfg: Config, tmp_path: Path, precision: str) -> None:
    cfg = with_train(
        tiny_cfg,
        out_dir=str(tmp_path),
        max_steps=6,
        log_every=1,
        precision=precision,
        device="cuda",
    )
    summary = train(cfg)
    losses = [r["loss"] for r in records(tmp_path) if "loss" in r]
    assert summary["step"] == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]


def test_cuda_matches_cpu_in_fp32(tiny_cfg: Config, tmp_path: Path) -> None:
    cfg = dataclasses.replace(tiny_cfg, model=dataclasses.replace(tiny_cfg.model, dropout=0.0))
    cfg = with_train(cfg, max_steps=3, log_every=1, valid_every=0, save_every=0)
    train(with_train(cfg, out_dir=str(tmp_path / "cpu"), device="cpu"))
    train(with_train(cfg, out_dir=str(tmp_path / "cuda"), device="cuda"))
    cpu = [r["loss"] for r in records(tmp_path / "cpu") if "loss" in r]
    gpu = [r["loss"] for r in records(tmp_path / "cuda") if "loss" in r]
    assert cpu == pytest.approx(gpu, rel=1e-3)  # TF32 matmuls: close, not equal
