"""The `tmt` command line: parse, load the config, call one library function, print its result.

One convention for every command: what a command reads is named with -m/--model (a checkpoint,
an averaged model or a run directory; repeatable where several are read), --last N / --best N
[--by METRIC] average a run's newest or best checkpoints, text comes in with -i/--input and goes
out with -o/--output, an existing output is replaced only with --overwrite, and a result is
printed for people unless --json asks for one JSON object. Old spellings (tmt 0.1) still work for
one release, with a note: --checkpoint, --average-last, --src, positional models of average and
plot.

Heavy modules (torch, datasets) are imported inside the commands so `tmt --help` is instant.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from transformer_mt import flags
from transformer_mt.common import exits
from transformer_mt.common.exits import TmtError
from transformer_mt.config import apply_overrides, load_config

app = typer.Typer(
    cls=flags.Commands,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
command = functools.partial(app.command, cls=flags.OnceCommand)


@app.callback()
def _commands() -> None:
    """tmt: train the Transformer of 'Attention Is All You Need' and translate raw text."""


# The flag that sets each library parameter an error may name, where it is not "--" + the name.
_FLAG_OF = {"fmt": "--format", "model": "-m", "overrides": "--set"}


def _flag(param: str) -> str:
    return _FLAG_OF.get(param, "--" + param.replace("_", "-"))


def _printed_on_the_way(record: logging.LogRecord) -> bool:
    """Whether a handler below the root printed `record` already: datasets and huggingface_hub
    (and transformers where CI is set) print their warnings through a handler of their own and
    pass them on to the root as well, where tmt printed each again ("Retrying in 1s" then "tmt:
    Retrying in 1s", for every retry of an unreachable hub)."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None and logger is not logging.root:
        if logger.handlers:
            return True
        if not logger.propagate:
            return False
        logger = logger.parent
    return False


def _log_to_stderr() -> None:
    """tmt's messages on stderr as "tmt: ...", each once; a process that has set up logging (a
    program calling the CLI, pytest) keeps its own."""
    if logging.root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("tmt: %(message)s"))
    handler.addFilter(lambda record: not _printed_on_the_way(record))
    logging.root.addHandler(handler)
    logging.root.setLevel(logging.INFO)


def _user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Bad input ends a command with one line on stderr and exit code 2, never a traceback; the
    parameters an error names are written as this command line's flags."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        _log_to_stderr()
        try:
            return command(*args, **kwargs)
        except (TmtError, OSError) as err:  # an OSError the library did not name: still one line
            ended = exits.user_error(err, _flag)
            if ended is None:
                raise
            typer.echo(f"tmt: error: {ended[0]}", err=True)
            raise typer.Exit(ended[1]) from None

    return run


def _echo(result: dict[str, Any], as_json: bool, text: str) -> None:
    """A command's result: one JSON object with --json, else `text` for people."""
    typer.echo(json.dumps(result) if as_json else text)


def _load(
    models: list[Path], weights: str | None, overrides: list[str], last: int | None,
    best: int | None, by: str | None, keep_model: bool = False,
) -> Any:  # fmt: skip
    """The model, average or ensemble the command decodes (translate.load_ensemble)."""
    from transformer_mt.network import ensemble
    from transformer_mt.translation import translate

    chosen = ensemble.parse_weights(weights)
    return translate.load_ensemble(models, overrides, chosen, last=last, best=best, by=by,
                                   keep_model=keep_model)  # fmt: skip


@command()
@_user_errors
def train(
    config: flags.ConfigOption = "multi30k",
    set_: flags.Overrides = None,
    init_from: flags.InitFrom = None,
    dry_run: flags.DryRun = False,
    as_json: flags.AsJson = False,
) -> None:
    """Train a model. Multi-GPU: torchrun --nproc_per_node=N -m transformer_mt train -c CONFIG."""
    from transformer_mt.training import dry_run as dry_run_lib
    from transformer_mt.training import progress
    from transformer_mt.training import train as train_lib

    overrides = [*(set_ or []), *([f"train.init_from={init_from}"] if init_from else [])]
    cfg = load_config(config, overrides)
    if dry_run:
        report = dry_run_lib.dry_run(cfg)
        _echo(report, as_json, dry_run_lib.format_report(report, cfg))
        return
    summary = train_lib.train(cfg)
    if summary.pop("rank") == 0:  # a single process, or rank 0 of a distributed run
        _echo(summary, as_json, progress.format_summary(summary))
    if summary["stop"] in exits.SIGNAL_EXIT:  # stopped by a signal, after saving
        raise typer.Exit(exits.SIGNAL_EXIT[summary["stop"]])


