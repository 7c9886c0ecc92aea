"""Batch shapes an epoch meets, with exact lengths and with bounded shapes (data.bucketing), and
what the bounding costs in padding: the bundled Multi30k (the default recipe's tokenizer,
tests/fixtures/multi30k_lengths.npz) and WMT-length corpora of 100,000 and 1,000,000 pairs
(tests/test_sampler.py's wmt_lengths), at 4,096, 16,384 and 25,000 tokens a batch.

    python scripts/bench_shapes.py

A GPU pays for each shape the first time it meets it (cuDNN's attention plans, CUDA graphs,
compiled kernels); a CPU pays for each padding token. Seconds: planning one epoch (the sampler's
packing), on this machine. The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    # No options; --help says what it does, before anything is written.
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    from test_sampler import multi30k_lengths, wmt_lengths

    from transformer_mt.data.sampler import ShapeBuckets, TokenBucketSampler, padding_efficiency

    corpora = {
        "multi30k": multi30k_lengths(),
        "wmt_100k": wmt_lengths(),
        "wmt_1m": wmt_lengths(1_000_000),
    }
    rows = []
    for name, (src, tgt) in corpora.items():
        for max_tokens in (4096, 16384, 25000):
            row = {"corpus": name, "pairs": len(src), "max_tokens": max_tokens}
            for mode, shapes in (("exact", None), ("bucketed", ShapeBuckets())):
                start = time.perf_counter()
                sampler = TokenBucketSampler(src, tgt, max_tokens, seed=1, shapes=shapes)
                batches = sampler.epoch_batches(0)
                seconds = time.perf_counter() - start
                padded = sampler.padded_lengths(0)
                row[mode] = {
                    "batches": len(batches),
                    "shapes": len(sampler.epoch_shapes(0)),
                    "padding_efficiency": round(padding_efficiency(batches, src, tgt, padded), 4),
                    "seconds": round(seconds, 2),
                }
            rows.append(row)
            e, b = row["exact"], row["bucketed"]
            print(
                f"{name:<9} {max_tokens:>6} tokens: exact {e['batches']:>5} batches"
                f" {e['shapes']:>5} shapes eff {e['padding_efficiency']:.3f} |"
                f" bucketed {b['batches']:>5} batches {b['shapes']:>4} shapes"
                f" eff {b['padding_efficiency']:.3f} ({b['seconds']:.2f} s)",
                flush=True,
            )
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    run_script(main)
