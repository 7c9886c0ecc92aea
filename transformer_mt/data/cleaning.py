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

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from transformer_mt.common import files, textio
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, to_dict
from transformer_mt.data import corpus, filters

logger = logging.getLogger(__name__)


def clean_corpus(cfg: Config, prefix: str, annotate: bool = False, overwrite: bool = False) -> dict:
    """Clean data.train into PREFIX.{src_lang}, PREFIX.{tgt_lang} and PREFIX.report.json (a
    mixture: each corpus i into PREFIX.i.{src_lang,tgt_lang}, its weight and tag kept in the
    report's data.train); the report."""
    start = time.monotonic()
    _check_prefix(prefix)
    _check_settings(cfg)
    corpora = corpus.open_training(cfg.data)
    if cfg.data.encoding_errors == "skip":  # judged, not hidden: the encoding rule reports them
        cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, encoding_errors="replace")
        )
        corpora = corpus.open_training(cfg.data)
    outputs = _outputs(cfg, prefix, len(corpora), annotate)
    inputs = [path for split in corpora for path in corpus.input_files(split)]
    inputs += _evaluation_files(cfg)  # the overlap rule reads them: never an output either
    textio.check_path(prefix, "output")
    with textio.OutputLock(prefix):  # one writer: the checks below hold while it writes
        for path in outputs.values():
            textio.check_output(path, inputs=inputs, overwrite=overwrite)
            textio.check_directory(path.parent, "-o")
        directory = Path(prefix).absolute().parent
        directory.mkdir(parents=True, exist_ok=True)
        if cfg.clean.langid:
            filters.Identify().check(cfg.data.src_lang, cfg.data.tgt_lang)  # before any work
        rules, notes = filters.eval_sets(cfg)
        files.recover_together(directory)  # a killed replacement of these outputs: undone
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
            if len(corpora) > 1:
                report["train_with"] = _mixture(prefix, corpora)
            files.atomic_write(staged["report"], (json.dumps(report, indent=1) + "\n").encode())
            # All or nothing: a report never sits beside another run's corpus.
            files.replace_together([(staged[k], outputs[k]) for k in outputs])
        finally:
            for path in staged.values():
                path.unlink(missing_ok=True)
    return report


def _check_prefix(prefix: str) -> None:
    """PREFIX must name files: "DIR/" or "." would write hidden files named ".de", ".en"."""
    name = os.path.basename(str(prefix))
    if not name or name in (".", "..") or str(prefix).endswith(os.sep):
        raise TmtError(f"{prefix}: a prefix with no name (the outputs would be hidden files"
                       f" {name or ''}.de, ...); give one, e.g. {prefix.rstrip(os.sep) or '.'}"
                       f"{os.sep}cleaned", param="output")  # fmt: skip


def _check_settings(cfg: Config) -> None:
    """Refuse settings under which a filter removes every pair."""
    c = cfg.clean
    if c.length and c.min_words > c.max_words:
        raise TmtError(f"clean.min_words={c.min_words} > clean.max_words={c.max_words}: the"
                       " length filter would remove every pair")  # fmt: skip


def _outputs(cfg: Config, prefix: str, count: int, annotate: bool) -> dict[str, Path]:
    """The files written: per corpus its two sides (and reasons), then the report."""
    langs = (cfg.data.src_lang, cfg.data.tgt_lang)
    outputs = {}
    for i in range(count):
        stem = f"{prefix}.{i}" if count > 1 else prefix
        key = f"{i}:" if count > 1 else ""
        for lang in langs:
            outputs[f"{key}{lang}"] = Path(f"{stem}.{lang}")
        if annotate:
            outputs[f"{key}reason"] = Path(f"{stem}.reason")
    outputs["report"] = Path(f"{prefix}.report.json")
    return outputs


