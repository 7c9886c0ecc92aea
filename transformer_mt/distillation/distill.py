"""`tmt distill`: sequence-level knowledge distillation (Kim & Rush, 2016) in one command.

    tmt distill -m TEACHER [-m TEACHER2 ...] -c student -o DIR

The config is the student's (its model, schedule and data). Each step writes into DIR and is
reused when the command runs again:

1. DIR/original{i}.{src,tgt}: the training corpora of data.train, read as `tmt train` reads them
   (any source; corpus i of a mixture keeps its weight and tag);
2. DIR/teacher{i}.txt: the teacher (a model, an average, an ensemble, an imported OPUS-MT model)
   translates those sources with the file job of `tmt translate` (resumable chunk by chunk), beam
   distill.beam_size; with distill.nbest > 1, that many hypotheses a source, and
3. DIR/distilled{i}.{src,tgt}: of a source's hypotheses the one nearest its reference by
   sentence-level chrF (or BLEU), Kim & Rush's "sequence-level interpolation" and Marian's
   students' recipe; the teacher's best when nbest is 1;
4. DIR/student: `tmt train` of the config's model on the distilled corpora (each with its
   original's weight), mixed with the originals at distill.original_weight (0: distilled only);
   resumed as any run is, averaged at the end as train.average_last says;
5. DIR/eval: teacher and student translate distill.eval_split; sacreBLEU's paired tests
   (evaluate.compare) and each one's sentences/s on this machine;
6. DIR/student-{format}: the student exported (`tmt export`, parity-checked), if distill.export;
7. the student's shortlist (`tmt shortlist` from the distilled corpora, what it learned to output)
   beside it, if distill.shortlist; decoding uses it only when asked (decode.shortlist).

DIR/distill.json records what each step was made from (the corpora's and the teacher's
fingerprints, the settings) and the SHA-256 of every file it wrote, the export's included, by
paths relative to DIR (a copied or moved DIR verifies its own files). What tmt reads back is
verified: a file that no longer matches its record is made again from its step; a different
teacher, corpus, language pair or setting is refused, naming it, before anything is written,
rather than mixed into DIR. A record that is not tmt's is refused, not overwritten.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformer_mt.common import exits, files, languages, textio
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, Corpus, apply_overrides, to_dict
from transformer_mt.data import corpus
from transformer_mt.distillation import record
from transformer_mt.exchange import export
from transformer_mt.network import ensemble
from transformer_mt.runs import run
from transformer_mt.training import train
from transformer_mt.translation import bulk, evaluate, shortlisting, translate

logger = logging.getLogger("tmt")

MANIFEST = "distill.json"
FORMAT = 1


def distill(
    cfg: Config, teachers: Sequence[str | Path], out: Path, weights: str | None = None
) -> dict[str, Any]:
    """Run (or resume) the distillation of `teachers` (an ensemble weighted by `weights`, "0.6,0.4")
    into cfg's model in `out`; the report."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise TmtError("tmt distill runs as one process (its translate and train steps each run"
                       " under torchrun on their own)")  # fmt: skip
    textio.check_directory(out, "-o")
    if out.exists() and not out.is_dir():
        raise TmtError(f"{out}: not a directory; {{output}} names the distillation's directory",
                       mentions=["output"])  # fmt: skip
    foreign = (
        out.is_dir()
        and not (out / MANIFEST).exists()
        and any(not entry.name.startswith(".") for entry in out.iterdir())
    )
    if foreign:  # a run directory, a teacher, a user's files: never written into
        raise TmtError(f"{out}: exists and holds no distillation ({MANIFEST}); choose another"
                       " {output}", mentions=["output"])  # fmt: skip
    lock = run.RunLock(out, hint="or distill into another {output}", mentions=["output"])
    lock.acquire()
    try:
        return _Distillation(cfg, teachers, ensemble.parse_weights(weights), out).run()
    finally:
        lock.release()


