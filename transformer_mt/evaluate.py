"""Scores: sacreBLEU (cased, 13a), chrF and lowercased BLEU of detokenized text, with signatures;
the validation BLEU of training; and `tmt evaluate`'s library function.

Validation BLEU decodes through translate.py exactly as `tmt translate` and `tmt evaluate` do, so
the BLEU seen during training is the BLEU `tmt evaluate` reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from transformer_mt import corpus, distributed
from transformer_mt.config import Config
from transformer_mt.distributed import DistInfo
from transformer_mt.exits import TmtError
from transformer_mt.model import Transformer
from transformer_mt.tokenizer import Tokenizer
from transformer_mt.translate import Translator, translate_text


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
        model=model, tokenizer=tokenizer, config=dataclasses.replace(cfg, decode=decode),
        device=info.device, origin="training",
    )  # fmt: skip
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


def check_split(split: str) -> None:
    """A split of a config to score: test, valid or train."""
    if split not in ("test", "valid", "train"):
        raise TmtError(f"{split!r}: expected test, valid or train", param="split")


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
    if split is not None:
        check_split(split)
    if references is None:
        config = cfg or (translator.config if translator else None)
        if config is None or split is None:
            raise TmtError(
                "evaluate needs references: a split of the checkpoint's config or a reference file"
            )
        split_sources, references = corpus.read_split(config.data, f"data.{split}")
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
