"""The command line's options: their spellings and help (cli.py's commands take them), and the
decoding flags as decode.* overrides.

Typer reads them from the annotations; typer is the only import, so `tmt --help` stays instant.
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from typer.core import TyperCommand, TyperGroup

try:  # Typer 0.2x parses with its own copy of click
    from typer._click.exceptions import UsageError
except ImportError:  # earlier Typers use click itself
    from click.exceptions import UsageError

from transformer_mt.common.exits import TmtError

ConfigOption = Annotated[
    str,
    typer.Option(
        "--config",
        "-c",
        help="A YAML file or a shipped preset: tiny, multi30k, multi30k-gpu, student, base, big.",
    ),
]
Overrides = Annotated[
    list[str] | None,
    typer.Option(
        "--set", help="Override a config value, e.g. --set optim.warmup_steps=8000 (repeatable)."
    ),
]

AsJson = Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")]
Output = Annotated[Path, typer.Option("--output", "-o", help="Where to write it.")]
Overwrite = Annotated[
    bool, typer.Option("--overwrite", help="Replace an existing output (never tmt's own files).")
]
# What a command reads; the hidden options are tmt 0.1's spellings.
Model = Annotated[
    Path | None,
    typer.Option(
        "--model",
        "-m",
        help="A checkpoint, an averaged model, or a run directory (its average, else its best"
        " checkpoint, else its newest).",
    ),
]
Ensemble = Annotated[
    list[Path] | None,
    typer.Option(
        "--model",
        "-m",
        help="A checkpoint, an averaged model, or a run directory (its average, else its best"
        " checkpoint, else its newest); repeat it to decode with an ensemble.",
    ),
]
Weights = Annotated[
    str | None,
    typer.Option("--weights", help="An ensemble's weight per -m, e.g. 0.6,0.4 (default: equal)."),
]
Models = Annotated[
    list[Path] | None,
    typer.Option("--model", "-m", help="A checkpoint or run directory (repeatable)."),
]
OldModel = Annotated[Path | None, typer.Option("--checkpoint", hidden=True)]
OldModels = Annotated[list[Path] | None, typer.Argument(hidden=True, metavar="MODELS")]
Last = Annotated[
    int | None, typer.Option("--last", help="Average the newest N checkpoints of the run (§6.1).")
]
Best = Annotated[
    int | None, typer.Option("--best", help="Average the N best checkpoints of the run.")
]
By = Annotated[
    str | None,
    typer.Option(
        "--by",
        help="What --best ranks by: val_bleu, val_chrf, val_loss or val_ppl (default: val_bleu"
        " when the run measured it, else val_loss).",
    ),
]
OldLast = Annotated[int | None, typer.Option("--average-last", hidden=True)]
Hyps = Annotated[
    list[Path] | None,
    typer.Option(
        "--hyp",
        help="Score this hypothesis file; no translating. Several: compare them with the first"
        " (sacreBLEU's paired bootstrap and approximate randomization).",
    ),
]

# The decoding options people change most; each is one decode.* override (the rest: --set).
Beam = Annotated[
    int | None, typer.Option("--beam", help="Beam size, 1 = greedy (decode.beam_size).")
]
Lenpen = Annotated[
    float | None, typer.Option("--lenpen", help="Length penalty α (decode.length_penalty).")
]
MaxTokens = Annotated[
    int | None, typer.Option("--max-tokens", help="Source tokens per batch (decode.max_tokens).")
]
Device = Annotated[
    str | None, typer.Option("--device", help="auto, cpu, cuda or cuda:N (decode.device).")
]
Precision = Annotated[
    str | None,
    typer.Option("--precision", help="fp32, bf16, fp16 (GPU) or int8 (CPU) (decode.precision)."),
]
Engine = Annotated[
    str | None,
    typer.Option("--engine", help="torch, or ctranslate2: an export of the model (decode.engine)."),
]
Sampling = Annotated[
    str | None,
    typer.Option("--sampling", help="Sample instead of search: full, topk:K or topp:P."),
]
Temperature = Annotated[
    float | None, typer.Option("--temperature", help="Sampling temperature (0 = greedy).")
]
Seed = Annotated[
    int | None, typer.Option("--seed", help="Sampling seed (each line's stream: seed, line).")
]
Prefix = Annotated[
    str | None,
    typer.Option(
        "--prefix",
        help="A target prefix for each input line (may be empty): outputs start with it.",
    ),
]
Alignment = Annotated[
    str | None,
    typer.Option(
        "--alignment", help="subword or word: i-j pairs after each output (decode.alignment)."
    ),
]
TargetLang = Annotated[
    str | None,
    typer.Option(
        "--target-lang",
        help="A multi-target model's target language xxx: >>xxx<< first (decode.target_lang).",
    ),
]
HfModel = Annotated[
    Path | None,
    typer.Option(
        "--model",
        "-m",
        help="A Hugging Face MarianMTModel directory (OPUS-MT), or a Hub id OWNER/NAME.",
    ),
]
Languages = Annotated[
    str | None, typer.Option(help="The model's language, if its tokenizer_config.json lacks it.")
]
ShortlistFlag = Annotated[
    str | None,
    typer.Option(
        "--shortlist",
        help="none, auto (shortlist.npz beside the model: tmt shortlist) or a file: score each"
        " sentence's outputs over its own candidates (decode.shortlist).",
    ),
]
GlossaryFile = Annotated[
    str | None,
    typer.Option(
        "--glossary",
        help="A TSV or CSV glossary (source, target): every translation uses its entries"
        " (glossary.path; glossary.mode strict, check, hint or auto).",
    ),
]
GlossaryMode = Annotated[
    str | None,
    typer.Option(
        "--glossary-mode",
        help="strict (every entry in every output: constrained search where needed), check"
        " (report only), hint or auto (a model trained with hints) (glossary.mode).",
    ),
]
GlossaryReport = Annotated[
    str | None,
    typer.Option(
        "--glossary-report",
        help="Write one JSON object per input line: the glossary entries it matched, whether"
        " the output uses each, and whether constrained decoding put it there.",
    ),
]
# Each flag is one override of decode.NAME (serve.NAME for host and port) unless named here.
_KEYS = {"beam": "decode.beam_size", "lenpen": "decode.length_penalty", "glossary": "glossary.path",
         "glossary_mode": "glossary.mode"}  # fmt: skip


def flag_overrides(set_: list[str] | None, **flags: Any) -> list[str | tuple[str, str]]:
    """--set first, then the flags given (a flag wins over a --set of the same key)."""
    overrides: list[str | tuple[str, str]] = list(set_ or [])
    for name, value in flags.items():
        if value is not None:
            section = "serve" if name in ("host", "port") else "decode"
            key = _KEYS.get(name, f"{section}.{name}")
            overrides.append((f"{key}={value}", f"--{name.replace('_', '-')} {value}"))
    return overrides


# Options of one command each.
ShortlistOutput = Annotated[
    Path | None,
    typer.Option("--output", "-o", help="Where to write it (default: beside the model)."),
]
ExportShortlist = Annotated[
    str | None,
    typer.Option(
        "--shortlist",
        help="ctranslate2: write the model's lexical shortlist (auto: beside it; or a file) as"
        " the export's vmap.txt.",
    ),
]
Marian = Annotated[
    Path | None,
    typer.Option("--from-marian", help="Read Marian's text shortlist (lex.s2t) instead."),
]
First = Annotated[int, typer.Option("--first", help="The corpus's most frequent target pieces.")]
BestPieces = Annotated[
    int, typer.Option("--best", help="Translations kept per source piece, likeliest first.")
]
MinProb = Annotated[
    float, typer.Option("--min-prob", help="Drop translations under this p(target | source).")
]
Aligner = Annotated[
    str, typer.Option("--aligner", help="auto (eflomal where installed), eflomal or ibm1.")
]
InitFrom = Annotated[
    str | None,
    typer.Option(
        "--init-from",
        help="Fine-tune: start from this model's weights and tokenizer (a checkpoint, an"
        " averaged model or a run directory) with a fresh optimizer (train.init_from).",
    ),
]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Prepare data and batches, report, exit.")]
TextInput = Annotated[
    str, typer.Option("--input", "-i", help="Raw text, one sentence per line; - = stdin.")
]
TextOutput = Annotated[
    str, typer.Option("--output", "-o", help="Detokenized translations; - = stdout.")
]
NBest = Annotated[
    int | None, typer.Option("--nbest", help="Write N hypotheses per line: index, score, text.")
]
Split = Annotated[
    str | None,
    typer.Option("--split", help="test or valid: a split of the model's config (test)."),
]
SourceFile = Annotated[
    Path | None,
    typer.Option("--input", "-i", help="Source file to translate instead of a split."),
]
TargetFile = Annotated[
    Path | None, typer.Option("--ref", help="The target side of -i: its translations, a line each.")
]
Ref = Annotated[
    list[Path] | None,
    typer.Option(
        "--ref",
        help="Reference file instead of the split's. Several: one reference each (multi-reference"
        " BLEU, chrF and TER, as sacreBLEU scores them).",
    ),
]
Quantization = Annotated[
    str | None,
    typer.Option("--quantization", help="ctranslate2 only: int8, int8_float16 or float16."),
]
CheckLines = Annotated[
    int | None,
    typer.Option(
        "--check-lines",
        help="Validation lines the export must reproduce; 0 = all (default: all for ctranslate2,"
        " the first 200 for huggingface, whose generate is slow on a CPU).",
    ),
]
Annotate = Annotated[
    bool,
    typer.Option("--annotate", help="Keep every pair; PREFIX.reason says why each would go."),
]
RunLast = Annotated[
    int | None, typer.Option("--last", help="With a run directory: its newest N checkpoints.")
]
RunBest = Annotated[
    int | None, typer.Option("--best", help="With a run directory: its N best checkpoints (--by).")
]
RunDirs = Annotated[
    list[Path] | None,
    typer.Option("--model", "-m", help="A run directory (repeatable: overlaid to compare)."),
]
PlotOutput = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        help="A .png, .svg or .pdf (default: RUN_DIR/curves.png, or ./curves.png for several).",
    ),
]
Host = Annotated[str | None, typer.Option(help="Address to bind (serve.host).")]
Port = Annotated[int | None, typer.Option(help="Port (serve.port; 0: any free).")]
ApiKey = Annotated[
    str | None,
    typer.Option(
        envvar="TMT_API_KEY",
        help="Require Authorization: Bearer KEY (not /health); printable ASCII without"
        " spaces (an empty one is refused).",
    ),
]
OldInput = Annotated[Path | None, typer.Option("--src", hidden=True)]
CleanOutput = Annotated[
    str,
    typer.Option(
        "--output", "-o", help="PREFIX: writes PREFIX.SRC, PREFIX.TGT, PREFIX.report.json."
    ),
]


def _usage_error(err: UsageError, ctx: Any) -> NoReturn:
    """A mistake on the command line as every other error of tmt: one line on stderr and exit 2
    (click draws a box around it, under the usage line and a hint). `tmt` alone is no mistake:
    click shows the help (click 8.2 through this exception, earlier ones without it)."""
    if type(err).__name__ == "NoArgsIsHelpError":
        raise err
    message = err.format_message().rstrip(".")
    typer.echo(f"tmt: error: {message}; see {ctx.command_path} --help", err=True)
    sys.exit(err.exit_code)


class OnceCommand(TyperCommand):
    """A command whose single-valued options may be given once: a second -m to `tmt export`
    would otherwise silently replace the first (click keeps the last value). Its usage errors
    (an unknown option, a value of another type) are one line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # `tmt --help` lists each command by its docstring's first paragraph. Rich help keeps that
        # paragraph's source line breaks, so a sentence broke off mid-way in the list; given as
        # one line, rich wraps it to the terminal.
        if self.short_help is None and self.help:
            first = inspect.cleandoc(self.help).split("\n\n")[0]
            self.short_help = " ".join(first.split())

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            if not ctx.resilient_parsing:
                _, _, order = self.make_parser(ctx).parse_args(args=list(args))
                for param in set(order):
                    # Options only (arguments have no is_flag); a flag twice says one thing twice.
                    once = not getattr(param, "multiple", True)
                    if once and not getattr(param, "is_flag", True) and order.count(param) > 1:
                        ctx.fail(f"{'/'.join(param.opts)} given more than once: give it once")
            return super().parse_args(ctx, args)
        except UsageError as err:
            if ctx.resilient_parsing:
                raise
            _usage_error(err, ctx)


