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


# Parsers that recurse into nested input: "[" * 10**5 raises RecursionError, which a handler of
# ValueError does not catch, so a hostile file tmt reads back was a traceback.
PARSERS = {("json", "loads"), ("json", "load"), ("yaml", "safe_load"), ("yaml", "load")}
# Functions whose every caller catches RecursionError itself (the caller named after the dash).
CAUGHT_BY_CALLER = {
    "data/batches.py:_read_entry",  # _encoded_table's try (else an entry it has just written)
    "serving/glossary_store.py:_verified",  # GlossaryStore._file's try
}


def _catches_recursion(node: ast.AST) -> bool:
    """A try's handler, or a contextlib.suppress(...), that catches RecursionError."""
    names: list[ast.expr] = []
    if isinstance(node, ast.Try):
        for handler in node.handlers:
            if handler.type is None:
                return True
            kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            names += kinds
    elif isinstance(node, ast.With):
        for item in node.items:
            call = item.context_expr
            if isinstance(call, ast.Call) and ast.unparse(call.func).endswith("suppress"):
                names += call.args
    return any(ast.unparse(n) in ("RecursionError", "Exception", "BaseException") for n in names)


def test_every_parse_survives_input_nested_past_the_recursion_limit() -> None:
    uncaught = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for call in ast.walk(tree):
            func = getattr(call, "func", None)
            if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
                continue
            if (func.value.id, func.attr) not in PARSERS:
                continue
            node, function, caught = call, None, False
            while node in parents:
                node = parents[node]
                # a try guards the calls of its body only, not those of its handlers
                guards = isinstance(node, ast.With) or (
                    isinstance(node, ast.Try)
                    and any(call is n for stmt in node.body for n in ast.walk(stmt))
                )
                caught = caught or (guards and _catches_recursion(node))
                if function is None and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    function = node.name
            where = f"{path.relative_to(PACKAGE)}:{function}"
            if not caught and where not in CAUGHT_BY_CALLER:
                uncaught.append(f"{where} (line {call.lineno})")
    assert not uncaught, "catch RecursionError where these parse: " + ", ".join(uncaught)
