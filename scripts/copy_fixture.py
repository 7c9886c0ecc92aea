"""Keep the copy model of tests/test_alignment.py as a test fixture: tests/fixtures/copy_model.

The alignment tests need a model that copies its input (so that word i aligns to word i); training
one took 35 s of every test run, and its alignments moved with the machine's thread count. The
recipe stays in the test module (train_copy_model); this script runs it once and keeps the final
weights as a self-contained model directory (tmt average of the last checkpoint: weights, config
and tokenizer, no optimizer state). Run it from the repository root when the recipe changes:

    python scripts/copy_fixture.py            # replaces tests/fixtures/copy_model
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    # No options; --help says what it does, before anything is written.
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    import test_alignment  # the recipe, in one place

    from transformer_mt.runs import averaging

    out = test_alignment.COPY_MODEL
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = test_alignment.train_copy_model(Path(tmp))
        kept = Path(tmp) / "copy_model"
        print(averaging.average_into([run_dir], kept, last=1))
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(kept, out)
    print(f"{out}: {sum(f.stat().st_size for f in out.iterdir()):,} bytes")


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    run_script(main)
