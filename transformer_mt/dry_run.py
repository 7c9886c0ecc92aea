"""`tmt train --dry-run`: everything before the first step, reported, and nothing written.

The resolved config, what each filter removed from each split, the vocabulary, the parameter count,
the batches of the first epoch and their padding efficiency; the last line is the same as JSON.
"""

from __future__ import annotations

import json
from typing import Any

from transformer_mt.config import Config, to_yaml
from transformer_mt.data import padding_efficiency, prepare_data
from transformer_mt.model import Transformer, count_parameters


def dry_run(cfg: Config) -> dict[str, Any]:
    """Prepare the data (filling the caches) and the model; print the report; return it."""
    data = prepare_data(cfg)
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
    }
    print("# resolved config")
    print(to_yaml(cfg), end="")
    print("# data")
    for key, counts in data.counts.items():
        print(f"{key}: " + ", ".join(f"{name} {n}" for name, n in counts.as_dict().items()))
    print(f"vocab_size: {summary['vocab_size']}")
    print(f"parameters: {summary['parameters']:,}")
    print(f"batches per epoch: {summary['batches']} (max_tokens {cfg.data.max_tokens})")
    print(f"padding efficiency: {summary['padding_efficiency']:.4f}")
    print(json.dumps(summary))
    return summary
