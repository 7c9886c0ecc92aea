"""`tmt export`: a trained model as a CTranslate2 model or a Hugging Face model, checked first.

An export is written only when it reproduces tmt: its greedy outputs on the model's validation
split (or the first `check_lines` lines of it) must be token-identical to tmt's own greedy outputs,
else the export fails and names the first line that differs. It is built in a hidden staging
directory beside the output and renamed into place, so an interrupted export leaves nothing under
the final name.

- ctranslate2: `ctranslate2.specs.TransformerSpec` (pre- or post-norm, ReLU, the sinusoid table, the
  one tied matrix as both embeddings and the output projection). A quantization (int8,
  int8_float16, float16) is applied after the parity check of the float32 conversion; the
  quantized model's agreement with tmt is reported, not required.
- huggingface: a post-norm model as MarianMTModel, a pre-norm one as
  PegasusForConditionalGeneration, with a tokenizer.json that gives tmt's ids (huggingface.py
  converts them); the parity check reads the directory back with AutoModelForSeq2SeqLM and
  AutoTokenizer, as a user would.

Both peers are optional (`pip install "transformer_mt[export]"`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from transformer_mt.common import files, textio
from transformer_mt.common.exits import TmtError
from transformer_mt.config import apply_overrides
from transformer_mt.exchange import huggingface, recipes
from transformer_mt.runs import checkpoint
from transformer_mt.translation import ct2, translate
from transformer_mt.translation.translate import Translator

logger = logging.getLogger(__name__)

FORMATS = ("ctranslate2", "huggingface")
QUANTIZATIONS = ("int8", "int8_float16", "float16")  # CTranslate2's, stored weights
REPORT_FILE = ct2.REPORT_FILE
# Lines a Hugging Face export is checked on by default: transformers' generate on a CPU took
# 9 min 20 s for all 1,014 of Multi30k's validation lines (about 0.5 s a line); --check-lines 0
# checks every line.
HF_CHECK_LINES = 200
_EXTRA = ct2.EXTRA


def export(
    model: str | Path,
    fmt: str,
    output: Path,
    quantization: str | None = None,
    check_lines: int | None = None,
    overwrite: bool = False,
    last: int | None = None,
    best: int | None = None,
    by: str | None = None,
    shortlist: str | None = None,
) -> dict[str, Any]:
    """Export `model` (a checkpoint, an average or a run directory; with `last` or `best`, the
    average of the run's newest or best N) to `output` in format `fmt` after checking it against
    tmt on `check_lines` validation lines (0: all of them; None: all for CTranslate2, the first
    HF_CHECK_LINES for Hugging Face, whose generate is slow on a CPU); an earlier export at
    `output` is replaced only with `overwrite`; `shortlist` (auto or a file, CTranslate2 only): the
    model's lexical shortlist written as the export's vmap.txt."""
    if fmt not in FORMATS:
        raise TmtError(f"{fmt}: expected one of {', '.join(FORMATS)}", param="fmt")
    if quantization is not None and (fmt != "ctranslate2" or quantization not in QUANTIZATIONS):
        allowed = f"ctranslate2 takes {', '.join(QUANTIZATIONS)}"
        raise TmtError(
            f"{quantization}: not for {{fmt}} {fmt} ({allowed})",
            param="quantization", mentions=["fmt"],
        )  # fmt: skip
    if shortlist not in (None, "none") and fmt != "ctranslate2":
        raise TmtError(f"is for a CTranslate2 export (its vocabulary map), not for {fmt}",
                       param="shortlist")  # fmt: skip
    if check_lines is None:
        check_lines = HF_CHECK_LINES if fmt == "huggingface" else 0
    if check_lines < 0:
        raise TmtError(f"{check_lines}: expected 0 (all) or more", param="check_lines")
    if ct2.is_export(Path(model)):
        raise TmtError(f"{model}: a CTranslate2 export already; export the tmt model it came from")
    textio.check_path(output)
    with textio.OutputLock(output):  # one writer: the checks below hold while it writes
        return _export(model, fmt, output, quantization, check_lines, overwrite, last, best, by,
                       None if shortlist == "none" else shortlist)  # fmt: skip


def _export(
    model: str | Path, fmt: str, output: Path, quantization: str | None, check_lines: int,
    overwrite: bool, last: int | None, best: int | None, by: str | None,
    shortlist: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    _check_destination(output, model, overwrite)
    builder = _require(fmt)
    settings = ["decode.device=cpu", "decode.precision=fp32", "decode.engine=torch"]
    translator = translate.load_translator(model, settings, last=last, best=best, by=by)
    table = None  # read and verified before anything is written
    if shortlist is not None:
        table = translate.with_shortlist(dataclasses.replace(translator, config=apply_overrides(
            translator.config, [f"decode.shortlist={shortlist}"]))).shortlist  # fmt: skip
    every, checked_on = translate.check_lines(translator.config, 0)
    lines = every[: check_lines or None]
    if len(lines) < len(every):  # a sample, and what checking them all would take
        checked_on = (f"the first {len(lines)} of the {len(every)} lines of {checked_on}"
                      f" (--check-lines 0 checks all)")  # fmt: skip
    greedy = dataclasses.replace(
        translator,
        config=apply_overrides(translator.config, ["decode.beam_size=1", "decode.nbest=1"]),
    )
    expected = [
        h[0].tokens if h else [] for h in translate.translate_lines(greedy, lines, scores=False)
    ]
    staging = output.parent / f".tmp-export-{output.name}-{os.getpid()}"
    if output.parent.is_dir():  # what killed exports to this output left behind
        files.recover(
            output.parent, live_writers=True, names=[f"export-{output.name}", output.name]
        )
    shutil.rmtree(staging, ignore_errors=True)
    try:
        built = builder(translator, staging, lines, expected, quantization)
        if table is not None:  # after the parity check, which is the exact decode's
            built["vmap_lines"] = ct2.write_vmap(staging, table, translator.tokenizer)
            with open(staging / recipes.README_FILE, "a", encoding="utf-8") as readme:
                readme.write(recipes.VMAP_NOTE)
        report = _write_report(staging, fmt, translator, built | {"checked_on": checked_on})
        output.parent.mkdir(parents=True, exist_ok=True)
        files.swap_into_place(staging, output)  # an empty directory or an earlier export
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("exported %s to %s (%d lines identical to tmt)", translator.origin, output,
                report["check_lines"])  # fmt: skip
    return {"output": str(output), **report}


def _write_report(
    staging: Path, fmt: str, translator: Translator, report: dict[str, Any]
) -> dict[str, Any]:
    """tmt_export.json: what was exported, from what, by which tmt; for CTranslate2 also the
    files' checksums and tmt's config, so that tmt decodes it (-m EXPORT_DIR)."""
    written = sorted(p.name for p in staging.iterdir() if p.name != REPORT_FILE)
    report |= {
        "format": fmt,
        "source": translator.origin,
        "tmt_version": checkpoint.TMT_VERSION,
        "step": translator.step,
        "parameters": translator.parameters,
        "files": written,
    }  # fmt: skip  (what --overwrite may replace: these only)
    if fmt == "huggingface":
        files.atomic_write(staging / REPORT_FILE, json.dumps(report, indent=1).encode())
        return report
    stored = apply_overrides(translator.config, ["decode.engine=ctranslate2", "decode.device=auto"])
    ct2.write_report(staging, report, stored, translator.tokenizer)
    return report


def format_report(report: dict[str, Any]) -> str:
    """An export's report for people: where it went and what its parity check showed."""
    kind = report.get("architecture") or report.get("quantization")
    text = (
        f"exported {report['source']} to {report['output']} ({report['format']}, {kind}):"
        f" its greedy outputs equal tmt's on {report['check_lines']} lines of"
        f" {report.get('checked_on', 'the validation split')}"
    )
    if "quantized_identical_lines" in report:
        text += f"; quantized, {report['quantized_identical_lines']} lines identical"
    return text


def _check_destination(output: Path, model: str | Path, overwrite: bool) -> None:
    """An export goes into a new or empty directory, or replaces an earlier export with
    `overwrite`; never anything else (textio.check_output: nor the model, nor tmt's files)."""
    if output.exists() and not (output.is_dir() and not output.is_symlink()):
        raise TmtError(f"{output}: exists and is not a directory; choose another output")
    if output.is_dir() and any(output.iterdir()):
        if not (output / REPORT_FILE).is_file():
            raise TmtError(
                f"{output}: exists and is not an empty directory nor a tmt export; choose"
                " another output"
            )
        foreign = files.foreign_entries(output, _written(output))
        if foreign:
            raise TmtError(f"{output}: holds {foreign[0]}, which tmt did not write there: an"
                           " export replaces only its own files; move it, or choose another"
                           " output")  # fmt: skip
    textio.check_output(output, [model], overwrite, directory=True)


def _written(output: Path) -> set[str]:
    """What an earlier export wrote in `output`: the files its report lists (exports before the
    list: the report's checksums, and the files of its format)."""
    try:
        report = json.loads(files.read_plain(output / REPORT_FILE, limit=1 << 24))
    except (OSError, ValueError, RecursionError):
        return set()
    if not isinstance(report, dict):
        return set()
    if isinstance(report.get("files"), list):
        return {str(name) for name in report["files"]} | {REPORT_FILE}
    known = set(report.get("sha256") or {}) | {REPORT_FILE, recipes.README_FILE}
    if report.get("format") == "huggingface":
        known |= {"config.json", "generation_config.json", "model.safetensors",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "source.spm", "target.spm", "vocab.json", "target_vocab.json"}  # fmt: skip
    return known


def _require(fmt: str) -> Callable[..., dict[str, Any]]:
    """The builder of `fmt`, once its optional package is importable."""
    needs = {"ctranslate2": ["ctranslate2"], "huggingface": ["transformers", "tokenizers"]}[fmt]
    for package in needs:
        try:
            __import__(package)
        except ImportError:
            raise TmtError(f"{fmt} needs the {package} package: {_EXTRA}", param="fmt") from None
    return _ctranslate2 if fmt == "ctranslate2" else _huggingface


def _parity(expected: list[list[int]], found: list[list[int]], lines: list[str], fmt: str,
            translator: Translator) -> None:  # fmt: skip
    """Refuse an export whose greedy outputs differ from tmt's, naming the first line."""
    for i, (ours, theirs) in enumerate(zip(expected, found, strict=True)):
        if ours != theirs:
            text = translator.tokenizer.decode([ours, theirs])
            raise TmtError(
                f"the {fmt} export differs from tmt on validation line {i + 1} ({lines[i][:60]!r}):"
                f" tmt {text[0][:60]!r}, {fmt} {text[1][:60]!r}; nothing was written"
            )


def _limits(translator: Translator, lines: Sequence[str]) -> list[int]:
    """tmt's maximum output length per line (the EOS included), as translate_lines applies it."""
    return translate.output_limits(translator, translate.source_ids(translator, lines))


def _batches(limits: list[int], size: int = 64) -> list[list[int]]:
    """Line indices in batches of similar output-length limits. A peer takes one limit per call:
    it decodes a batch to the largest, and each row is cut at its own (greedy rows do not depend
    on each other, so this is exactly tmt's forced end of sentence)."""
    order = sorted(range(len(limits)), key=limits.__getitem__)
    return [order[i : i + size] for i in range(0, len(order), size)]


def _cut(row: list[int], eos_id: int, limit: int) -> list[int]:
    """A peer's greedy output as tmt's: up to the EOS, at most limit - 1 tokens."""
    end = row.index(eos_id) if eos_id in row else len(row)
    return row[: min(end, limit - 1)]


# --- CTranslate2 -------------------------------------------------------------------------------


def _ctranslate2(
    translator: Translator,
    staging: Path,
    lines: list[str],
    expected: list[list[int]],
    quantization: str | None,
) -> dict[str, Any]:
    assert translator.model is not None
    model, tokenizer, cfg = translator.model, translator.tokenizer, translator.config
    ct2.save(staging, model, tokenizer, cfg, None)  # float32: what the parity check reads
    found = _ctranslate2_greedy(staging, translator, lines)
    _parity(expected, found, lines, "ctranslate2", translator)
    report: dict[str, Any] = {"check_lines": len(lines), "quantization": quantization or "float32"}
    readme = recipes.ctranslate2_readme(translator, len(lines), checkpoint.TMT_VERSION)
    if quantization:
        quantized = staging.with_name(staging.name + "-q")
        try:
            ct2.save(quantized, model, tokenizer, cfg, quantization)
            shutil.rmtree(staging)
            os.rename(quantized, staging)
        finally:
            shutil.rmtree(quantized, ignore_errors=True)
        found = _ctranslate2_greedy(staging, translator, lines)
        report["quantized_identical_lines"] = sum(map(list.__eq__, expected, found))
    files.atomic_write(staging / recipes.README_FILE, readme.encode())
    return report


def _ctranslate2_greedy(
    directory: Path, translator: Translator, lines: list[str]
) -> list[list[int]]:
    """The export's greedy outputs as its README computes them: the README's own code, through
    the directory's sentencepiece.model."""
    code = recipes.python_block(recipes.ctranslate2_readme(translator, 0, ""))
    outputs = recipes.run_ctranslate2_recipe(code, str(directory), lines, beam=1)
    index = translator.tokenizer.piece_to_id
    return [[index(piece) for piece in output] for output in outputs]


# --- Hugging Face ------------------------------------------------------------------------------


def _huggingface(
    translator: Translator,
    staging: Path,
    lines: list[str],
    expected: list[list[int]],
    quantization: str | None,
) -> dict[str, Any]:
    transformers = huggingface.transformers_module()
    hf_model, architecture = huggingface.model(translator)
    # Its progress bars of writing and reading back a model of one file say nothing here.
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        hf_model.save_pretrained(str(staging))
        huggingface.save_tokenizer(translator, staging)
        # The parity check reads the directory back exactly as a user would.
        loaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(staging)).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(staging))
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    found = _hf_greedy(loaded, tokenizer, translator, lines)
    _parity(expected, found, lines, "huggingface", translator)
    readme = recipes.huggingface_readme(
        translator, architecture, len(lines), checkpoint.TMT_VERSION, example=lines[0]
    )
    files.atomic_write(staging / recipes.README_FILE, readme.encode())
    return {"check_lines": len(lines), "architecture": architecture}


