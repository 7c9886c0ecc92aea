"""The `tmt` command line: parse, load the config, call one library function.

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

from transformer_mt import exits
from transformer_mt.config import load_config
from transformer_mt.exits import TmtError

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="tmt: train the Transformer of 'Attention Is All You Need' and translate raw text.",
)

ConfigOption = Annotated[
    str,
    typer.Option(
        "--config", "-c", help="A YAML file or a shipped preset: tiny, multi30k, base, big."
    ),
]
Overrides = Annotated[
    list[str] | None,
    typer.Option(
        "--set", help="Override a config value, e.g. --set optim.warmup_steps=8000 (repeatable)."
    ),
]


@app.callback()
def _commands() -> None:
    """tmt: train the Transformer of 'Attention Is All You Need' and translate raw text."""


# The flag that sets each library parameter an error may name, where it is not "--" + the name.
_FLAG_OF = {"fmt": "--format", "checkpoint": "-m"}


def _flag(param: str) -> str:
    return _FLAG_OF.get(param, "--" + param.replace("_", "-"))


def _user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Bad input ends a command with one line on stderr and exit code 2, never a traceback; the
    parameters an error names are written as this command line's flags."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        logging.basicConfig(level=logging.INFO, format="tmt: %(message)s", stream=sys.stderr)
        try:
            return command(*args, **kwargs)
        except TmtError as err:
            if os.environ.get("TMT_DEBUG"):
                raise
            typer.echo(f"tmt: error: {err.render(_flag)}", err=True)
            raise typer.Exit(err.exit_code) from None
        except OSError as err:  # what the library did not name itself: still one line
            if os.environ.get("TMT_DEBUG") or isinstance(err, BrokenPipeError):
                raise
            from transformer_mt.textio import WRITE_FAILED

            where = f"{err.filename}: " if err.filename else ""
            full = err.errno in WRITE_FAILED
            typer.echo(f"tmt: error: {where}{err.strerror or err}", err=True)
            raise typer.Exit(exits.NO_ROOM if full else exits.BAD_INPUT) from None

    return run


@app.command()
@_user_errors
def train(
    config: ConfigOption = "multi30k",
    set_: Overrides = None,
    init_from: Annotated[
        str | None,
        typer.Option(
            "--init-from",
            help="Fine-tune: start from this model's weights and tokenizer (a checkpoint, an"
            " averaged model or a run directory) with a fresh optimizer (train.init_from).",
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Prepare data and batches, report, exit.")
    ] = False,
) -> None:
    """Train a model. Multi-GPU: torchrun --nproc_per_node=N -m transformer_mt train -c CONFIG."""
    from transformer_mt import dry_run as dry_run_lib
    from transformer_mt import train as train_lib

    overrides = [*(set_ or []), *([f"train.init_from={init_from}"] if init_from else [])]
    cfg = load_config(config, overrides)
    if dry_run:
        dry_run_lib.dry_run(cfg)
        return
    summary = train_lib.train(cfg)
    if summary["rank"] == 0:  # a single process, or rank 0 of a distributed run
        typer.echo(json.dumps({k: v for k, v in summary.items() if k != "rank"}))
    if summary["stop"] in exits.SIGNAL_EXIT:  # stopped by a signal, after saving
        raise typer.Exit(exits.SIGNAL_EXIT[summary["stop"]])


CheckpointOption = Annotated[
    Path,
    typer.Option(
        "--checkpoint",
        "-m",
        help="A checkpoint or averaged model, or a run directory (its average, else its best).",
    ),
]
AverageLast = Annotated[
    int,
    typer.Option("--average-last", help="Average the newest N checkpoints of the run directory."),
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
    typer.Option("--precision", help="fp32, bf16 or fp16 (GPU) (decode.precision)."),
]
_FLAGS = {  # flag name -> (config key, what the user typed)
    "nbest": ("decode.nbest", "--nbest"),
    "beam": ("decode.beam_size", "--beam"),
    "lenpen": ("decode.length_penalty", "--lenpen"),
    "max_tokens": ("decode.max_tokens", "--max-tokens"),
    "device": ("decode.device", "--device"),
    "precision": ("decode.precision", "--precision"),
    "sampling": ("decode.sampling", "--sampling"),
    "temperature": ("decode.temperature", "--temperature"),
    "seed": ("decode.seed", "--seed"),
}


def _decode_overrides(set_: list[str] | None, **flags: Any) -> list[str | tuple[str, str]]:
    """--set first, then the decoding flags given (a flag wins over a --set of the same key)."""
    overrides: list[str | tuple[str, str]] = list(set_ or [])
    for name, value in flags.items():
        if value is not None:
            key, typed = _FLAGS[name]
            overrides.append((f"{key}={value}", f"{typed} {value}"))
    return overrides


@app.command()
@_user_errors
def translate(
    checkpoint: CheckpointOption,
    input_: Annotated[
        str, typer.Option("--input", "-i", help="Raw text, one sentence per line; - = stdin.")
    ] = "-",
    output: Annotated[
        str, typer.Option("--output", "-o", help="Detokenized translations; - = stdout.")
    ] = "-",
    nbest: Annotated[
        int | None, typer.Option("--nbest", help="Write N hypotheses per line: index, score, text.")
    ] = None,
    beam: Beam = None,
    lenpen: Lenpen = None,
    max_tokens: MaxTokens = None,
    device: Device = None,
    precision: Precision = None,
    sampling: Annotated[
        str | None,
        typer.Option("--sampling", help="Sample instead of search: full, topk:K or topp:P."),
    ] = None,
    temperature: Annotated[
        float | None, typer.Option("--temperature", help="Sampling temperature (0 = greedy).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Sampling seed (each line's stream: seed, line).")
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing --output file.")
    ] = False,
    average_last: AverageLast = 0,
    set_: Overrides = None,
) -> None:
    """Translate raw text, one output line per input line (other options: --set decode.KEY=V).

    A file into a file is a resumable job in chunks (decode.chunk_lines): the same command after
    a kill translates only what is missing. Under torchrun the processes share the chunks."""
    from transformer_mt import bulk
    from transformer_mt import translate as lib

    overrides = _decode_overrides(
        set_, nbest=nbest, beam=beam, lenpen=lenpen, max_tokens=max_tokens, device=device,
        precision=precision, sampling=sampling, temperature=temperature, seed=seed,
    )  # fmt: skip
    translator = lib.load_translator(checkpoint, overrides, last=average_last)
    if bulk.is_bulk(input_, output):
        report = bulk.translate_job(translator, input_, output, overwrite)
        if "output" in report:  # rank 0
            typer.echo(f"tmt: {output}: {report['lines']} lines in {report['chunks']} chunks"
                       f" ({report['resumed_chunks']} translated before)", err=True)  # fmt: skip
        return
    try:
        lib.translate_file(translator, input_, output, overwrite)
    except BrokenPipeError:  # the reader left (e.g. `| head -1`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


@app.command()
@_user_errors
def evaluate(
    checkpoint: Annotated[
        Path | None, typer.Option("--checkpoint", "-m", help="Model to translate with.")
    ] = None,
    split: Annotated[
        str, typer.Option("--split", help="test or valid: a split of the model's config.")
    ] = "test",
    src: Annotated[
        Path | None, typer.Option("--src", help="Source file to translate instead of a split.")
    ] = None,
    ref: Annotated[
        Path | None, typer.Option("--ref", help="Reference file instead of the split's.")
    ] = None,
    hyp: Annotated[
        Path | None, typer.Option("--hyp", help="Score this hypothesis file; no translating.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    beam: Beam = None,
    lenpen: Lenpen = None,
    max_tokens: MaxTokens = None,
    device: Device = None,
    precision: Precision = None,
    average_last: AverageLast = 0,
    set_: Overrides = None,
) -> None:
    """sacreBLEU (with signature), chrF and lowercased BLEU of a model or a hypothesis file."""
    from transformer_mt import evaluate as lib
    from transformer_mt import textio, translate

    if split not in ("test", "valid", "train"):
        raise TmtError(f"--split {split!r}: expected test, valid or train")
    overrides = _decode_overrides(
        set_, beam=beam, lenpen=lenpen, max_tokens=max_tokens, device=device, precision=precision
    )
    # Splits come from the model's config (its data section), else from the default preset.
    translator = None
    if checkpoint:
        translator = translate.load_translator(checkpoint, overrides, last=average_last)
    cfg = translator.config if translator else load_config("multi30k", set_ or [])
    report = lib.evaluate(
        translator,
        split=split,
        sources=textio.read_text_file(src, "input") if src else None,
        references=textio.read_text_file(ref, "ref") if ref else None,
        hypotheses=textio.read_text_file(hyp, "hyp") if hyp else None,
        cfg=cfg,
    )
    typer.echo(json.dumps(report) if as_json else lib.format_report(report))


@app.command()
@_user_errors
def export(
    checkpoint: CheckpointOption,
    fmt: Annotated[str, typer.Option("--format", help="ctranslate2 or huggingface.")],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Directory to create (new or empty).")
    ],
    quantization: Annotated[
        str | None,
        typer.Option("--quantization", help="ctranslate2 only: int8, int8_float16 or float16."),
    ] = None,
    check_lines: Annotated[
        int,
        typer.Option("--check-lines", help="Validation lines the export must reproduce; 0 = all."),
    ] = 0,
) -> None:
    """Export to CTranslate2 or Hugging Face; written only if its greedy outputs equal tmt's."""
    from transformer_mt import export as lib

    typer.echo(json.dumps(lib.export(checkpoint, fmt, output, quantization, check_lines)))


