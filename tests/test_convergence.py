"""Slow: the whole pipeline learns a task: reversing word order reaches BLEU > 90 (Sockeye-style)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import reverse_pairs, write_parallel

from transformer_mt.config import load_config
from transformer_mt.training.train import train
from transformer_mt.translation import evaluate, translate


@pytest.mark.slow
def test_reverse_task_reaches_bleu_90(tmp_path: Path) -> None:
    train_prefix = write_parallel(tmp_path / "train", reverse_pairs(6000, seed=11))
    valid_prefix = write_parallel(tmp_path / "valid", reverse_pairs(200, seed=12))
    test_prefix = write_parallel(tmp_path / "test", reverse_pairs(200, seed=13))
    cfg = load_config(
        "tiny",
        [
            "data.source=files", f"data.train={train_prefix}", f"data.valid={valid_prefix}", f"data.test={test_prefix}",
            "data.max_tokens=2048", "tokenizer.vocab_size=400", "tokenizer.byte_fallback=false",
            "model.d_model=64", "model.d_ff=256", "model.n_heads=4", "model.dropout=0.0",
            "optim.warmup_steps=300", "optim.lr_scale=2.0",
            "train.max_steps=1500", "train.valid_every=500", "train.save_every=500", "train.log_every=100",
            f"train.out_dir={tmp_path / 'run'}", "decode.beam_size=4",
        ],
    )  # fmt: skip
    train(cfg)
    report = evaluate.evaluate(translate.load_translator(tmp_path / "run"), split="test")
    assert report["bleu"] > 90, report