def _evaluation_files(cfg: Config) -> list[Path]:
    """The validation and test files the overlap rule reads."""
    if not cfg.clean.overlap:
        return []
    found = []
    for key in ("data.valid", "data.test"):
        try:
            found += corpus.input_files(corpus.open_split(cfg.data, key))
        except TmtError:
            continue  # unreadable: eval_sets names it in the notes
    return found


def _mixture(prefix: str, corpora: list[corpus.RawSplit]) -> dict[str, Any]:
    """The data section that trains on the cleaned mixture: each corpus its weight and tag."""
    return {"source": "files", "train": [
        {"split": f"{prefix}.{i}", "weight": split.weight, "tag": split.tag}
        for i, split in enumerate(corpora)
    ]}  # fmt: skip


def _clean_all(
    cfg: Config, corpora: list[corpus.RawSplit], rules: filters.Rules, handles: dict[str, Any],
    annotate: bool,
) -> dict[str, Any]:  # fmt: skip
    from tqdm import tqdm

    src_lang, tgt_lang = cfg.data.src_lang, cfg.data.tgt_lang
    total = _empty_counts()
    examples: dict[str, list[dict[str, str]]] = {name: [] for name in filters.FILTERS}
    rows = []
    for number, split in enumerate(corpora):
        key = f"{number}:" if len(corpora) > 1 else ""  # a mixture: each corpus its own files
        counts = _empty_counts()
        bar = tqdm(unit="pair", desc=split.key, dynamic_ncols=True, disable=None, mininterval=1.0)
        for chunk, codes in filters.reasons(split.pairs(filters.CHUNK), rules, cfg.data.num_proc):
            names = [filters.FILTERS[c - 1] if c else "" for c in codes.tolist()]
            shown = (
                range(len(chunk)) if annotate else np.flatnonzero(codes == filters.KEPT).tolist()
            )
            handles[key + src_lang].write("".join(_line(chunk[i][0]) for i in shown))
            handles[key + tgt_lang].write("".join(_line(chunk[i][1]) for i in shown))
            if annotate:
                handles[key + "reason"].write("".join(name + "\n" for name in names))
            for i in np.flatnonzero(codes != filters.KEPT).tolist():
                if len(examples[names[i]]) < cfg.clean.examples:
                    examples[names[i]].append({"src": chunk[i][0][:300], "tgt": chunk[i][1][:300]})
            found = np.bincount(codes.astype(np.int64), minlength=len(filters.FILTERS) + 1)
            counts["kept"] += int(found[0])
            for index, name in enumerate(filters.FILTERS, 1):
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
    return {"kept": 0, **{name: 0 for name in filters.FILTERS}}


def _summary(key: str, origin: str, counts: dict[str, int]) -> dict[str, Any]:
    pairs_in = sum(counts.values())
    removed = {name: counts[name] for name in filters.FILTERS}
    return {"key": key, "origin": origin, "pairs_in": pairs_in, "pairs_out": counts["kept"],
            "removed": removed}  # fmt: skip


def format_report(report: dict[str, Any]) -> str:
    """The report for people: a table of what each filter removed, per corpus when several."""
    columns = [report] + (report["corpora"] if len(report["corpora"]) > 1 else [])
    width = max(len(c["key"]) for c in columns)
    head = f"{'filter':<16}" + "".join(f"{c['key']:>{width + 2}}" for c in columns)
    lines = [head]
    for name in ("pairs_in", *filters.FILTERS, "pairs_out"):
        values = [c[name] if name.startswith("pairs") else c["removed"][name] for c in columns]
        lines.append(f"{name:<16}" + "".join(f"{v:>{width + 2},}" for v in values))
    share = 100 * report["pairs_out"] / max(report["pairs_in"], 1)
    lines.append(f"kept {share:.1f} % in {report['seconds']:.1f} s ({report['pairs_per_s']:,.0f}"
                 f" pairs/s); report: {report['outputs']['report']}")  # fmt: skip
    lines += [f"note: {note}" for note in report["notes"]]
    return "\n".join(lines)