def _hf_greedy(
    model: Any, tokenizer: Any, translator: Translator, lines: list[str]
) -> list[list[int]]:
    """generate's greedy outputs (EOS excluded) with tmt's limits, sources read by `tokenizer`;
    its advice that max_new_tokens overrides the config's max_length (as meant) not repeated."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return _hf_generate(model, tokenizer, translator, lines)
    finally:
        hf_logging.set_verbosity(verbosity)


def _hf_generate(
    model: Any, tokenizer: Any, translator: Translator, lines: list[str]
) -> list[list[int]]:
    tok, limits = translator.tokenizer, _limits(translator, lines)
    keep = translator.config.model.max_positions - 1  # tmt truncates the source to this, + EOS
    code = translator.config.decode.target_lang  # a multi-target model's >>xxx<<, put first
    outputs: list[list[int]] = [[] for _ in lines]
    for batch in _batches(limits):
        sources = []
        for i in batch:
            ids = tokenizer(f">>{code}<< {lines[i]}" if code else lines[i])["input_ids"]
            sources.append(ids[:keep] + ids[-1:] if len(ids) > keep + 1 else ids)
        width = max(map(len, sources))
        pad = tok.source_pad_id  # the encoder's input is padded on the source side
        padded = torch.tensor([s + [pad] * (width - len(s)) for s in sources])
        with torch.inference_mode():
            generated = model.generate(
                input_ids=padded, attention_mask=(padded != pad).long(), num_beams=1,
                do_sample=False, max_new_tokens=max(limits[i] for i in batch) - 1,
                bad_words_ids=[[token] for token in tok.never_output], forced_eos_token_id=None,
            )  # fmt: skip
        for i, row in zip(batch, generated[:, 1:].tolist(), strict=True):
            outputs[i] = _cut(row, tok.eos_id, limits[i])
    return outputs
