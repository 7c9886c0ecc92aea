"""Translate a file in committed chunks, over one process or many (torchrun), resumable.

    tmt translate -m MODEL -i BIG.txt -o OUT.txt
    torchrun --nproc_per_node=N -m transformer_mt translate -m MODEL -i BIG.txt -o OUT.txt

The input is cut into chunks of decode.chunk_lines lines. Beside the output, OUT.txt.tmt-job/
holds job.json (the input's SHA-256, the model's fingerprint, the decoding options, the target
prefix file's SHA-256 if there is one) and, per
finished chunk, its text (NNNNNNNN.txt) and then its commit record (NNNNNNNN.json: its rows and
SHA-256), each written atomically: a chunk is committed when its record exists and its text
matches it. Committed chunks are verified, not trusted: the plan of a resume re-translates one
whose text no longer matches its record (and says so), and assembly hashes every chunk as it copies
it. Rank r takes every world_size-th chunk still missing; when all are there, rank 0 writes OUT.txt
(atomically, in input order, one line per input line, or nbest rows) and removes the job
directory. The same
command after a kill, a lost rank or a full disk translates only the missing chunks; a different
model, input or decoding option is refused, naming it. Sampling draws from each line's own random
stream (search.line_uniforms), so 1 process, N processes and a resumed job write the same bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from transformer_mt.common import distributed, exits, faults, files, finished, textio
from transformer_mt.common.distributed import DistInfo
from transformer_mt.common.exits import TmtError
from transformer_mt.runs import run
from transformer_mt.translation import job_identity, streams
from transformer_mt.translation.translate import Translator

logger = logging.getLogger("tmt")

JOB_SUFFIX = files.JOB_SUFFIX
JOB_FILE = job_identity.JOB_FILE
NOT_IN_IDENTITY = job_identity.NOT_IN_IDENTITY


@dataclasses.dataclass(frozen=True)
class Plan:
    """What rank 0 found and every rank follows: the job directory and where each chunk starts."""

    job_dir: str
    offsets: list[int]  # byte offset of each chunk's first line
    lines: int  # lines in the input
    missing: list[int]  # chunks not yet committed
    prefix: str | None = None  # the target prefix file (one line an input line), if any
    prefix_offsets: list[int] = dataclasses.field(default_factory=list)  # ... its chunks' starts
    report: str | None = None  # the glossary report's path, if one is written
    identity: dict[str, Any] = dataclasses.field(default_factory=dict)  # job.json's
    done: bool = False  # this very job finished before: nothing to translate or write


def is_bulk(
    input_path: str,
    output_path: str,
    prefix_path: str | None = None,
    report_path: str | None = None,
) -> bool:
    """A file into a file (not stdin, stdout, a device or a FIFO): the resumable path, which
    reads its input (and prefix file) again on a resume. What does not exist, or is a directory,
    comes here too, to be named (textio.regular_file)."""
    extra = [p for p in (prefix_path, report_path) if p]
    paths = [input_path, output_path, *extra]
    return all(path != "-" and (not Path(path).exists() or Path(path).is_file()
                                or Path(path).is_dir()) for path in paths)  # fmt: skip


def translate_job(
    translator: Translator,
    input_path: str,
    output_path: str,
    overwrite: bool = False,
    prefix_path: str | None = None,
    report_path: str | None = None,
) -> dict[str, Any]:
    """Translate `input_path` into `output_path` as one resumable job on this process group;
    `prefix_path`: a target prefix for each input line (translate.translate_lines);
    `report_path`: the glossary report, one JSON line an input line, committed with each chunk."""
    textio.check_path(output_path)  # before the job directory beside it is named
    info = distributed.setup(str(translator.device), timeout_s=86_400.0)  # ranks finish unevenly
    output = Path(output_path)
    job_dir = output.with_name(output.name + JOB_SUFFIX)
    lock = run.RunLock(job_dir, hint="or translate into another {output}", mentions=["output"],
                       named=f"{{output}} {output_path} (its job directory {job_dir})")  # fmt: skip
    try:
        plan = _agree(info, lambda: _plan(translator, input_path, output_path, overwrite, lock,
                                           prefix_path, report_path))  # fmt: skip
        mine = plan.missing[info.rank :: info.world_size]
        done = _translate_chunks(translator, input_path, plan, mine, info)
        distributed.barrier(info)
        report = {"lines": plan.lines, "chunks": len(plan.offsets),
                  "resumed_chunks": len(plan.offsets) - len(plan.missing),
                  "translated_chunks": _gather_count(done, info), "done": plan.done}  # fmt: skip
        if info.is_main:
            if not plan.done:
                _assemble(plan, translator, input_path, output_path)
                _finish(plan, output_path)
            report["output"] = output_path
            if plan.report:
                report["glossary_report"] = plan.report
    finally:
        lock.release()
        distributed.cleanup()
    return report


def _finish(plan: Plan, output_path: str) -> None:
    """The output is complete: the job's chunks go, its record of what it wrote stays
    (common/finished.py: the same command again then says it is done)."""
    job_dir = Path(plan.job_dir)
    files.clear_directory(job_dir, keep=[run.LOCK_FILE])
    outputs = [Path(output_path), *([Path(plan.report)] if plan.report else [])]
    finished.mark_done(job_dir, plan.identity, outputs)


def _agree(info: DistInfo, make_plan: Any) -> Plan:
    """Rank 0 plans; every rank gets the plan, or the same one-line refusal."""
    found: list[Any] = [None]
    if info.is_main:
        try:
            found = [make_plan()]
        except TmtError as err:
            found = [err]
    if info.distributed:
        dist.broadcast_object_list(found, src=0)
    if isinstance(found[0], TmtError):
        raise found[0]
    return found[0]


def _gather_count(done: int, info: DistInfo) -> int:
    total = torch.tensor([done], dtype=torch.long)
    if info.distributed and dist.get_backend() == "nccl":
        total = total.to(info.device)
    return int(distributed.all_reduce_sum(total, info).item())


# --- rank 0: the job, its identity and its plan ------------------------------------------------


def _plan(
    translator: Translator,
    input_path: str,
    output_path: str,
    overwrite: bool,
    lock: run.RunLock,
    prefix_path: str | None,
    report_path: str | None = None,
) -> Plan:
    """Check the job against what is on disk, take the job directory (`lock`), find what is left."""
    source, output = textio.regular_file(input_path, "input"), Path(output_path)
    job_dir = output.with_name(output.name + JOB_SUFFIX)
    chunk_lines = translator.config.decode.chunk_lines
    digest, offsets, lines = _scan(source, chunk_lines)
    prefix = _scan_prefix(prefix_path, chunk_lines, lines, input_path)
    identity = job_identity.identity_of(translator, source, digest, prefix[0] if prefix else None)
    if report_path is not None:  # a job writing a report is another job: its chunks hold one
        identity["glossary_report"] = True
    previous = job_identity.read_job(job_dir)
    identity = job_identity.as_named_before(identity, previous, translator)
    if (
        previous is None
        and not overwrite
        and _finished_before(job_dir, identity, output_path, report_path, translator)
    ):
        lock.acquire()  # the same command after it finished: nothing to do
        return Plan(str(job_dir), offsets, lines, [], prefix_path, [], report_path, identity,
                    done=True)  # fmt: skip
    if previous is not None and previous != identity:
        if not overwrite:
            what = job_identity.difference(previous, identity)
            raise TmtError(
                f"{output_path}: {job_dir} is an unfinished job with {what}; run it with the same"
                " ones to finish it, or add {overwrite} to start again",
                param="output", mentions=["overwrite"],
            )  # fmt: skip
        previous = None
    # An output of an earlier session of this job (not yet assembled) is its own to replace.
    inputs = [input_path, *([prefix_path] if prefix_path else [])]
    textio.check_output(output_path, inputs, overwrite=overwrite or previous is not None)
    if report_path is not None:
        streams.check_report(translator, report_path, [*inputs, output_path],
                               overwrite=overwrite or previous is not None)  # fmt: skip
    if not output.parent.is_dir():
        raise TmtError(
            f"{output_path}: cannot write in {output.parent} (no such directory)", param="output"
        )
    _take(job_dir, lock, identity, output_path, new=previous is None)
    reporting = report_path is not None
    missing, altered = _uncommitted(job_dir, len(offsets), lines, translator, reporting)
    missing = sorted(missing + altered)
    if previous is not None and len(missing) < len(offsets):
        logger.info("%s: resuming: %d of %d chunks already translated", output_path,
                    len(offsets) - len(missing), len(offsets))  # fmt: skip
    return Plan(str(job_dir), offsets, lines, missing, prefix_path, prefix[1] if prefix else [],
                report_path, identity)  # fmt: skip


def _take(
    job_dir: Path, lock: run.RunLock, identity: dict[str, Any], output_path: str, new: bool
) -> None:
    """The job directory held (a second job on this output stops here, naming the first), the
    writes of killed ranks swept; for a `new` job, emptied of another's and given its job.json."""
    lock.acquire()
    try:
        files.remove_leftovers(job_dir, [f"*{files.TEMP_SUFFIX}"])
        if new:  # nothing of another job (its chunks, its done.json) may pass for this one's
            files.clear_directory(job_dir, keep=[lock.path.name])
            files.atomic_write(job_dir / JOB_FILE, json.dumps(identity, indent=1).encode())
    except OSError as err:
        reason, code = exits.write_failed(err)
        raise TmtError(
            f"{output_path}: cannot write in {job_dir.parent} ({reason})",
            exit_code=code,
            param="output",
        ) from None


