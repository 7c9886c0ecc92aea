"""Imports flow one way: each module sits in a layer and imports only from the layers below it,
with the exceptions named here (style.md §5.3). An import against the rule fails, whether it is
new or old: the rule is stated, not a snapshot of today's imports."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "transformer_mt"

# Bottom to top. A module may import any module of a lower layer.
LAYERS: list[tuple[str, set[str]]] = [
    # stdlib only: exit codes and TmtError, file primitives and tmt's file names, fault points,
    # the allocator setting that must run before torch loads
    # ... and the one table of language codes
    ("leaves", {"exits", "files", "faults", "allocator", "languages"}),
    # the config tree (stdlib + yaml), and text in and out (stdlib)
    ("foundations", {"config", "textio"}),
    # one concern each, knowing nothing of runs or commands
    (
        "components",
        {
            "corpus",
            "clean",
            "marian_tokenizer",
            "foreign",
            "tokenizer",
            "data",
            "model",
            "loss",
            "optim",
            "search",
            "distributed",
            "train_state",
            "metrics",
            "kernels",
            "glossary",
            "hints",
            "maxima",
            "aligner",
            "shortlist",
        },
    ),
    # what decoding adds over the models: several decoding as one (their search states and
    # probabilities combined), alignments from the cross-attention, constrained search
    # ... and a batch's candidates under a lexical shortlist
    ("ensembles", {"ensemble", "alignment", "constraints", "candidates"}),
    # what tmt keeps on disk: one checkpoint, a run directory, averages of checkpoints
    # ... and a CTranslate2 export of a model, the engine that decodes it
    ("stores", {"checkpoint", "run", "averaging", "ct2"}),
    # a model's lines to hypotheses: batches, the search or CTranslate2 (what translate reads)
    ("decoding", {"decoding"}),
    # what the commands do: translate, score, one update, the file job, export, plots, dry run
    (
        "engines",
        {
            "translate",
            "streams",
            "evaluate",
            "step",
            "bulk",
            "export",
            "huggingface",
            "pretrained",
            "marian_config",
            "recipes",
            "plot",
            "dry_run",
            "cleaning",
            "terms",
            "shortlisting",
        },
    ),
    # the server: one worker batching requests, the service that knows the model, the two
    # APIs (tmt's own and LibreTranslate's) and the HTTP app around them
    ("serving", {"batching", "glossary_store", "service", "gate", "libretranslate", "serve"}),
    # the training loop: the only module that knows a whole run; where it stands, why it stops
    ("training", {"train", "progress"}),
    # recipes over whole runs: distillation translates with a teacher, then trains a student
    ("workflows", {"distill_record", "distill"}),
    # the command line's options: spellings, help, decoding flags as overrides (typer only)
    ("options", {"flags"}),
    # the faces: the command line, `python -m transformer_mt`, the Python API
    ("faces", {"cli", "__main__", "__init__"}),
]
LAYER_OF = {module: index for index, (_, modules) in enumerate(LAYERS) for module in modules}

# Imports within one layer, each with its reason; nothing else crosses sideways.
SIDEWAYS: dict[tuple[str, str], str] = {
    ("files", "faults"): "a set of files replaced together has fault points between its renames",
    ("tokenizer", "corpus"): "the joint vocabulary is trained on the training corpora",
    ("tokenizer", "marian_tokenizer"): "a model's tokenizer is tmt's joint one or Marian's pair",
    ("data", "corpus"): "batches are made of the corpora's pairs",
    ("data", "tokenizer"): "... encoded with the joint vocabulary",
    ("data", "clean"): "data.clean judges the training corpora by the clean rules as they are read",
    ("data", "hints"): "data.terms: the training sources' term hints, drawn each epoch",
    ("hints", "glossary"): "a hint's terms are a dictionary's, matched as a glossary's",
    ("hints", "tokenizer"): "... and its tags the tokenizer's symbols",
    ("search", "maxima"): "greedy's argmax and beam search's top-k are block-wise maxima",
    ("shortlist", "aligner"): "p(target piece | source piece) from eflomal's links",
    ("clean", "corpus"): "the overlap rule reads the validation and test splits",
    ("metrics", "distributed"): "the metrics log all-reduces its sums over ranks",
    ("run", "checkpoint"): "a run directory holds checkpoints",
    ("averaging", "checkpoint"): "averaging reads and writes checkpoints",
    ("averaging", "run"): "... of a run: its newest or best",
    ("evaluate", "translate"): "scores what translate decodes (validation BLEU too)",
    ("bulk", "translate"): "the file job translates chunks",
    ("bulk", "streams"): "... into the rows (and glossary reports) a stream gets",
    ("streams", "translate"): "a stream's lines are translated by a loaded Translator",
    ("export", "translate"): "an export is checked against tmt's own decoding",
    ("export", "huggingface"): "the Hugging Face export is huggingface.py's conversion",
    ("huggingface", "translate"): "converts a loaded Translator's model and tokenizer",
    ("pretrained", "huggingface"): "an import reads transformers' names through the export's map",
    ("pretrained", "marian_config"): "an import reads the directory's JSON files as tmt settings",
    ("marian_config", "huggingface"): "... generate's stopping rules as the export names them",
    ("terms", "translate"): "tmt terms -m aligns with a loaded model's attention",
    ("shortlisting", "translate"): "tmt shortlist reads a loaded model (and its translations)",
    ("export", "recipes"): "an export's README, whose code is its parity check",
    ("recipes", "translate"): "the README's values are a loaded Translator's",
    ("service", "batching"): "requests are translated through the one batching worker",
    ("libretranslate", "service"): "the LibreTranslate API is a second face of the service",
    ("serve", "service"): "the HTTP app answers with the service",
    ("serve", "libretranslate"): "... and mounts the LibreTranslate API",
    ("serve", "batching"): "... and starts and drains the batching worker",
    ("service", "glossary_store"): "requests name the server's stored glossaries",
    ("serve", "glossary_store"): "the glossary endpoints manage the stored glossaries",
    ("gate", "service"): "the outer layer checks the service's key and limits, counts its metrics",
    ("serve", "gate"): "... around the HTTP app",
    ("train", "progress"): "where the run stands and why it stops",
    ("distill", "distill_record"): "the distillation's record, read back verified",
    ("__main__", "cli"): "python -m transformer_mt is the command line",
    ("__init__", "translate"): "the Python API is the Translator (imported lazily)",
}


def project_imports(path: Path) -> set[str]:
    """The package's modules that `path` imports, at module level or inside functions."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
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
                found.update(a.name if a.name in modules else "__init__" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(
                a.name.split(".")[1] for a in node.names if a.name.startswith("transformer_mt.")
            )
    return found - {path.stem}


def test_every_module_has_a_layer() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert modules == set(LAYER_OF), "place new modules in LAYERS"


def against_the_rule(module: str, imported: set[str]) -> list[str]:
    """The imports of `module` that neither go down the layers nor sideways with a reason."""
    return [
        f"{module} imports {name} ({LAYERS[LAYER_OF[name]][0]}, {module} is in"
        f" {LAYERS[LAYER_OF[module]][0]})"
        for name in sorted(imported)
        if LAYER_OF[name] >= LAYER_OF[module] and (module, name) not in SIDEWAYS
    ]


def test_imports_go_down_the_layers_or_sideways_with_a_reason() -> None:
    wrong = [
        problem
        for path in sorted(PACKAGE.glob("*.py"))
        for problem in against_the_rule(path.stem, project_imports(path))
    ]
    assert not wrong, "\n".join(wrong)


def test_the_rule_refuses_imports_up_and_unnamed_sideways(tmp_path: Path) -> None:
    up = tmp_path / "model.py"
    up.write_text("from transformer_mt import run\n")  # a component reaching into a store
    assert against_the_rule("model", project_imports(up)) == [
        "model imports run (stores, model is in components)"
    ]
    sideways = tmp_path / "loss.py"
    sideways.write_text("def f():\n    from transformer_mt.model import Transformer\n")
    assert against_the_rule("loss", project_imports(sideways)) == [
        "loss imports model (components, loss is in components)"
    ]


def test_model_and_search_stand_alone() -> None:
    # style.md: model.py imports only the config; search.py nothing of the package but its
    # vocabulary maxima (maxima.py, itself importing nothing: tensor arithmetic), as it gets a
    # step function, so it decodes a toy distribution in tests as it decodes the model.
    assert project_imports(PACKAGE / "model.py") <= {"config"}
    assert project_imports(PACKAGE / "search.py") <= {"maxima"}
    assert project_imports(PACKAGE / "maxima.py") == set()


def test_nothing_imports_the_cli_except_main() -> None:
    for path in PACKAGE.glob("*.py"):
        if path.stem not in ("cli", "__main__"):
            assert "cli" not in project_imports(path), path.name