@command()
@_user_errors
def translate(
    model: flags.Ensemble = None,
    weights: flags.Weights = None,
    input_: flags.TextInput = "-",
    output: flags.TextOutput = "-",
    overwrite: flags.Overwrite = False,
    nbest: flags.NBest = None,
    beam: flags.Beam = None,
    lenpen: flags.Lenpen = None,
    max_tokens: flags.MaxTokens = None,
    device: flags.Device = None,
    precision: flags.Precision = None,
    engine: flags.Engine = None,
    sampling: flags.Sampling = None,
    temperature: flags.Temperature = None,
    seed: flags.Seed = None,
    prefix: flags.Prefix = None,
    alignment: flags.Alignment = None,
    target_lang: flags.TargetLang = None,
    shortlist: flags.ShortlistFlag = None,
    glossary: flags.GlossaryFile = None,
    glossary_mode: flags.GlossaryMode = None,
    glossary_report: flags.GlossaryReport = None,
    last: flags.Last = None,
    best: flags.Best = None,
    by: flags.By = None,
    set_: flags.Overrides = None,
    old_model: flags.OldModel = None,
    old_last: flags.OldLast = None,
) -> None:
    """Translate raw text, one output line per input line (other options: --set decode.KEY=V).

    A file into a file is a resumable job in chunks (decode.chunk_lines): the same command after
    a kill translates only what is missing. Under torchrun the processes share the chunks."""
    from transformer_mt.translation import bulk, streams

    overrides = flags.flag_overrides(
        set_, nbest=nbest, beam=beam, lenpen=lenpen, max_tokens=max_tokens, device=device,
        precision=precision, engine=engine, sampling=sampling, temperature=temperature,
        seed=seed, alignment=alignment, target_lang=target_lang, glossary=glossary,
        glossary_mode=glossary_mode, shortlist=shortlist,
    )  # fmt: skip
    last = flags.renamed(last, old_last, "--last", "--average-last")
    translator = _load(flags.given_models(model, old_model), weights, overrides, last, best, by)
    if bulk.is_bulk(input_, output, prefix, glossary_report):
        report = bulk.translate_job(translator, input_, output, overwrite, prefix, glossary_report)
        if "output" in report and not report["done"]:  # rank 0 (done: the job said so)
            typer.echo(f"tmt: {output}: {report['lines']} lines in {report['chunks']} chunks"
                       f" ({report['resumed_chunks']} translated before)", err=True)  # fmt: skip
        return
    try:
        streams.translate_file(translator, input_, output, overwrite=overwrite, prefix_path=prefix,
                           report_path=glossary_report)  # fmt: skip
    except BrokenPipeError:  # the reader left (e.g. `| head -1`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


@command()
@_user_errors
def evaluate(
    model: flags.Ensemble = None,
    weights: flags.Weights = None,
    split: flags.Split = None,
    input_: flags.SourceFile = None,
    ref: flags.Ref = None,
    hyp: flags.Hyps = None,
    as_json: flags.AsJson = False,
    beam: flags.Beam = None,
    lenpen: flags.Lenpen = None,
    max_tokens: flags.MaxTokens = None,
    device: flags.Device = None,
    precision: flags.Precision = None,
    engine: flags.Engine = None,
    target_lang: flags.TargetLang = None,
    shortlist: flags.ShortlistFlag = None,
    glossary: flags.GlossaryFile = None,
    glossary_mode: flags.GlossaryMode = None,
    last: flags.Last = None,
    best: flags.Best = None,
    by: flags.By = None,
    set_: flags.Overrides = None,
    old_model: flags.OldModel = None,
    old_input: flags.OldInput = None,
    old_last: flags.OldLast = None,
) -> None:
    """sacreBLEU (with signature), chrF, chrF++, TER and lowercased BLEU of a model or a
    hypothesis file; with several --hyp, paired significance tests against the first; with
    --glossary, term use (entries used / entries matched)."""
    from transformer_mt.translation import evaluate as lib

    input_ = flags.renamed(input_, old_input, "--input", "--src")
    translating = {"--weights": weights, "--last": last if last is not None else old_last,
                   "--best": best, "--by": by, "--beam": beam, "--lenpen": lenpen,
                   "--max-tokens": max_tokens, "--device": device, "--precision": precision,
                   "--engine": engine, "--target-lang": target_lang, "--shortlist": shortlist,
                   "--glossary-mode": glossary_mode}  # fmt: skip
    lib.check_arguments(bool(hyp), bool(model or old_model), input_ is not None, bool(ref),
                        split is not None, translating, glossary is not None)  # fmt: skip
    split = split or "test"
    if hyp and len(hyp) > 1:  # several systems: compared by sacreBLEU's paired tests
        report = lib.compare_files(hyp, ref, split, load_config("multi30k", set_ or []))
        _echo(report, as_json, lib.format_comparison(report))
        return

    overrides = flags.flag_overrides(
        set_, beam=beam, lenpen=lenpen, max_tokens=max_tokens, device=device, precision=precision,
        engine=engine, target_lang=target_lang, glossary=glossary, shortlist=shortlist,
        glossary_mode=glossary_mode,
    )  # fmt: skip
    lib.check_split(split)  # before a model is loaded
    last = flags.renamed(last, old_last, "--last", "--average-last")
    # Splits come from the model's config (its data section), else from the default preset.
    translator = None
    if model or old_model:
        translator = _load(flags.given_models(model, old_model), weights, overrides, last, best, by)
    cfg = translator.config if translator else apply_overrides(load_config("multi30k"), overrides)
    texts = lib.read_files(input_, ref, hyp[0] if hyp else None)
    report = lib.evaluate(translator, split, *texts, cfg, lib.glossary_of(translator, cfg))
    _echo(report, as_json, lib.format_report(report))


