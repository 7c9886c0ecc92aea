"""Scores: sacreBLEU (cased; 13a, or its tokenizer for Chinese, Japanese and Korean targets),
chrF and lowercased BLEU of detokenized text, with signatures; the validation BLEU of training;
and `tmt evaluate`'s library function.

Validation BLEU decodes through translate.py exactly as `tmt translate` and `tmt evaluate` do, so
the BLEU seen during training is the BLEU `tmt evaluate` reports.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from transformer_mt.common import distributed, languages, textio
from transformer_mt.common.distributed import DistInfo
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config
from transformer_mt.data import corpus
from transformer_mt.data import glossary as glossaries
from transformer_mt.data.tokenizer import Tokenizer
from transformer_mt.network.model import Transformer
from transformer_mt.translation.sources import readable
from transformer_mt.translation.translate import Translator, load_glossary, translate_text

# A test set's references: one line per hypothesis, or several such streams (one reference
# each, as sacreBLEU takes them: multi-reference BLEU, chrF and TER).
References = Sequence[str] | Sequence[Sequence[str]]


def streams(references: References) -> list[list[str]]:
    """The reference streams of `references`: one stream, or several."""
    if references and not isinstance(references[0], str):
        return [list(stream) for stream in references]
    return [list(references)]


def target_language(cfg: Config | None) -> str | None:
    """The language of the hypotheses, as sacreBLEU names it: a multi-target model's
    decode.target_lang, else data.tgt_lang (None: unknown)."""
    return languages.canonical(cfg.decode.target_lang or cfg.data.tgt_lang) if cfg else None


def bleu(language: str | None, lowercase: bool = False) -> Any:
    """sacreBLEU's BLEU with the tokenizer its own command picks for the target language (`-l`):
    zh for Chinese, MeCab for Japanese and Korean, 13a for the rest (13a leaves a line of Chinese
    one token, so BLEU says nothing). Without MeCab (pip install 'sacrebleu[ja]' or [ko]),
    Japanese and Korean are split into characters: said once, and the signature says tok:char."""
    from sacrebleu.metrics import BLEU

    try:
        return BLEU(lowercase=lowercase, trg_lang=language or "")
    except RuntimeError:  # sacreBLEU's MeCab tokenizers, without MeCab
        _said_once(f"BLEU of {language} text: MeCab is not installed (pip install"
                   f" 'sacrebleu[{language}]', sacreBLEU's tokenizer for it); scored with its"
                   " 'char' tokenizer instead (tok:char in the signature)")  # fmt: skip
        return BLEU(lowercase=lowercase, tokenize="char")


def ter(language: str | None) -> Any:
    """sacreBLEU's TER; for Chinese and Japanese with its normalization and asian_support, which
    make their characters words of their own (without, a sentence of them is one word and TER
    says nothing; asian_support works only inside the normalization)."""
    from sacrebleu.metrics import TER

    asian = language in ("zh", "ja")
    return TER(normalized=asian, asian_support=asian)


def check_language(refs: list[list[str]], language: str | None) -> None:
    """A warning where the references are mostly of scripts written without spaces (Chinese,
    Japanese, Thai ...) but are scored as another language: 13a reads such a line as about one
    word, so BLEU is near 0 whatever the hypotheses."""
    if language in languages.NO_SPACES:
        return
    sample = "".join(line for stream in refs for line in stream[:200])
    if languages.unspaced_share(sample) > 0.5:
        _said_once(f"the references are mostly written without spaces between words (Chinese,"
                   f" Japanese, Thai ...), but are scored as {language or 'an unknown language'}"
                   " (13a: a line is about one word); name their language, e.g. --set"
                   " data.tgt_lang=zh")  # fmt: skip


@functools.cache
def _said_once(message: str) -> None:
    logging.getLogger(__name__).warning(message)


def score(
    hypotheses: Sequence[str],
    references: References,
    all_metrics: bool = True,
    language: str | None = None,
) -> dict[str, Any]:
    """sacreBLEU (cased; the tokenizer of the target `language`, bleu()), chrF and lowercased
    BLEU of detokenized text, against one reference or several; with all_metrics also chrF++
    (word bigrams too) and TER (sacreBLEU's tercom: lowercased, lower is better; the slow one,
    so training's validation leaves both out)."""
    from sacrebleu.metrics import CHRF

    refs = streams(references)
    _check_counts(hypotheses, refs)
    check_language(refs, language)
    metrics = {"bleu": bleu(language), "chrf": CHRF(), "bleu_lc": bleu(language, lowercase=True)}
    if all_metrics:
        metrics |= {"chrfpp": CHRF(word_order=2), "ter": ter(language)}
    report: dict[str, Any] = {
        name: round(metric.corpus_score(list(hypotheses), refs).score, 2)
        for name, metric in metrics.items()
    }
    for name, metric in metrics.items():
        if name != "bleu_lc":
            report[_SIGNATURES[name]] = str(metric.get_signature())
    return {**report, "sentences": len(hypotheses)}


_SIGNATURES = {"bleu": "signature", "chrf": "chrf_signature", "chrfpp": "chrfpp_signature",
               "ter": "ter_signature"}  # fmt: skip


def _check_counts(hypotheses: Sequence[str], refs: list[list[str]], name: str = "") -> None:
    if any(len(hypotheses) != len(stream) for stream in refs):
        count = next(len(stream) for stream in refs if len(stream) != len(hypotheses))
        raise TmtError(
            f"{name + ': ' if name else ''}{len(hypotheses)} hypotheses but {count}"
            " references: the counts must match"
        )
    if not hypotheses:
        raise TmtError("nothing to score: no hypotheses and no references")


def format_report(report: dict[str, Any]) -> str:
    """The human-readable form of evaluate()'s figures."""
    lines = [
        f"BLEU = {report['bleu']:.2f}  ({report['signature']})",
        f"chrF2 = {report['chrf']:.2f}  ({report['chrf_signature']})",
    ]
    if "ter" in report:
        lines += [
            f"chrF2++ = {report['chrfpp']:.2f}  ({report['chrfpp_signature']})",
            f"TER = {report['ter']:.2f}  ({report['ter_signature']}; lower is better)",
        ]
    if report.get("glossary"):
        g = report["glossary"]
        use = "-" if g["term_use"] is None else f"{g['term_use']:.2f} %"
        lines.append(f"term use = {use}  ({g['terms_used']} of {g['terms_matched']} matched"
                     f" entries used, {g['lines_with_terms']} lines; {g['file']})")  # fmt: skip
    lines += [
        f"BLEU lowercased = {report['bleu_lc']:.2f}",
        f"sentences = {report['sentences']}"
        + (f"; model = {report['model']}" if report.get("model") else ""),
    ]
    return "\n".join(lines)


# sacreBLEU's names of the compared metrics, and ours.
_COMPARED = {"BLEU": "bleu", "chrF2": "chrf", "TER": "ter"}


def compare(
    systems: Sequence[tuple[str, Sequence[str]]],
    references: References | None,
    split: str = "test",
    cfg: Config | None = None,
) -> dict[str, Any]:
    """Each system against the first (the baseline), by sacreBLEU's paired tests on BLEU, chrF
    and TER: paired bootstrap resampling (1,000 resamples: each system's mean and 95 % confidence
    interval, and a p-value) and approximate randomization (10,000 trials: a p-value). Both test
    the null hypothesis that the system and the baseline score the same (two-sided: the absolute
    difference). sacreBLEU's fixed seed (SACREBLEU_SEED, 12345) makes the figures repeatable.
    Against one reference or several; without `references`, those of the config's `split`."""
    from sacrebleu.metrics import CHRF
    from sacrebleu.significance import PairedTest

    if len(systems) < 2:
        raise TmtError("a comparison needs at least two hypothesis files (--hyp A --hyp B)")
    if references is None:  # the split's references
        if cfg is None:
            raise TmtError("a comparison needs references: a reference file or a config's split")
        references = corpus.read_split(cfg.data, f"data.{split}")[1]
    refs = streams(references)
    for name, hypotheses in systems:
        _check_counts(hypotheses, refs, name)
    named = [(name, list(hypotheses)) for name, hypotheses in systems]
    logging.getLogger("sacrebleu").setLevel(logging.WARNING)  # its progress, line by line
    language = target_language(cfg)
    check_language(refs, language)
    results: dict[str, Any] = {}
    for test in ("bs", "ar"):
        metrics = {"BLEU": bleu(language), "chrF2": CHRF(), "TER": ter(language)}
        # The bootstrap gives the confidence intervals; randomization adds only its p-values.
        signatures, scores = PairedTest(named, metrics, refs, test_type=test, n_ar_confidence=-1)()
        results[test] = (signatures, scores)
    (bs_signatures, bootstrap), (_, randomization) = results["bs"], results["ar"]
    rows = []
    tested = len(refs[0]) >= MIN_TEST_SENTENCES
    for i, (name, hypotheses) in enumerate(named):
        # sacreBLEU gives an output identical to the baseline's the smallest p-value (no
        # resample differs, and its test counts only larger differences): no test is reported.
        same = i > 0 and hypotheses == named[0][1]
        row: dict[str, Any] = {"system": name, "baseline": i == 0, "identical_to_baseline": same}
        for theirs, ours in _COMPARED.items():
            b, r = bootstrap[theirs][i], randomization[theirs][i]
            untested = same or not tested
            row[ours] = {
                "score": round(b.score, 2), "mean": round(float(b.mean), 2) if tested else None,
                "ci95": round(float(b.ci), 2) if tested else None,
                "p_bootstrap": None if untested else b.p_value,
                "p_randomization": None if untested else r.p_value,
            }  # fmt: skip
        rows.append(row)
    return {
        "systems": rows,
        "sentences": len(refs[0]),
        "tested": tested,
        "signatures": {_COMPARED[m]: str(sig) for m, sig in bs_signatures.items()},
        "randomization_trials": 10_000,
    }


# Fewer sentences than this get scores but no paired test: resampling a handful of sentences
# (one, in the limit) tells nothing about a test set, yet sacreBLEU would report p 0.001.
MIN_TEST_SENTENCES = 30


def format_comparison(report: dict[str, Any]) -> str:
    """compare()'s table: per metric, each system's score, bootstrap mean ± 95 % CI and the two
    p-values against the baseline (the first system); * marks p < 0.05 in both tests."""
    width = max(len(row["system"]) for row in report["systems"]) + 2
    lines = [f"{report['sentences']} sentences; baseline: {report['systems'][0]['system']}"]
    for theirs, ours in _COMPARED.items():
        better = "lower is better" if ours == "ter" else "higher is better"
        lines += ["", f"{theirs} ({better}; {report['signatures'][ours]})",
                  f"{'system':<{width}}{'score':>8}{'mean ± 95% CI':>18}{'p (bootstrap)':>16}"
                  f"{'p (randomization)':>20}"]  # fmt: skip
        for row in report["systems"]:
            m = row[ours]
            p_bs, p_ar = m["p_bootstrap"], m["p_randomization"]
            mark = " *" if p_bs is not None and p_ar is not None and max(p_bs, p_ar) < 0.05 else ""
            interval = f"{m['mean']:.2f} ± {m['ci95']:.2f}" if report["tested"] else "-"
            none = "identical" if row["identical_to_baseline"] else "-"
            p_bs_text = none if p_bs is None else f"{p_bs:.4f}"
            p_ar_text = none if p_ar is None else f"{p_ar:.4f}"
            lines.append(
                f"{row['system']:<{width}}{m['score']:>8.2f}{interval:>18}{p_bs_text:>16}"
                f"{p_ar_text:>20}{mark}"
            )
    if report["tested"]:
        lines += ["", "* p < 0.05 in both tests (the system differs from the baseline)"]
    else:
        lines += ["", f"no paired test: {report['sentences']} sentences, fewer than"
                      f" {MIN_TEST_SENTENCES} (scores only)"]  # fmt: skip
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
    shard = range(info.rank, len(sources), info.world_size)  # warnings name the split's lines
    mine = translate_text(translator, [sources[i] for i in shard], lines_at=shard)
    model.train(was_training)
    shards = distributed.gather_to_main(mine, info)
    figures = torch.zeros(2, dtype=torch.float64, device=info.device)
    if info.is_main:
        hypotheses = [
            shards[i % info.world_size][i // info.world_size] for i in range(len(sources))
        ]
        result = score(hypotheses, references, all_metrics=False, language=target_language(cfg))
        figures += torch.tensor(
            [result["bleu"], result["chrf"]], dtype=torch.float64, device=info.device
        )
    distributed.all_reduce_sum(figures, info)
    return {"val_bleu": figures[0].item(), "val_chrf": figures[1].item()}


def check_arguments(
    hyp: bool,
    model: bool,
    input_: bool,
    ref: bool,
    split: bool,
    translating: dict[str, Any],
    glossary: bool = False,
) -> None:
    """tmt evaluate scores a model's translations or hypothesis files: an option (named as the
    command line spells it) that the way chosen would not read is refused, never ignored (a
    score reported for a model that did not make it, references of another input). With a
    glossary, -i gives --hyp's sources (whose terms are matched)."""
    given = [name for name, value in translating.items() if value is not None]
    source_ok = glossary  # term use reads the sources the hypotheses translate
    if hyp and (model or (input_ and not source_ok) or given):
        names = ", ".join([*(["-m"] if model else []),
                           *(["-i"] if input_ and not source_ok else []), *given])  # fmt: skip
        raise TmtError(f"{names}: not with --hyp, whose lines are scored as they are (nothing"
                       " is translated)")  # fmt: skip
    if not hyp and not model:
        names = ", ".join([*(["-i"] if input_ else []), *given])
        if names:
            raise TmtError(f"{names}: nothing to translate with: give the model with -m")
    if input_ and not ref:
        raise TmtError("-i needs --ref, the references of that input (a split has its own"
                       " sources: --split)")  # fmt: skip
    if model and ref and not input_:
        raise TmtError("--ref needs -i, the sources of those references (a split has its own"
                       " references: --split)")  # fmt: skip
    if split and ref and (input_ or hyp):
        raise TmtError("--split: not with --ref and -i or --hyp, which give both sides")
    if hyp and glossary and ref and not input_:
        raise TmtError("--glossary with --hyp and --ref needs -i, the sources of those"
                       " hypotheses (their terms are matched there)")  # fmt: skip


def check_split(split: str) -> None:
    """A split of a config to score: test, valid or train."""
    if split not in ("test", "valid", "train"):
        raise TmtError(f"{split!r}: expected test, valid or train", param="split")


def read_files(
    sources: Path | None, references: Sequence[Path] | None, hypotheses: Path | None
) -> tuple[list[str] | None, list[list[str]] | None, list[str] | None]:
    """tmt evaluate's -i, --ref (one file per reference) and --hyp files, each read whole (None
    where not given)."""
    return (
        textio.read_text_file(sources, "input") if sources else None,
        read_references(references) if references else None,
        textio.read_text_file(hypotheses, "hyp") if hypotheses else None,
    )


def read_references(paths: Sequence[Path]) -> list[list[str]]:
    """--ref files, a stream each: as many lines in each (a line per sentence of the test set)."""
    refs = [textio.read_text_file(path, "ref") for path in paths]
    for path, stream in zip(paths[1:], refs[1:], strict=True):
        if len(stream) != len(refs[0]):
            raise TmtError(f"{path}: {len(stream)} lines, but {paths[0]} has {len(refs[0])}:"
                           " each reference file has a line per sentence", param="ref")  # fmt: skip
    return refs


def compare_files(
    hyps: Sequence[Path], refs: Sequence[Path] | None, split: str, cfg: Config
) -> dict[str, Any]:
    """tmt evaluate --hyp A --hyp B ...: sacreBLEU's paired tests against the first."""
    check_split(split)
    return compare(
        [(str(path), textio.read_text_file(path, "hyp")) for path in hyps],
        read_references(refs) if refs else None, split=split, cfg=cfg,
    )  # fmt: skip


def glossary_of(translator: Translator | None, cfg: Config) -> glossaries.Glossary | None:
    """The glossary evaluate measures term use with: the translator's, else glossary.path's."""
    if translator is not None:
        return translator.glossary
    return load_glossary(cfg)


def _model_split(config: Config, split: str, of_model: bool) -> tuple[list[str], list[str]]:
    """A split's sources and references; one the model's config names that is not on this
    machine (the model was trained elsewhere, or from another directory) says what else to do."""
    try:
        return corpus.read_split(config.data, f"data.{split}")
    except TmtError as err:
        if not of_model:
            raise
        raise TmtError(
            f"{err.message}: the model's config names it; score other text with {{input}} SOURCES"
            " {ref} REFERENCES",
            err.exit_code,
            err.param,
            (*err.mentions, "input", "ref"),
        ) from None


def evaluate(
    translator: Translator | None,
    split: str | None = None,
    sources: Sequence[str] | None = None,
    references: References | None = None,
    hypotheses: Sequence[str] | None = None,
    cfg: Config | None = None,
    glossary: glossaries.Glossary | None = None,
) -> dict[str, Any]:
    """Score `hypotheses`, or the translator's output for `sources` or a config split, against the
    references (one or several). Returns score()'s figures plus where the text came from; with a
    glossary, term use over the sources' matched entries (glossary.term_use)."""
    if split is not None:
        check_split(split)
    if references is None:
        config = cfg or (translator.config if translator else None)
        if config is None or split is None:
            raise TmtError(
                "evaluate needs references: a split of the checkpoint's config or a reference file"
            )
        split_sources, references = _model_split(config, split, translator is not None)
        sources = sources if sources is not None else split_sources
    elif sources is None and glossary is not None and split is not None and cfg is not None:
        sources = corpus.read_split(cfg.data, f"data.{split}")[0]  # --hyp and --ref: the split's
    if hypotheses is None:
        if translator is None or sources is None:
            raise TmtError(
                "evaluate needs hypotheses: a checkpoint to translate with or a hypothesis file"
            )
        count = len(streams(references)[0])
        if len(sources) != count:
            raise TmtError(f"{len(sources)} source lines but {count} references: counts must match")
        hypotheses = translate_text(translator, sources)
    language = target_language(translator.config if translator else cfg)
    report = {**score(hypotheses, references, language=language),
              "model": translator.origin if translator else None}  # fmt: skip
    if glossary is not None:
        if sources is None or len(sources) != len(hypotheses):
            raise TmtError("term use needs the sources the hypotheses translate: a split, or -i")
        if translator is not None:  # the entries of what the model read, as it matched them
            sources = readable(translator, sources)
        report["glossary"] = {"file": glossary.name, "entries": len(glossary),
                              **glossaries.term_use(glossary, sources, hypotheses)}  # fmt: skip
    return report
