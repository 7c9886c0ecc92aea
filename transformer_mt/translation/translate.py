"""Translating raw text: the one path behind `tmt translate`, `tmt evaluate`, the file job
(bulk.py), export's parity check and the validation BLEU of training.

A `Translator` is a model loaded once onto a device in a precision, with its tokenizer and
decoding settings, decoded by one of two engines (decode.engine): tmt's own search over the
PyTorch model, or CTranslate2 over an export of it (ct2.py) that is made on first use beside the
model, checked against tmt's greedy output, and reused after. Raw text in, detokenized text out:
the sentencepiece model travels inside the checkpoint. Several models that share a tokenizer
decode as one (load_ensemble, ensemble.py). Lines become hypotheses in decoding.py (batched by
length, output in input order); here they become text, exactly one output per input line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from transformer_mt.common import distributed, textio
from transformer_mt.common.exits import TmtError
from transformer_mt.common.files import METRICS_FILE
from transformer_mt.config import MODEL_SECTIONS, Config, apply_overrides, changed_keys
from transformer_mt.data import corpus, hints
from transformer_mt.data import glossary as glossaries
from transformer_mt.data.tokenizer import Tokenizer
from transformer_mt.network import ensemble, kernels
from transformer_mt.network import shortlist as shortlists
from transformer_mt.network.alignment import check_layer
from transformer_mt.network.model import Transformer, count_parameters
from transformer_mt.network.shortlist import Shortlist
from transformer_mt.runs import averaging, run
from transformer_mt.runs.checkpoint import Checkpoint
from transformer_mt.translation import ct2
from transformer_mt.translation.decode_checks import check_engine, check_options
from transformer_mt.translation.decoding import translate_lines
from transformer_mt.translation.glossary_use import check_glossary, glossary_of, load_glossary
from transformer_mt.translation.sources import output_limits, source_ids

logger = logging.getLogger(__name__)

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
    parameters: int = 0  # the model's parameter count (the ensemble's: all of them)
    # An ensemble: the other models (`model` is the first) and every model's weight, summing to 1
    # (ensemble.py); () for one model.
    ensemble: tuple[Transformer, ...] = ()
    weights: tuple[float, ...] = ()
    # SHA-256 of what decodes (the export's files; the weights before int8); "" until a job asks
    # for it (fingerprint()): hashing every weight is not worth it on each load.
    fingerprint: str = ""
    glossary: glossaries.Glossary | None = None  # glossary.path, read (and checked) at load
    shortlist: Shortlist | None = None  # decode.shortlist, read and verified at load

    @classmethod
    def load(
        cls,
        path: str | Path | Sequence[str | Path],
        device: str = "auto",
        precision: str = "fp32",
        engine: str = "torch",
        weights: Sequence[float] | None = None,
        glossary: str | Path | None = None,
        **decode: Any,
    ) -> Translator:
        """A checkpoint, an averaged model or a run directory (its average, else its best, else its
        newest checkpoint), or with engine="ctranslate2" also a CTranslate2 export of tmt; a list
        of them is an ensemble (`weights`: one per model, equal by default); `glossary`: a TSV
        or CSV glossary every translation obeys; `decode` sets DecodeConfig fields by name
        (beam_size=5, ...)."""
        settings = {**decode, "device": device, "precision": precision, "engine": engine}
        if not isinstance(path, str | Path | Iterable):
            raise TypeError(f"path: expected a path or a list of paths, got {type(path).__name__}")
        paths = [path] if isinstance(path, str | Path) else list(path)
        if isinstance(weights, str):  # the command line's form, 0.6,0.4
            weights = ensemble.parse_weights(weights)
        overrides = _keyword_overrides(settings)
        if glossary is not None:
            overrides.append((f"glossary.path={glossary}", f"glossary={str(glossary)!r}"))
        return load_ensemble(paths, overrides, weights)

    def translate(
        self,
        lines: Sequence[str] | str,
        beam: int | None = None,
        prefix: Sequence[str] | str | None = None,
        glossary: glossaries.Glossary | str | Path | Sequence[Sequence[str]] | None = None,
        **decode: Any,
    ) -> list[str] | str:
        """The best translation of each line, in order (one per line; "" for an empty line); of
        one string, its translation (as DeepL's translate_text: a string was taken as a list of
        characters); `prefix`: a target prefix for each line ("" for none) that its translation
        starts with; `glossary` (a file, a glossary.Glossary, or [source, target] pairs), `beam`
        and `decode` (DecodeConfig fields by name) apply to this call only."""
        if isinstance(lines, str):
            one = [prefix] if isinstance(prefix, str) else prefix
            return self.translate([lines], beam, one, glossary, **decode)[0]
        lines = _strings(lines, "lines")
        prefix = None if prefix is None else _strings(prefix, "prefix")
        if beam is not None:
            decode["beam_size"] = beam
        moved = {"device", "precision", "engine", "shortlist"} & set(decode)
        if moved:
            raise TmtError(f"{', '.join(sorted(moved))}: set when loading (Translator.load)")
        translator = self
        if decode:
            config = apply_overrides(self.config, _keyword_overrides(decode))
            check_options(config, _keyword_overrides(decode))
            translator = dataclasses.replace(self, config=config)
        if glossary is not None:
            found = glossary_of(glossary, translator.config)
            translator = dataclasses.replace(translator, glossary=found)
            check_glossary(translator)
        return translate_text(translator, lines, prefix)


def _strings(values: Any, name: str) -> list[str]:
    """`values` as a list of strings, or a TypeError naming the first that is not one."""
    if isinstance(values, str) or not isinstance(values, Iterable):
        raise TypeError(f"{name}: expected a list of strings, got {type(values).__name__}")
    values = list(values)
    for index, value in enumerate(values):
        if not isinstance(value, str):
            raise TypeError(f"{name}[{index}]: expected a string, got {type(value).__name__}")
    return values


def _default_mode(translator: Translator, overrides: Sequence[str | tuple[str, str]]) -> Translator:
    """glossary.mode=auto for a model trained with term hints, unless the caller set a mode
    (hint for a CTranslate2 export alone: auto's re-decoding needs the tmt model)."""
    if not hints.trained_with_hints(translator.config) or _override(overrides, "glossary.mode"):
        return translator
    alone = translator.engine is not None and translator.model is None
    config = apply_overrides(translator.config, [f"glossary.mode={'hint' if alone else 'auto'}"])
    return dataclasses.replace(translator, config=config)


def _with_glossary(translator: Translator) -> Translator:
    """The translator with the glossary its config names, read and checked."""
    glossary = load_glossary(translator.config)
    if glossary is None:
        return translator
    translator = dataclasses.replace(translator, glossary=glossary)
    check_glossary(translator)
    return translator


def _keyword_overrides(settings: dict[str, Any]) -> list[tuple[str, str]]:
    """decode.* overrides from keyword arguments; an error quotes the keyword as it was given."""
    return [(f"decode.{k}={v}", f"{k}={v!r}") for k, v in settings.items()]


def _override(overrides: Sequence[str | tuple[str, str]], key: str) -> str | None:
    """The value the last of `overrides` gives `key`, if any."""
    value = None
    for item in overrides:
        name, _, given = (item[0] if isinstance(item, tuple) else item).partition("=")
        if name.strip() == key:
            value = given.strip()
    return value


def load_translator(
    path: str | Path,
    overrides: Sequence[str | tuple[str, str]] = (),
    last: int | None = None,
    best: int | None = None,
    by: str | None = None,
    keep_model: bool = False,
) -> Translator:
    """A checkpoint directory, an averaged model, or a run directory (its average, else its best
    checkpoint, else its newest), read once and put on decode.device in decode.precision; with
    `last` or `best` N, the average of the run's newest N or N best by `by` (averaging.choose).
    With decode.engine=ctranslate2, `path` may also be a CTranslate2 export of tmt; a model is
    decoded through the export kept beside it (made on first use: _ctranslate2_cache)."""
    if last is None and best is None and ct2.is_export(Path(path)):
        return _load_export(Path(path), overrides)
    saved = averaging.choose([path], last, best, by)
    if saved is not None:
        origin = f"average of {', '.join(Path(p).name for p in saved.sources)}"
    else:
        saved = run.load_model(Path(path))
        origin = str(saved.path)
    assert saved.model is not None  # a checkpoint read whole, or an average: its model is built
    cfg, target = _checked(saved, overrides)
    nbytes = sum(t.numel() * 4 for t in saved.state_dict.values())
    torch_engine = cfg.decode.engine == "torch"
    # A model decoding in bf16 or fp16 keeps its float32 weights' fingerprint, as int8 does: a
    # shortlist, a file job and a distillation name the model by it, whatever it decodes in.
    # Hashed now, before the weights are rounded (0.4 s for an OPUS-MT-sized model).
    rounded = torch_engine and cfg.decode.precision in ("bf16", "fp16")
    weights = _weights_digest(saved.tokenizer, (saved.model,), ()) if rounded else ""
    with distributed.allocating(f"the model in {cfg.decode.precision}", nbytes, target):
        if torch_engine:
            model = kernels.in_precision(saved.model, cfg.decode.precision, target)
        else:  # float32 on the CPU: what the CTranslate2 conversion reads
            model = kernels.in_precision(saved.model, "fp32", torch.device("cpu"))
    translator = Translator(
        model=model.eval(), tokenizer=saved.tokenizer, config=cfg, device=target, origin=origin,
        step=saved.step, path=saved.path, run_dir=_run_of(Path(path), saved.path),
        parameters=count_parameters(model), fingerprint=weights,
    )  # fmt: skip
    if cfg.decode.shortlist != "none":
        translator = with_shortlist(translator)
    if not torch_engine:  # the cache is named by the weights' fingerprint
        keep = keep_model or bool(cfg.glossary.path)  # constrained lines are tmt's to decode
        return _ctranslate2_cache(
            dataclasses.replace(translator, fingerprint=fingerprint(translator)), keep
        )
    if cfg.decode.precision == "int8":  # the fingerprint of the weights, not of their int8
        weights = fingerprint(translator)
        return dataclasses.replace(translator, model=kernels.int8(model), fingerprint=weights)
    if cfg.decode.cpu_linear == "onednn" and target.type == "cpu":
        kernels.pack_linears(model)  # where oneDNN cannot, torch's kernels stay
    return translator


def _checked(
    saved: Checkpoint, overrides: Sequence[str | tuple[str, str]]
) -> tuple[Config, torch.device]:
    """The checkpoint's config with the overrides, and the device it decodes on, once every
    decoding setting is checked against them (before a model is put anywhere)."""
    assert saved.model is not None
    cfg = apply_overrides(saved.config, overrides)
    check_options(cfg, overrides)
    fixed = changed_keys(saved.config, cfg, MODEL_SECTIONS)
    if fixed:
        raise TmtError(f"{', '.join(fixed)}: fixed by the checkpoint ({saved.path})")
    target = distributed.resolve_device(cfg.decode.device, key="decode.device")
    check_engine(cfg, target)
    if cfg.decode.engine == "torch":
        kernels.check_bf16("decode.precision", cfg.decode.precision, target)
    if cfg.decode.alignment != "none":  # before a job starts on it
        check_layer(saved.model, cfg.decode.alignment_layer)
    return cfg, target


def load_ensemble(
    paths: Sequence[str | Path],
    overrides: Sequence[str | tuple[str, str]] = (),
    weights: Sequence[float] | None = None,
    last: int | None = None,
    best: int | None = None,
    by: str | None = None,
    keep_model: bool = False,
) -> Translator:
    """Models that decode as one (ensemble.py), each read as load_translator reads one, `weights`
    one per model (equal ones by default); one path without weights is load_translator's.
    `keep_model`: with decode.engine=ctranslate2, keep the PyTorch model too (a server: its
    requests' glossaries may need constrained decoding)."""
    if not paths:
        raise TmtError("no model: name it with -m/--model (a checkpoint or a run directory)")
    if len(paths) == 1 and weights is None:
        one = load_translator(paths[0], overrides, last=last, best=best, by=by,
                              keep_model=keep_model)  # fmt: skip
        return _with_glossary(_default_mode(one, overrides))
    normalized = ensemble.normalized_weights(weights, len(paths))
    # Refused before anything loads: a model's first CTranslate2 decoding exports it.
    exports = [p for p in paths if ct2.is_export(Path(p))]
    if _override(overrides, "decode.engine") == "ctranslate2" or exports:
        named = f" ({exports[0]} is a CTranslate2 export)" if exports else ""
        raise TmtError(
            f"an ensemble decodes with decode.engine=torch: CTranslate2 runs one model{named}"
        )
    # The first model's shortlist serves the ensemble (its candidates for every model).
    others = [*overrides, "decode.shortlist=none"]
    members = [load_translator(p, others if i else overrides, last=last, best=best, by=by)
               for i, p in enumerate(paths)]  # fmt: skip
    first = members[0]
    ensemble.check_same_vocabulary([m.tokenizer for m in members], [m.origin for m in members])
    return _with_glossary(_default_mode(dataclasses.replace(
        first, origin=f"ensemble of {', '.join(m.origin for m in members)}", weights=normalized,
        ensemble=tuple(m.model for m in members[1:] if m.model is not None),
        parameters=sum(m.parameters for m in members), fingerprint="",
        # No one checkpoint's scores or curves describe it.
        step=max(m.step for m in members), path=None, run_dir=None,
    ), overrides))  # fmt: skip


def _load_export(directory: Path, overrides: Sequence[str | tuple[str, str]]) -> Translator:
    """A CTranslate2 export of tmt (tmt export, or a cache beside a model) as a Translator."""
    export = ct2.read(directory)
    cfg = apply_overrides(export.config, overrides)
    check_options(cfg, overrides)
    fixed = changed_keys(export.config, cfg, MODEL_SECTIONS)
    if fixed:
        raise TmtError(f"{', '.join(fixed)}: fixed by the export ({directory})")
    if cfg.decode.engine != "ctranslate2":
        raise TmtError(
            f"{directory}: a CTranslate2 export; decode it with decode.engine=ctranslate2"
            " (--engine ctranslate2), or give the tmt model it came from"
        )
    if cfg.decode.shortlist not in ("none", "auto") or (
        cfg.decode.shortlist == "auto" and not export.has_vmap
    ):
        has = "has one" if export.has_vmap else "has none"
        raise TmtError(f"decode.shortlist={cfg.decode.shortlist}: a CTranslate2 export decodes"
                       " with its own vmap.txt (tmt export --shortlist; then --shortlist auto),"
                       f" and {directory} {has}")  # fmt: skip
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


def _ctranslate2_cache(translator: Translator, keep_model: bool = False) -> Translator:
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
        export = ct2.read_cache(final, made_from=translator.fingerprint)
        if export is None:
            logger.info(
                "making the CTranslate2 export of %s in %s (once)", translator.origin, final
            )
            greedy = apply_overrides(translator.config, ["decode.engine=torch",
                                     "decode.precision=fp32", "decode.beam_size=1"])  # fmt: skip
            torch_greedy = dataclasses.replace(translator, config=greedy)
            lines = check_lines(greedy, 200)[0]
            expected = [h[0].tokens for h in translate_lines(torch_greedy, lines, scores=False)]
            ids = source_ids(translator, lines)
            report = {"source": translator.origin, "step": translator.step,
                      "parameters": translator.parameters,
                      "made_from": translator.fingerprint}  # fmt: skip
            check = ct2.Check(lines, ids, output_limits(translator, ids), expected)
            ct2.make_cache(final, translator.model, translator.tokenizer, translator.config,
                           report, check)  # fmt: skip
            export = ct2.read(final)
    engine = ct2.load(export, translator.device, decode.precision, torch.get_num_threads())
    # The PyTorch model stays (float32, on the CPU) only where a glossary's lines may need
    # constrained decoding, which is tmt's: with a glossary, or a server (requests bring them).
    return dataclasses.replace(
        translator, model=translator.model if keep_model else None, engine=engine,
        export=final, fingerprint=export.fingerprint,
    )  # fmt: skip


_CHECK_LINES = ["a", "Ein Hund rennt.", "Two people are walking down a street.", "1 2 3 4 5"]


def check_lines(cfg: Config, limit: int = 0) -> tuple[list[str], str]:
    """The source lines a conversion is checked on (the first `limit`; 0: all), and what they are:
    the validation split; for a model that has none where its config says (an import), the
    bundled Multi30k validation text in its source language, else a few lines."""
    try:
        lines, what = corpus.read_split(cfg.data, "data.valid")[0], f"data.valid {cfg.data.valid}"
    except TmtError:
        lines, what = [], ""
    if not any(line.strip() for line in lines) and cfg.data.src_lang in corpus.MULTI30K_LANGS:
        path = corpus.BUNDLED_DIR / f"val.{cfg.data.src_lang}.gz"
        lines = [textio.decode_line(raw, str(path), 0)[0] for raw in textio.read_lines(path)]
        what = f"the bundled Multi30k val.{cfg.data.src_lang}"
    lines = [line for line in lines if line.strip()][: limit or None]
    return (lines, what) if lines else (_CHECK_LINES, "tmt's own check lines")


def _run_of(given: Path, read: Path) -> Path | None:
    """The run directory a model came from: the one given, or the run holding what was read (a
    checkpoint in its checkpoints/, its average)."""
    for candidate in (given, read.parent.parent, read.parent):
        if (candidate / run.CHECKPOINTS).is_dir() and (candidate / METRICS_FILE).is_file():
            return candidate
    return None


def with_shortlist(translator: Translator) -> Translator:
    """The translator with decode.shortlist read and verified against its model: "auto" is
    shortlist.npz in the model's directory."""
    setting, tok = translator.config.decode.shortlist, translator.tokenizer
    if translator.config.decode.engine != "torch":
        raise TmtError("decode.shortlist with decode.engine=ctranslate2: export the model with"
                       " tmt export --format ctranslate2 --shortlist auto and decode that export"
                       " (-m EXPORT --shortlist auto)")  # fmt: skip
    if translator.path is None:
        raise TmtError("decode.shortlist: this model has no directory to find its shortlist in")
    path = translator.path / shortlists.FILE_NAME if setting == "auto" else Path(setting)
    if setting == "auto" and not path.is_file():
        raise TmtError(f"decode.shortlist=auto: no {shortlists.FILE_NAME} in {translator.path}:"
                       f" make one with tmt shortlist -m {translator.path}")  # fmt: skip
    weights = fingerprint(translator)
    table = shortlists.load(path, weights, tok.source_vocab_size, tok.vocab_size)
    return dataclasses.replace(translator, shortlist=table, fingerprint=weights)


def fingerprint(translator: Translator) -> str:
    """SHA-256 of the weights (float32) and the tokenizer: the model, whatever file it came from
    (for CTranslate2, of the export's files)."""
    if translator.fingerprint or translator.model is None:
        return translator.fingerprint
    return _weights_digest(translator.tokenizer, (translator.model, *translator.ensemble),
                           translator.weights)  # fmt: skip


def rounded_fingerprint(translator: Translator) -> str:
    """The fingerprint an earlier tmt gave a model decoding in bf16 or fp16: of its weights as
    rounded (before 2026-11-29; now of its float32 ones, as load_translator hashes them)."""
    return fingerprint(dataclasses.replace(translator, fingerprint=""))


def named_before(translator: Translator, name: str | None) -> bool:
    """Whether `name`, recorded by a file job or a distillation, is what an earlier tmt named
    this model, decoding in bf16 or fp16: the same model, named by its rounded weights."""
    decode = translator.config.decode
    return (name is not None and decode.engine == "torch" and decode.precision in ("bf16", "fp16")
            and name == rounded_fingerprint(translator))  # fmt: skip


def _weights_digest(
    tokenizer: Tokenizer, models: Sequence[Transformer], weights: Sequence[float]
) -> str:
    """fingerprint's SHA-256: the tokenizer, then each model's tensors as float32 (an ensemble's
    models after the first with their weights; one model hashes as it always has)."""
    digest = hashlib.sha256(tokenizer.model_bytes)
    for i, model in enumerate(models):
        if i:
            digest.update(f"model {i} weight {weights[i]!r}".encode())
        for name, tensor in model.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# --- hypotheses to text ------------------------------------------------------------------------


def translate_text(
    translator: Translator,
    lines: Sequence[str],
    prefixes: Sequence[str] | None = None,
    lines_at: Sequence[int] | None = None,
) -> list[str]:
    """Detokenized best translation of each line, in input order (each starting with its target
    prefix, if given; `lines_at`: as translate_lines's)."""
    hypotheses = translate_lines(translator, lines, prefixes=prefixes, scores=False,
                                 lines_at=lines_at)  # fmt: skip
    return detokenize(translator, [hyps[0].tokens if hyps else [] for hyps in hypotheses])


def detokenize(translator: Translator, outputs: Sequence[Sequence[int]]) -> list[str]:
    """Text of each output, on one line: byte pieces could spell a line break, which would break
    the one-output-line-per-input-line promise, so CR and LF become spaces."""
    return [_LINE_BREAKS.sub(" ", text) for text in translator.tokenizer.decode(outputs)]