def _finished_before(
    job_dir: Path,
    identity: dict[str, Any],
    output_path: str,
    report_path: str | None,
    translator: Translator,
) -> bool:
    """Whether this very job finished before (common/finished.py: its record, its outputs as it
    wrote them), said in the log; another job's finished output is refused, naming what
    differs."""
    outputs = [Path(output_path), *([Path(report_path)] if report_path else [])]
    kind, recorded = finished.state(job_dir, identity, outputs)
    if kind == "other":  # an earlier tmt's name for this model (job_identity.as_named_before)?
        named = job_identity.as_named_before(identity, recorded, translator)
        if named is not identity:
            kind, recorded = finished.state(job_dir, named, outputs)
    if kind == "other":
        raise TmtError(
            f"{output_path}: the output of a finished job with"
            f" {job_identity.difference(recorded, identity)}; run that job's command (it is"
            " done), or add {overwrite} to translate again", param="output",
            mentions=["overwrite"],
        )  # fmt: skip
    if kind == "done":
        logger.info("%s: done: this job (input, model and settings) finished before; nothing"
                    " translated, nothing written", output_path)  # fmt: skip
    return kind == "done"


def _scan(source: Path, chunk_lines: int) -> tuple[str, list[int], int]:
    """One pass over the input: its SHA-256, the byte offset of every chunk, its line count."""
    digest, offsets, lines, position = hashlib.sha256(), [], 0, 0
    with open(source, "rb") as handle:
        for line in handle:  # split on b"\n"; a last line without one still counts
            if lines % chunk_lines == 0:
                offsets.append(position)
            digest.update(line)
            position += len(line)
            lines += 1
    return digest.hexdigest(), offsets, lines


