"""`tmt train --dry-run`: everything before the first step, reported, and nothing written.

The resolved config, what each filter removed from each split, the training corpora (pairs and
tokens kept, weight, tag, and the mixture the first epoch actually draws), the vocabulary, the
parameter count, the batches of the first epoch and their padding efficiency: dry_run returns
them, format_report writes them for people (tmt train --dry-run --json prints the figures as JSON).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transformer_mt import run
from transformer_mt.config import Config, to_yaml
from transformer_mt.data import PreparedData, TokenBucketSampler, padding_efficiency, prepare_data
from transformer_mt.model import Transformer, count_parameters


def dry_run(cfg: Config) -> dict[str, Any]:
    """Prepare the data (filling the caches) and the model; the figures of the report. With
    train.init_from, the model is checked and its tokenizer used, as training would."""
    parent = run.init_model(cfg) if cfg.train.init_from else None
    data = prepare_data(cfg, parent.tokenizer if parent else None)
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
        "corpora": corpus_report(data, sampler),
    }
    return summary


def format_report(summary: dict[str, Any], cfg: Config) -> str:
    """The dry run for people: the resolved config, then the data, corpora, model and batches."""
    lines = ["# resolved config", to_yaml(cfg).rstrip("\n"), "# data"]
    for key, counts in summary["filters"].items():
        lines.append(f"data.{key}: " + ", ".join(f"{name} {n}" for name, n in counts.items()))
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
        f"batches per epoch: {summary['batches']} (max_tokens {cfg.data.max_tokens})",
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
