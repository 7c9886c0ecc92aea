"""Training runs: the dry run (resolve, load, tokenize, batch, report)."""

from __future__ import annotations

import json
from typing import Any

from transformer_mt.config import Config, to_yaml
from transformer_mt.data import padding_efficiency, prepare_data


def dry_run(cfg: Config) -> dict[str, Any]:
    """Everything before the first step, reported: config, filter counts, vocab, batches."""
    data = prepare_data(cfg)
    sampler = data.train.sampler(cfg.data.max_tokens, cfg.train.seed)
    batches = sampler.epoch_batches(0)
    summary = {
        "pairs": len(data.train),
        "valid_pairs": len(data.valid),
        "vocab_size": data.tokenizer.vocab_size,
        "batches": len(batches),
        "padding_efficiency": round(
            padding_efficiency(batches, sampler.src_lengths, sampler.tgt_lengths), 4
        ),
        "filters": {
            key.removeprefix("data."): counts.as_dict() for key, counts in data.counts.items()
        },
    }
    print("# resolved config")
    print(to_yaml(cfg), end="")
    print("# data")
    for key, counts in data.counts.items():
        print(f"{key}: " + ", ".join(f"{name} {n}" for name, n in counts.as_dict().items()))
    print(f"vocab_size: {summary['vocab_size']}")
    print(f"batches per epoch: {summary['batches']} (max_tokens {cfg.data.max_tokens})")
    print(f"padding efficiency: {summary['padding_efficiency']:.4f}")
    print(json.dumps(summary))
    return summary
