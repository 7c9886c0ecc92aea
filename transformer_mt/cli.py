"""The `tmt` command line: parse, load the config, call one library function.

Heavy modules (torch, datasets) are imported inside the commands so `tmt --help` is instant.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from transformer_mt.config import TmtError, load_config

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


def _user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Bad input ends a command with one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        logging.basicConfig(level=logging.INFO, format="tmt: %(message)s", stream=sys.stderr)
        try:
            return command(*args, **kwargs)
        except TmtError as err:
            if os.environ.get("TMT_DEBUG"):
                raise
            typer.echo(f"tmt: error: {err}", err=True)
            raise typer.Exit(2) from None

    return run


@app.command()
@_user_errors
def train(
    config: ConfigOption = "multi30k",
    set_: Overrides = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Prepare data and batches, report, exit.")
    ] = False,
) -> None:
    """Train a model. Multi-GPU: torchrun --nproc_per_node=N -m transformer_mt train -c CONFIG."""
    from transformer_mt import train as train_lib

    cfg = load_config(config, set_ or [])
    if dry_run:
        train_lib.dry_run(cfg)
    else:
        summary = train_lib.train(cfg)
        if summary is not None:  # rank 0 of a distributed run, or a single process
            typer.echo(json.dumps(summary))


def keep_freed_memory() -> None:
    """Make glibc keep freed memory instead of returning it to the OS.

    By default glibc serves every block over 32 MiB (logits and their gradients: hundreds of MB
    per step) with a fresh mmap and unmaps it when freed, so each step page-faults and zeroes the
    same memory again. Reusing it makes CPU training 20-35 % faster on our benchmark machine
    (scripts/bench_train.py). Called before torch is imported; MALLOC_* variables set by the user
    win; a no-op where libc is not glibc.
    """
    if any(name.startswith("MALLOC_") for name in os.environ):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_max = -1, -4  # from glibc's malloc.h
    libc.mallopt(m_mmap_max, 0)
    libc.mallopt(m_trim_threshold, 2**31 - 1)


def main() -> None:
    keep_freed_memory()
    app()
