"""Models that take hints measured (issue 48): a plain model and one trained with term hints
(data.terms: the same recipe, seed and updates), each on a Multi30k de→en split with the three
term lists of scripts/bench_terms.py (reference-consistent, override, random control) and with
no glossary: term use, BLEU, chrF (paired tests against the plain model's) and sentences/s.

    python scripts/terms_quality.py --plain runs/terms/plain_2100/average \\
        --hinted runs/terms/hints_2100/average --split test

Modes: the plain model with none and strict; the hinted model with none, hint, strict and auto.
The goals (issue 48): the hinted model without a glossary not significantly below the plain one;
hint at >= 95 % (consistent) and >= 90 % (override) term use, BLEU >= the plain model's strict,
speed >= 0.9x its own none; auto at 100 % and >= 0.8x; the random control gaining clearly less.
Speed: every mode decodes the whole split at beam 4, interleaved --repeats times, the median. The
last line printed is one JSON object.

    python scripts/terms_quality.py --misses --hinted runs/terms/hints_replace_min2_a05/average

--misses instead sorts the hinted model's misses in hint mode (no timing): for each list, the
terms it missed, how many of those it also missed without a glossary and how many it used
without one, and how many outputs hold a broken or inflected copy (the hint's first four letters).
The lists are those the last full run wrote (--out), so the figures are that run's.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_terms  # the term lists and the timing, shared with issue 46's bench

PAIRED = ("score", "p_bootstrap", "p_randomization")


def translators(plain_path: Path, hinted_path: Path, lists: list[str], out: Path, beam: int):
    """{mode name: translator}: plain/none, plain/LIST/strict, hinted/none, hinted/LIST/MODE."""
    from transformer_mt.translation import translate

    plain = translate.load_translator(plain_path, [f"decode.beam_size={beam}"])
    hinted = translate.load_translator(hinted_path, [f"decode.beam_size={beam}"])
    modes = {"plain/none": plain, "hinted/none": hinted}
    for name in lists:
        for who, base, chosen in (("plain", plain, ("strict",)),
                                  ("hinted", hinted, ("hint", "strict", "auto"))):  # fmt: skip
            for mode in chosen:
                cfg = translate.apply_overrides(base.config, [
                    f"glossary.path={out / f'{name}.tsv'}", f"glossary.mode={mode}"])  # fmt: skip
                one = dataclasses.replace(base, config=cfg, glossary=translate.load_glossary(cfg))
                translate.check_glossary(one)
                modes[f"{who}/{name}/{mode}"] = one
    return modes


def misses(hinted_path: Path, out: Path, sources: list[str], beam: int) -> dict:
    """{list: counts} of the hinted model's misses in hint mode, against its no-glossary output."""
    from transformer_mt.data import glossary as glossaries
    from transformer_mt.translation import translate

    hinted = translate.load_translator(hinted_path, [f"decode.beam_size={beam}"])
    none = translate.translate_text(hinted, sources)
    found = {}
    for name in ("consistent", "override"):
        path = out / f"{name}.tsv"
        if not path.is_file():
            raise SystemExit(f"{path}: no list; run the full measurement first")
        cfg = translate.apply_overrides(hinted.config, [f"glossary.path={path}",
                                                        "glossary.mode=hint"])  # fmt: skip
        one = dataclasses.replace(hinted, config=cfg, glossary=translate.load_glossary(cfg))
        hint = translate.translate_text(one, sources)
        listed = glossaries.load(path)
        row = collections.Counter()
        for source, plain, hinted_line in zip(sources, none, hint, strict=True):
            for match in listed.match(source):
                row["terms_matched"] += 1
                if glossaries.used(match.entry, hinted_line) is not None:
                    continue
                row["missed"] += 1
                used_without = glossaries.used(match.entry, plain) is not None
                row["missed_used_without_glossary" if used_without
                    else "missed_also_without_glossary"] += 1  # fmt: skip
                lowered = hinted_line.lower()
                if any(t.lower()[:4] in lowered for t in match.entry.targets):
                    row["missed_with_a_broken_or_inflected_copy"] += 1
        found[name] = dict(row)
        print(f"{name}: {json.dumps(found[name])}", file=sys.stderr)
    return found


