"""Translating raw text: the one path behind `tmt translate`, `tmt evaluate`, the file job
(bulk.py), export's parity check and the validation BLEU of training.

A `Translator` is a model loaded once onto a device in a precision, with its tokenizer and
decoding settings, decoded by one of two engines (decode.engine): tmt's own search over the
PyTorch model, or CTranslate2 over an export of it (ct2.py) that is made on first use beside the
model, checked against tmt's greedy output, and reused after. Raw text in, detokenized text out:
the sentencepiece model travels inside the checkpoint. Inputs are sorted by length and batched
by tokens; outputs come back in input order, exactly one per input line. An empty line gives an
empty output without running the model; a line longer than the model's positions is truncated
with a warning. search.py knows nothing of the model: `_translate_batch` gives it the step
function (one decoder step over the cache).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import numpy as np
import torch
import torch.nn.functional as F

from transformer_mt import averaging, corpus, ct2, distributed, kernels, run, textio
from transformer_mt.config import MODEL_SECTIONS, Config, apply_overrides, changed_keys
from transformer_mt.data import TokenBucketSampler
from transformer_mt.exits import TmtError
from transformer_mt.files import METRICS_FILE
from transformer_mt.model import DecoderCache, Transformer, count_parameters, make_src_mask
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

    model: Transformer | None  # in eval mode, on `device`, in the decoding precision (torch)
    tokenizer: Tokenizer
    config: Config  # the checkpoint's config with the caller's overrides
    device: torch.device
    origin: str  # what was loaded, for messages
    step: int = 0  # the updates its weights were trained for (the newest, for an average)
    path: Path | None = None  # the checkpoint or averaged model read (the newest averaged)
    run_dir: Path | None = None  # the run directory it belongs to, when there is one
    engine: Any = None  # a ctranslate2.Translator when decode.engine=ctranslate2
    export: Path | None = None  # ... and the export directory it reads
    parameters: int = 0  # the model's parameter count
    # SHA-256 of what decodes (the export's files; the weights before int8); "" until a job asks
    # for it (fingerprint()): hashing every weight is not worth it on each load.
    fingerprint: str = ""

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str = "auto",
        precision: str = "fp32",
        engine: str = "torch",
        **decode: Any,
    ) -> Translator:
        """A checkpoint, an averaged model or a run directory (its average, else its best, else its
        newest checkpoint), or with engine="ctranslate2" also a CTranslate2 export of tmt;
        `decode` sets DecodeConfig fields by name (beam_size=5, ...)."""
        settings = {**decode, "device": device, "precision": precision, "engine": engine}
        return load_translator(path, _keyword_overrides(settings))

    def translate(self, lines: Sequence[str], beam: int | None = None, **decode: Any) -> list[str]:
        """The best translation of each line, in order (one per line; "" for an empty line);
        `beam` and `decode` (DecodeConfig fields by name) apply to this call only."""
        if beam is not None:
            decode["beam_size"] = beam
        moved = {"device", "precision", "engine"} & set(decode)
        if moved:
            raise TmtError(f"{', '.join(sorted(moved))}: set when loading (Translator.load)")
        translator = self
        if decode:
            config = apply_overrides(self.config, _keyword_overrides(decode))
            translator = dataclasses.replace(self, config=config)
        return translate_text(translator, list(lines))


def _keyword_overrides(settings: dict[str, Any]) -> list[tuple[str, str]]:
    """decode.* overrides from keyword arguments; an error quotes the keyword as it was given."""
    return [(f"decode.{k}={v}", f"{k}={v!r}") for k, v in settings.items()]


def load_translator(
    path: str | Path,
    overrides: Sequence[str | tuple[str, str]] = (),
    last: int = 0,
    best: int = 0,
    by: str | None = None,
) -> Translator:
    """A checkpoint directory, an averaged model, or a run directory (its average, else its best
    checkpoint, else its newest), read once and put on decode.device in decode.precision; with
    `last` or `best` N, the average of the run's newest N or N best by `by` (averaging.choose).
    With decode.engine=ctranslate2, `path` may also be a CTranslate2 export of tmt; a model is
    decoded through the export kept beside it (made on first use: _ctranslate2_cache)."""
    if not (last or best) and ct2.is_export(Path(path)):
        return _load_export(Path(path), overrides)
    saved = averaging.choose([path], last, best, by)
    if saved is not None:
        origin = f"average of {', '.join(Path(p).name for p in saved.sources)}"
    else:
        saved = run.load_model(Path(path))
        origin = str(saved.path)
    assert saved.model is not None  # a checkpoint read whole, or an average: its model is built
    cfg = apply_overrides(saved.config, overrides)
    fixed = changed_keys(saved.config, cfg, MODEL_SECTIONS)
    if fixed:
        raise TmtError(f"{', '.join(fixed)}: fixed by the checkpoint ({saved.path})")
    target = distributed.resolve_device(cfg.decode.device, key="decode.device")
    check_engine(cfg, target)
    nbytes = sum(t.numel() * 4 for t in saved.state_dict.values())
    torch_engine = cfg.decode.engine == "torch"
    with distributed.allocating(f"the model in {cfg.decode.precision}", nbytes, target):
        if torch_engine:
            model = kernels.in_precision(saved.model, cfg.decode.precision, target)
        else:  # float32 on the CPU: what the CTranslate2 conversion reads
            model = kernels.in_precision(saved.model, "fp32", torch.device("cpu"))
    translator = Translator(
        model=model.eval(), tokenizer=saved.tokenizer, config=cfg, device=target, origin=origin,
        step=saved.step, path=saved.path, run_dir=_run_of(Path(path), saved.path),
        parameters=count_parameters(model),
    )  # fmt: skip
    if not torch_engine:  # the cache is named by the weights' fingerprint
        return _ctranslate2_cache(
            dataclasses.replace(translator, fingerprint=fingerprint(translator))
        )
    if cfg.decode.precision == "int8":  # the fingerprint of the weights, not of their int8
        weights = fingerprint(translator)
        return dataclasses.replace(translator, model=kernels.int8(model), fingerprint=weights)
    if cfg.decode.cpu_linear == "onednn" and target.type == "cpu":
        kernels.pack_linears(model)  # where oneDNN cannot, torch's kernels stay
    return translator


def check_engine(cfg: Config, device: torch.device) -> None:
    """Refuse, naming the option, what an engine cannot do as tmt promises it."""
    decode, engine = cfg.decode, cfg.decode.engine
    if decode.precision == "fp16" and device.type != "cuda":
        raise TmtError("decode.precision=fp16 needs a GPU (decode.device); use bf16 or fp32")
    if engine == "torch" and decode.precision == "int8" and device.type != "cpu":
        raise TmtError(
            f"decode.precision=int8: the torch engine quantizes on CPU only (decode.device is"
            f" {device}); use fp16 or bf16 there, or decode.engine=ctranslate2"
        )
    if engine == "ctranslate2" and decode.sampling != "none":
        raise TmtError(
            f"decode.sampling={decode.sampling}: not with decode.engine=ctranslate2 (its random"
            " streams depend on the batch, tmt's on the line alone); use decode.engine=torch"
        )


def _load_export(directory: Path, overrides: Sequence[str | tuple[str, str]]) -> Translator:
    """A CTranslate2 export of tmt (tmt export, or a cache beside a model) as a Translator."""
    export = ct2.read(directory)
    cfg = apply_overrides(export.config, overrides)
    fixed = changed_keys(export.config, cfg, MODEL_SECTIONS)
    if fixed:
        raise TmtError(f"{', '.join(fixed)}: fixed by the export ({directory})")
    if cfg.decode.engine != "ctranslate2":
        raise TmtError(
            f"{directory}: a CTranslate2 export; decode it with decode.engine=ctranslate2"
            " (--engine ctranslate2), or give the tmt model it came from"
        )
    target = distributed.resolve_device(cfg.decode.device, key="decode.device")
    check_engine(cfg, target)
    engine = ct2.load(export, target, cfg.decode.precision, torch.get_num_threads())
    source = export.report.get("source")
    return Translator(
        model=None, tokenizer=export.tokenizer, config=cfg, device=target, origin=str(directory),
        fingerprint=export.fingerprint, step=int(export.report.get("step", 0)),
        run_dir=_run_of(Path(source), Path(source)) if isinstance(source, str) else None,
        engine=engine, export=directory, parameters=int(export.report.get("parameters", 0)),
    )  # fmt: skip


def _ctranslate2_cache(translator: Translator) -> Translator:
    """`translator` decoded by CTranslate2: through the export kept beside its model (in the
    checkpoint's directory), made on first use once the float32 conversion's greedy outputs
    match tmt's on the validation split, and verified whenever it is read back. One process
    makes it while others wait (a lock), so torchrun ranks and a second command share it."""
    ct2.require()
    assert translator.path is not None and translator.model is not None
    decode = translator.config.decode
    root = translator.path if translator.path.is_dir() else translator.path.parent
    final = root / ct2.cache_name(decode.precision, translator.fingerprint)
    if not ct2.writable(root) and not final.is_dir():
        raise TmtError(
            f"{root}: cannot write the CTranslate2 export beside the model there; make one with"
            " `tmt export --format ctranslate2` and decode it with -m EXPORT_DIR"
        )
    with ct2.cache_lock(root):
        export = ct2.read_cache(final)
        if export is None:
            logger.info(
                "making the CTranslate2 export of %s in %s (once)", translator.origin, final
            )
            greedy = apply_overrides(translator.config, ["decode.engine=torch",
                                     "decode.precision=fp32", "decode.beam_size=1"])  # fmt: skip
            torch_greedy = dataclasses.replace(translator, config=greedy)
            try:  # the validation split; if it is not where the config says, a few lines
                sources = corpus.read_split(greedy.data, "data.valid")[0]
            except TmtError:
                sources = []
            lines = [s for s in sources if s.strip()][:200] or _CHECK_LINES
            expected = [h[0].tokens for h in translate_lines(torch_greedy, lines)]
            ids = source_ids(translator, lines)
            report = {"source": translator.origin, "step": translator.step,
                      "parameters": translator.parameters}  # fmt: skip
            check = ct2.Check(lines, ids, output_limits(translator, ids), expected)
            ct2.make_cache(final, translator.model, translator.tokenizer, translator.config,
                           report, check)  # fmt: skip
            export = ct2.read(final)
    engine = ct2.load(export, translator.device, decode.precision, torch.get_num_threads())
    return dataclasses.replace(
        translator, model=None, engine=engine, export=final, fingerprint=export.fingerprint
    )


_CHECK_LINES = ["a", "Ein Hund rennt.", "Two people are walking down a street.", "1 2 3 4 5"]


def _run_of(given: Path, read: Path) -> Path | None:
    """The run directory a model came from: the one given, or the run holding what was read (a
    checkpoint in its checkpoints/, its average)."""
    for candidate in (given, read.parent.parent, read.parent):
        if (candidate / run.CHECKPOINTS).is_dir() and (candidate / METRICS_FILE).is_file():
            return candidate
    return None


def fingerprint(translator: Translator) -> str:
    """SHA-256 of the weights (float32) and the tokenizer: the model, whatever file it came from
    (for CTranslate2, of the export's files)."""
    if translator.fingerprint or translator.model is None:
        return translator.fingerprint
    digest = hashlib.sha256(translator.tokenizer.model_bytes)
    for name, tensor in translator.model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# --- lines to hypotheses -----------------------------------------------------------------------


class _DecodeState:
    """What search.py needs from the model: the decoder cache and source mask, reorderable."""

    def __init__(self, cache: DecoderCache, src_mask: torch.Tensor) -> None:
        self.cache, self.src_mask = cache, src_mask

    def reorder(self, index: torch.Tensor, beam: int) -> None:
        sentences = self.cache.reorder(index.to(self.src_mask.device), beam)
        if sentences is not None:  # the source mask is per sentence, like the cross K/V
            self.src_mask = self.src_mask.index_select(0, sentences)


def source_ids(translator: Translator, lines: Sequence[str]) -> list[list[int]]:
    """The subword ids of each line as the model reads it: lone surrogates (possible in Python
    strings, never in UTF-8, fatal to sentencepiece) replaced, and cut to the model's positions
    (source tokens + EOS must fit them) with a warning."""
    limit = translator.config.model.max_positions - 1
    ids = translator.tokenizer.encode([_SURROGATES.sub("\ufffd", line) for line in lines])
    for i, seq in enumerate(ids):
        if len(seq) > limit:
            logger.warning(
                "line %d: %d tokens, truncated to %d (model.max_positions)", i + 1, len(seq), limit
            )
            ids[i] = seq[:limit]
    return ids


def output_limits(translator: Translator, sources: Sequence[Sequence[int]]) -> list[int]:
    """§6.1: the maximum output length (the EOS included) of each source, a · |x| + b, within the
    position table."""
    decode, positions = translator.config.decode, translator.config.model.max_positions
    return [min(int(decode.max_len_a * len(x) + decode.max_len_b), positions) for x in sources]


@torch.inference_mode()
def translate_lines(
    translator: Translator, lines: Sequence[str], first_line: int = 0
) -> list[list[Hypothesis]]:
    """The n-best hypotheses (token ids) of each line, in input order; [] for an empty line.
    `first_line`: the index of lines[0] in the whole input (it seeds each line's sampling)."""
    if translator.engine is not None:  # decoding options may have changed since the load
        check_engine(translator.config, translator.device)
    ids = source_ids(translator, lines)
    results: list[list[Hypothesis]] = [[] for _ in lines]
    todo = [i for i, seq in enumerate(ids) if seq]  # empty input: empty output, no model call
    if not todo:
        return results
    lengths = np.array([len(ids[i]) + 1 for i in todo])
    budget = max(translator.config.decode.max_tokens, int(lengths.max()))
    sampler = TokenBucketSampler(
        src_lengths=lengths, tgt_lengths=lengths, max_tokens=budget, seed=0, shuffle=False
    )
    for batch in sampler.epoch_batches(0):
        chosen = [todo[j] for j in batch]
        sources = [ids[i] for i in chosen]
        try:
            hypotheses = _translate_batch(translator, sources, [first_line + i for i in chosen])
        except (torch.OutOfMemoryError, RuntimeError, MemoryError) as err:
            if not distributed.is_out_of_memory(err):
                raise
            raise _out_of_memory(translator, sources) from None
        for index, hyps in zip(chosen, hypotheses, strict=True):
            results[index] = hyps
    return results


def _out_of_memory(translator: Translator, sources: list[list[int]]) -> TmtError:
    decode = translator.config.decode
    k = decode.nbest if decode.sampling != "none" else decode.beam_size
    return TmtError(
        f"decoding {len(sources)} sentences of up to {max(map(len, sources))} tokens, {k} rows"
        f" each, ran out of memory on {translator.device}: lower decode.max_tokens"
        f" ({decode.max_tokens}) or decode.beam_size ({decode.beam_size})"
    )


def _translate_batch(
    translator: Translator, sources: list[list[int]], line_ids: Sequence[int]
) -> list[list[Hypothesis]]:
    """Encode a batch of sources once and search over the decoder: sampling, greedy or beam."""
    model, tok, decode = translator.model, translator.tokenizer, translator.config.decode
    if translator.engine is not None:
        limits = output_limits(translator, sources)
        return ct2.decode(translator.engine, tok, sources, limits, decode)
    assert model is not None
    samples = decode.nbest if decode.sampling != "none" else 1
    if samples > 1:  # N independent samples of a line are N rows of the same source
        sources = [seq for seq in sources for _ in range(samples)]
    src = torch.full((len(sources), max(map(len, sources)) + 1), tok.pad_id, dtype=torch.long)
    for row, seq in enumerate(sources):
        src[row, : len(seq)] = torch.tensor(seq)
        src[row, len(seq)] = tok.eos_id
    src = src.to(translator.device)
    src_mask = make_src_mask(src, tok.pad_id)
    memory = model.encode(src, src_mask)
    # One decoder row per sentence; beam search makes k (B·k), the source stays (B, S, D).
    state = _DecodeState(model.start_cache(memory), src_mask)

    def step(tokens: torch.Tensor, s: _DecodeState) -> tuple[torch.Tensor, _DecodeState]:
        logits = model.decode(tokens[:, None], None, s.src_mask, s.cache)  # (N, 1, V)
        return F.log_softmax(logits[:, 0].float(), dim=-1), s

    common = {
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "banned": (tok.pad_id, tok.bos_id),
        "alpha": decode.length_penalty,
        "form": decode.length_penalty_form,
        "device": translator.device,
    }
    limits = output_limits(translator, sources)
    if decode.sampling != "none":
        uniforms = torch.stack([
            line_uniforms(decode.seed, line, j, model.cfg.max_positions)
            for line in line_ids for j in range(samples)
        ])  # fmt: skip
        hypotheses = sample(
            step, state, limits, uniforms=uniforms, method=decode.sampling,
            temperature=decode.temperature, **common,
        )  # fmt: skip
        return [hypotheses[i : i + samples] for i in range(0, len(hypotheses), samples)]
    if decode.beam_size == 1:
        return [[h] for h in greedy(step, state, limits, **common)]
    return beam_search(
        step, state, limits, beam_size=decode.beam_size, nbest=decode.nbest,
        early_stopping=decode.early_stopping, **common,
    )  # fmt: skip


def line_uniforms(seed: int, line: int, sample_index: int, steps: int) -> torch.Tensor:
    """(steps,) uniforms in [0, 1) that drive sample `sample_index` of input line `line`: a
    function of these three numbers alone, whichever process or batch translates the line."""
    key = np.random.SeedSequence([seed, line, sample_index]).generate_state(1, np.uint64)[0]
    generator = torch.Generator().manual_seed(int(key))
    return torch.rand(steps, generator=generator, dtype=torch.float64)


# --- hypotheses to text ------------------------------------------------------------------------


def translate_text(translator: Translator, lines: Sequence[str]) -> list[str]:
    """Detokenized best translation of each line, in input order."""
    best = [hyps[0].tokens if hyps else [] for hyps in translate_lines(translator, lines)]
    return detokenize(translator, best)


def detokenize(translator: Translator, outputs: Sequence[Sequence[int]]) -> list[str]:
    """Text of each output, on one line: byte pieces could spell a line break, which would break
    the one-output-line-per-input-line promise, so CR and LF become spaces."""
    return [_LINE_BREAKS.sub(" ", text) for text in translator.tokenizer.decode(outputs)]


def output_rows(
    translator: Translator, hyps: Sequence[Hypothesis], index: int, nbest: int
) -> list[str]:
    """What translate writes for input line `index` (from 0): its best translation, or with
    nbest > 1 that many rows "index<TAB>score<TAB>text" (rows of zeros for an empty line)."""
    if nbest == 1:
        return [detokenize(translator, [hyps[0].tokens if hyps else []])[0] + "\n"]
    texts = detokenize(translator, [h.tokens for h in hyps])
    rows = [f"{index}\t{h.score:.4f}\t{t}\n" for h, t in zip(hyps, texts, strict=True)]
    return rows or [f"{index}\t0.0000\t\n"] * nbest


# --- streams and files -------------------------------------------------------------------------


def translate_stream(
    translator: Translator, source: BinaryIO, sink: TextIO, where: str = "input"
) -> int:
    """Translate lines from `source` to `sink` as they arrive: a chunk is whatever is already
    waiting (up to decode.buffer_lines), so a pipe is translated in batches and an interactive
    line right away. Returns the number of lines. Bytes split on b"\\n" only; invalid UTF-8 is
    replaced (and reported, naming `where`) so every input line gets its output line."""
    decode = translator.config.decode
    count = 0
    for chunk in textio.waiting_chunks(textio.stream_lines(source, where), decode.buffer_lines):
        for i, hyps in enumerate(translate_lines(translator, chunk, first_line=count)):
            rows = output_rows(translator, hyps, index=count + i, nbest=decode.nbest)
            sink.write("".join(rows))
        sink.flush()
        count += len(chunk)
    return count


def translate_file(
    translator: Translator, input_path: str, output_path: str, overwrite: bool = False
) -> int:
    """Translate `input_path` ("-": stdin, streamed) into `output_path` ("-": stdout). A file
    output appears complete or not at all (an interrupted or failed translation leaves the old
    content); textio.check_output says what it may be. Returns the line count."""
    textio.check_output(output_path, inputs=[input_path], overwrite=overwrite)
    where = "stdin" if input_path == textio.STDIO else input_path
    with (
        textio.open_input(input_path) as source,
        textio.open_output(output_path) as sink,
    ):
        return translate_stream(translator, source, sink, where=where)