class _Distillation:
    """The steps, each skipped when DIR/distill.json says it is done and its files verify."""

    def __init__(
        self, cfg: Config, teachers: Sequence[str | Path], weights: Sequence[float] | None,
        out: Path,
    ) -> None:  # fmt: skip
        self.cfg, self.out = cfg, out
        self.teachers, self.weights = [str(t) for t in teachers], weights
        self.src, self.tgt = cfg.data.src_lang, cfg.data.tgt_lang
        self.manifest = record.read(out / MANIFEST, FORMAT)
        self.reused: list[str] = []
        self.teacher: translate.Translator | None = None

    def run(self) -> dict[str, Any]:
        self._load_teacher()  # a missing or other teacher is refused before anything is written
        self._check_selection()  # ... and a selection the trained student did not learn from
        corpora = self._originals()
        distilled = self._distilled(corpora)
        student_run = self._student(corpora, distilled)
        evaluation = self._evaluate(student_run)
        exported = self._export(student_run)
        listed = self._shortlist(student_run)
        return {"out": str(self.out), "teacher": self.manifest["teacher"], "corpora": distilled,
                "student": str(student_run), "evaluation": evaluation, "export": exported,
                "shortlist": listed, "reused": self.reused}  # fmt: skip

    # --- 1. the original corpora ------------------------------------------------------------------

    def _originals(self) -> list[dict[str, Any]]:
        splits = corpus.open_training(self.cfg.data)
        identity = [{"key": s.key, "fingerprint": s.fingerprint, "weight": s.weight, "tag": s.tag}
                    for s in splits]  # fmt: skip
        done = self.manifest.get("originals")
        if done and done["identity"] != identity:
            changed = next((k["key"] for k in identity if k not in done["identity"]), "data.train")
            raise TmtError(f"{self.out}: distilled from other training corpora ({changed} differs);"
                           " distill into another {output}", mentions=["output"])  # fmt: skip
        if done and self._verified(done["files"]):
            self.reused.append("originals")
            return done["corpora"]
        rows = []
        for i, split in enumerate(splits):
            prefix = self.out / f"original{i}"
            with files.atomic_file(_side(prefix, self.src)) as src, \
                    files.atomic_file(_side(prefix, self.tgt)) as tgt:  # fmt: skip
                pairs = 0
                for chunk in split.pairs(20_000, as_trained=True):
                    src.write("".join(_line(s) for s, _ in chunk).encode())
                    tgt.write("".join(_line(t) for _, t in chunk).encode())
                    pairs += len(chunk)
            rows.append({"prefix": prefix.name, "key": split.key, "origin": split.origin,
                         "weight": split.weight, "tag": split.tag, "pairs": pairs})  # fmt: skip
        paths = [_side(self._at(r["prefix"]), lang) for r in rows for lang in (self.src, self.tgt)]
        self._record("originals", {"identity": identity, "corpora": rows,
                                   "files": self._hashes(paths)})  # fmt: skip
        return rows

    # --- 2, 3. the teacher's translations, the hypothesis nearest each reference ------------------

    def _load_teacher(self) -> translate.Translator:
        if self.teacher is None:
            d = self.cfg.distill
            settings = [f"decode.beam_size={d.beam_size}", f"decode.nbest={d.nbest}",
                        f"decode.chunk_lines={self.cfg.decode.chunk_lines}"]  # fmt: skip
            self.teacher = translate.load_ensemble(self.teachers, settings, self.weights)
            self._check_languages(self.teacher)
            # What changes the teacher's output: a file job's decode keys, not chunk_lines
            decode = {k: v for k, v in to_dict(self.teacher.config)["decode"].items()
                      if k not in (*bulk.NOT_IN_IDENTITY, "chunk_lines")}  # fmt: skip
            identity = {"models": self.teachers, "fingerprint": translate.fingerprint(self.teacher),
                        "origin": self.teacher.origin, "decode": decode}  # fmt: skip
            known = self.manifest.get("teacher")
            if known and translate.named_before(self.teacher, known["fingerprint"]):
                identity["fingerprint"] = known["fingerprint"]  # an earlier tmt's name for it
            if known and known["fingerprint"] != identity["fingerprint"]:
                raise TmtError(f"{self.out}: distilled from another teacher ({known['origin']});"
                               " distill into another {output}", mentions=["output"])  # fmt: skip
            changed = sorted(k for k, v in identity["decode"].items()
                             if known and known["decode"].get(k) != v)  # fmt: skip
            if changed:
                raise TmtError(f"{self.out}: its teacher decoded with other settings (decode."
                               f"{changed[0]}); distill into another {{output}}",
                               mentions=["output"])  # fmt: skip
            self._record("teacher", identity)
        return self.teacher

    def _selection(self) -> dict[str, Any]:
        d = self.cfg.distill
        return {"nbest": d.nbest, "select_by": d.select_by}

    def _check_selection(self) -> None:
        """A student trained on pairs chosen otherwise (distill.select_by, distill.nbest) is
        refused before anything is written, naming the setting."""
        done, student = self.manifest.get("distilled"), self.manifest.get("student")
        if not (done and student and (self.out / "student" / "checkpoints").exists()):
            return
        for key, value in self._selection().items():
            if done["selection"].get(key) != value:
                raise TmtError(
                    f"{self.out}: its student was trained on pairs chosen with distill.{key}="
                    f"{done['selection'].get(key)} (not {value}); distill with that, or into"
                    " another {output}", mentions=["output"],
                )  # fmt: skip

    def _check_languages(self, teacher: translate.Translator) -> None:
        """The teacher translates the student's pair (a multi-target teacher: into one of its
        languages), whatever code form each names it by (de, deu, ger)."""
        data, theirs = self.cfg.data, teacher.config.data
        codes = [c[2:-2] for c in teacher.tokenizer.language_codes]
        targets_ok = (
            any(languages.same_language(c, data.tgt_lang) for c in codes)
            if codes
            else languages.same_language(theirs.tgt_lang, data.tgt_lang)
        )
        if not languages.same_language(theirs.src_lang, data.src_lang) or not targets_ok:
            into = "/".join(codes) if codes else theirs.tgt_lang
            raise TmtError(
                f"{teacher.origin}: translates {theirs.src_lang}→{into}; the student learns"
                f" {data.src_lang}→{data.tgt_lang} (data.src_lang, data.tgt_lang): give a teacher"
                " of the student's pair"
            )

    def _distilled(self, corpora: list[dict[str, Any]]) -> list[dict[str, Any]]:
        selection = self._selection()
        done = self.manifest.get("distilled")
        translations = self.manifest.get("translations", {})
        teacher_outputs = {f"teacher{i}.txt": translations.get(str(i), "")
                           for i in range(len(corpora))}  # fmt: skip
        if (done and done["selection"] == selection
                and self._verified({**done["files"], **teacher_outputs})):  # fmt: skip
            self._load_teacher()  # the same teacher, or a refusal
            self.reused.append("distilled")
            return done["corpora"]
        rows = []
        for i, original in enumerate(corpora):
            output = self.out / f"teacher{i}.txt"
            recorded = translations.get(str(i))
            resumed = 0
            if not (recorded and self._verified({output.name: recorded})):
                resumed = self._translate(self._at(original["prefix"]), original["tag"], output,
                                          i)  # fmt: skip
            else:
                self._load_teacher()
                self.reused.append(f"teacher{i}")
            row = self._select(self._at(original["prefix"]), output, i, original)
            rows.append({**row, "teacher_output": output.name, "resumed_chunks": resumed})
        paths = [_side(self._at(r["prefix"]), lang) for r in rows for lang in (self.src, self.tgt)]
        self._record("distilled", {"selection": selection, "corpora": rows,
                                   "files": self._hashes(paths)})  # fmt: skip
        return rows

    def _translate(self, original: Path, tag: str, output: Path, i: int) -> int:
        """The teacher's translations of corpus i into `output`; the chunks a killed job had
        already committed."""
        teacher = self._load_teacher()
        source = _side(original, self.src)
        if tag:  # the teacher reads a source as training does: the corpus's tag, a space, it
            ids = teacher.tokenizer.tag_ids(tag)  # >>de<< is the model's >>deu<< (tag_ids)
            if ids is not None and len(ids) == 1:
                tag = teacher.tokenizer.id_to_piece(ids[0], side="source")
            source = self.out / f"teacher{i}.input"
            with files.atomic_file(source) as handle:
                for line in textio.read_text_file(_side(original, self.src), "input"):
                    handle.write(_line(f"{tag} {line}").encode())
        logger.info("the teacher translates %s (beam %d, %d-best)", source,
                    teacher.config.decode.beam_size, teacher.config.decode.nbest)  # fmt: skip
        # A file job of a killed run resumes; a finished output of an unrecorded run is redone.
        job = output.with_name(output.name + bulk.JOB_SUFFIX)
        report = bulk.translate_job(teacher, str(source), str(output), overwrite=not job.exists())
        self.manifest.setdefault("translations", {})[str(i)] = files.sha256_file(output)  # by i
        self._record("translations", self.manifest["translations"])
        shutil.rmtree(job, ignore_errors=True)  # distill.json records it now: the job's record goes
        logger.info("teacher: %d lines, %d chunks resumed", report["lines"],
                    report["resumed_chunks"])  # fmt: skip
        return int(report["resumed_chunks"])

    def _select(self, original: Path, output: Path, i: int, row: dict[str, Any]) -> dict:
        """DIR/distilled{i}: each source with its chosen hypothesis; sources whose hypotheses
        are all empty are left out."""
        sources = textio.read_text_file(_side(original, self.src), "input")
        references = textio.read_text_file(_side(original, self.tgt), "ref")
        chosen = choose(_hypotheses(output, len(sources), self.cfg.distill.nbest), references,
                        self.cfg.distill.select_by)  # fmt: skip
        prefix = self.out / f"distilled{i}"
        kept = [j for j, text in enumerate(chosen) if text.strip()]
        with files.atomic_file(_side(prefix, self.src)) as src, \
                files.atomic_file(_side(prefix, self.tgt)) as tgt:  # fmt: skip
            src.write("".join(_line(sources[j]) for j in kept).encode())
            tgt.write("".join(_line(chosen[j]) for j in kept).encode())
        same = sum(chosen[j] == references[j] for j in kept)
        return {
            **row,
            "prefix": prefix.name,
            "pairs": len(kept),
            "empty_left_out": len(sources) - len(kept),
            "equal_to_reference": same,
        }

    # --- 4. the student ---------------------------------------------------------------------------

    def _student(self, originals: list[dict], distilled: list[dict]) -> Path:
        student_dir = self.out / "student"
        mixture = [Corpus(split=str(self._at(r["prefix"])), source="files", weight=r["weight"],
                          tag=r["tag"]) for r in distilled]  # fmt: skip
        w = self.cfg.distill.original_weight
        mixture += [Corpus(split=str(self._at(r["prefix"])), source="files",
                           weight=r["weight"] * w, tag=r["tag"])
                    for r in originals if w > 0]  # fmt: skip
        data = dataclasses.replace(self.cfg.data, train=tuple(mixture))
        schedule = dataclasses.replace(self.cfg.train, out_dir=str(student_dir))
        cfg = dataclasses.replace(self.cfg, data=data, train=schedule)
        trained_on = self.manifest["distilled"]["files"]
        known = self.manifest.get("student")
        if known and known["trained_on"] != trained_on and (student_dir / "checkpoints").exists():
            raise TmtError(f"{student_dir}: trained on an earlier distillation; remove it or"
                           " distill into another {output}", mentions=["output"])  # fmt: skip
        finished = bool(known and known["trained_on"] == trained_on and known.get("finished"))
        # The config the run was first trained with: what a resume is compared against.
        trained_with = to_dict(cfg)
        if known and known["trained_on"] == trained_on and isinstance(known.get("config"), dict):
            trained_with = known["config"]
            cfg = record.moved(cfg, trained_with, student_dir)  # the same pairs, read from here
        self._record("student", {"trained_on": trained_on, "run": student_dir.name,
                                 "config": trained_with})  # fmt: skip
        summary = train.train(cfg)  # a finished run trains nothing and writes nothing
        if summary["stop"] in exits.SIGNAL_EXIT:
            raise TmtError(
                f"{student_dir}: training stopped by {summary['stop']}; run the same"
                " command again to resume",
                exit_code=exits.SIGNAL_EXIT[summary["stop"]],
            )
        if summary["stop"] in ("non_finite", "out_of_memory"):
            raise TmtError(f"{student_dir}: training stopped ({summary['stop']}); see its"
                           " metrics.jsonl")  # fmt: skip
        if finished:
            self.reused.append("student")
        self._record("student", {"trained_on": trained_on, "run": student_dir.name,
                                 "config": trained_with, "finished": True,
                                 "stop": summary["stop"], "step": summary["step"]})  # fmt: skip
        return student_dir

    # --- 5. teacher against student ---------------------------------------------------------------

    def _evaluate(self, student_dir: Path) -> dict[str, Any]:
        split = self.cfg.distill.eval_split
        student = translate.load_translator(student_dir)
        identity = {"student": translate.fingerprint(student), "split": split,
                    "student_decode": to_dict(student.config)["decode"]}  # fmt: skip
        done = self.manifest.get("evaluation")
        if done and done["identity"] == identity and self._verified(done["files"]):
            self.reused.append("evaluation")
            return done["report"]
        sources, references = corpus.read_split(self.cfg.data, f"data.{split}")
        teacher = self._load_teacher()
        teacher = dataclasses.replace(
            teacher, config=apply_overrides(teacher.config, ["decode.nbest=1"])
        )
        systems, speed, paths = [], {}, []
        for name, translator in (("teacher", teacher), ("student", student)):
            start = time.perf_counter()
            hypotheses = translate.translate_text(translator, sources)
            seconds = time.perf_counter() - start
            speed[name] = {"seconds": round(seconds, 2),
                           "sentences_per_s": round(len(sources) / seconds, 1),
                           "beam_size": translator.config.decode.beam_size,
                           "parameters": translator.parameters}  # fmt: skip
            path = self.out / "eval" / f"{name}.{split}.{self.tgt}"
            files.atomic_write(path, "".join(_line(h) for h in hypotheses).encode())
            systems.append((name, hypotheses))
            paths.append(path)
        report = {
            "split": split,
            "speed": speed,
            "comparison": evaluate.compare(systems, references, split=split, cfg=self.cfg),
        }
        self._record("evaluation", {"identity": identity, "report": report,
                                    "files": self._hashes(paths)})  # fmt: skip
        return report

    # --- 6. the export ----------------------------------------------------------------------------

    def _export(self, student_dir: Path) -> dict[str, Any] | None:
        d = self.cfg.distill
        if d.export == "none":
            return None
        destination = self.out / f"student-{d.export}"
        identity = {"student": self.manifest["evaluation"]["identity"]["student"],
                    "format": d.export, "quantization": d.quantization}  # fmt: skip
        done = self.manifest.get("export")
        if done and done["identity"] == identity and done.get("files") and self._verified(
            done["files"]
        ):  # fmt: skip
            self.reused.append("export")
            return done["report"]
        quantization = None if d.quantization == "none" else d.quantization
        report = export.export(student_dir, d.export, destination, overwrite=True,
                               quantization=quantization)  # fmt: skip
        written = sorted(p for p in destination.rglob("*") if p.is_file())
        self._record("export", {"identity": identity, "report": report,
                                "files": self._hashes(written)})  # fmt: skip
        return report

    # --- 7. the student's shortlist ---------------------------------------------------------------

    def _shortlist(self, student_dir: Path) -> dict[str, Any] | None:
        if not self.cfg.distill.shortlist:  # made again when the student changes
            return None
        identity = {"student": self.manifest["evaluation"]["identity"]["student"]}
        done = self.manifest.get("shortlist")
        if done and done["identity"] == identity and self._verified(done["files"]):
            self.reused.append("shortlist")  # where it is now (DIR may have moved)
            return {**done["report"], "output": str(self._at(next(iter(done["files"]))))}
        report = shortlisting.make(str(student_dir), overwrite=True)
        self._record("shortlist", {"identity": identity, "report": report,
                                   "files": self._hashes([Path(report["output"])])})  # fmt: skip
        return report

    # --- the record -------------------------------------------------------------------------------

    def _at(self, name: str) -> Path:
        """A path of the record: relative to DIR (an absolute one, of an earlier tmt, as is)."""
        return self.out / name

    def _hashes(self, paths: Sequence[Path]) -> dict[str, str]:
        """The SHA-256 of each file, by its path relative to DIR."""
        return {path.relative_to(self.out).as_posix(): files.sha256_file(path) for path in paths}

    def _verified(self, recorded: dict[str, str]) -> bool:
        """Every file as recorded; one that is not is named, and its step made again."""
        for name, digest in recorded.items():
            path = self._at(name)
            if not digest or not path.is_file() or files.sha256_file(path) != digest:
                logger.warning("%s: missing or changed since it was written; making it again", path)
                return False
        return True

    def _record(self, step: str, value: Any) -> None:
        self.manifest[step] = value
        self.manifest["format"] = FORMAT
        data = json.dumps(self.manifest, indent=1, sort_keys=True) + "\n"
        files.atomic_write(self.out / MANIFEST, data.encode())


