"""Size rules that keep the package readable: small functions, modules of one concern."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "transformer_mt"
FUNCTION_LINES = 60
MODULE_LINES = 500
LARGER_MODULES = {"config", "batches"}  # the field-by-field config tree; the data pipeline


def test_functions_over_60_lines_say_why() -> None:
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            length = node.end_lineno - node.lineno + 1
            doc = ast.get_docstring(node) or ""
            if length > FUNCTION_LINES and f"Longer than {FUNCTION_LINES} lines" not in doc:
                unexplained.append(
                    f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({length} lines)"
                )
    assert not unexplained, "shorten them, or say why in the docstring: " + ", ".join(unexplained)


def test_modules_stay_small() -> None:
    large = [
        f"{path.relative_to(PACKAGE)} ({n} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.stem not in LARGER_MODULES
        and (n := len(path.read_text().splitlines())) > MODULE_LINES
    ]
    assert not large, "split by noun: " + ", ".join(large)