def _scan_prefix(
    prefix_path: str | None, chunk_lines: int, lines: int, input_path: str
) -> tuple[str, list[int]] | None:
    """The target prefix file's SHA-256 and chunk offsets, if there is one: a line an input line."""
    if prefix_path is None:
        return None
    prefix = textio.regular_file(prefix_path, "prefix")
    digest, offsets, count = _scan(prefix, chunk_lines)
    if count != lines:
        raise TmtError(
            f"{prefix_path}: {count} lines, but {input_path} has {lines}: one target prefix (maybe"
            " empty) an input line", param="prefix",
        )  # fmt: skip
    return digest, offsets


def _uncommitted(
    job_dir: Path, chunks: int, lines: int, translator: Translator, reporting: bool
) -> tuple[list[int], list[int]]:
    """(missing, altered): the chunks with no commit record, and the committed ones whose text
    no longer matches their record (each altered one is reported)."""
    missing, altered = [], []
    for chunk in range(chunks):
        size = _chunk_size(chunk, lines, translator.config.decode.chunk_lines)
        report_rows = size if reporting else None
        _, _, problem = _verified(job_dir, chunk, _rows_of(chunk, lines, translator), report_rows)
        if problem == _NOT_COMMITTED:
            missing.append(chunk)
        elif problem is not None:
            altered.append(chunk)
            _report_altered(job_dir, chunk, problem, translator)
    return missing, altered


