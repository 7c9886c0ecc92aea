"""`tmt train --dry-run`: everything before the first step, reported, and nothing written.

The checks training makes before it writes anything (check_before_training: where the run goes,
whether the model fits in memory), the resolved config, what each filter removed from each split,
the training corpora (pairs and tokens kept, weight, tag, and the mixture the first epoch actually
draws), the vocabulary, the parameter count and the memory they take, the batches of the first
epoch and their padding efficiency: dry_run returns them, format_report writes them for people
(tmt train --dry-run --json prints the figures as JSON).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from transformer_mt.common import distributed, textio
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, to_yaml
from transformer_mt.data.batches import PreparedData, SubwordSampling, prepare_data
from transformer_mt.data.sampler import TokenBucketSampler, padding_efficiency
from transformer_mt.network import kernels
from transformer_mt.network.model import parameter_count
from transformer_mt.runs import run
from transformer_mt.training import device_defaults


def training_bytes(cfg: Config, vocab_size: int, source_vocab_size: int | None = None) -> int:
    """What training keeps in memory besides its batches: the weights, their gradients and Adam's
    two moments (four fp32 copies, whatever autocast's train.precision; bf16_weights: bf16
    weights and gradients beside float32 masters, their gradients and the moments), and the
    sinusoid table."""
    positions = cfg.model.max_positions * cfg.model.d_model
    copies = 5 if cfg.train.precision == "bf16_weights" else 4  # 2 + 2 + 4 · 4 bytes: 20 = 4 · 5
    return 4 * (copies * parameter_count(cfg.model, vocab_size, source_vocab_size) + positions)


def check_before_training(
    cfg: Config, device: torch.device, vocab_size: int = 0, world_size: int = 1
) -> None:
    """What training checks before it writes anything: that it may write into train.out_dir, that
    the budget schedule's shares fit in its budget, that CUDA graphs are asked for what they can
    do (_check_graphs), and that the model fits in the device's free memory (vocab_size: the
    tokenizer's when known, else tokenizer.vocab_size), refused in one line naming the size and
    the memory there is."""
    textio.check_directory(Path(cfg.train.out_dir), "train.out_dir")
    optim = cfg.optim
    if optim.schedule == "budget" and optim.warmup_fraction + optim.decay_fraction > 1:
        # Checked for training, not in Config: a checkpoint that holds such a config still loads.
        raise TmtError(
            f"optim.warmup_fraction {optim.warmup_fraction:g} + optim.decay_fraction"
            f" {optim.decay_fraction:g} > 1: the warmup and the decay are shares of one budget"
        )
    _check_graphs(cfg, device, world_size)
    kernels.check_bf16("train.precision", cfg.train.precision, device)
    vocab = vocab_size or cfg.tokenizer.vocab_size
    what = f"training a model of {parameter_count(cfg.model, vocab):,} parameters (model.*)"
    distributed.check_room(training_bytes(cfg, vocab), device, what)


def _check_graphs(cfg: Config, device: torch.device, world_size: int) -> None:
    """CUDA graphs, torch.compile's (train.compile_mode) or tmt's own (train.cuda_graphs), only
    for what they can record: refused on CUDA, where they are made, in one line naming the keys;
    a CPU records none and trains as ever."""
    if device.type != "cuda":
        return
    train = cfg.train
    mode = train.compile_mode
    if train.compile == "on" and mode in device_defaults.GRAPHED_MODES and train.update_freq > 1:
        # Measured on an H200 (docs/benchmarks.md): the backward of the second micro-batch read
        # graph outputs the replay had overwritten (PyTorch issue 169545: CUDA graph trees and
        # accumulated gradients).
        raise TmtError(
            f"train.compile_mode={mode} with train.update_freq {train.update_freq}:"
            " CUDA graphs do not accumulate gradients over micro-batches in this PyTorch; set"
            " train.update_freq=1 (and data.max_tokens larger) or another train.compile_mode"
        )
    if train.cuda_graphs != "on":
        return
    why = (
        "train.compile=on (its own graphs or code: one or the other)" if train.compile == "on"
        else "train.precision=fp16 (its loss scaler)" if train.precision == "fp16"
        else f"{world_size} ranks and train.grad_sync=overlapped (DDP all-reduces inside the"
             " backward)" if world_size > 1 and device_defaults.grad_sync(cfg) == "overlapped"
        else None
    )  # fmt: skip
    if why:
        raise TmtError(f"train.cuda_graphs=on cannot record a step with {why}; set one of them"
                       " otherwise, or train.cuda_graphs=off")  # fmt: skip


def check_prepared(cfg: Config, data: PreparedData, world_size: int) -> SubwordSampling | None:
    """What training refuses once its data is prepared, before it writes anything (the dry run
    refuses the same): a validation split too small for its ranks, BPE-dropout
    (data.subword_alpha) on a tokenizer that is no BPE. Returns the BPE-dropout sampling."""
    if (cfg.train.valid_every or cfg.train.bleu_every) and len(data.valid) < world_size:
        counts = data.counts["data.valid"]
        raise TmtError(
            f"data.valid ({cfg.data.valid}): {len(data.valid)} pairs after filtering"
            f" ({counts.read} read), fewer than the {world_size} rank(s) that validate:"
            " validation, the best checkpoint and early stopping need it; fix the split, or set"
            " train.valid_every=0 and train.bleu_every=0 to train without them"
        )
    return SubwordSampling.of(cfg, data.tokenizer)


def dry_run(cfg: Config) -> dict[str, Any]:
    """Prepare the data (filling the caches) and size the model; the figures of the report. With
    train.init_from, the model is checked and its tokenizer used, as training would."""
    device = distributed.resolve_device(cfg.train.device, key="train.device")
    check_before_training(cfg, device)  # before the data cache is written
    parent = run.init_model(cfg) if cfg.train.init_from else None
    data = prepare_data(cfg, parent.tokenizer if parent else None)
    check_prepared(cfg, data, world_size=1)
    cfg = device_defaults.resolve(cfg, device, world_size=1)  # as a new run on this device
    sampler = data.train.sampler(
        cfg.data.max_tokens, cfg.train.seed, shapes=device_defaults.shape_buckets(cfg)
    )
    batches = sampler.epoch_batches(0)
    efficiency = padding_efficiency(batches, *sampler.epoch_lengths(0), sampler.padded_lengths(0))
    vocab = data.tokenizer.vocab_size, data.tokenizer.source_vocab_size
    summary = {
        "pairs": len(data.train),
        "valid_pairs": len(data.valid),
        "vocab_size": vocab[0],
        "parameters": parameter_count(cfg.model, *vocab),
        "training_bytes": training_bytes(cfg, *vocab),
        "device": str(device),
        "free_bytes": distributed.free_memory(device),
        "batches": len(batches),
        "max_tokens": cfg.data.max_tokens,
        "bucketing": cfg.data.bucketing,
        "batch_shapes": len(sampler.epoch_shapes(0)),
        "padding_efficiency": round(efficiency, 4),
        "filters": {key.removeprefix("data."): c.as_dict() for key, c in data.counts.items()},
        "cleaned": {key.removeprefix("data."): c for key, c in data.cleaned.items()},
        "corpora": corpus_report(data, sampler),
    }
    return summary


def format_report(summary: dict[str, Any], cfg: Config) -> str:
    """The dry run for people: the resolved config (with what it leaves to the device chosen),
    then the data, corpora, model and batches."""
    chosen = {"max_tokens": summary["max_tokens"], "bucketing": summary["bucketing"]}
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **chosen))
    lines = ["# resolved config", to_yaml(cfg).rstrip("\n"), "# data"]
    for key, counts in summary["filters"].items():
        lines.append(f"data.{key}: " + ", ".join(f"{name} {n}" for name, n in counts.items()))
    for key, removed in summary["cleaned"].items():  # data.clean: each filter's share
        lines.append(f"data.{key} data.clean: " + ", ".join(f"{n} {c}" for n, c in removed.items()))
    lines.append("# training corpora (epoch 0 draws these pairs from each)")
    for row in summary["corpora"]:
        tag = f", tag {row['tag']}" if row["tag"] else ""
        lines.append(
            f"{row['key']}: {row['pairs']} pairs, {row['src_tokens']} + {row['tgt_tokens']}"
            f" tokens, weight {row['weight']:g}{tag}; drawn {row['drawn']}"
            f" ({100 * row['share']:.1f}% of the epoch, {row['passes']:.2f} passes)"
            f" [{row['origin']}]"
        )
    lines += [
        f"vocab_size: {summary['vocab_size']}",
        f"parameters: {summary['parameters']:,}",
        f"memory: {summary['training_bytes'] / 2**30:,.2f} GiB to train (weights, gradients,"
        f" Adam's moments), {summary['free_bytes'] / 2**30:,.1f} GiB free on {summary['device']}",
        f"batches per epoch: {summary['batches']} (max_tokens {cfg.data.max_tokens}),"
        f" {summary['batch_shapes']} shapes (data.bucketing={cfg.data.bucketing})",
        f"padding efficiency: {summary['padding_efficiency']:.4f}",
    ]
    return "\n".join(lines)


def corpus_report(data: PreparedData, sampler: TokenBucketSampler) -> list[dict[str, Any]]:
    """Per training corpus: pairs and subword tokens kept, weight, tag, and how many pairs
    epoch 0 draws from it (its share of the epoch, and passes over its pairs)."""
    train, drawn = data.train, sampler.epoch_draw(0)
    groups = train.groups if train.groups is not None else np.zeros(len(train), dtype=np.int64)
    drawn_per = np.bincount(groups[drawn], minlength=len(data.corpora))
    rows = []
    for index, split in enumerate(data.corpora):
        mine = groups == index
        pairs = int(mine.sum())
        rows.append(
            {
                "key": split.key,
                "origin": split.origin,
                "weight": split.weight,
                "tag": split.tag,
                "pairs": pairs,
                "src_tokens": int(train.src_lengths[mine].sum()),
                "tgt_tokens": int(train.tgt_lengths[mine].sum()),
                "drawn": int(drawn_per[index]),
                "share": round(float(drawn_per[index] / len(drawn)), 4),
                "passes": round(float(drawn_per[index] / pairs), 4),
            }
        )
    return rows
