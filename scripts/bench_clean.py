"""tmt clean measured: how well each filter finds the noise scripts/noisy_corpus.py planted, and
how fast and in how much memory it cleans 1 and 10 million pairs.

    python scripts/bench_clean.py labels [--out runs/clean_bench]
    python scripts/bench_clean.py speed --pairs 1000000 [--num-proc 2]

labels: the noisy corpus cleaned with `tmt clean --annotate` (language identification on); per
noise kind, the share removed (by any filter); the clean pairs kept; per filter, its removals and
their precision (the share that is planted noise) and its recall of the kind it is for.
speed: a synthetic corpus of PAIRS Multi30k pairs, each made unique by a number both sides share
(so that the duplicate rule keeps them and the hash set grows with the corpus), cleaned by tmt
clean; pairs/s and the peak RSS of the process (and its workers), as printed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TMT = [sys.executable, "-m", "transformer_mt"]
DATA = REPO / "transformer_mt" / "multi30k"
# The filters meant for each planted kind (a pair may also go, rightly, by another).
MEANT = {"duplicate": {"duplicate", "near_duplicate"}, "copy": {"copy"}, "french": {"langid"},
         "empty": {"empty"}, "ratio": {"ratio", "length"}, "symbols": {"symbols", "script"},
         "test": {"overlap"}}  # fmt: skip


def files_config(train: Path) -> list[str]:
    test = DATA / "test_2016_flickr"
    return ["--set", "data.source=files", "--set", f"data.train={train}",
            "--set", f"data.valid={DATA / 'val'}", "--set", f"data.test={test}"]  # fmt: skip


def labels(out: Path) -> None:
    corpus = out / "noisy"
    if not (corpus / "noisy.label").exists():
        subprocess.run([sys.executable, str(REPO / "scripts" / "noisy_corpus.py"), str(corpus)],
                       check=True)  # fmt: skip
    prefix = out / "annotated"
    subprocess.run([*TMT, "clean", *files_config(corpus / "noisy"), "--set", "clean.langid=true",
                    "--set", "data.num_proc=2", "-o", str(prefix), "--annotate", "--overwrite"],
                   check=True, cwd=REPO)  # fmt: skip
    kinds = (corpus / "noisy.label").read_text().split("\n")[:-1]
    reasons = (Path(f"{prefix}.reason")).read_text().split("\n")[:-1]
    assert len(kinds) == len(reasons), (len(kinds), len(reasons))
    by_kind = Counter(kinds)
    removed_kind = Counter(k for k, r in zip(kinds, reasons, strict=True) if r)
    print(f"{len(kinds)} pairs, {len(kinds) - by_kind['clean']} planted noise")
    print(f"{'kind':<10}{'pairs':>8}{'removed':>10}{'share':>9}   by (filter: pairs)")
    for kind in ("clean", *MEANT):
        by = Counter(r for k, r in zip(kinds, reasons, strict=True) if k == kind and r)
        share = removed_kind[kind] / by_kind[kind]
        shown = 1 - share if kind == "clean" else share
        what = "kept" if kind == "clean" else "removed"
        print(f"{kind:<10}{by_kind[kind]:>8}{removed_kind[kind]:>10}{100 * shown:>8.2f}% {what}"
              f"   {dict(by.most_common())}")  # fmt: skip
    print(
        f"\n{'filter':<16}{'removed':>8}{'precision':>11}{'recall':>9}  (recall: of the kind it is"
        " for, by the filters for that kind)"
    )
    filters = Counter(r for r in reasons if r)
    for name, count in filters.most_common():
        noise = sum(1 for k, r in zip(kinds, reasons, strict=True) if r == name and k != "clean")
        kind = next((k for k, meant in MEANT.items() if name in meant), None)
        recall = ""
        if kind:  # of the kind, the share removed by the filters meant for it (this one too)
            hits = sum(
                1 for k, r in zip(kinds, reasons, strict=True) if k == kind and r in MEANT[kind]
            )
            recall = f"{100 * hits / by_kind[kind]:.2f}%"
        print(f"{name:<16}{count:>8}{100 * noise / count:>10.2f}%{recall:>9}")


def measured(command: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in MiB of the command and its processes) of one command, run in a
    fresh Python that reports its children's peak."""
    probe = ("import resource, subprocess, sys, time; t = time.monotonic(); "
             "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
             "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss; "
             "print(time.monotonic() - t, peak)")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", probe, *command], check=True, cwd=REPO,
                            capture_output=True, text=True)  # fmt: skip
    seconds, peak_kib = result.stdout.split()
    return float(seconds), int(peak_kib) / 1024


