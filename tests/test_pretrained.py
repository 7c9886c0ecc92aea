"""tmt import: MarianMTModel directories written by transformers (tests/marian_models.py) become
tmt models that compute what transformers computes: the tokenizer's ids, the logits, greedy and
beam outputs token for token, batched and one at a time; the import is deterministic and atomic;
what is not a Marian model tmt can hold is refused in one line, with nothing written."""

from __future__ import annotations

import functools
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import cli_processes
import pytest
import torch
from marian_models import multi30k
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.common.exits import TmtError
from transformer_mt.exchange import pretrained
from transformer_mt.network.model import make_src_mask
from transformer_mt.runs import checkpoint
from transformer_mt.translation import decoding, translate

transformers = pytest.importorskip("transformers")
runner = CliRunner()
# English sources, each with the target language the multi-target models expect first.
ENGLISH = multi30k("en", "val", 48)
LINES = [(">>fra<< " if i % 2 else ">>deu<< ") + line for i, line in enumerate(ENGLISH)]


def hf_tokenizer(path: Path):
    return transformers.MarianTokenizer.from_pretrained(str(path))


def generate(path: Path, lines: list[str], beam: int) -> list[list[int]]:
    """MarianMTModel.generate's outputs (no start token, no </s>, no padding), the directory's
    generation config otherwise, in batches of 16 (each asked for once)."""
    return [list(row) for row in _generate(path, tuple(lines), beam)]


@functools.lru_cache(maxsize=16)
def _generate(path: Path, lines: tuple[str, ...], beam: int) -> tuple[tuple[int, ...], ...]:
    tokenizer, model = hf_tokenizer(path), transformers.MarianMTModel.from_pretrained(str(path))
    outputs = []
    for i in range(0, len(lines), 16):
        batch = tokenizer(lines[i : i + 16], return_tensors="pt", padding=True)
        with torch.inference_mode():
            rows = model.eval().generate(**batch, num_beams=beam).tolist()
        for row in rows:
            row = row[1:]
            outputs.append(row[: row.index(tokenizer.eos_token_id)]
                           if tokenizer.eos_token_id in row else row)  # fmt: skip
    return tuple(map(tuple, outputs))


def tmt_outputs(model: Path, lines: list[str], beam: int, one_by_one: bool = False) -> list:
    translator = translate.load_translator(model, [f"decode.beam_size={beam}"])
    if one_by_one:
        return [decoding.translate_lines(translator, [line])[0][0].tokens for line in lines]
    return [hyps[0].tokens for hyps in decoding.translate_lines(translator, lines)]


# --- the tokenizer -----------------------------------------------------------------------------

TRICKY = [
    "A dog runs.", ">>fra<< A dog runs.", ">>fra<<A dog", ">>deu<<", ">>xyz<< unknown code",
    ">> not a code", "a >>fra<< inside", "ends with </s> typed", "<unk> and <pad> typed",
    "  spaces   inside  ", "Ünïcödé ẞ and emoji 🙂", ">>deu<< >>fra<< two codes", "x</s>y",
]  # fmt: skip


@pytest.mark.parametrize("kind", ["multi", "separate"])
def test_the_tokenizer_gives_marian_tokenizers_ids(
    marian_dirs: dict[str, Path], imported: dict[str, Path], kind: str
) -> None:
    theirs = hf_tokenizer(marian_dirs[kind])
    ours = checkpoint.read(imported[kind]).tokenizer
    assert ours.encode(TRICKY) == [theirs(t)["input_ids"][:-1] for t in TRICKY]
    targets = multi30k("de", "val", 20) + multi30k("fr", "val", 20) + TRICKY
    expected = [theirs(text_target=t)["input_ids"][:-1] for t in targets]
    assert ours.encode(targets, side="target") == expected
    # Special ids read from the files, not assumed: </s> is 37 here, <pad> the last id.
    vocab = json.loads((marian_dirs[kind] / "vocab.json").read_text())
    assert (ours.eos_id, ours.pad_id, ours.unk_id) == (37, len(vocab) - 1, vocab["<unk>"])
    assert ours.language_codes == (">>deu<<", ">>fra<<")
    # Decoding writes what batch_decode(skip_special_tokens=True) writes, with the target model.
    assert ours.decode(expected) == theirs.batch_decode(
        [[*ids, ours.eos_id] for ids in expected], skip_special_tokens=True,
        use_source_tokenizer=False,
    )  # fmt: skip


