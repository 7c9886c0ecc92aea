"""Translating a stream or a file: exactly one output line (or nbest rows) per input line, the
target prefixes read beside the input, the glossary report written beside the output. A stream
is translated as its lines arrive; a file into a file is bulk.py's resumable job, which writes
its chunks with the same rows.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO, TextIO

from transformer_mt.common import files, textio
from transformer_mt.common.exits import TmtError
from transformer_mt.data import glossary as glossaries
from transformer_mt.network.alignment import pharaoh
from transformer_mt.network.search import Hypothesis
from transformer_mt.translation.decoding import translate_lines
from transformer_mt.translation.sources import readable
from transformer_mt.translation.translate import Translator, detokenize


def output_rows(
    translator: Translator, hyps: Sequence[Hypothesis], index: int, nbest: int
) -> list[str]:
    """What translate writes for input line `index` (from 0): its best translation, or with
    nbest > 1 that many rows "index<TAB>score<TAB>text" (rows of zeros for an empty line).
    With decode.alignment, each ends with its alignment: "text ||| i-j ..." (Marian's form), or
    a fourth column of n-best rows."""
    aligned = translator.config.decode.alignment != "none"
    if nbest == 1:
        best = hyps[0] if hyps else Hypothesis([], 0.0, 0.0, ())
        text = detokenize(translator, [best.tokens])[0]
        return [f"{text} ||| {pharaoh(best.alignment or ())}\n" if aligned else text + "\n"]
    texts = detokenize(translator, [h.tokens for h in hyps])
    rows = [f"{index}\t{h.score:.4f}\t{t}" + (f"\t{pharaoh(h.alignment or ())}" if aligned else "")
            for h, t in zip(hyps, texts, strict=True)]  # fmt: skip
    empty = f"{index}\t0.0000\t" + ("\t" if aligned else "")
    return [row + "\n" for row in rows or [empty] * nbest]


def translate_stream(
    translator: Translator,
    source: BinaryIO,
    sink: TextIO,
    where: str = "input",
    prefixes: Prefixes | None = None,
    report: TextIO | None = None,
) -> int:
    """Translate lines from `source` to `sink` as they arrive: a chunk is whatever is already
    waiting (up to decode.buffer_lines), so a pipe is translated in batches and an interactive
    line right away. Returns the number of lines. Bytes split on b"\\n" only; invalid UTF-8 is
    replaced (and reported, naming `where`) so every input line gets its output line.
    `prefixes`: the target prefix of each line, in step with the input; `report`: where the
    glossary report goes, one JSON object a line (glossary.report)."""
    decode = translator.config.decode
    count = 0
    for chunk in textio.waiting_chunks(textio.stream_lines(source, where), decode.buffer_lines):
        forced = prefixes.take(len(chunk)) if prefixes else None
        for rows, report_line in output_and_report(translator, chunk, count, forced):
            sink.write(rows)
            if report is not None:
                report.write(report_line)
        sink.flush()
        if report is not None:
            report.flush()
        count += len(chunk)
    return count


def output_and_report(
    translator: Translator, lines: list[str], first: int, prefixes: list[str] | None
) -> list[tuple[str, str]]:
    """Per line: what translate writes for it (output_rows) and its glossary report line."""
    glossary, decode = translator.glossary, translator.config.decode
    # what the model reads: matched, reported
    lines = readable(translator, lines, range(first, first + len(lines)))
    matches = glossary.match_lines(lines) if glossary is not None else [[] for _ in lines]
    # Scores are printed with n-best lists only.
    hypotheses = translate_lines(
        translator, lines, first, prefixes, matches, scores=decode.nbest > 1
    )
    out = []
    for i, hyps in enumerate(hypotheses):
        rows = "".join(output_rows(translator, hyps, index=first + i, nbest=decode.nbest))
        if glossary is None:
            out.append((rows, ""))
            continue
        best = hyps[0].terms if hyps else None
        line = glossaries.report(first + i + 1, lines[i], matches[i], best)
        out.append((rows, json.dumps(line, ensure_ascii=False) + "\n"))
    return out


class Prefixes:
    """The target prefixes of the input's lines, read whole before anything is translated (the
    counts compared first: a refusal comes before any output), handed out in step with the
    input (translate --prefix)."""

    def __init__(self, lines: list[str]) -> None:
        self._lines, self._read = lines, 0

    def take(self, count: int) -> list[str]:
        """The prefixes of the next `count` input lines."""
        taken = self._lines[self._read : self._read + count]
        self._read += count
        return taken


def _read_prefixes(prefix_path: str, input_path: str) -> tuple[Prefixes, BinaryIO | None]:
    """The prefix file read whole and checked against the input's line count; an input that is
    no regular file (stdin, a FIFO) is read whole here too, to be counted before anything is
    written (returned as a stream), so --prefix gives up streaming stdin."""
    if prefix_path == input_path == textio.STDIO:  # the prefixes would take every line
        raise TmtError("-: the input reads stdin too; give one of them as a file",
                       param="prefix")  # fmt: skip
    with textio.open_input(prefix_path, param="prefix") as handle:
        prefixes = list(textio.stream_lines(handle, prefix_path))
    held = None
    if input_path == textio.STDIO or not Path(input_path).is_file():
        with textio.open_input(input_path) as source:
            held = io.BytesIO(source.read())
        lines = sum(1 for _ in files.split_lines(held))
        held.seek(0)
    else:
        lines = textio.count_lines(input_path)
    if len(prefixes) != lines:  # refused before anything is written
        raise TmtError(
            f"{prefix_path}: {len(prefixes)} lines, but the input has {lines}: one target prefix"
            " (maybe empty) an input line", param="prefix",
        )  # fmt: skip
    return Prefixes(prefixes), held


def translate_file(
    translator: Translator,
    input_path: str,
    output_path: str,
    overwrite: bool = False,
    prefix_path: str | None = None,
    report_path: str | None = None,
) -> int:
    """Translate `input_path` ("-": stdin, streamed) into `output_path` ("-": stdout). A file
    output appears complete or not at all (an interrupted or failed translation leaves the old
    content); textio.check_output says what it may be. Returns the line count. `prefix_path`: a
    target prefix for each input line; the line counts are compared before anything runs (so,
    with a prefix file, stdin is read whole first). `report_path`: the glossary report."""
    inputs = [input_path] + ([prefix_path] if prefix_path else [])
    outputs = [p for p in (output_path, report_path) if p and _replaced_whole(p)]
    with contextlib.ExitStack() as locks:
        for path in outputs:  # one writer: the checks below hold while it writes
            textio.check_path(path)
            locks.enter_context(textio.OutputLock(path))
        return _translate_file(translator, input_path, output_path, overwrite, prefix_path,
                               report_path, inputs)  # fmt: skip


def _replaced_whole(path: str) -> bool:
    """A file output (written aside and renamed), not stdout, a device or a FIFO."""
    return path != textio.STDIO and (not Path(path).exists() or Path(path).is_file())


def _translate_file(
    translator: Translator, input_path: str, output_path: str, overwrite: bool,
    prefix_path: str | None, report_path: str | None, inputs: list[str],
) -> int:  # fmt: skip
    textio.check_output(output_path, inputs=inputs, overwrite=overwrite)
    if report_path is not None:
        check_report(translator, report_path, [*inputs, output_path], overwrite)
    prefixes, held = _read_prefixes(prefix_path, input_path) if prefix_path else (None, None)
    where = "stdin" if input_path == textio.STDIO else input_path
    with (
        contextlib.nullcontext(held) if held else textio.open_input(input_path) as source,
        textio.open_output(output_path) as sink,
        textio.open_output(report_path, param="glossary_report") if report_path
        else contextlib.nullcontext() as report,
    ):  # fmt: skip
        return translate_stream(
            translator, source, sink, where=where, prefixes=prefixes, report=report
        )


def check_report(
    translator: Translator, report_path: str, others: Sequence[str], overwrite: bool
) -> None:
    """The glossary report: only with a glossary, never one of the command's other files
    (`others`: its inputs, then its output)."""
    if translator.glossary is None:
        raise TmtError("needs a glossary: give it with --glossary FILE (glossary.path)",
                       param="glossary_report")  # fmt: skip
    if report_path == others[-1]:  # the output: one stream, one file, for two things
        raise TmtError(f"{report_path}: is the output; choose another",
                       param="glossary_report")  # fmt: skip
    textio.check_output(report_path, inputs=others, overwrite=overwrite, param="glossary_report")