class Commands(TyperGroup):
    """tmt's commands: an unknown one, or an unknown option before it, is one line too."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except UsageError as err:
            _usage_error(err, ctx)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        try:
            return super().resolve_command(ctx, args)
        except UsageError as err:
            _usage_error(err, ctx)


T = TypeVar("T")


def renamed(new: T, old: T, new_name: str, old_name: str) -> T:
    """The value of an option that tmt 0.1 spelled `old_name`: the old spelling still works for
    one release, with a note; giving both is an error."""
    if old in (None, 0, []):
        return new
    if new not in (None, 0, []):
        raise TmtError(f"{old_name} is the old spelling of {new_name}: give {new_name} only")
    typer.echo(
        f"tmt: note: {old_name} is now {new_name}; the old spelling goes in the next release",
        err=True,
    )
    return old


def api_key(given: str | None) -> str:
    """The server's key, from --api-key or TMT_API_KEY ("": none asked for). One given empty, or
    with a character an `Authorization: Bearer` header cannot carry (a space, a line break,
    non-ASCII), is refused: it would serve openly, or behind a key no client can send. So is a
    TMT_API_KEY set empty, which click reads as unset (`TMT_API_KEY=$SECRET` with SECRET unset
    would have served without a key)."""
    if given is None and os.environ.get("TMT_API_KEY") == "":
        given = ""
    if given is None:
        return ""
    if not given or not all(33 <= ord(c) < 127 for c in given):
        what = "empty" if not given else "not printable ASCII without spaces"
        raise TmtError(f"--api-key (or TMT_API_KEY): the key is {what}; give one a header can"
                       " carry, or leave it out to serve without a key")  # fmt: skip
    return given


def given_models(new: list[Path] | None, old: Path | None) -> list[Path]:
    """-m given once, or several times for an ensemble (or tmt 0.1's --checkpoint)."""
    models = renamed(new or None, [old] if old else None, "--model", "--checkpoint")
    if not models:
        raise TmtError("no model: name it with -m/--model (a checkpoint or a run directory)")
    return models


def given_model(new: Path | None, old: Path | None) -> Path:
    model = renamed(new, old, "--model", "--checkpoint")
    if model is None:
        raise TmtError("no model: name it with -m/--model (a checkpoint or a run directory)")
    return model