def test_a_damaged_tokenizer_is_one_line(imported: dict[str, Path]) -> None:
    from transformer_mt.data.marian_tokenizer import MarianTokenizer

    data = checkpoint.read(imported["multi"]).tokenizer.model_bytes
    broken_json = data.replace(b'"<unk>": ', b'"<unk>"; ', 1)  # same length, not JSON
    for bad in (data[:-10], data[:60], broken_json):
        with pytest.raises(TmtError, match="damaged Marian tokenizer|vocabulary|sentencepiece"):
            MarianTokenizer(bad, origin="x")


# --- the model ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["multi", "separate"])
def test_logits_equal_transformers(
    marian_dirs: dict[str, Path], imported: dict[str, Path], kind: str
) -> None:
    tokenizer = hf_tokenizer(marian_dirs[kind])
    theirs = transformers.MarianMTModel.from_pretrained(str(marian_dirs[kind])).eval()
    ours = checkpoint.read(imported[kind]).model.eval()
    batch = tokenizer(LINES[:8], text_target=multi30k("de", "val", 8), padding=True,
                      return_tensors="pt")  # fmt: skip
    labels = batch.pop("labels")
    pad = tokenizer.pad_token_id
    start = torch.full((8, 1), pad)
    decoder_in = torch.cat([start, labels[:, :-1]], dim=1)  # Marian's shift: <pad> first
    with torch.inference_mode():
        expected = theirs(**batch, decoder_input_ids=decoder_in).logits
        found = ours.decode(decoder_in, ours.encode(batch["input_ids"],
                            make_src_mask(batch["input_ids"], pad)),
                            make_src_mask(batch["input_ids"], pad))  # fmt: skip
    real = labels != pad  # positions whose input is a real token (or the start)
    assert real.sum() > 100
    torch.testing.assert_close(found[real], expected[real], rtol=0, atol=2e-4)
    assert theirs.final_logits_bias.abs().max() > 0.5  # the output bias is part of it


# make test decodes each kind and each beam once ([4-multi], [1-separate]); the other two pairs
# (3-4 s each on the 2-core machine) are in the slow set, which .ci/run runs too.
@pytest.mark.parametrize(
    ("beam", "kind"),
    [
        (1, "separate"),
        (4, "multi"),
        pytest.param(1, "multi", marks=pytest.mark.slow),
        pytest.param(4, "separate", marks=pytest.mark.slow),
    ],
)
def test_outputs_equal_generate_batched_and_one_by_one(
    marian_dirs: dict[str, Path], imported: dict[str, Path], kind: str, beam: int
) -> None:
    expected = generate(marian_dirs[kind], LINES, beam)
    assert tmt_outputs(imported[kind], LINES, beam) == expected
    assert tmt_outputs(imported[kind], LINES, beam, one_by_one=True) == expected
    # Not vacuous: the outputs depend on the source and its language token.
    assert len({tuple(o) for o in expected}) >= 15
    if beam > 1:
        assert expected != generate(marian_dirs[kind], LINES, 1)


def test_the_decoding_settings_are_the_generation_configs(imported: dict[str, Path]) -> None:
    cfg = checkpoint.read(imported["multi"]).config
    decode = cfg.decode
    assert (decode.beam_size, decode.length_penalty, decode.length_penalty_form) == (
        4,
        1.0,
        "power",
    )
    assert (decode.early_stopping, decode.max_len_a, decode.max_len_b) == ("current", 0.0, 63)
    model = cfg.model
    assert (model.activation, model.output_bias, model.decoder_start) == ("swish", True, "pad")
    assert not checkpoint.read(imported["separate"]).config.model.share_embeddings
    report = json.loads((imported["multi"] / pretrained.REPORT_FILE).read_text())
    assert report["generation"]["num_beams"] == 4 and report["not_reproduced"] == {}
    # --beam and the other flags override them, as for tmt's own models.
    translator = translate.load_translator(imported["multi"], [("decode.beam_size=2", "--beam 2")])
    assert translator.config.decode.beam_size == 2