@command()
@_user_errors
def export(
    output: flags.Output,
    fmt: Annotated[str, typer.Option("--format", help="ctranslate2 or huggingface.")],
    model: flags.Model = None,
    quantization: flags.Quantization = None,
    check_lines: flags.CheckLines = None,
    overwrite: flags.Overwrite = False,
    last: flags.Last = None,
    best: flags.Best = None,
    by: flags.By = None,
    shortlist: flags.ExportShortlist = None,
    as_json: flags.AsJson = False,
    old_model: flags.OldModel = None,
) -> None:
    """Export to CTranslate2 or Hugging Face; written only if its greedy outputs equal tmt's."""
    from transformer_mt.exchange import export as lib

    report = lib.export(
        flags.given_model(model, old_model), fmt, output, quantization=quantization,
        check_lines=check_lines, overwrite=overwrite, last=last, best=best, by=by,
        shortlist=shortlist,
    )  # fmt: skip
    _echo(report, as_json, lib.format_report(report))


@command("import")
@_user_errors
def import_(
    output: flags.Output,
    model: flags.HfModel = None,
    src_lang: flags.Languages = None,
    tgt_lang: flags.Languages = None,
    overwrite: flags.Overwrite = False,
    as_json: flags.AsJson = False,
) -> None:
    """Import a Hugging Face MarianMTModel (OPUS-MT) as a tmt model: -m HF_DIR or -m OWNER/NAME."""
    from transformer_mt.exchange import pretrained

    report = pretrained.import_model(
        flags.given_model(model, None), output, src_lang, tgt_lang, overwrite
    )
    _echo(report, as_json, pretrained.format_report(report))


@command()
@_user_errors
def clean(
    output: flags.CleanOutput,
    config: flags.ConfigOption = "multi30k",
    set_: flags.Overrides = None,
    annotate: flags.Annotate = False,
    overwrite: flags.Overwrite = False,
    as_json: flags.AsJson = False,
) -> None:
    """Clean data.train by the clean section's filters: the pairs kept, what each removed."""
    from transformer_mt.data import cleaning

    report = cleaning.clean_corpus(load_config(config, set_ or []), output, annotate, overwrite)
    _echo(report, as_json, cleaning.format_report(report))


@command()
@_user_errors
def terms(
    output: flags.Output,
    config: flags.ConfigOption = "multi30k",
    model: flags.Model = None,
    set_: flags.Overrides = None,
    overwrite: flags.Overwrite = False,
    as_json: flags.AsJson = False,
) -> None:
    """A term dictionary of data.train (TSV: source, targets, count): eflomal's word alignments,
    or with -m a trained model's; what data.terms.dictionary reads. Resumable."""
    from transformer_mt.translation import terms as lib

    cfg = load_config(config, set_ or [])
    report = lib.build(cfg, output, str(model) if model else None, overwrite)
    _echo(report, as_json, lib.format_report(report))