def choose(candidates: list[list[str]], references: Sequence[str], metric: str) -> list[str]:
    """Of each line's hypotheses (best first), the one with the highest sentence-level score
    against its reference; ties to the teacher's better one."""
    from sacrebleu.metrics import BLEU, CHRF

    scorer = CHRF() if metric == "chrf" else BLEU(effective_order=True)
    chosen = []
    for hypotheses, reference in zip(candidates, references, strict=True):
        if len(hypotheses) == 1:
            chosen.append(hypotheses[0])
            continue
        scores = [scorer.sentence_score(h, [reference]).score for h in hypotheses]
        chosen.append(hypotheses[scores.index(max(scores))])
    return chosen


def _hypotheses(path: Path, lines: int, nbest: int) -> list[list[str]]:
    """The teacher's output: one line a source, or with nbest > 1 rows "index<TAB>score<TAB>text"
    (streams.output_rows), grouped by source."""
    rows = textio.read_text_file(path, "input")
    if nbest == 1:
        found: list[list[str]] = [[row] for row in rows]
    else:
        found = [[] for _ in range(lines)]
        for number, row in enumerate(rows, 1):
            index, _, text = [*row.split("\t", 2), "", ""][:3]
            if not index.isdigit() or int(index) >= lines:
                raise TmtError(f"{path}:{number}: not an n-best row of this corpus")
            found[int(index)].append(text)
    if len(found) != lines:
        raise TmtError(f"{path}: {len(found)} translations for {lines} sources")
    return [hyps or [""] for hyps in found]


