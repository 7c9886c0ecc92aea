"""Write a run with this tmt, and what this tmt translates with it, as a test fixture.

Later versions must load a run an earlier tmt wrote and translate exactly as it did
(tests/test_compat.py). Run this once per release whose files changed shape, from the repository
root, with the version to be kept installed:

    python scripts/compat_fixture.py tests/fixtures/run_v0.2.0

It trains configs/tiny.yaml (no dropout) for 200 updates on the bundled Multi30k (de→en) with the
command line, then records the command line's output for the first 20 sentences of
test_2016_flickr: beam 2 (the config's), greedy, and 2-best lists with their scores, in
<run>.golden.json beside the run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
from pathlib import Path

from transformer_mt import __version__

REPO = Path(__file__).resolve().parent.parent
SENTENCES = 20


def tmt(*args: str, stdin: str = "") -> str:
    done = subprocess.run(
        [sys.executable, "-m", "transformer_mt", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if done.returncode != 0:  # tmt's own one-line error (or its traceback), and its exit code
        sys.stderr.write(done.stderr)
        sys.exit(done.returncode)
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the run directory to write (must not exist)")
    run = parser.parse_args().run
    if run.exists():
        sys.exit(f"{run}: exists (this script writes a new run)")
    sets = {
        "train.out_dir": str(run),
        "train.max_steps": "200",
        "train.keep_last": "1",
        "train.save_every": "200",
        "train.valid_every": "200",
        "model.dropout": "0.0",
    }
    overrides = [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    tmt("train", "--config", "configs/tiny.yaml", *overrides)
    with gzip.open(REPO / "transformer_mt/multi30k/test_2016_flickr.de.gz", "rt") as lines:
        inputs = [next(lines).rstrip("\n") for _ in range(SENTENCES)]
    text = "".join(line + "\n" for line in inputs)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    golden = {
        "written_by": f"tmt {__version__} at commit {commit}",
        "inputs": inputs,
        "beam2": tmt("translate", "-m", str(run), stdin=text).splitlines(),
        "greedy": tmt("translate", "-m", str(run), "--beam", "1", stdin=text).splitlines(),
        "nbest2": tmt("translate", "-m", str(run), "--nbest", "2", stdin=text).splitlines(),
    }
    out = run.with_name(run.name + ".golden.json")
    out.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {run} and {out}")


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    run_script(main)