@command()
@_user_errors
def shortlist(
    model: flags.Model = None,
    output: flags.ShortlistOutput = None,
    input_: flags.SourceFile = None,
    ref: flags.TargetFile = None,
    marian: flags.Marian = None,
    first: flags.First = 100,
    best: flags.BestPieces = 100,
    min_prob: flags.MinProb = 0.0001,
    aligner: flags.Aligner = "auto",
    overwrite: flags.Overwrite = False,
    as_json: flags.AsJson = False,
) -> None:
    """A lexical shortlist for a model (--shortlist auto finds it beside the model): per source
    piece its likeliest target pieces, from its training data, -i SRC --ref TGT, -i SRC alone
    (its own translations), or Marian's lex.s2t."""
    from transformer_mt.translation import shortlisting as lib

    if model is None:
        raise TmtError("name the model with -m/--model", param="model")
    report = lib.make(str(model), output, input_, ref, marian, first, best, min_prob, aligner,
                      overwrite)  # fmt: skip
    _echo(report, as_json, lib.format_report(report))


@command()
@_user_errors
def distill(
    output: flags.Output,
    model: flags.Ensemble = None,
    weights: flags.Weights = None,
    config: flags.ConfigOption = "student",
    set_: flags.Overrides = None,
    as_json: flags.AsJson = False,
) -> None:
    """Distil a teacher (-m; several: an ensemble) into the config's model in -o DIR: the teacher
    translates data.train, the student trains on that, is compared with it and exported."""
    from transformer_mt.distillation import distill as lib

    report = lib.distill(
        load_config(config, set_ or []), flags.given_models(model, None), output, weights
    )
    _echo(report, as_json, lib.format_report(report))


@command()
@_user_errors
def average(
    output: flags.Output,
    models: flags.Models = None,
    last: flags.RunLast = None,
    best: flags.RunBest = None,
    by: flags.By = None,
    overwrite: flags.Overwrite = False,
    as_json: flags.AsJson = False,
    old_models: flags.OldModels = None,
) -> None:
    """Average checkpoints into one self-contained model (§6.1: the last 5 for base, 20 for big):
    -m CKPT -m CKPT ..., or -m RUN_DIR with --last N or --best N."""
    from transformer_mt.runs import averaging

    models = flags.renamed(models, old_models, "-m/--model", "a positional model")
    report = averaging.average_into(
        models or [], output, last=last, best=best, by=by, overwrite=overwrite
    )
    _echo(report, as_json, averaging.format_report(report))


@command()
@_user_errors
def plot(
    models: flags.RunDirs = None,
    output: flags.PlotOutput = None,
    overwrite: flags.Overwrite = False,
    as_json: flags.AsJson = False,
    old_models: flags.OldModels = None,
) -> None:
    """Draw training loss, validation loss and BLEU, learning rate and tokens/s against updates."""
    from transformer_mt.runs import plot as lib

    run_dirs = flags.renamed(models, old_models, "-m/--model", "a positional run directory")
    report = lib.plot(run_dirs or [], output, overwrite)
    panels = ", ".join(f"{title} {n}" for title, n in report["curves"].items())
    _echo(report, as_json, f"{report['output']}: curves drawn per panel: {panels}")


@command()
@_user_errors
def serve(
    model: flags.Ensemble = None,
    weights: flags.Weights = None,
    host: flags.Host = None,
    port: flags.Port = None,
    api_key: flags.ApiKey = None,
    beam: flags.Beam = None,
    lenpen: flags.Lenpen = None,
    max_tokens: flags.MaxTokens = None,
    device: flags.Device = None,
    precision: flags.Precision = None,
    engine: flags.Engine = None,
    shortlist: flags.ShortlistFlag = None,
    target_lang: flags.TargetLang = None,
    last: flags.Last = None,
    best: flags.Best = None,
    by: flags.By = None,
    set_: flags.Overrides = None,
) -> None:
    """Serve the model over HTTP: tmt's API, the LibreTranslate API, a page, metrics (serve.*)."""
    try:
        from transformer_mt.serving import serve as lib
    except ImportError as err:
        raise TmtError(f"tmt serve needs the serve extra ({err.name} is missing): pip install"
                       " 'transformer_mt[serve]'") from None  # fmt: skip

    key = flags.api_key(api_key)
    overrides = flags.flag_overrides(
        set_, beam=beam, lenpen=lenpen, max_tokens=max_tokens, device=device, precision=precision,
        engine=engine, host=host, port=port, target_lang=target_lang, shortlist=shortlist,
    )  # fmt: skip
    # kept beside a CTranslate2 engine: requests may bring glossaries, decoded by tmt's engine
    translator = _load(
        flags.given_models(model, None), weights, overrides, last, best, by, keep_model=True
    )
    lib.serve(translator, overrides, api_key=key)


def main() -> None:
    from transformer_mt.common.allocator import keep_freed_memory

    keep_freed_memory()  # before torch is imported and allocates
    app(prog_name="tmt")  # also as `python -m transformer_mt` (torchrun), not "__main__.py"
