"""tmt export: CTranslate2 and Hugging Face models that reproduce tmt, or nothing at all."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import reverse_pairs
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config
from transformer_mt.data import corpus
from transformer_mt.exchange import export
from transformer_mt.runs import averaging
from transformer_mt.training.train import train
from transformer_mt.translation import ct2, translate

runner = CliRunner()
LINES = 8  # validation lines each export must reproduce (the tiny models' outputs run long)


@pytest.fixture(scope="module")
def pre_norm_run(tiny_cfg: Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny pre-norm model (the default preset's layout): final layer norms, pre-norm layers."""
    out = tmp_path_factory.mktemp("pre_norm")
    cfg = dataclasses.replace(
        tiny_cfg,
        model=dataclasses.replace(tiny_cfg.model, pre_norm=True),
        train=dataclasses.replace(tiny_cfg.train, out_dir=str(out), max_steps=20, save_every=10),
    )
    train(cfg)
    return out


def greedy_tokens(model: Path, lines: list[str]) -> list[list[int]]:
    translator = translate.load_translator(model, ["decode.beam_size=1"])
    return [h[0].tokens if h else [] for h in translate.translate_lines(translator, lines)]


def check_lines(model: Path) -> list[str]:
    translator = translate.load_translator(model)
    return corpus.read_split(translator.config.data, "data.valid")[0][:LINES]


@pytest.mark.parametrize("layout", ["post_norm", "pre_norm"])
def test_ctranslate2_export_reproduces_tmt(
    trained_run: Path, pre_norm_run: Path, tmp_path: Path, layout: str
) -> None:
    import ctranslate2

    model = trained_run if layout == "post_norm" else pre_norm_run
    report = export.export(model, "ctranslate2", tmp_path / "ct2", check_lines=LINES)
    assert report["check_lines"] == LINES and report["quantization"] == "float32"
    # The directory works on its own, as a user deploys it.
    translator = translate.load_translator(model)
    tok = translator.tokenizer
    lines = check_lines(model) + [s for s, _ in reverse_pairs(4, seed=11)]
    ct2 = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
    pieces = [[tok._sp.id_to_piece(t) for t in ids] for ids in tok.encode(lines)]
    results = ct2.translate_batch(pieces, beam_size=1, max_decoding_length=19, min_decoding_length=0,
                                  suppress_sequences=[["<pad>"], ["<s>"]])  # fmt: skip
    theirs = [[tok._sp.piece_to_id(p) for p in r.hypotheses[0]] for r in results]
    ours = [out[:19] for out in greedy_tokens(model, lines)]  # both cut at 19 tokens
    assert theirs == ours


def test_quantized_ctranslate2_export_reports_its_agreement(
    trained_run: Path, tmp_path: Path
) -> None:
    report = export.export(trained_run, "ctranslate2", tmp_path / "int8", "int8", LINES)
    assert report["quantization"] == "int8"
    assert 0 <= report["quantized_identical_lines"] <= LINES
    config = json.loads((tmp_path / "int8" / "config.json").read_text())
    assert config["add_source_eos"] is True
    assert (
        json.loads((tmp_path / "int8" / export.REPORT_FILE).read_text())["format"] == "ctranslate2"
    )


@pytest.mark.parametrize(
    ("layout", "architecture"),
    [("post_norm", "MarianMTModel"), ("pre_norm", "PegasusForConditionalGeneration")],
)
def test_huggingface_export_loads_with_auto_classes_and_reproduces_tmt(
    trained_run: Path, pre_norm_run: Path, tmp_path: Path, layout: str, architecture: str
) -> None:
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = trained_run if layout == "post_norm" else pre_norm_run
    report = export.export(model, "huggingface", tmp_path / "hf", check_lines=LINES)
    assert report["architecture"] == architecture
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    hf = AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(hf).__name__ == architecture
    translator = translate.load_translator(model)
    lines = check_lines(model)[:3]
    # The tokenizer gives tmt's ids (the source with </s>), and decodes them back the same way.
    for line in [*lines, "  extra   spaces ", "kalo mi <s> literal"]:
        ours = translator.tokenizer.encode([line])[0] + [translator.tokenizer.eos_id]
        assert tokenizer(line)["input_ids"] == ours
    expected, limits = greedy_tokens(model, lines), export._limits(translator, lines)
    eos = translator.tokenizer.eos_id
    for line, tokens, limit in zip(lines, expected, limits, strict=True):
        source = tokenizer(line, return_tensors="pt")
        with torch.inference_mode():  # generate's own defaults, from the exported config
            out = hf.generate(
                **source, num_beams=1, do_sample=False, max_new_tokens=len(tokens) + 1
            )
        generated = out[0, 1:].tolist()
        assert generated[: len(tokens)] == tokens
        if len(tokens) < limit - 1:  # tmt stopped at its EOS, not at its length limit
            assert generated[len(tokens)] == eos
        text = tokenizer.decode(out[0, : len(tokens) + 1], skip_special_tokens=True)
        assert text == translator.tokenizer.decode([tokens])[0]


