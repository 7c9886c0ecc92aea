"""Imports flow one way: cli -> train/evaluate -> components -> config (style.md §5.3)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "transformer_mt"

# Which project modules each module may import (module level or inside functions).
ALLOWED = {
    "__init__": set(),
    "__main__": {"cli"},
    "config": set(),
    "corpus": {"config"},
    "tokenizer": {"config"},
    "data": {"config", "corpus", "tokenizer"},  # data trains the tokenizer on the corpus it reads
    "model": {"config"},
    "loss": set(),
    "optim": {"config"},
    "distributed": set(),
    "faults": set(),
    "checkpoint": {"__init__", "config", "faults"},  # the version goes into each manifest
    "train": {
        "checkpoint",
        "config",
        "data",
        "distributed",
        "evaluate",  # validation BLEU decodes exactly as tmt evaluate does
        "faults",
        "loss",
        "model",
        "optim",
        "tokenizer",
    },
    "search": set(),  # a step function in, hypotheses out: no model, no config
    "evaluate": {"checkpoint", "config", "corpus", "data", "model", "search", "tokenizer"},
    "cli": {"checkpoint", "config", "evaluate", "train"},
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