OPUSFILTER = """common:
  output_directory: {out}
steps:
  - type: filter
    parameters:
      inputs: [{corpus}.de, {corpus}.en]
      outputs: [opusfilter.de, opusfilter.en]
      filters:
        - LengthFilter: {{unit: word, min_length: 1, max_length: 150}}
        - LengthFilter: {{unit: char, min_length: 1, max_length: 1024}}
        - LengthRatioFilter: {{unit: char, threshold: 3}}
        - CharacterScoreFilter: {{scripts: [Latin, Latin], thresholds: [0.5, 0.5]}}
        - AlphabetRatioFilter: {{threshold: 0.5, exclude_whitespace: true}}
  - type: remove_duplicates
    parameters:
      inputs: [opusfilter.de, opusfilter.en]
      outputs: [opusfilter_dedup.de, opusfilter_dedup.en]
"""


def speed(pairs: int, num_proc: int, out: Path, opusfilter: str) -> None:
    corpus = out / f"synthetic{pairs}"
    if not Path(f"{corpus}.en").exists():
        rng = random.Random(1)
        with (
            gzip.open(DATA / "train.de.gz", "rt") as de,
            gzip.open(DATA / "train.en.gz", "rt") as en,
        ):
            base = list(zip(de.read().splitlines(), en.read().splitlines(), strict=True))
        out.mkdir(parents=True, exist_ok=True)
        with open(f"{corpus}.de", "w") as de_out, open(f"{corpus}.en", "w") as en_out:
            for i in range(pairs):
                src, tgt = rng.choice(base)
                de_out.write(f"{src} (Nr. {i})\n")
                en_out.write(f"{tgt} (No. {i})\n")
    command = [*TMT, "clean", *files_config(corpus), "--set", f"data.num_proc={num_proc}",
               "-o", str(out / f"cleaned{pairs}"), "--overwrite", "--json"]  # fmt: skip
    seconds, peak = measured(command)
    report = json.loads(Path(f"{out / f'cleaned{pairs}'}.report.json").read_text())
    kept = report["pairs_out"]
    print(f"tmt clean, {pairs:,} pairs, {num_proc} process(es): {seconds:.1f} s,"
          f" {pairs / seconds:,.0f} pairs/s, peak RSS {peak:,.0f} MiB, kept {kept:,}")  # fmt: skip
    if opusfilter:  # OpusFilter's nearest rules (no language identification), the same corpus
        config = out / f"opusfilter{pairs}.yaml"
        config.write_text(OPUSFILTER.format(out=out, corpus=corpus))
        seconds_of, peak_of = measured([opusfilter, "--overwrite", str(config)])
        kept = (out / "opusfilter_dedup.de").read_text(encoding="utf-8").count("\n")
        print(f"OpusFilter, {pairs:,} pairs: {seconds_of:.1f} s, {pairs / seconds_of:,.0f} pairs/s,"
              f" peak RSS {peak_of:,.0f} MiB, kept {kept:,}")  # fmt: skip
        print(f"tmt clean / OpusFilter: {seconds_of / seconds:.2f}x the speed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["labels", "speed"])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "clean_bench")
    parser.add_argument("--pairs", type=int, default=1_000_000)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--opusfilter", default="", help="OpusFilter's command, run after tmt")
    args = parser.parse_args()
    if args.what == "labels":
        labels(args.out)
    else:
        speed(args.pairs, args.num_proc, args.out, args.opusfilter)


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    run_script(main)
