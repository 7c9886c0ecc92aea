"""A noisy corpus with labels, for measuring tmt clean: the bundled Multi30k de-en training pairs
plus planted noise of the kinds web-crawled corpora carry, each line labelled.

    python scripts/noisy_corpus.py OUT_DIR [--seed 1]

Writes OUT_DIR/noisy.de, noisy.en (the corpus: `data.source=files data.train=OUT_DIR/noisy`),
noisy.label (per line: clean, or the kind of noise), clean.de/clean.en (the clean pairs alone).
Noise, as a share of the 29,000 clean pairs: duplicates 6 % (half exact, half with case and
punctuation changed), untranslated copies 3 % (the German source as the target), French targets
3 % (Multi30k's own French of that line), an empty side 1.5 %, length-ratio outliers 3 % (a target
more than four times as long, or a one-word source), digits-and-symbols lines 1.5 %, test pairs 3 %
(test_2016_flickr's own pairs, which no model may train on). About 21 % noise in all.
"""

from __future__ import annotations

import argparse
import gzip
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "transformer_mt" / "multi30k"
SHARES = {"duplicate": 0.06, "copy": 0.03, "french": 0.03, "empty": 0.015, "ratio": 0.03,
          "symbols": 0.015, "test": 0.03}  # fmt: skip


def read(split: str, lang: str) -> list[str]:
    with gzip.open(DATA / f"{split}.{lang}.gz", "rt", encoding="utf-8") as handle:
        return [line.rstrip("\n") for line in handle]


def roughen(text: str, rng: random.Random) -> str:
    """The same sentence as another crawl writes it: case and final punctuation changed."""
    text = text.lower() if rng.random() < 0.5 else text.upper()
    return text.rstrip(".!?") + rng.choice(["", " .", "!", " ..."])


def symbols(rng: random.Random) -> str:
    parts = [str(rng.randint(0, 99999)), "###", "$$", "%", "|", "--", "@@", "***", "+49", "..."]
    return " ".join(rng.choice(parts) for _ in range(rng.randint(3, 9)))


def planted(kind: str, i: int, clean: list[tuple[str, str]], fr: list[str],
            test: list[tuple[str, str]], rng: random.Random) -> tuple[str, str]:  # fmt: skip
    src, tgt = clean[i]
    if kind == "duplicate":
        return (src, tgt) if rng.random() < 0.5 else (roughen(src, rng), roughen(tgt, rng))
    if kind == "copy":
        return src, src
    if kind == "french":
        return src, fr[i]
    if kind == "empty":
        return (src, "") if rng.random() < 0.5 else ("", tgt)
    if kind == "ratio":  # a misaligned target 4 times too long, or a source cut to a word
        if rng.random() < 0.5:
            long = tgt
            while len(long) <= 4 * len(src):
                long += " " + rng.choice(clean)[1]
            return src, long
        return src.split()[0], tgt
    if kind == "symbols":
        return (symbols(rng), symbols(rng)) if rng.random() < 0.5 else (src, symbols(rng))
    return test[i % len(test)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    clean = list(zip(read("train", "de"), read("train", "en"), strict=True))
    fr = read("train", "fr")
    test = list(zip(read("test_2016_flickr", "de"), read("test_2016_flickr", "en"), strict=True))
    rows = [(src, tgt, "clean", i) for i, (src, tgt) in enumerate(clean)]
    for kind, share in SHARES.items():
        for _ in range(round(share * len(clean))):
            i = rng.randrange(len(clean))
            rows.append((*planted(kind, i, clean, fr, test, rng), kind, i))
    # The noise spread through the corpus, each duplicate after the pair it repeats (which one
    # of equal pairs is "the" duplicate is a matter of order: the first one stays).
    rng.shuffle(rows)
    first = {}
    for at, row in enumerate(rows):
        if row[2] in ("clean", "duplicate"):
            first.setdefault(row[3], at)
    for at, row in enumerate(rows):
        if row[2] == "clean" and first[row[3]] != at:  # a duplicate came first: swap them
            rows[at], rows[first[row[3]]] = rows[first[row[3]]], rows[at]
    args.out.mkdir(parents=True, exist_ok=True)
    outputs = {"noisy.de": 0, "noisy.en": 1, "noisy.label": 2}
    for name, column in outputs.items():
        (args.out / name).write_text("".join(row[column] + "\n" for row in rows), encoding="utf-8")
    for lang, column in (("de", 0), ("en", 1)):
        (args.out / f"clean.{lang}").write_text("".join(p[column] + "\n" for p in clean))
    counts = {kind: sum(r[2] == kind for r in rows) for kind in ("clean", *SHARES)}
    print(
        f"{args.out}/noisy.*: {len(rows)} pairs: "
        + ", ".join(f"{k} {v}" for k, v in counts.items())
    )


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    run_script(main)
