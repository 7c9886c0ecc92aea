"""Glossaries measured (issue 46): term use, BLEU and chrF, and speed of translating with no
glossary, with glossary.mode=check and with strict, on Multi30k de→en, for three term lists
built from the training corpus only; and a 100,000-entry glossary's load and match time.

    python scripts/bench_terms.py --model runs/terms/plain_2100/average
    python scripts/bench_terms.py --model M --split valid --repeats 3 --out runs/bench_terms

The term lists (written to OUT/{consistent,override,random}.tsv; the random list is drawn with
--seed, but eflomal's sampler takes no seed, so two runs' lists can differ by a few entries: 99
and 101 override entries on test2016 in two runs; compare models within one run's lists):

- a dictionary: data.train's words aligned by eflomal (forward and reverse, intersected; the
  bench extra installs it), p(target word | source word) from the counts; kept, as Dinu et al.
  (2019) keep terms: capitalised German words (nouns) of 3+ letters seen 5+ times, outside the
  150 most frequent words of each side, with translations seen 3+ times and p >= 0.1.
- consistent: each source word of the dictionary that the split's sources contain, with the
  translations the references of its lines use (alternatives, "dog | dogs"), kept when every
  one of its lines' references uses one of them.
- override: the same source words with a translation the corpus also uses (p >= 0.05, 3+ times)
  that none of their lines' references uses and that is no inflection of a consistent one
  (e.g. Wald → woods where the references say forest): the house style a glossary imposes.
- random: as many source words of the split drawn at random from the dictionary, each with its
  most frequent translation, whatever the references say: the control of WMT23, whose random
  dictionary improved scores nearly as much as the real one.

Speed: each mode decodes the whole split at the model's beam (--beam, 4), the modes interleaved
--repeats times, the median sentences/s of each and its ratio to no glossary, on this machine's
threads (torch.get_num_threads()); match speed on one thread. Quality: sacreBLEU's BLEU and chrF
of each mode, strict and check against no glossary by the paired bootstrap and approximate
randomization (tmt evaluate's compare). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "transformer_mt" / "multi30k"
SPLITS = {"test": "test_2016_flickr", "valid": "val"}


def read(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [line.rstrip("\n") for line in handle]


def tokens(line: str) -> list[str]:
    from transformer_mt.data.glossary import plain, words

    return [plain(w) for w, _, _ in words(line)]


def align(source: list[list[str]], target: list[list[str]]) -> list[set[tuple[int, int]]]:
    """eflomal's forward and reverse links of each pair, intersected (precision first)."""
    import eflomal

    with tempfile.TemporaryDirectory() as scratch:
        fwd, rev = Path(scratch) / "fwd", Path(scratch) / "rev"
        aligner = eflomal.Aligner()
        src = [" ".join(s) + "\n" for s in source]
        tgt = [" ".join(t) + "\n" for t in target]
        aligner.align(src, tgt, links_filename_fwd=str(fwd), links_filename_rev=str(rev))
        links = []
        for a, b in zip(fwd.read_text().splitlines(), rev.read_text().splitlines(), strict=True):
            forward = {tuple(map(int, p.split("-"))) for p in a.split()}
            reverse = {tuple(map(int, p.split("-"))) for p in b.split()}
            links.append(forward & reverse)
        return links


def dictionary(src_lines: list[str], tgt_lines: list[str]) -> dict[str, collections.Counter]:
    """Source word -> Counter of the target words (lower case) aligned to it, filtered."""
    source = [tokens(x) for x in src_lines]
    target = [[w.lower() for w in tokens(y)] for y in tgt_lines]
    pairs: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for s, t, links in zip(source, target, align(source, target), strict=True):
        for i, j in links:
            pairs[s[i]][t[j]] += 1
    src_freq = collections.Counter(w for s in source for w in s)
    tgt_freq = collections.Counter(w for t in target for w in t)
    common_src = {w for w, _ in src_freq.most_common(150)}
    common_tgt = {w for w, _ in tgt_freq.most_common(150)}
    kept = {}
    for word, counts in pairs.items():
        if (len(word) < 3 or not word.isalpha() or not word[0].isupper()
                or word in common_src or src_freq[word] < 5):  # fmt: skip
            continue
        total = sum(counts.values())
        good = collections.Counter({
            t: c for t, c in counts.items()
            if c >= 3 and c / total >= 0.05 and t.isalpha() and len(t) >= 3 and t not in common_tgt
        })  # fmt: skip
        if good and good.most_common(1)[0][1] / total >= 0.1:
            kept[word] = good
    return kept