def _rows_of(chunk: int, lines: int, translator: Translator) -> int:
    """The rows chunk `chunk` holds when complete: nbest per line."""
    decode = translator.config.decode
    return _chunk_size(chunk, lines, decode.chunk_lines) * decode.nbest


def _report_altered(job_dir: Path, chunk: int, problem: str, translator: Translator) -> None:
    first = chunk * translator.config.decode.chunk_lines + 1
    logger.warning("%s: chunk %d (from line %d): %s; translating it again", job_dir, chunk,
                   first, problem)  # fmt: skip


def _chunk_size(chunk: int, lines: int, chunk_lines: int) -> int:
    return min(chunk_lines, lines - chunk * chunk_lines)


def _chunk_path(job_dir: str | Path, chunk: int) -> Path:
    return Path(job_dir) / f"{chunk:08d}.txt"


def _record_path(job_dir: str | Path, chunk: int) -> Path:
    return Path(job_dir) / f"{chunk:08d}.json"


def _report_path(job_dir: str | Path, chunk: int) -> Path:
    return Path(job_dir) / f"{chunk:08d}.report.jsonl"


_NOT_COMMITTED = "not committed"


def _verified(
    job_dir: Path, chunk: int, rows: int, report_rows: int | None = None
) -> tuple[bytes, bytes, str | None]:
    """(text, report, None) when the chunk is committed and whole: its record names `rows` rows
    and its text has them and the record's SHA-256 (and so its glossary report, when
    `report_rows` is given); else (b"", b"", what is wrong), _NOT_COMMITTED when it has no
    record."""
    try:
        record = json.loads(files.read_plain(_record_path(job_dir, chunk), limit=1 << 16))
    except FileNotFoundError:
        return b"", b"", _NOT_COMMITTED  # never committed, or killed before its record
    except (OSError, ValueError, RecursionError):
        return b"", b"", "its commit record is unreadable"
    if not isinstance(record, dict) or record.get("rows") != rows:
        return b"", b"", f"its commit record does not describe {rows} rows"
    parts = [(_chunk_path(job_dir, chunk), rows, "sha256", "text")]
    if report_rows is not None:
        parts.append((_report_path(job_dir, chunk), report_rows, "report_sha256", "report"))
    found = []
    for path, count, key, what in parts:
        try:
            data = files.read_plain(path)
        except OSError as err:
            return b"", b"", f"its {what} cannot be read ({err.strerror or err})"
        if data.count(b"\n") != count or hashlib.sha256(data).hexdigest() != record.get(key):
            return b"", b"", (f"its {what} does not match its commit record (changed since it"
                              " was written)")  # fmt: skip
        found.append(data)
    return found[0], found[1] if len(found) > 1 else b"", None


def _commit(job_dir: str, chunk: int, text: bytes, rows: int, report: bytes | None) -> None:
    """The chunk's text (and glossary report), then its commit record (rows, SHA-256s): the
    record is the commit."""
    files.atomic_write(_chunk_path(job_dir, chunk), text)
    record = {"rows": rows, "sha256": hashlib.sha256(text).hexdigest()}
    if report is not None:
        files.atomic_write(_report_path(job_dir, chunk), report)
        record["report_sha256"] = hashlib.sha256(report).hexdigest()
    files.atomic_write(_record_path(job_dir, chunk), json.dumps(record).encode())


# --- every rank: translate its chunks, commit each ---------------------------------------------


