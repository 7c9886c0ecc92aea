"""Imports flow one way (style.md §5.3): the package is in wings by stage, and a wing imports only
the wings below it, which its docstring names on its "Imports:" line; modules import each other in
no circle, within a wing or across. An import against the rule fails, whether it is new or old:
the rule is stated, not a snapshot of today's imports."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "transformer_mt"

# Bottom to top: the stages as a user names them. "config" is the one config tree (a module);
# "faces" are the top-level modules users meet: the command line, its options, `python -m`, the
# Python API.
WINGS = [
    "common",
    "config",
    "data",
    "network",
    "runs",
    "translation",
    "exchange",
    "training",
    "serving",
    "distillation",
    "faces",
]
FACES = {"cli", "flags", "__main__", "__init__"}


def module_name(path: Path) -> str:
    """transformer_mt/data/batches.py -> "data.batches"; transformer_mt/cli.py -> "cli"."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1]) if parts[-1] == "__init__" and len(parts) > 1 else ".".join(parts)


MODULES = {module_name(p) for p in PACKAGE.rglob("*.py")}


def wing_of(module: str) -> str:
    top = module.split(".")[0]
    return "faces" if top in FACES else top


def project_imports(path: Path, module: str | None = None) -> set[str]:
    """The package's modules that `path` (the package's `module`) imports, at module level or
    inside functions, named as module_name names them; a wing's package for a name that is not
    one of its modules."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformer_mt"):
            base = node.module.removeprefix("transformer_mt").lstrip(".")
            for alias in node.names:
                inner = f"{base}.{alias.name}" if base else alias.name
                found.add(inner if inner in MODULES else base or "__init__")
        elif isinstance(node, ast.Import):
            found.update(
                a.name.removeprefix("transformer_mt.")
                for a in node.names
                if a.name.startswith("transformer_mt.")
            )
    return found - {module or module_name(path)}


def allowed_wings(wing: str) -> list[str]:
    """The wings a wing's docstring says it imports ("Imports: common, config."); faces may
    import every wing, config only common."""
    if wing == "faces":
        return WINGS
    if wing == "config":
        return ["common"]
    doc = ast.get_docstring(ast.parse((PACKAGE / wing / "__init__.py").read_text())) or ""
    line = re.search(r"^Imports: (.*)$", doc, re.MULTILINE)
    assert line, f"{wing}/__init__.py: say on an 'Imports:' line which wings it imports"
    if line.group(1).startswith("nothing"):
        return []
    return re.findall(r"[a-z_]+", line.group(1).split("(")[0])  # "(why)" may follow the names


def against_the_rule(module: str, imported: set[str]) -> list[str]:
    """The imports of `module` that run up between wings or to a wing its docstring omits."""
    wing = wing_of(module)
    allowed = {wing, *allowed_wings(wing)}
    return [
        f"{module} imports {name} ({wing_of(name)}: not below {wing} or not named by it)"
        for name in sorted(imported)
        if wing_of(name) not in allowed or WINGS.index(wing_of(name)) > WINGS.index(wing)
    ]


def test_every_module_is_in_a_wing_and_every_wing_says_what_it_holds() -> None:
    assert {wing_of(m) for m in MODULES} == set(WINGS)
    for wing in set(WINGS) - {"config", "faces"}:
        package = importlib.import_module(f"transformer_mt.{wing}")
        assert package.__doc__ and len(package.__doc__.split()) > 10, wing
        below = WINGS[: WINGS.index(wing)]
        assert set(allowed_wings(wing)) <= set(below), f"{wing} names a wing above it"


def test_imports_run_down_between_wings() -> None:
    wrong = [
        problem
        for path in sorted(PACKAGE.rglob("*.py"))
        for problem in against_the_rule(module_name(path), project_imports(path))
    ]
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_through_a_circle() -> None:
    graph = {module_name(p): project_imports(p) & MODULES for p in PACKAGE.rglob("*.py")}
    for wing in WINGS[:-1]:  # a wing's package imports nothing; its name is its modules' folder
        graph.pop(wing, None)
    state: dict[str, str] = {}
    circles = []

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for name in sorted(graph.get(module, ())):
            if state.get(name) == "open":
                circles.append(" -> ".join([*trail[trail.index(name) :], name]))
            elif name not in state:
                visit(name, [*trail, name])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(circles)


def test_the_rule_refuses_imports_up_and_to_unnamed_wings(tmp_path: Path) -> None:
    up = tmp_path / "model.py"
    up.write_text("from transformer_mt.runs import run\n")  # the network reaching into runs
    assert against_the_rule("network.model", project_imports(up, "network.model")) == [
        "network.model imports runs.run (runs: not below network or not named by it)"
    ]
    inside = tmp_path / "loss.py"
    inside.write_text("def f():\n    from transformer_mt.serving.service import Service\n")
    assert against_the_rule("training.loss", project_imports(inside, "training.loss")) == [
        "training.loss imports serving.service (serving: not below training or not named by it)"
    ]
    assert against_the_rule("training.loss", {"network.model", "common.exits"}) == []


def test_model_and_search_stand_alone() -> None:
    # style.md: model.py imports only the config; search.py nothing of the package but its
    # vocabulary maxima (maxima.py, itself importing nothing: tensor arithmetic), as it gets a
    # step function, so it decodes a toy distribution in tests as it decodes the model.
    assert project_imports(PACKAGE / "network" / "model.py") <= {"config"}
    assert project_imports(PACKAGE / "network" / "search.py") <= {"network.maxima"}
    assert project_imports(PACKAGE / "network" / "maxima.py") == set()


def test_nothing_imports_the_cli_except_main() -> None:
    for path in PACKAGE.rglob("*.py"):
        if module_name(path) not in ("cli", "__main__"):
            assert "cli" not in project_imports(path), path