def test_a_line_with_no_target_language_for_a_multi_target_model_is_said_once(
    imported: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Without >>xxx<< a multi-target model picks a language itself: said once, naming the
    model's languages; not for lines that name theirs, nor with decode.target_lang."""
    said = "the model translates into several languages (deu, fra); a line that does not start"
    for settings, lines, told in [
        (["decode.target_lang=fra"], ENGLISH[:2], False),
        ([], [f">>fra<< {line}" for line in ENGLISH[:2]], False),
        ([], ENGLISH[:2], True),
    ]:
        translator = translate.load_translator(imported["multi"], ["decode.beam_size=1", *settings])
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            decoding.translate_lines(translator, lines)
            decoding.translate_lines(translator, lines)  # once a model
        assert [said in r.message for r in caplog.records].count(True) == told, caplog.text


def test_target_lang_puts_the_language_token_first(
    marian_dirs: dict[str, Path], imported: dict[str, Path]
) -> None:
    expected = generate(marian_dirs["multi"], [f">>fra<< {line}" for line in ENGLISH[:10]], 1)
    translator = translate.load_translator(
        imported["multi"], ["decode.beam_size=1", "decode.target_lang=fra"]
    )
    found = decoding.translate_lines(translator, ENGLISH[:10])
    assert [hyps[0].tokens for hyps in found] == expected
    text = hf_tokenizer(marian_dirs["multi"]).batch_decode(expected, skip_special_tokens=True)
    result = runner.invoke(
        app, ["translate", "-m", str(imported["multi"]), "--beam", "1", "--target-lang", "fra"],
        input="\n".join(ENGLISH[:10]) + "\n",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == text
    refused = runner.invoke(
        app, ["translate", "-m", str(imported["multi"]), "--target-lang", "ita"], input="Hi.\n"
    )
    assert refused.exit_code == 2
    assert "no >>ita<< token (its target languages: deu, fra)" in refused.stderr.strip()


# --- the import itself -------------------------------------------------------------------------


def test_the_import_is_deterministic(marian_dirs: dict[str, Path], tmp_path: Path) -> None:
    first = pretrained.import_model(marian_dirs["separate"], tmp_path / "a")
    pretrained.import_model(marian_dirs["separate"], tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["config.yaml", "import.json", "manifest.json", "model.pt"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (
        first["files"]["pytorch_model.bin"]
        == __import__("hashlib")
        .sha256((marian_dirs["separate"] / "pytorch_model.bin").read_bytes())
        .hexdigest()
    )


def test_a_killed_import_leaves_nothing(marian_dirs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "imported"
    command = ["import", "-m", str(marian_dirs["multi"]), "-o", str(out)]
    env = {**__import__("os").environ, "TMT_FAULT": "save0_bytes@20000:kill"}
    killed = cli_processes.run(command, env=env, timeout=120)
    assert killed.returncode == -9
    assert not out.exists()
    again = cli_processes.run(command, timeout=120)
    assert again.returncode == 0, again.stderr
    assert not list(tmp_path.glob(".tmp-*")), "the killed import's staging is swept"
    assert checkpoint.read(out).step == 0


def test_an_import_is_replaced_only_with_overwrite(
    marian_dirs: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "imported"
    assert (
        runner.invoke(app, ["import", "-m", str(marian_dirs["multi"]), "-o", str(out)]).exit_code
        == 0
    )
    again = runner.invoke(app, ["import", "-m", str(marian_dirs["multi"]), "-o", str(out)])
    assert again.exit_code == 2 and "add --overwrite" in again.stderr
    forced = ["import", "-m", str(marian_dirs["multi"]), "-o", str(out), "--overwrite"]
    assert runner.invoke(app, forced).exit_code == 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    refused = runner.invoke(
        app,
        ["import", "-m", str(marian_dirs["multi"]), "-o", str(tmp_path / "other"), "--overwrite"],
    )
    assert refused.exit_code == 2 and "not an empty directory nor a tmt import" in refused.stderr
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


# --- refusals: one line, exit 2, nothing written -----------------------------------------------


def _copy(source: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "hf"
    shutil.copytree(source, copy)
    return copy


def _edit_config(directory: Path, **changes: object) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


class _Exploit:
    def __reduce__(self):
        return (print, ("pwned",))


def _refusals() -> dict[str, tuple]:
    def t5(d: Path) -> None:
        _edit_config(d, model_type="t5", architectures=["T5ForConditionalGeneration"])

    def bart(d: Path) -> None:
        _edit_config(d, model_type="bart", architectures=["BartForConditionalGeneration"])

    def rnn(d: Path) -> None:  # a Marian-native OPUS-MT tiny model: an SSRU decoder, no config
        import numpy as np

        for name in ("config.json", "pytorch_model.bin"):
            (d / name).unlink()
        spec = b"type: transformer\ntransformer-decoder-autoreg: rnn\ndec-cell: ssru\n"
        np.savez(d / "opus.spm32k.model1.npz",
                 **{"special:model.yml": np.frombuffer(spec, dtype=np.int8)})  # fmt: skip
        (d / "decoder.yml").write_text("models: [opus.spm32k.model1.npz]\n")

    def missing(d: Path) -> None:
        (d / "target.spm").unlink()

    def tmt_export(d: Path) -> None:  # tmt's Hugging Face export of its own model
        (d / "source.spm").unlink()
        (d / "tokenizer.json").write_text("{}")
        (d / "tmt_export.json").write_text("{}")

    def no_weights(d: Path) -> None:
        (d / "pytorch_model.bin").unlink()

    def shapes(d: Path) -> None:
        _edit_config(d, encoder_ffn_dim=128, decoder_ffn_dim=128)

    def pickle_code(d: Path) -> None:
        torch.save({"model.shared.weight": _Exploit()}, d / "pytorch_model.bin")

    def pickle_text(d: Path) -> None:
        torch.save({"model.shared.weight": "not a tensor"}, d / "pytorch_model.bin")

    def ids(d: Path) -> None:  # another id than the tokenizer's is taken (M2); none at all not
        _edit_config(d, eos_token_id=100_000)

    # Sizes past what the weights hold: refused before anything of that size is made. (A
    # d_model of 10^7 made tmt compute a 41 GB position table, 10^6 decoder layers a shape-only
    # model for minutes; smaller here, to fail fast where the check is missing.)
    def wide(d: Path) -> None:
        _edit_config(d, d_model=100_000)

    def deep(d: Path) -> None:
        _edit_config(d, decoder_layers=20_000)

    def long(d: Path) -> None:  # no weights hold the table: the range bounds it
        _edit_config(d, max_position_embeddings=10**8)

    return {
        "t5": (t5, "model_type 't5' (T5ForConditionalGeneration) is not a MarianMTModel"),
        "bart": (bart, "model_type 'bart' (BartForConditionalGeneration) is not a MarianMTModel"),
        "rnn": (rnn, "an RNN (SSRU) decoder"),
        "missing file": (missing, "target.spm: no such file"),
        "tmt's own export": (tmt_export, "this is tmt's export of its own model: use that model"),
        "no weights": (no_weights, "no model.safetensors nor pytorch_model.bin"),
        "shapes": (shapes, "fc1.weight has shape (192, 48), its config says (128, 48)"),
        "pickle with code": (pickle_code, "refused: holds more than tensors"),
        "pickle of text": (pickle_text, "refused: not a mapping of names to tensors"),
        "special ids": (ids, "eos_token_id=100000, outside the decoder's vocabulary of"),
        "d_model past the weights": (wide, "weights do not fit its config's model"),
        "layers past the weights": (deep, "weights do not fit its config's model"),
        "positions past the range": (long, "model.max_positions = 100000000: expected in [2,"),
    }


@pytest.mark.parametrize("case", sorted(_refusals()))
def test_what_tmt_cannot_hold_is_refused_in_one_line(
    marian_dirs: dict[str, Path], tmp_path: Path, case: str, capfd: pytest.CaptureFixture
) -> None:
    change, message = _refusals()[case]
    source = _copy(marian_dirs["separate"], tmp_path)
    change(source)
    out = tmp_path / "out"
    result = runner.invoke(app, ["import", "-m", str(source), "-o", str(out)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tmt: error:") and message in lines[0], lines
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))
    assert "pwned" not in capfd.readouterr().out


# --- every command takes the imported model ----------------------------------------------------


@pytest.mark.parametrize("kind", ["multi", "separate"])
def test_ctranslate2_engine_and_export_equal_tmt(
    imported: dict[str, Path], kind: str, tmp_path: Path
) -> None:
    from transformer_mt.exchange import export, recipes

    expected = tmt_outputs(imported[kind], LINES, 1)
    model = shutil.copytree(imported[kind], tmp_path / "model")  # the engine's cache goes there
    engine = translate.load_translator(model, ["decode.beam_size=1", "decode.engine=ctranslate2"])
    assert [h[0].tokens for h in decoding.translate_lines(engine, LINES)] == expected
    out = tmp_path / "ct2"
    report = export.export(model, "ctranslate2", out, check_lines=40)
    assert report["check_lines"] == 40 and "Multi30k val.en" in report["checked_on"]
    exported = translate.load_translator(out, ["decode.beam_size=1", "decode.engine=ctranslate2"])
    texts = translate.translate_text(exported, LINES[:12])
    assert texts == translate.translate_text(translate.load_translator(model, ["decode.beam_size=1"]),
                                             LINES[:12])  # fmt: skip
    # The README's code alone (ctranslate2 + sentencepiece, no tmt) writes the same text.
    script = tmp_path / "translate.py"
    script.write_text(recipes.python_block((out / "README.md").read_text()))
    alone = subprocess.run([sys.executable, str(script), str(out), "1"], input="\n".join(LINES[:12]) + "\n",
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout.splitlines() == texts


@pytest.mark.parametrize("kind", ["multi", "separate"])
def test_a_huggingface_export_of_an_import_generates_as_the_original(
    marian_dirs: dict[str, Path], imported: dict[str, Path], kind: str, tmp_path: Path
) -> None:
    from transformer_mt.exchange import export

    out = tmp_path / "hf"
    export.export(imported[kind], "huggingface", out, check_lines=24)
    assert generate(out, LINES[:24], 4) == generate(marian_dirs[kind], LINES[:24], 4)
    theirs = transformers.MarianMTModel.from_pretrained(str(marian_dirs[kind])).state_dict()
    again = transformers.MarianMTModel.from_pretrained(str(out)).state_dict()
    assert theirs.keys() == again.keys()
    assert all(torch.equal(theirs[k], again[k]) for k in theirs)  # bit for bit
    original = json.loads((marian_dirs[kind] / "generation_config.json").read_text())
    written = json.loads((out / "generation_config.json").read_text())
    assert {k: written[k] for k in original if k != "transformers_version"} == {
        k: v for k, v in original.items() if k != "transformers_version"
    }


def test_the_file_job_evaluate_and_an_ensemble_take_the_import(
    imported: dict[str, Path], tmp_path: Path
) -> None:
    model = str(imported["multi"])
    source = tmp_path / "source.en"
    source.write_text("\n".join(ENGLISH[:20]) + "\n")
    out = tmp_path / "out.fr"
    job = runner.invoke(app, ["translate", "-m", model, "-i", str(source), "-o", str(out),
                              "--target-lang", "fra"])  # fmt: skip
    assert job.exit_code == 0, job.output
    translator = translate.load_translator(imported["multi"], ["decode.target_lang=fra"])
    assert out.read_text().splitlines() == translate.translate_text(translator, ENGLISH[:20])
    reference = tmp_path / "ref.fr"
    reference.write_text("\n".join(multi30k("fr", "val", 20)) + "\n")
    scored = runner.invoke(app, ["evaluate", "-m", model, "-i", str(source), "--ref", str(reference),
                                 "--target-lang", "fra", "--json"])  # fmt: skip
    by_file = runner.invoke(app, ["evaluate", "--hyp", str(out), "--ref", str(reference), "--json"])
    assert scored.exit_code == 0 and by_file.exit_code == 0, scored.output
    assert json.loads(scored.stdout)["bleu"] == json.loads(by_file.stdout)["bleu"]
    pair = translate.load_ensemble([model, model], ["decode.target_lang=fra"])
    assert translate.translate_text(pair, ENGLISH[:8]) == translate.translate_text(
        translator, ENGLISH[:8]
    )


# slow: make test keeps its promise with
# test_pretrained.py::test_outputs_equal_generate_batched_and_one_by_one (multi-target) and
# test_serve.py::test_the_endpoints_answer_and_translate_as_tmt_translate_does
@pytest.mark.slow
def test_serve_translates_into_each_target_language(imported: dict[str, Path]) -> None:
    from test_serve import Server

    server = Server(imported["multi"])
    try:
        languages = server.client.get("/languages").json()
        assert languages[0] == {"code": "en", "name": "English", "targets": ["deu", "fra"]}
        for target in ("deu", "fra"):
            answer = server.client.post("/translate", json={"q": ENGLISH[:3], "source": "en",
                                                            "target": target}).json()  # fmt: skip
            translator = translate.load_translator(imported["multi"],
                                                   [f"decode.target_lang={target}"])  # fmt: skip
            assert answer["translatedText"] == translate.translate_text(translator, ENGLISH[:3])
        native = server.client.post(
            "/v1/translate", json={"text": ENGLISH[0], "target_lang": "fra"}
        )
        assert native.json()["translations"][0] == answer["translatedText"][0]
        refused = server.client.post("/v1/translate", json={"text": "Hi.", "target_lang": "ita"})
        assert refused.status_code == 422 and "no >>ita<< token" in refused.json()["error"]
        wrong = server.client.post("/translate", json={"q": "Hi.", "source": "en", "target": "it"})
        assert wrong.status_code == 400
    finally:
        assert server.stop() == 0


# --- fine-tuning -------------------------------------------------------------------------------


# slow: make test keeps its promise with test_hints.py::test_fine_tuning_an_import_with_hints and
# test_reliability.py::test_kill_and_resume_is_bit_exact
@pytest.mark.slow
def test_fine_tuning_an_import_uses_its_tokenizer_and_resumes_bit_exactly(
    imported: dict[str, Path], marian_dirs: dict[str, Path], tmp_path: Path
) -> None:
    from conftest import write_parallel
    from test_reliability import same_run
    from test_train import run_tmt

    pairs = list(zip(multi30k("en", n=300), multi30k("fr", n=300), strict=True))
    corpus = write_parallel(tmp_path / "data" / "train", pairs, src="en", tgt="fr")
    valid = write_parallel(tmp_path / "data" / "valid", pairs[:20], src="en", tgt="fr")
    model = imported["multi"]

    def args(out: Path) -> list[str]:
        settings = {
            "data.source": "files", "data.train": corpus, "data.valid": valid,
            "data.src_lang": "en", "data.tgt_lang": "fr", "decode.target_lang": "fra",
            "data.max_tokens": 512, "train.max_steps": 8, "train.save_every": 4,
            "train.valid_every": 4, "train.bleu_every": 0, "train.best_metric": "val_loss",
            "train.patience": 0, "train.average_last": 0, "train.out_dir": out,
        }  # fmt: skip
        sets = [a for key, value in settings.items() for a in ("--set", f"{key}={value}")]
        return ["train", "-c", str(model / "config.yaml"), "--init-from", str(model), *sets]

    straight = runner.invoke(app, args(tmp_path / "straight"))
    assert straight.exit_code == 0, straight.output
    killed = run_tmt(args(tmp_path / "resumed"), fault="step@6:kill")
    assert killed.returncode == -9
    resumed = run_tmt(args(tmp_path / "resumed"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    same_run(tmp_path / "straight", tmp_path / "resumed")
    # The imported tokenizer, never a new one: the run keeps it, and the target side was encoded
    # with target.spm and the vocabulary, the source with >>fra<< first (decode.target_lang).
    parent = checkpoint.read(model).tokenizer
    final = checkpoint.read(tmp_path / "straight" / "checkpoints" / "step_00000008")
    assert final.tokenizer.model_bytes == parent.model_bytes
    assert (tmp_path / "straight" / "tokenizer.model").read_bytes() == parent.model_bytes
    from transformer_mt.data.batches import prepare_data

    data = prepare_data(final.config, final.tokenizer)
    source_ids, target_ids = data.valid.ids(list(range(3)))
    theirs = hf_tokenizer(marian_dirs["multi"])
    by_text = {tuple(theirs(text_target=t)["input_ids"][:-1]): t for _, t in pairs[:20]}
    assert all(tuple(ids) in by_text for ids in target_ids)
    assert all(ids[0] == parent.piece_to_id(">>fra<<", side="source") for ids in source_ids)