def paired(evaluate, a: tuple[str, list[str]], b: tuple[str, list[str]], refs) -> dict:
    theirs = evaluate.compare([a, b], refs)["systems"][1]
    return {m: {k: theirs[m][k] for k in PAIRED} for m in ("bleu", "chrf")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plain", type=Path)
    parser.add_argument("--misses", action="store_true", help="sort the hinted model's misses")
    parser.add_argument("--hinted", required=True, type=Path)
    parser.add_argument("--split", default="test", choices=sorted(bench_terms.SPLITS))
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=bench_terms.REPO / "runs" / "terms_quality")
    args = parser.parse_args()

    from transformer_mt.data import glossary as glossaries
    from transformer_mt.translation import evaluate

    if args.misses:
        sources = bench_terms.read(bench_terms.DATA / f"{bench_terms.SPLITS[args.split]}.de.gz")
        found = misses(args.hinted, args.out / args.split, sources, args.beam)
        print(json.dumps({"hinted": str(args.hinted), "split": args.split, "misses": found}))
        return
    if args.plain is None:
        parser.error("--plain is required (but for --misses)")
    cpu = Path("/proc/cpuinfo").read_text()
    isa = "AVX-512" if "avx512f" in cpu else "AVX2" if "avx2" in cpu else "no AVX2"
    print(f"machine: {isa}, {torch.get_num_threads()} threads", file=sys.stderr)
    data = bench_terms.DATA
    split = bench_terms.SPLITS[args.split]
    sources = bench_terms.read(data / f"{split}.de.gz")
    refs = bench_terms.read(data / f"{split}.en.gz")
    found = bench_terms.dictionary(bench_terms.read(data / "train.de.gz"),
                                   bench_terms.read(data / "train.en.gz"))  # fmt: skip
    lists = bench_terms.term_lists(found, sources, refs, args.seed)
    out = args.out / args.split
    for name, entries in lists.items():
        bench_terms.write_tsv(out / f"{name}.tsv", entries)
    modes = translators(args.plain, args.hinted, list(lists), out, args.beam)

    bench_terms.timed(modes["plain/none"], sources[:50])  # warm-up
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    outputs: dict[str, list[str]] = {}
    reports: dict[str, list] = {}
    for _ in range(args.repeats):
        for key, translator in modes.items():
            outputs[key], took, reports[key] = bench_terms.timed(translator, sources)
            seconds[key].append(took)

    result: dict = {"machine": isa, "threads": torch.get_num_threads(), "split": args.split,
                    "beam": args.beam, "sentences": len(sources), "plain": str(args.plain),
                    "hinted": str(args.hinted), "lists": {k: len(v) for k, v in lists.items()},
                    "modes": {}}  # fmt: skip
    for key in modes:
        who, *rest = key.split("/")
        base = statistics.median(seconds[f"{who}/none"])
        row = {
            "sentences_per_second": round(len(sources) / statistics.median(seconds[key]), 1),
            "speed_vs_none": round(base / statistics.median(seconds[key]), 3),
            **{k: v for k, v in evaluate.score(outputs[key], refs, all_metrics=False).items()
               if k in ("bleu", "chrf")},
        }  # fmt: skip
        if rest[0] != "none":
            listed = glossaries.load(out / f"{rest[0]}.tsv")
            row |= glossaries.term_use(listed, sources, outputs[key])
            row["lines_decoded_again"] = sum(
                any(t["forced"] for t in r["terms"]) for r in reports[key])  # fmt: skip
            # against the plain model with the same list decoded strictly: what hints replace
            if key != f"plain/{rest[0]}/strict":
                row["paired_vs_plain_strict"] = paired(
                    evaluate, (f"plain/{rest[0]}/strict", outputs[f"plain/{rest[0]}/strict"]),
                    (key, outputs[key]), refs)  # fmt: skip
        elif who == "hinted":  # what hints cost the everyday case
            row["paired_vs_plain"] = paired(evaluate, ("plain/none", outputs["plain/none"]),
                                            (key, outputs[key]), refs)  # fmt: skip
        for name in lists:  # term use without a glossary, for each list
            if rest[0] == "none":
                listed = glossaries.load(out / f"{name}.tsv")
                row[f"term_use_{name}"] = glossaries.term_use(listed, sources, outputs[key])[
                    "term_use"]  # fmt: skip
        result["modes"][key] = row
        print(f"{key:<26} {json.dumps(row)}", file=sys.stderr)
    # The random control: what each list's hints gain over the hinted model's own no-glossary BLEU.
    none = result["modes"]["hinted/none"]
    result["gain_over_none"] = {
        f"{name}/{mode}": {m: round(result["modes"][f"hinted/{name}/{mode}"][m] - none[m], 2)
                           for m in ("bleu", "chrf")}
        for name in lists for mode in ("hint", "auto")
    }  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    run_script(main)
