"""Translating raw text and scoring it: the one path behind `tmt translate`, `tmt evaluate` and the
validation BLEU of training, so the BLEU seen during training is the BLEU `tmt evaluate` reports.

Raw text in, detokenized text out: the sentencepiece model travels inside the checkpoint. Inputs
are sorted by length and batched by tokens; outputs come back in input order, exactly one per input
line. An empty line gives an empty output without running the model; a line longer than the model's
positions is truncated with a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import logging
import os
import queue
import re
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import numpy as np
import torch
import torch.nn.functional as F

from transformer_mt import checkpoint, corpus, distributed, exits, files, run
from transformer_mt.config import Config, apply_overrides
from transformer_mt.data import TokenBucketSampler
from transformer_mt.distributed import DistInfo
from transformer_mt.exits import TmtError
from transformer_mt.model import DecoderCache, Transformer, make_src_mask
from transformer_mt.search import Hypothesis, beam_search, greedy, sample
from transformer_mt.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_SURROGATES = re.compile("[\ud800-\udfff]")
_LINE_BREAKS = re.compile("[\r\n]")


@dataclass(frozen=True)
class Translator:
    """A model ready to translate raw text: the Python face of `tmt translate`.

    from transformer_mt import Translator
    translator = Translator.load("runs/multi30k", device="cpu")
    translator.translate(["Ein Hund rennt."], beam=5)
    """

    model: Transformer  # in eval mode, on `device`, in the decoding precision
    tokenizer: Tokenizer
    config: Config  # the checkpoint's config with the caller's overrides
    device: torch.device
    origin: str  # what was loaded, for messages

    @classmethod
    def load(
        cls, path: str | Path, device: str = "auto", precision: str = "fp32", **decode: Any
    ) -> Translator:
        """A checkpoint, an averaged model or a run directory (its average, else its best, else its
        newest checkpoint); `decode` sets DecodeConfig fields by name (beam_size=5, ...)."""
        overrides = [f"decode.{k}={v}" for k, v in {**decode, "device": device,
                                                      "precision": precision}.items()]  # fmt: skip
        return load_translator(path, overrides)

    def translate(self, lines: Sequence[str], beam: int | None = None, **decode: Any) -> list[str]:
        """The best translation of each line, in order (one per line; "" for an empty line);
        `beam` and `decode` (DecodeConfig fields by name) apply to this call only."""
        if beam is not None:
            decode["beam_size"] = beam
        moved = {"device", "precision"} & set(decode)
        if moved:
            raise TmtError(f"{', '.join(sorted(moved))}: set when loading (Translator.load)")
        if decode:
            overrides = [f"decode.{k}={v}" for k, v in decode.items()]
            translator = dataclasses.replace(self, config=apply_overrides(self.config, overrides))
        else:
            translator = self
        return translate_text(translator, list(lines))


def load_translator(
    path: str | Path, overrides: Sequence[str | tuple[str, str]] = (), average_last: int = 0
) -> Translator:
    """A checkpoint directory, an averaged model, or a run directory (its average, else its best
    checkpoint, else its newest; with average_last=N the average of its newest N), each read
    once, on decode.device in decode.precision."""
    if average_last > 0:
        saved = checkpoint.average(run.newest_models(Path(path), average_last))
        origin = f"average of {', '.join(Path(p).name for p in saved.sources)}"
    else:
        saved = run.load_model(Path(path))
        origin = str(saved.path)
    cfg = apply_overrides(saved.config, overrides)
    fixed = checkpoint.model_differences(saved.config, b"", cfg, b"")
    if fixed:
        raise TmtError(f"--set {', '.join(fixed)}: fixed by the checkpoint ({saved.path})")
    # Under torchrun each process decodes on its own GPU (LOCAL_RANK), as in training.
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    target = distributed.resolve_device(cfg.decode.device, local_rank, key="decode.device")
    tokenizer = saved.tokenizer()
    model = _in_precision(checkpoint.build_model(saved, tokenizer), cfg.decode.precision, target)
    return Translator(model.eval(), tokenizer, cfg, target, origin)


def _in_precision(model: Transformer, precision: str, device: torch.device) -> Transformer:
    """The model on `device` in the decoding precision (decode.precision)."""
    if precision == "fp16" and device.type != "cuda":
        raise TmtError("decode.precision=fp16 needs a GPU (decode.device); use bf16 or fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    return model.to(device=device, dtype=dtype)


# --- translating -------------------------------------------------------------------------------


class _DecodeState:
    """What search.py needs from the model: the decoder cache and source mask, reorderable."""

    def __init__(self, cache: DecoderCache, src_mask: torch.Tensor) -> None:
        self.cache, self.src_mask = cache, src_mask

    def reorder(self, index: torch.Tensor) -> None:
        sentences = self.cache.reorder(index.to(self.src_mask.device))
        if sentences is not None:  # the source mask is per sentence, like the cross K/V
            self.src_mask = self.src_mask.index_select(0, sentences)


@torch.inference_mode()
def translate_lines(
    translator: Translator, lines: Sequence[str], first_line: int = 0
) -> list[list[Hypothesis]]:
    """The n-best hypotheses (token ids) of each line, in input order; [] for an empty line.
    `first_line`: the index of lines[0] in the whole input (it seeds each line's sampling)."""
    tok, decode = translator.tokenizer, translator.config.decode
    limit = translator.config.model.max_positions - 1  # source tokens + eos must fit the positions
    # Lone surrogates (possible in Python strings, never in UTF-8) would crash sentencepiece.
    ids = tok.encode([_SURROGATES.sub("\ufffd", line) for line in lines])
    for i, seq in enumerate(ids):
        if len(seq) > limit:
            logger.warning(
                "line %d: %d tokens, truncated to %d (model.max_positions)", i + 1, len(seq), limit
            )
            ids[i] = seq[:limit]
    results: list[list[Hypothesis]] = [[] for _ in lines]
    todo = [i for i, seq in enumerate(ids) if seq]  # empty input: empty output, no model call
    if not todo:
        return results
    lengths = np.array([len(ids[i]) + 1 for i in todo])
    batches = TokenBucketSampler(
        lengths, lengths, max(decode.max_tokens, int(lengths.max())), seed=0, shuffle=False
    ).epoch_batches(0)
    for batch in batches:
        chosen = [todo[j] for j in batch]
        for index, hyps in zip(
            chosen,
            _translate_batch(
                translator, [ids[i] for i in chosen], [first_line + i for i in chosen]
            ),
            strict=True,
        ):
            results[index] = hyps
    return results


def _translate_batch(
    translator: Translator, sources: list[list[int]], line_ids: Sequence[int]
) -> list[list[Hypothesis]]:
    model, tok, decode = translator.model, translator.tokenizer, translator.config.decode
    samples = decode.nbest if decode.sampling != "none" else 1
    if samples > 1:  # N independent samples of a line are N rows of the same source
        sources = [seq for seq in sources for _ in range(samples)]
    src = torch.full((len(sources), max(map(len, sources)) + 1), tok.pad_id, dtype=torch.long)
    for row, seq in enumerate(sources):
        src[row, : len(seq)] = torch.tensor(seq)
        src[row, len(seq)] = tok.eos_id
    src = src.to(translator.device)
    # §6.1: maximum output length a · input length + b, within the position table.
    limits = [
        min(int(decode.max_len_a * len(seq) + decode.max_len_b), model.cfg.max_positions)
        for seq in sources
    ]
    k = 1 if decode.sampling != "none" else decode.beam_size
    src_mask = make_src_mask(src, tok.pad_id)
    memory = model.encode(src, src_mask)
    # k decoder rows per sentence (B·k); the source stays (B, S, D): see DecoderCache.
    state = _DecodeState(model.start_cache(memory, beam=k), src_mask)

    def step(tokens: torch.Tensor, s: _DecodeState) -> tuple[torch.Tensor, _DecodeState]:
        logits = model.decode(tokens[:, None], None, s.src_mask, s.cache)  # (N, 1, V)
        return F.log_softmax(logits[:, 0].float(), dim=-1), s

    banned, device = (tok.pad_id, tok.bos_id), translator.device
    alpha, form = decode.length_penalty, decode.length_penalty_form
    if decode.sampling != "none":
        uniforms = torch.stack([
            line_uniforms(decode.seed, line, j, model.cfg.max_positions)
            for line in line_ids for j in range(samples)
        ])  # fmt: skip
        hypotheses = sample(
            step, state, limits, uniforms, tok.bos_id, tok.eos_id, decode.sampling,
            decode.temperature, banned, alpha, form, device,
        )  # fmt: skip
        return [hypotheses[i : i + samples] for i in range(0, len(hypotheses), samples)]
    if k == 1:
        hypotheses = greedy(
            step, state, limits, tok.bos_id, tok.eos_id, banned, alpha, form, device
        )
        return [[h] for h in hypotheses]
    return beam_search(
        step, state, limits, tok.bos_id, tok.eos_id, k, alpha, form,
        nbest=decode.nbest, banned=banned, early_stopping=decode.early_stopping, device=device,
    )  # fmt: skip


def line_uniforms(seed: int, line: int, sample_index: int, steps: int) -> torch.Tensor:
    """(steps,) uniforms in [0, 1) that drive sample `sample_index` of input line `line`: a
    function of these three numbers alone, whichever process or batch translates the line."""
    key = np.random.SeedSequence([seed, line, sample_index]).generate_state(1, np.uint64)[0]
    generator = torch.Generator().manual_seed(int(key))
    return torch.rand(steps, generator=generator, dtype=torch.float64)


def translate_text(translator: Translator, lines: Sequence[str]) -> list[str]:
    """Detokenized best translation of each line, in input order."""
    best = [hyps[0].tokens if hyps else [] for hyps in translate_lines(translator, lines)]
    return detokenize(translator, best)


def detokenize(translator: Translator, outputs: Sequence[Sequence[int]]) -> list[str]:
    """Text of each output, on one line: byte pieces could spell a line break, which would break
    the one-output-line-per-input-line promise, so CR and LF become spaces."""
    return [_LINE_BREAKS.sub(" ", text) for text in translator.tokenizer.decode(outputs)]


def translate_stream(translator: Translator, source: BinaryIO, sink: TextIO) -> int:
    """Translate lines from `source` to `sink` as they arrive: a chunk is whatever is already
    waiting (up to decode.buffer_lines), so a pipe is translated in batches and an interactive
    line right away. Returns the number of lines. Bytes split on b"\\n" only; invalid UTF-8 is
    replaced (and reported) so every input line gets its output line."""
    decode = translator.config.decode
    count = 0
    for chunk in _chunks(_read_lines(source), decode.buffer_lines):
        for i, hyps in enumerate(translate_lines(translator, chunk, first_line=count)):
            sink.write("".join(output_rows(translator, count + i, hyps, decode.nbest)))
        sink.flush()
        count += len(chunk)
    return count


def output_rows(
    translator: Translator, index: int, hyps: Sequence[Hypothesis], nbest: int
) -> list[str]:
    """What translate writes for input line `index` (from 0): its best translation, or with
    nbest > 1 that many rows "index<TAB>score<TAB>text" (rows of zeros for an empty line)."""
    if nbest == 1:
        return [detokenize(translator, [hyps[0].tokens if hyps else []])[0] + "\n"]
    texts = detokenize(translator, [h.tokens for h in hyps])
    rows = [f"{index}\t{h.score:.4f}\t{t}\n" for h, t in zip(hyps, texts, strict=True)]
    return rows or [f"{index}\t0.0000\t\n"] * nbest


def translate_file(translator: Translator, input_path: str, output_path: str) -> int:
    """Translate `input_path` ("-": stdin, streamed) into `output_path` ("-": stdout). A file
    output appears complete or not at all (an interrupted or failed translation leaves the old
    content), and may be neither the input nor a file tmt manages. Returns the line count."""
    _check_output(output_path, input_path)
    try:
        source = sys.stdin.buffer if input_path == "-" else open(input_path, "rb")  # noqa: SIM115
    except OSError as err:
        raise TmtError(f"--input {input_path}: {err.strerror or err}") from None
    try:
        with contextlib.ExitStack() as stack:
            if source is not sys.stdin.buffer:
                stack.enter_context(source)
            sink = stack.enter_context(_open_output(output_path))
            return translate_stream(translator, source, sink)
    except OSError as err:  # a full disk, a quota, an I/O error: the old output is kept
        if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
            raise
        raise TmtError(
            f"--output {output_path}: cannot write ({err.strerror or err})",
            exit_code=exits.NO_ROOM,
        ) from None


def _check_output(output_path: str, input_path: str) -> None:
    if output_path == "-":
        return
    output = Path(output_path)
    if input_path != "-":
        source = Path(input_path)
        same = (
            os.path.samefile(output, source)
            if output.exists() and source.exists()
            else output.resolve() == source.resolve()
        )
        if same:
            raise TmtError(f"--output {output_path}: is the input file; choose another output")
    managed = run.managed_by_tmt(output)
    if managed:
        raise TmtError(f"--output {output_path}: {managed}; choose another output")


@contextlib.contextmanager
def _open_output(path: str) -> Iterator[TextIO]:
    """stdout, a device or FIFO as it is; a file through the atomic path (temporary beside it,
    renamed into place when the translation is complete, removed if it is not)."""
    if path == "-":
        yield sys.stdout
        return
    target = Path(path)
    direct = target.exists() and not target.is_file()  # /dev/stdout, /dev/full, a FIFO, ...
    if not direct:  # temporaries of killed translations into this file (a live one is younger)
        pattern = f".{target.name}.*{files.TEMP_SUFFIX}"
        files.remove_leftovers(target.parent, [pattern], older_than_s=86_400)
    with contextlib.ExitStack() as stack:
        try:
            if direct:
                text = stack.enter_context(open(target, "w", encoding="utf-8", newline="\n"))
            else:
                raw = stack.enter_context(files.atomic_file(target))
                text = io.TextIOWrapper(raw, encoding="utf-8", newline="\n")
        except OSError as err:
            raise TmtError(f"--output {path}: {err.strerror or err}") from None
        try:
            yield text
        except BaseException:
            if not direct:
                with contextlib.suppress(OSError, ValueError):
                    text.detach()  # the atomic file then removes its temporary
            raise
        if not direct:
            text.detach()  # flushes; the atomic file fsyncs and renames it into place


def _read_lines(source: BinaryIO) -> Iterator[str]:
    for lineno, line in enumerate(files.split_lines(source), 1):
        yield decode_line(line, lineno)


def decode_line(line: bytes, lineno: int) -> str:
    """An input line as text: invalid UTF-8 is replaced and reported, never dropped."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as err:
        logger.warning(
            "input line %d: invalid UTF-8 at byte offset %d, replaced", lineno, err.start
        )
        return line.decode("utf-8", "replace")


def _chunks(lines: Iterator[str], size: int) -> Iterator[list[str]]:
    """Group lines: block for the first, then take only what is already waiting (a reader thread
    fills the queue), so no line waits for input that has not arrived yet."""
    waiting: queue.Queue[Any] = queue.Queue(maxsize=4 * size)
    end = object()

    def reader() -> None:
        try:
            for line in lines:
                waiting.put(line)
        finally:
            waiting.put(end)

    threading.Thread(target=reader, daemon=True).start()
    while True:
        first = waiting.get()
        if first is end:
            return
        chunk = [first]
        while len(chunk) < size:
            try:
                item = waiting.get_nowait()
            except queue.Empty:
                break
            if item is end:
                yield chunk
                return
            chunk.append(item)
        yield chunk


# --- scoring -----------------------------------------------------------------------------------


def score(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
    """sacreBLEU (cased, 13a tokenization), chrF and lowercased BLEU of detokenized text."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hypotheses) != len(references):
        raise TmtError(
            f"{len(hypotheses)} hypotheses but {len(references)} references: the counts must match"
        )
    if not hypotheses:
        raise TmtError("nothing to score: no hypotheses and no references")
    bleu, bleu_lc, chrf = BLEU(), BLEU(lowercase=True), CHRF()
    refs = [list(references)]
    return {
        "bleu": round(bleu.corpus_score(list(hypotheses), refs).score, 2),
        "chrf": round(chrf.corpus_score(list(hypotheses), refs).score, 2),
        "bleu_lc": round(bleu_lc.corpus_score(list(hypotheses), refs).score, 2),
        "signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "sentences": len(hypotheses),
    }


def format_report(report: dict[str, Any]) -> str:
    """The human-readable form of evaluate()'s figures."""
    lines = [
        f"BLEU = {report['bleu']:.2f}  ({report['signature']})",
        f"chrF2 = {report['chrf']:.2f}  ({report['chrf_signature']})",
        f"BLEU lowercased = {report['bleu_lc']:.2f}",
        f"sentences = {report['sentences']}"
        + (f"; model = {report['model']}" if report.get("model") else ""),
    ]
    return "\n".join(lines)


def validation_bleu(
    model: Transformer,
    tokenizer: Tokenizer,
    cfg: Config,
    info: DistInfo,
    sources: list[str],
    references: list[str],
) -> dict[str, float]:
    """BLEU and chrF of training's validation split, decoded by the tmt evaluate path with beam
    train.bleu_beam_size; each rank translates every world_size-th line, rank 0 scores, and every
    rank gets rank 0's figures (the same best-checkpoint and early-stopping decisions)."""
    decode = dataclasses.replace(cfg.decode, beam_size=cfg.train.bleu_beam_size, nbest=1)
    translator = Translator(
        model, tokenizer, dataclasses.replace(cfg, decode=decode), info.device, "training"
    )
    was_training = model.training
    model.eval()
    mine = translate_text(translator, sources[info.rank :: info.world_size])
    model.train(was_training)
    shards = distributed.gather_to_main(mine, info)
    figures = torch.zeros(2, dtype=torch.float64, device=info.device)
    if info.is_main:
        hypotheses = [
            shards[i % info.world_size][i // info.world_size] for i in range(len(sources))
        ]
        result = score(hypotheses, references)
        figures += torch.tensor(
            [result["bleu"], result["chrf"]], dtype=torch.float64, device=info.device
        )
    distributed.all_reduce_sum(figures, info)
    return {"val_bleu": figures[0].item(), "val_chrf": figures[1].item()}


def read_split(cfg: Config, key: str) -> tuple[list[str], list[str]]:
    """Raw source and reference text of the split that config key `key` names ("data.test")."""
    split = corpus.open_split(cfg.data, key)
    with tempfile.TemporaryDirectory(prefix="tmt-eval-") as work:
        dataset = split.load(Path(work))
        return [s or "" for s in dataset["src"]], [t or "" for t in dataset["tgt"]]


def read_text_file(path: str | Path) -> list[str]:
    """Lines of a plain or .gz file to score (split on \\n only, strict UTF-8); an empty file
    is an error: there would be nothing to score."""
    file = Path(path)
    if file.is_dir():
        raise TmtError(f"{path}: is a directory, expected a text file")
    if not file.is_file():
        raise TmtError(f"{path}: no such file")
    lines = [
        corpus.decode_line(raw, str(file), n, "strict", hint=" (the file must be UTF-8)")[0]
        for n, raw in enumerate(corpus.read_lines(file), 1)
    ]
    if not lines:
        raise TmtError(f"{path}: empty file: nothing to score")
    return lines


def evaluate(
    translator: Translator | None,
    split: str | None = None,
    sources: Sequence[str] | None = None,
    references: Sequence[str] | None = None,
    hypotheses: Sequence[str] | None = None,
    cfg: Config | None = None,
) -> dict[str, Any]:
    """Score `hypotheses`, or the translator's output for `sources` or a config split, against the
    references. Returns score()'s figures plus where the text came from."""
    if references is None:
        config = cfg or (translator.config if translator else None)
        if config is None or split is None:
            raise TmtError(
                "evaluate needs references: a split of the checkpoint's config or a reference file"
            )
        split_sources, references = read_split(config, f"data.{split}")
        sources = sources if sources is not None else split_sources
    if hypotheses is None:
        if translator is None or sources is None:
            raise TmtError(
                "evaluate needs hypotheses: a checkpoint to translate with or a hypothesis file"
            )
        if len(sources) != len(references):
            raise TmtError(
                f"{len(sources)} source lines but {len(references)} references: counts must match"
            )
        hypotheses = translate_text(translator, sources)
    return {**score(hypotheses, references), "model": translator.origin if translator else None}
