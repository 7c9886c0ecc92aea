"""`tmt shortlist`: a model's lexical shortlist (shortlist.py) from its training corpora, from a
corpus the user names, from the model's own translations of monolingual text (an imported
OPUS-MT model ships no corpus), or from Marian's lex.s2t; written beside the model or to -o."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from transformer_mt.common import textio
from transformer_mt.common.exits import TmtError
from transformer_mt.data import corpus
from transformer_mt.data.tokenizer import encode_heads
from transformer_mt.network.shortlist import (
    ALIGN_TOKENS,
    FILE_NAME,
    Shortlist,
    build,
    from_marian,
    save,
)
from transformer_mt.translation import translate


def make(
    model: str,
    output: Path | None = None,
    source_file: Path | None = None,
    reference_file: Path | None = None,
    marian: Path | None = None,
    first: int = 100,
    best: int = 100,
    min_prob: float = 0.0001,
    aligner: str = "auto",
    overwrite: bool = False,
) -> dict[str, Any]:
    """tmt shortlist: a shortlist for `model` from its training corpora, from -i SRC --ref TGT,
    from -i SRC alone (the model's own greedy translations as targets: an imported model ships
    no corpus), or from Marian's lex.s2t; written to `output` or beside the model."""
    for name, value in (("first", first), ("best", best)):
        if value < 0:
            raise TmtError(f"{value}: expected 0 or more", param=name)
    if not 0.0 <= min_prob <= 1.0:
        raise TmtError(f"{min_prob}: expected a probability in [0, 1]", param="min_prob")
    if aligner not in ("auto", "eflomal", "ibm1"):
        raise TmtError(f"{aligner}: expected auto, eflomal or ibm1", param="aligner")
    translator = translate.load_translator(model, ["decode.device=cpu", "decode.engine=torch"])
    tok = translator.tokenizer
    if translator.path is None:
        raise TmtError(f"{model}: no model directory to write its shortlist in: give -o FILE")
    # Beside the model (tmt's own file in its directory, as the CTranslate2 export is), or where
    # -o says (never inside a directory tmt manages).
    beside = output is None
    output = translator.path / FILE_NAME if output is None else output
    textio.check_path(output)
    inputs = [p for p in (source_file, reference_file, marian) if p is not None]
    if not beside:  # never a directory, nor an input overwritten by its own shortlist
        textio.check_output(output, inputs, overwrite=True)
    if output.exists() and not overwrite:
        raise TmtError(f"{output}: exists; --overwrite replaces it", param="output")
    if reference_file is not None and source_file is None:
        raise TmtError("needs -i SRC: the sources of those references", param="ref")
    with textio.OutputLock(output, own=beside):
        if marian is not None:
            table = from_marian(marian, tok, first, best)
            report: dict[str, Any] = {"aligner": table.header["aligner"], "pairs": 0}
        else:
            sources, target_ids, what = _pairs(translator, source_file, reference_file)
            # heads only: a side past ALIGN_TOKENS is left out whatever its length
            source_ids = encode_heads(tok, sources, "source", ALIGN_TOKENS)[0]
            table, report = build(zip(source_ids, target_ids, strict=True),
                                  tok.source_vocab_size, tok.vocab_size, tok.never_output, first,
                                  best, min_prob, aligner)  # fmt: skip
            table = Shortlist(table.frequent, table.offsets, table.targets,
                              {**table.header, "corpus": what})  # fmt: skip
            report["corpus"] = what
        save(table, output, translate.fingerprint(translator))
    return {"output": str(output), **report, "mean_translations": round(table.size(), 1)}


def _pairs(
    translator: translate.Translator, source_file: Path | None, reference_file: Path | None
) -> tuple[list[str], list[list[int]], str]:
    """(sources, target ids, what they are): -i and --ref, -i and the model's own greedy
    translations, or the model's training corpora (data.train)."""
    tok = translator.tokenizer
    if source_file is None:
        corpora = corpus.open_training(translator.config.data)
        pairs = [p for split in corpora for block in split.pairs(20_000, as_trained=True)
                 for p in block]  # fmt: skip
        targets = encode_heads(tok, [t for _, t in pairs], "target", ALIGN_TOKENS)[0]
        return [s for s, _ in pairs], targets, "data.train"
    sources = textio.read_text_file(source_file, "input")
    if reference_file is None:  # the model's own translations: what it would output
        found = translate.translate_lines(apply_greedy(translator), sources, scores=False)
        what = f"{source_file} and the model's greedy translations of it"
        return sources, [h[0].tokens if h else [] for h in found], what
    targets = textio.read_text_file(reference_file, "ref")
    if len(targets) != len(sources):
        raise TmtError(f"{reference_file}: {len(targets)} lines for {len(sources)} sources in"
                       f" {source_file}")  # fmt: skip
    ids = encode_heads(tok, targets, "target", ALIGN_TOKENS)[0]
    return sources, ids, f"{source_file} and {reference_file}"


def apply_greedy(translator: Any) -> Any:
    """The translator decoding greedily, one hypothesis a line, without a shortlist."""
    decode = dataclasses.replace(translator.config.decode, beam_size=1, nbest=1,
                                 sampling="none", shortlist="none")  # fmt: skip
    config = dataclasses.replace(translator.config, decode=decode)
    return dataclasses.replace(translator, config=config, shortlist=None)


def format_report(report: dict[str, Any]) -> str:
    return (f"tmt: {report['output']}: {report.get('mean_translations')} translations a source"
            f" piece on average, from {report.get('corpus', report['aligner'])}"
            f" ({report['pairs']} pairs; aligner: {report['aligner']})")  # fmt: skip
