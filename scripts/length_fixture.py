"""Keep the subword lengths of the bundled Multi30k training split as a test fixture:
tests/fixtures/multi30k_lengths.npz (the default recipe's 8,000-piece tokenizer, configs/multi30k).

The sampler's shape-budget tests (tests/test_sampler.py) batch the real corpus's lengths at GPU
batch sizes; encoding it takes a tokenizer trained on 58,000 sentences, too slow for every test
run, and nothing else of the corpus matters to them. Run it from the repository root when the
recipe's tokenizer or filters change:

    python scripts/length_fixture.py          # replaces tests/fixtures/multi30k_lengths.npz
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "multi30k_lengths.npz"


def main() -> None:
    # No options; --help says what it does, before anything is written.
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    from transformer_mt.config import load_config
    from transformer_mt.data.batches import prepare_data

    with tempfile.TemporaryDirectory() as cache:
        data = prepare_data(load_config("multi30k", [f"data.cache_dir={cache}"]))
    # +1: the eos of a source and the bos (or eos) of a target, as the sampler counts them.
    source = (data.train.src_lengths + 1).astype(np.uint16)
    target = (data.train.tgt_lengths + 1).astype(np.uint16)
    np.savez_compressed(FIXTURE, source=source, target=target)
    print(f"{FIXTURE}: {len(source)} pairs, {FIXTURE.stat().st_size:,} bytes")


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    run_script(main)