def test_an_export_that_differs_is_refused_naming_the_line(
    trained_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_convert = ct2.convert

    def tampered(*args):  # an off-by-one in the converter, say
        spec = real_convert(*args)
        projection = spec.decoder.projection.weight  # a validated spec wraps its arrays
        projection.array = projection.array[::-1].copy()
        return spec

    monkeypatch.setattr(ct2, "convert", tampered)
    with pytest.raises(TmtError, match=r"differs from tmt on validation line 1 \(.*nothing was"):
        export.export(trained_run, "ctranslate2", tmp_path / "bad", check_lines=LINES)
    assert list(tmp_path.iterdir()) == []  # no output, no staging left


def test_an_interrupted_export_leaves_nothing(
    trained_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "_parity", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export.export(trained_run, "huggingface", tmp_path / "hf", check_lines=LINES)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "onnx"], "--format onnx: expected one of ctranslate2, huggingface"),
        (["--format", "huggingface", "--quantization", "int8"], "--quantization int8: not for"),
        (["--format", "ctranslate2", "--quantization", "int4"], "--quantization int4: not for"),
        (["--format", "ctranslate2", "--check-lines", "-1"], "--check-lines -1"),
    ],
)
def test_bad_export_options_are_one_line(
    trained_run: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    result = runner.invoke(
        app, ["export", "-m", str(trained_run), "-o", str(tmp_path / "x"), *args]
    )
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.output


def test_export_refuses_an_occupied_output_and_a_missing_model(
    trained_run: Path, tmp_path: Path
) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    result = runner.invoke(app, ["export", "-m", str(trained_run), "--format", "ctranslate2",
                                 "-o", str(tmp_path / "taken")])  # fmt: skip
    assert result.exit_code == 2 and "exists and is not an empty directory" in result.stderr
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    result = runner.invoke(app, ["export", "-m", str(tmp_path / "nowhere"), "--format",
                                 "ctranslate2", "-o", str(tmp_path / "out")])  # fmt: skip
    assert result.exit_code == 2 and "nowhere: no such file or directory" in result.stderr


def test_a_missing_extra_is_named(
    trained_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import builtins

    real_import = builtins.__import__

    def no_ctranslate2(name, *args, **kwargs):
        if name == "ctranslate2":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ctranslate2)
    with pytest.raises(TmtError, match=r"needs the ctranslate2 package: pip install .*\[export\]"):
        export.export(trained_run, "ctranslate2", tmp_path / "x", check_lines=LINES)


def test_export_of_a_run_takes_its_average(trained_run: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    import shutil

    shutil.copytree(trained_run, run_dir, symlinks=True)
    mean = averaging.write(averaging.newest(run_dir, 2), run_dir / "average")
    report = export.export(run_dir, "ctranslate2", tmp_path / "ct2", check_lines=2)
    assert report["source"] == str(mean.path)


def test_a_ctranslate2_export_is_self_contained_and_its_readme_code_reproduces_tmt(
    trained_run: Path, tmp_path: Path
) -> None:
    """The README's recipe, run as a script by a Python that never imports tmt, with only the
    export directory: ctranslate2 + sentencepiece give tmt's greedy translations."""
    import subprocess
    import sys

    from transformer_mt.exchange import recipes

    out = tmp_path / "ct2"
    export.export(trained_run, "ctranslate2", out, check_lines=LINES)
    translator = translate.load_translator(trained_run, ["decode.beam_size=1"])
    assert (out / ct2.SENTENCEPIECE_FILE).read_bytes() == translator.tokenizer.model_bytes
    readme = (out / recipes.README_FILE).read_text()
    assert f"on {LINES} validation lines" in readme and "min_decoding_length=0" in readme
    script = tmp_path / "translate.py"
    script.write_text(recipes.python_block(readme))
    lines = [*check_lines(trained_run), "", "kalo " * 40, *[s for s, _ in reverse_pairs(6, seed=5)]]
    guard = "import sys; sys.modules['transformer_mt'] = None; "  # importing tmt would fail
    result = subprocess.run(
        [sys.executable, "-c", guard + f"import runpy; runpy.run_path({str(script)!r}, "
         "run_name='__main__')", str(out), "1"],
        input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:-1] == translate.translate_text(translator, lines)


def test_a_huggingface_export_has_a_readme_whose_code_reproduces_tmt(
    trained_run: Path, tmp_path: Path
) -> None:
    import subprocess
    import sys

    from transformer_mt.exchange import recipes

    out = tmp_path / "hf"
    export.export(trained_run, "huggingface", out, check_lines=LINES)
    code = recipes.python_block((out / recipes.README_FILE).read_text())
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    translator = translate.load_translator(trained_run, ["decode.beam_size=1"])
    assert (
        result.stdout
        == translate.translate_text(translator, check_lines(trained_run)[:1])[0] + "\n"
    )


@pytest.mark.parametrize(
    ("rule", "expected"), [("bound", "never"), ("current", False), ("k_finished", True)]
)
def test_huggingface_generate_defaults_carry_the_stopping_rule(
    trained_run: Path, rule: str, expected: str | bool
) -> None:
    # What generate's early_stopping means for each of tmt's rules (its docstring): "never" is
    # the exact bound, False the current-length heuristic, True "stop once num_beams finished".
    from transformer_mt.exchange import huggingface

    translator = translate.load_translator(
        trained_run, ["decode.beam_size=3", f"decode.early_stopping={rule}"]
    )
    hf, _ = huggingface.model(translator)
    assert hf.generation_config.num_beams == 3
    assert hf.generation_config.early_stopping == expected
