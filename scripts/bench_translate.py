"""Bulk translation: lines/s of `tmt translate -i FILE -o FILE` on 1 and 2 processes, and the cost
of committing chunks against the streaming path (stdin -> stdout) with the same sort window
(decode.buffer_lines = decode.chunk_lines = 2000) and with its default 256-line window.

    python scripts/bench_translate.py --checkpoint runs/bench_decode_prenorm --lines 20000

Every figure is the wall time of the whole command (model loading included), run one after the
other on a quiet machine. One process uses all threads; two processes (torchrun, gloo) get
threads / 2 each. All three outputs must be byte-identical. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(command: list[str], env: dict[str, str], stdin: Path | None = None,
          stdout: Path | None = None) -> float:  # fmt: skip
    start = time.perf_counter()
    with open(stdin or os.devnull, "rb") as source, open(stdout or os.devnull, "wb") as sink:
        done = subprocess.run(command, stdin=source, stdout=sink, stderr=subprocess.PIPE, env=env)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr.decode()[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="runs/bench_decode_prenorm")
    parser.add_argument("--lines", type=int, default=20_000)
    parser.add_argument("--beam", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    corpus = REPO / "transformer_mt" / "multi30k" / "train.de.gz"
    with gzip.open(corpus, "rt", encoding="utf-8") as handle:
        lines = [line for _, line in zip(range(args.lines), handle, strict=False)]
    tmt = [sys.executable, "-m", "transformer_mt", "translate", "-m", args.checkpoint,
           "--beam", str(args.beam)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    half = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // 2))}
    with tempfile.TemporaryDirectory(prefix="tmt-bench-") as work:
        source = Path(work) / "input.de"
        source.write_text("".join(lines), encoding="utf-8")
        names = ("stream", "stream_2000", "chunks1", "chunks2")
        outputs = {name: Path(work) / f"{name}.en" for name in names}
        seconds = {
            "stream": timed(tmt, env, stdin=source, stdout=outputs["stream"]),
            # streaming with the chunks' sort window (decode.chunk_lines): only the commits differ
            "stream_2000": timed(
                [*tmt, "--set", "decode.buffer_lines=2000"],
                env,
                stdin=source,
                stdout=outputs["stream_2000"],
            ),
            "chunks1": timed([*tmt, "-i", str(source), "-o", str(outputs["chunks1"])], env),
            "chunks2": timed(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc_per_node=2",
                    "--master_port=29533",
                    "-m",
                    "transformer_mt",
                    *tmt[3:],
                    "-i",
                    str(source),
                    "-o",
                    str(outputs["chunks2"]),
                ],
                half,
            ),
        }
        identical = len({path.read_bytes() for path in outputs.values()}) == 1
    rates = {name: round(len(lines) / s, 1) for name, s in seconds.items()}
    for name, s in seconds.items():
        print(f"{name:10s} {s:8.1f} s  {rates[name]:8.1f} lines/s")
    overhead = seconds["chunks1"] / seconds["stream_2000"] - 1
    speedup = seconds["chunks1"] / seconds["chunks2"]
    print(f"chunk commits vs streaming with the same window: {100 * overhead:+.1f} %")
    print(f"chunked vs default streaming (256-line window): "
          f"{seconds['stream'] / seconds['chunks1']:.2f}x")  # fmt: skip
    print(f"2 processes vs 1: {speedup:.2f}x")
    print(f"outputs identical: {identical}")
    summary = {
        "lines": len(lines), "beam": args.beam, "threads": args.threads,
        "seconds": {k: round(v, 2) for k, v in seconds.items()}, "lines_per_s": rates,
        "chunk_overhead": round(overhead, 4), "two_over_one_process": round(speedup, 3),
        "identical": identical,
    }  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    run_script(main)