def inflection(a: str, b: str) -> bool:
    return a[:4] == b[:4]


def term_lists(
    found: dict[str, collections.Counter], sources: list[str], refs: list[str], seed: int
) -> dict[str, list[tuple[str, str]]]:
    from transformer_mt.data import glossary as glossaries

    lines_of: dict[str, list[int]] = collections.defaultdict(list)
    for n, line in enumerate(sources):
        for word in set(tokens(line)):
            if word in found:
                lines_of[word].append(n)
    consistent, override = [], []
    for word, lines in sorted(lines_of.items()):
        used = [t for t, c in found[word].most_common()
                if any(glossaries.used(glossaries.Entry(word, (t,), 0), refs[n]) is not None
                       for n in lines)]  # fmt: skip
        entry = glossaries.Entry(word, tuple(used), 0)
        if used and all(glossaries.used(entry, refs[n]) is not None for n in lines):
            consistent.append((word, " | ".join(used)))
            other = [t for t, c in found[word].most_common()
                     if t not in used and not any(inflection(t, u) for u in used)
                     and all(glossaries.used(glossaries.Entry(word, (t,), 0), refs[n]) is None
                             for n in lines)]  # fmt: skip
            if other:
                override.append((word, other[0]))
    rng = random.Random(seed)
    pool = sorted(lines_of)
    drawn = sorted(rng.sample(pool, min(len(consistent), len(pool))))
    randomly = [(word, found[word].most_common(1)[0][0]) for word in drawn]
    return {"consistent": consistent, "override": override, "random": randomly}


