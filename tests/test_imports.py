"""Imports flow one way: cli -> train/evaluate -> components -> config (style.md §5.3)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "transformer_mt"

# Which project modules each module may import (module level or inside functions).
ALLOWED = {
    "__init__": {
        "translate"
    },  # the Python API, imported lazily (from transformer_mt import Translator)
    "__main__": {"cli"},
    "exits": set(),  # the leaf: exit codes, TmtError, stop signals
    "files": set(),  # stdlib-only file primitives
    "allocator": set(),  # stdlib only: runs before torch is imported
    "config": {"exits"},
    "textio": {"exits", "files"},
    "corpus": {"config", "exits", "files", "textio"},
    "tokenizer": {"config", "corpus", "exits", "files"},  # trains and caches the joint model
    "data": {"config", "corpus", "exits", "files", "tokenizer"},
    "model": {"config"},
    "loss": set(),
    "optim": {"config"},
    "distributed": {"exits"},
    "faults": set(),
    # One checkpoint's format; it rebuilds its own model and tokenizer (one loading path).
    "checkpoint": {"config", "exits", "faults", "files", "model", "tokenizer", "train_state"},
    "train_state": {"exits"},
    "metrics": {"distributed", "exits", "files"},
    "averaging": {"checkpoint", "exits", "run", "textio"},
    # A run directory's lifetime; its metrics log all-reduces the sums since the last record.
    "run": {"checkpoint", "config", "distributed", "exits", "files", "metrics", "tokenizer"},
    "train": {
        "averaging",
        "checkpoint",
        "metrics",
        "train_state",
        "config",
        "corpus",
        "data",
        "distributed",
        "evaluate",  # validation BLEU decodes exactly as tmt evaluate does
        "exits",
        "faults",
        "loss",
        "model",
        "optim",
        "plot",  # curves.png at each validation
        "run",
        "step",
        "tokenizer",
    },
    # One update: loss, collectives, Adam; Batch from data and the fault points inside.
    "step": {"config", "data", "distributed", "faults", "loss", "model"},
    "dry_run": {"config", "data", "model", "run"},  # run: the model train.init_from names
    "plot": {"exits", "files", "metrics", "textio"},  # metrics.jsonl in, a figure out
    "search": set(),  # a step function in, hypotheses out: no model, no config
    "translate": {
        "averaging",
        "checkpoint",
        "config",
        "data",
        "distributed",
        "exits",
        "model",
        "run",
        "search",
        "textio",
        "tokenizer",
    },
    "evaluate": {"config", "corpus", "distributed", "exits", "model", "tokenizer", "translate"},
    "export": {"checkpoint", "config", "corpus", "exits", "files", "textio", "translate"},
    # A file translated in committed chunks over a process group.
    "bulk": {"config", "distributed", "exits", "faults", "files", "run", "textio", "translate"},
    "cli": {
        "allocator",
        "averaging",
        "bulk",
        "checkpoint",
        "config",
        "dry_run",
        "evaluate",
        "exits",
        "export",
        "plot",
        "run",
        "textio",
        "train",
        "translate",
    },
}
MODULES = set(ALLOWED)


def project_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("transformer_mt")
        ):
            parts = node.module.split(".")
            if len(parts) > 1:
                found.add(parts[1])
            else:  # from transformer_mt import x: a module, or a name of the package (__init__)
                found.update(a.name if a.name in MODULES else "__init__" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(
                a.name.split(".")[1] for a in node.names if a.name.startswith("transformer_mt.")
            )
    return found


def test_every_module_has_an_allow_list() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert modules == set(ALLOWED), "add new modules to ALLOWED with the imports they may use"


def test_imports_follow_the_dependency_direction() -> None:
    for name, allowed in ALLOWED.items():
        used = project_imports(PACKAGE / f"{name}.py")
        assert used <= allowed, f"{name}.py imports {sorted(used - allowed)}"


def test_nothing_imports_the_cli_except_main() -> None:
    for path in PACKAGE.glob("*.py"):
        if path.stem not in ("cli", "__main__"):
            assert "cli" not in project_imports(path), path.name