def format_report(report: dict[str, Any]) -> str:
    """The report for people: the corpora, teacher against student, where the files are."""
    lines = [f"teacher: {report['teacher']['origin']}"]
    for row in report["corpora"]:
        where = Path(report["out"]) / row["prefix"]
        lines.append(f"{row['key']}: {row['pairs']:,} distilled pairs ({row['empty_left_out']}"
                     f" empty left out) in {where}.{{src,tgt}}")  # fmt: skip
    evaluation = report["evaluation"]
    systems = {row["system"]: row for row in evaluation["comparison"]["systems"]}
    for name in ("teacher", "student"):
        scores, speed = systems[name], evaluation["speed"][name]
        p = scores["bleu"]["p_bootstrap"]
        lines.append(
            f"{name:<8} BLEU {scores['bleu']['score']:6.2f}  chrF {scores['chrf']['score']:6.2f}"
            f"  {speed['sentences_per_s']:8.1f} sentences/s (beam {speed['beam_size']},"
            f" {speed['parameters']:,} parameters)" + (f"  p = {p:.4f}" if p is not None else "")
        )
    lines.append(f"({evaluation['split']} split; student: {report['student']})")
    if report["export"]:
        lines.append(f"export: {report['export']['output']}")
    if report.get("shortlist"):
        lines.append(f"shortlist: {report['shortlist']['output']} (used with --shortlist auto)")
    if report["reused"]:
        lines.append(f"reused: {', '.join(report['reused'])}")
    return "\n".join(lines)


def _side(prefix: Path, lang: str) -> Path:
    return prefix.with_name(f"{prefix.name}.{lang}")


def _line(text: str) -> str:
    return text.replace("\n", " ").replace("\r", " ") + "\n"