def _translate_chunks(
    translator: Translator, input_path: str, plan: Plan, chunks: list[int], info: DistInfo
) -> int:
    from tqdm import tqdm

    chunk_lines = translator.config.decode.chunk_lines
    total = sum(_chunk_size(c, plan.lines, chunk_lines) for c in chunks)
    bar = tqdm(total=total, unit="line", disable=not info.is_main, dynamic_ncols=True,
               desc=f"rank 0 of {info.world_size}" if info.distributed else None)  # fmt: skip
    with (
        open(input_path, "rb") as source,
        open(plan.prefix or os.devnull, "rb") as prefix_source,
        bar,
    ):
        for chunk in chunks:
            first = chunk * chunk_lines
            count = _chunk_size(chunk, plan.lines, chunk_lines)
            lines = list(
                _read_chunk(source, input_path, plan.offsets[chunk], first=first, count=count)
            )
            prefixes = None
            if plan.prefix:
                offset = plan.prefix_offsets[chunk]
                prefixes = list(_read_chunk(prefix_source, plan.prefix, offset, first, count))
            rows, report = _rows(translator, lines, first, prefixes)
            text = "".join(rows).encode("utf-8")
            report_text = "".join(report).encode("utf-8") if plan.report else None
            try:
                _commit(plan.job_dir, chunk, text, sum(r.count("\n") for r in rows), report_text)
            except OSError as err:
                reason, code = exits.write_failed(err)
                raise TmtError(
                    f"{plan.job_dir}: cannot commit chunk {chunk} ({reason}); the chunks before"
                    " it are kept: run the same command again to finish",
                    exit_code=code,
                ) from None
            bar.update(len(lines))
            faults.fault_point("chunk", chunk + 1)
    return len(chunks)


def _read_chunk(source: Any, where: str, offset: int, first: int, count: int) -> Iterator[str]:
    """Lines first+1 .. first+count of the input, read from byte `offset`."""
    source.seek(offset)
    for i, line in enumerate(files.split_lines(source)):
        if i == count:
            return
        yield textio.decode_line(line, where, first + i + 1, "warn")[0]


def _rows(
    translator: Translator, lines: list[str], first: int, prefixes: list[str] | None
) -> tuple[list[str], list[str]]:
    """The output rows of these lines (one per line, or nbest tab-separated rows as translate's)
    and their glossary report lines."""
    both = streams.output_and_report(translator, lines, first, prefixes)
    return [rows for rows, _ in both], [line for _, line in both]


# --- rank 0: the output ------------------------------------------------------------------------


def _assemble(plan: Plan, translator: Translator, input_path: str, output_path: str) -> None:
    """The chunks in input order into the output (atomically), each verified as it is copied: a
    chunk altered since it was committed is translated again first (and said so), a missing one
    (a rank failed) ends the job with what to do."""
    job_dir, start = Path(plan.job_dir), time.perf_counter()
    solo = DistInfo(rank=0, world_size=1, local_rank=0, device=translator.device)
    chunk_lines = translator.config.decode.chunk_lines
    try:
        with (
            files.atomic_file(Path(output_path)) as sink,
            files.atomic_file(Path(plan.report)) if plan.report
            else contextlib.nullcontext() as report_sink,
        ):  # fmt: skip
            for chunk in range(len(plan.offsets)):
                rows = _rows_of(chunk, plan.lines, translator)
                report_rows = _chunk_size(chunk, plan.lines, chunk_lines) if plan.report else None
                text, report, problem = _verified(job_dir, chunk, rows, report_rows)
                if problem == _NOT_COMMITTED:
                    raise TmtError(
                        f"{job_dir}: chunk {chunk} is missing (a rank failed?); run the same"
                        " command again to translate only what is missing",
                        exit_code=exits.LOST_RANK,
                    )
                if problem is not None:
                    _report_altered(job_dir, chunk, problem, translator)
                    _translate_chunks(translator, input_path, plan, [chunk], solo)
                    text, report, problem = _verified(job_dir, chunk, rows, report_rows)
                    if problem is not None:
                        raise TmtError(f"{job_dir}: chunk {chunk}: {problem}")
                sink.write(text)
                if report_sink is not None:
                    report_sink.write(report)
    except OSError as err:
        reason, code = exits.write_failed(err)
        raise TmtError(
            f"{output_path}: cannot write ({reason}); the translated chunks are kept in"
            f" {job_dir}: run the same command again",
            exit_code=code,
            param="output",
        ) from None
    logger.debug("assembled %s in %.2f s", output_path, time.perf_counter() - start)
