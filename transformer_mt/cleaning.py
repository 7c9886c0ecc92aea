"""`tmt clean`: data.train read as `tmt train` reads it (any source, each corpus of a mixture
reported on its own), streamed in chunks through clean.py's rules (on data.num_proc processes),
the kept pairs written to PREFIX.{src_lang} and PREFIX.{tgt_lang} (what `data.source=files
data.train=PREFIX` trains on) and the report to PREFIX.report.json: pairs in, pairs out, the
pairs each filter removed (each counted once, under the first filter that removed it) and a few
examples. `annotate` writes every pair and PREFIX.reason, the filter that would remove each
("" when kept), removing nothing.

Memory is bounded by the chunk, not the corpus: text corpora are streamed line by line (datasets
sources from their memory-mapped Arrow data), and the duplicates are remembered by 8-byte hashes
(a sorted int64 array: 80 MB for 10 million pairs). The outputs appear whole or not at all
(written aside, renamed at the end); the inputs are never written.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from transformer_mt import clean, corpus, files, textio
from transformer_mt.config import Config, to_dict

logger = logging.getLogger(__name__)


def clean_corpus(cfg: Config, prefix: str, annotate: bool = False, overwrite: bool = False) -> dict:
    """Clean data.train into PREFIX.{src_lang}, PREFIX.{tgt_lang} and PREFIX.report.json; the
    report."""
    start = time.monotonic()
    langs = (cfg.data.src_lang, cfg.data.tgt_lang)
    outputs = {lang: Path(f"{prefix}.{lang}") for lang in langs}
    outputs["report"] = Path(f"{prefix}.report.json")
    if annotate:
        outputs["reason"] = Path(f"{prefix}.reason")
    corpora = corpus.open_training(cfg.data)
    inputs = [path for split in corpora for path in corpus.input_files(split)]
    for path in outputs.values():
        textio.check_output(path, inputs=inputs, overwrite=overwrite)
        textio.check_directory(path.parent, "-o")
        path.parent.mkdir(parents=True, exist_ok=True)
    if cfg.clean.langid:
        clean.Identify()  # the missing extra, said before any work
    rules, notes = clean.eval_sets(cfg)
    for directory in {p.parent for p in outputs.values()}:  # what a killed run left staged
        files.recover(directory, live_writers=True, names=[p.name for p in outputs.values()])
    staged = {k: p.with_name(f".tmp-{p.name}-{os.getpid()}") for k, p in outputs.items()}
    try:
        texts = {k: p for k, p in staged.items() if k != "report"}
        handles = {k: open(p, "w", encoding="utf-8") for k, p in texts.items()}  # noqa: SIM115
        try:
            report = _clean_all(cfg, corpora, rules, handles, annotate)
        finally:
            for handle in handles.values():
                handle.close()
        report.update(notes=notes, settings=to_dict(cfg)["clean"], annotated=annotate,
                      outputs={k: str(p) for k, p in outputs.items()},
                      seconds=round(time.monotonic() - start, 2))  # fmt: skip
        report["pairs_per_s"] = round(report["pairs_in"] / max(report["seconds"], 1e-9), 1)
        files.atomic_write(staged["report"], (json.dumps(report, indent=1) + "\n").encode())
        for key, path in staged.items():
            os.replace(path, outputs[key])
    finally:
        for path in staged.values():
            path.unlink(missing_ok=True)
    return report


def _clean_all(
    cfg: Config, corpora: list[corpus.RawSplit], rules: clean.Rules, handles: dict[str, Any],
    annotate: bool,
) -> dict[str, Any]:  # fmt: skip
    from tqdm import tqdm

    src_lang, tgt_lang = cfg.data.src_lang, cfg.data.tgt_lang
    total = _empty_counts()
    examples: dict[str, list[dict[str, str]]] = {name: [] for name in clean.FILTERS}
    rows = []
    for split in corpora:
        counts = _empty_counts()
        bar = tqdm(unit="pair", desc=split.key, dynamic_ncols=True, disable=None, mininterval=1.0)
        for chunk, codes in clean.reasons(split.pairs(clean.CHUNK), rules, cfg.data.num_proc):
            names = [clean.FILTERS[c - 1] if c else "" for c in codes.tolist()]
            shown = range(len(chunk)) if annotate else np.flatnonzero(codes == clean.KEPT).tolist()
            handles[src_lang].write("".join(_line(chunk[i][0]) for i in shown))
            handles[tgt_lang].write("".join(_line(chunk[i][1]) for i in shown))
            if annotate:
                handles["reason"].write("".join(name + "\n" for name in names))
            for i in np.flatnonzero(codes != clean.KEPT).tolist():
                if len(examples[names[i]]) < cfg.clean.examples:
                    examples[names[i]].append({"src": chunk[i][0][:300], "tgt": chunk[i][1][:300]})
            found = np.bincount(codes.astype(np.int64), minlength=len(clean.FILTERS) + 1)
            counts["kept"] += int(found[0])
            for index, name in enumerate(clean.FILTERS, 1):
                counts[name] += int(found[index])
            bar.update(len(chunk))
        bar.close()
        rows.append(_summary(split.key, split.origin, counts))
        for name, n in counts.items():
            total[name] += n
    return {**_summary("data.train", " + ".join(s.origin for s in corpora), total),
            "examples": {k: v for k, v in examples.items() if v}, "corpora": rows}  # fmt: skip


def _line(text: str) -> str:
    """One output line: a line break inside a sentence (U+2028, a lone CR) would split it."""
    return text.replace("\n", " ").replace("\r", " ") + "\n"


def _empty_counts() -> dict[str, int]:
    return {"kept": 0, **{name: 0 for name in clean.FILTERS}}


def _summary(key: str, origin: str, counts: dict[str, int]) -> dict[str, Any]:
    pairs_in = sum(counts.values())
    removed = {name: counts[name] for name in clean.FILTERS}
    return {"key": key, "origin": origin, "pairs_in": pairs_in, "pairs_out": counts["kept"],
            "removed": removed}  # fmt: skip


def format_report(report: dict[str, Any]) -> str:
    """The report for people: a table of what each filter removed, per corpus when several."""
    columns = [report] + (report["corpora"] if len(report["corpora"]) > 1 else [])
    width = max(len(c["key"]) for c in columns)
    head = f"{'filter':<16}" + "".join(f"{c['key']:>{width + 2}}" for c in columns)
    lines = [head]
    for name in ("pairs_in", *clean.FILTERS, "pairs_out"):
        values = [c[name] if name.startswith("pairs") else c["removed"][name] for c in columns]
        lines.append(f"{name:<16}" + "".join(f"{v:>{width + 2},}" for v in values))
    share = 100 * report["pairs_out"] / max(report["pairs_in"], 1)
    lines.append(f"kept {share:.1f} % in {report['seconds']:.1f} s ({report['pairs_per_s']:,.0f}"
                 f" pairs/s); report: {report['outputs']['report']}")  # fmt: skip
    lines += [f"note: {note}" for note in report["notes"]]
    return "\n".join(lines)