@app.command()
@_user_errors
def average(
    inputs: Annotated[
        list[Path], typer.Argument(help="Checkpoints to average, or one run directory.")
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Directory of the averaged model.")
    ],
    last: Annotated[
        int, typer.Option("--last", help="With a run directory: its newest N checkpoints.")
    ] = 0,
    best: Annotated[
        int, typer.Option("--best", help="With a run directory: its N best checkpoints (--by).")
    ] = 0,
    by: Annotated[
        str | None,
        typer.Option(
            "--by",
            help="What --best ranks by: val_bleu, val_chrf, val_loss or val_ppl"
            " (default: val_bleu when the run measured it, else val_loss).",
        ),
    ] = None,
) -> None:
    """Average checkpoints into one self-contained model (§6.1: the last 5 for base, 20 for big)."""
    from transformer_mt import averaging

    report = averaging.average_into(inputs, output, last, best, by, overwrite=True)
    typer.echo(json.dumps(report))


@app.command()
@_user_errors
def plot(
    run_dirs: Annotated[
        list[Path], typer.Argument(help="Run directories; several are overlaid to compare.")
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="A .png, .svg or .pdf (default: RUN_DIR/curves.png, or ./curves.png for several).",
        ),
    ] = None,
) -> None:
    """Draw training loss, validation loss and BLEU, learning rate and tokens/s against updates."""
    from transformer_mt import plot as lib
    from transformer_mt import textio

    output = output or (
        run_dirs[0] / lib.RUN_CURVES if len(run_dirs) == 1 else Path(lib.RUN_CURVES)
    )
    textio.check_output(output, run_dirs, overwrite=True)
    typer.echo(json.dumps(lib.draw_curves(run_dirs, output)))


def main() -> None:
    from transformer_mt.allocator import keep_freed_memory

    keep_freed_memory()  # before torch is imported and allocates
    app()