def write_tsv(path: Path, entries: list[tuple[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{s}\t{t}\n" for s, t in entries), encoding="utf-8")


def timed(translator, lines: list[str]) -> tuple[list[str], float, list]:
    from transformer_mt.translation import streams

    start = time.perf_counter()
    both = streams.output_and_report(translator, lines, 0, None)
    seconds = time.perf_counter() - start
    reports = [json.loads(r) for _, r in both if r]
    return [rows.rstrip("\n") for rows, _ in both], seconds, reports


def big_glossary(path: Path, entries: int, vocabulary: list[str], seed: int, single: float) -> None:
    """`entries` distinct sources, each with a made-up target: a `single` share of them one
    corpus word, the rest two or three corpus words (phrases that rarely occur)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    with open(path, "w", encoding="utf-8") as out:
        while len(seen) < entries:
            size = 1 if rng.random() < single else rng.choice((2, 3))
            source = " ".join(rng.choice(vocabulary) for _ in range(size))
            if source.casefold() in seen:
                continue
            seen.add(source.casefold())
            out.write(f"{source}\tterm{len(seen)}\n")


def glossary_speed(out: Path, sentences: list[str], entries: int) -> dict:
    """Load time of an `entries`-entry glossary (not cached) and match speed on one thread, for a
    termbase-like glossary (5 % single corpus words, the rest phrases) and for a stress case in
    which nearly every word of every sentence starts an entry (half of them single words)."""
    from transformer_mt.data import glossary as glossaries

    vocabulary = sorted({w for line in sentences[:20000] for w in tokens(line) if w.isalpha()})
    found = {}
    for kind, single in (("termbase", 0.05), ("every_word", 0.5)):
        path = out / f"glossary_{entries}_{kind}.tsv"
        if not path.exists():
            big_glossary(path, entries, vocabulary, seed=1, single=single)
        loads, matches = [], []  # repeated: a shared VM's timings vary by a third
        for _ in range(5):
            glossaries._CACHE.clear()
            start = time.perf_counter()
            loaded = glossaries.load(path, pair=("de", "en"))
            loads.append(time.perf_counter() - start)
            start = time.perf_counter()
            matched = sum(len(loaded.match(line)) for line in sentences)
            matches.append(time.perf_counter() - start)
        rate = [len(sentences) / t for t in matches]
        found[kind] = {"entries": len(loaded), "match_sentences": len(sentences),
                       "load_seconds": {"min": round(min(loads), 3),
                                        "median": round(statistics.median(loads), 3),
                                        "max": round(max(loads), 3)},
                       "match_sentences_per_second": {"min": round(min(rate)),
                                                      "median": round(statistics.median(rate)),
                                                      "max": round(max(rate))},
                       "matches_per_sentence": round(matched / len(sentences), 2)}  # fmt: skip
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--split", default="test", choices=sorted(SPLITS))
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_terms")
    parser.add_argument(
        "--only-glossary",
        action="store_true",
        help="only the 100,000-entry glossary's load and match speed",
    )
    args = parser.parse_args()

    from transformer_mt.data import glossary as glossaries
    from transformer_mt.translation import evaluate, translate

    lscpu = Path("/proc/cpuinfo").read_text()
    isa = "AVX-512" if "avx512f" in lscpu else "AVX2" if "avx2" in lscpu else "no AVX2"
    print(f"machine: {isa}, {torch.get_num_threads()} threads", file=sys.stderr)
    if args.only_glossary:
        torch.set_num_threads(1)
        speed = glossary_speed(args.out, read(DATA / "train.de.gz"), args.entries)
        print(json.dumps({"machine": isa, "glossary_100k": speed}))
        return
    # The model first: a wrong path ends before the dictionary's work and its files.
    plain = translate.load_translator(args.model, [f"decode.beam_size={args.beam}"])
    sources = read(DATA / f"{SPLITS[args.split]}.de.gz")
    refs = read(DATA / f"{SPLITS[args.split]}.en.gz")
    train_src, train_tgt = read(DATA / "train.de.gz"), read(DATA / "train.en.gz")

    found = dictionary(train_src, train_tgt)
    lists = term_lists(found, sources, refs, args.seed)
    for name, entries in lists.items():
        write_tsv(args.out / f"{name}.tsv", entries)
    print(f"dictionary: {len(found)} source words; lists: "
          + ", ".join(f"{k} {len(v)}" for k, v in lists.items()), file=sys.stderr)  # fmt: skip

    modes = {"none": plain}
    for name in lists:
        for mode in ("check", "strict"):
            cfg = translate.apply_overrides(plain.config, [
                f"glossary.path={args.out / f'{name}.tsv'}", f"glossary.mode={mode}"])  # fmt: skip
            modes[f"{name}/{mode}"] = translate.dataclasses.replace(
                plain, config=cfg, glossary=translate.load_glossary(cfg)
            )
    timed(plain, sources[:50])  # warm-up
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    outputs: dict[str, list[str]] = {}
    reports: dict[str, list] = {}
    for _ in range(args.repeats):
        for key, translator in modes.items():
            out, took, rep = timed(translator, sources)
            seconds[key].append(took)
            outputs[key], reports[key] = out, rep
    result: dict = {"machine": isa, "threads": torch.get_num_threads(), "split": args.split,
                    "beam": args.beam, "sentences": len(sources), "model": str(args.model),
                    "lists": {k: len(v) for k, v in lists.items()}, "modes": {}}  # fmt: skip
    base = statistics.median(seconds["none"])
    for key in modes:
        name = key.split("/")[0]
        listed = glossaries.load(args.out / f"{name}.tsv") if key != "none" else None
        row = {
            "sentences_per_second": round(len(sources) / statistics.median(seconds[key]), 1),
            "speed_vs_none": round(base / statistics.median(seconds[key]), 3),
            **{k: v for k, v in evaluate.score(outputs[key], refs, all_metrics=False).items()
               if k in ("bleu", "chrf")},
        }  # fmt: skip
        if listed is not None:
            row |= glossaries.term_use(listed, sources, outputs[key])
            row["term_use_without_glossary"] = glossaries.term_use(
                listed, sources, outputs["none"])["term_use"]  # fmt: skip
            row["lines_decoded_again"] = sum(
                any(t["forced"] for t in r["terms"]) for r in reports[key])  # fmt: skip
            if key.endswith("strict"):
                compared = evaluate.compare([("none", outputs["none"]), (key, outputs[key])], refs)
                theirs = compared["systems"][1]
                row["paired"] = {m: {k: theirs[m][k] for k in ("score", "p_bootstrap",
                                                                 "p_randomization")}
                                 for m in ("bleu", "chrf")}  # fmt: skip
        result["modes"][key] = row
        print(f"{key:<20} {json.dumps(row)}", file=sys.stderr)
    torch.set_num_threads(1)
    result["glossary_100k"] = glossary_speed(args.out, train_src, args.entries)
    print(json.dumps(result))


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    run_script(main)
