"""Write the manual's configuration reference from the config dataclasses (config.py).

Every key of every section, its default, the values it accepts (its type's range or choices) and
its meaning: the comments that config.py writes beside or above the field. The page is made, never
edited, so it cannot drift from the code; tests/test_docs.py fails when the committed page differs
from what this script makes.

    python scripts/config_reference.py            # writes docs/configuration.md
    python scripts/config_reference.py --check    # exit 1 when docs/configuration.md is stale
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import re
import sys
import tokenize
import typing
from pathlib import Path

from transformer_mt import config

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "configuration.md"
SOURCE = Path(config.__file__)

INTRO = """# Configuration reference

<!-- Made by scripts/config_reference.py from transformer_mt/config.py: do not edit. -->

One frozen config tree with the paper's names and defaults: dataclass defaults, then the YAML file
(`-c base`, `-c big`, `-c tiny` or a path; `configs/` holds the presets), then each
`--set section.key=value`. An unknown key is an error that lists the valid ones, a key given
twice in the file an error that names its line, a value outside its range an error that names
the key. The resolved config is saved as `OUT_DIR/config.yaml`
and inside every checkpoint. Departures from the paper are named as such below.

Ranges: `[a, b]` includes both ends, `(a, b)` excludes them.
"""


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> the comment on the field's line and the comment lines directly
    above it, in reading order."""
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            text = token.string.lstrip("#")
            # An indented "NAME  meaning" line is one entry of a list (data.source's values).
            item = re.fullmatch(r"\s{2,}(\S+)\s{2,}(.*)", text)
            comments[token.start[0]] = f"`{item[1]}`: {item[2]};" if item else text.strip()
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        group, previous_end = (
            "",
            0,
        )  # a comment above a block of fields speaks for those that say nothing
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            above, line = [], item.lineno - 1
            while line >= 1 and lines[line - 1].strip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            beside = [comments[n] for n in range(item.lineno, item.end_lineno + 1) if n in comments]
            if above:
                group = " ".join(above)
            elif item.lineno != previous_end + 1:
                group = ""
            own = " ".join([*above, *beside])
            found[(node.name, item.target.id)] = own or group  # a field that says nothing itself
            previous_end = item.end_lineno
    return {key: text.strip().removesuffix(";") for key, text in found.items()}


def accepts(hint: object) -> str:
    """What a field's type admits, as the config's errors say it."""
    if typing.get_origin(hint) is typing.Annotated:
        base, *extras = typing.get_args(hint)
        ranges = [str(e) for e in extras if type(e).__str__ is not object.__str__]
        return f"{accepts(base)}, {'; '.join(ranges)}" if ranges else accepts(base)
    if typing.get_origin(hint) is typing.Literal:
        return " \\| ".join(f"`{v}`" if v != "" else '`""`' for v in typing.get_args(hint))
    if hint is bool:
        return "true \\| false"
    if typing.get_origin(hint) is tuple:  # data.train's list of corpora
        return "a list of corpora (the keys of data.train[])"
    if isinstance(hint, type):
        return {"int": "integer", "float": "number", "str": "text"}.get(hint.__name__, "?")
    return " or ".join(accepts(a) for a in typing.get_args(hint)) or str(hint)


REQUIRED = object()  # a field without a default: each corpus of a mixture names its split


def markdown(text: str) -> str:
    """Text for a table cell: tags such as <s> shown, not read as HTML; | not a column."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def shown(value: object) -> str:
    if value is REQUIRED:
        return "(required)"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if value == "":
        return '`""`'
    if isinstance(value, tuple):
        return "`[]`" if not value else f"`{list(value)}`"
    return f"`{value}`"


def section_rows(cls: type, prefix: str, comments: dict) -> tuple[list[str], list[tuple]]:
    """The table rows of one section, and its nested sections (prefix, class) to list after."""
    hints = typing.get_type_hints(cls, include_extras=True)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = REQUIRED
        if dataclasses.is_dataclass(default):
            nested.append((f"{prefix}{f.name}.", type(default)))
            continue
        doc = markdown(comments.get((cls.__name__, f.name), ""))
        rows.append(f"| `{prefix}{f.name}` | {shown(default)} | {accepts(hints[f.name])} | {doc} |")
    return rows, nested


def render() -> str:
    comments = field_comments(SOURCE.read_text(encoding="utf-8"))
    parts = [INTRO]
    sections = [(f"{f.name}.", f.default_factory) for f in dataclasses.fields(config.Config)]
    sections.insert(3, ("data.train[].", config.Corpus))  # the keys of a mixture's corpus
    while sections:
        prefix, cls = sections.pop(0)
        doc = cls.__doc__ if cls.__doc__ and not cls.__doc__.startswith(cls.__name__) else ""
        rows, nested = section_rows(cls, prefix, comments)
        parts.append(f"## `{prefix.rstrip('.')}`\n")
        if doc:
            parts.append(markdown(" ".join(doc.split())) + "\n")
        parts.append("| key | default | accepts | meaning |\n|---|---|---|---|")
        parts.append("\n".join(rows) + "\n")
        sections[0:0] = nested
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    made = render()
    if parser.parse_args().check:
        if not PAGE.exists() or PAGE.read_text(encoding="utf-8") != made:
            sys.exit(f"{PAGE}: stale; run python scripts/config_reference.py")
        return
    PAGE.write_text(made, encoding="utf-8")
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    from transformer_mt.common.exits import run_script

    run_script(main)
