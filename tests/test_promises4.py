"""Keep the promises, round 4: what an outside probe of import, clean and distill broke, each
case with a test that failed before its fix (docs/reliability.md, P33-P60), and the class fix
behind it applied to every command: one writer per output, --overwrite replacing only what tmt
wrote, one typed reader for foreign JSON, one table of language codes, outputs under a directory
with a name of their own, files readable as the umask says."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import cli_processes
import pytest
import torch
from conftest import write_parallel
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.common import files, textio
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, apply_overrides
from transformer_mt.distillation import distill
from transformer_mt.exchange import pretrained
from transformer_mt.translation import decoding, translate

runner = CliRunner()
transformers = pytest.importorskip("transformers")


def one_line(result) -> str:
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("tmt:")]
    assert len(lines) == 1 and lines[0].startswith("tmt: error:"), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def copy(source: Path, to: Path) -> Path:
    shutil.copytree(source, to)
    return to


def generation(directory: Path, **changes: object) -> None:
    path = directory / "generation_config.json"
    settings = json.loads(path.read_text())
    settings.update(changes)
    path.write_text(json.dumps(settings))


def held(output: Path) -> files.Lock:
    """The lock another tmt writing `output` would hold (in this process: a second open of the
    lock file is refused by flock as another process would be)."""
    lock = files.Lock(output.parent / f".{output.name}.lock", remove=True)
    lock.acquire()
    return lock


# --- one writer per output; --overwrite replaces only what tmt wrote ---------------------------


def test_a_second_import_into_the_same_output_is_refused(marian_dirs, tmp_path) -> None:
    out = tmp_path / "imported"
    lock = held(out)
    try:
        result = runner.invoke(app, ["import", "-m", str(marian_dirs["multi"]), "-o", str(out)])
        assert result.exit_code == 2 and "another tmt is writing it (pid" in one_line(result)
        assert not out.exists()
    finally:
        lock.release()
    assert (
        runner.invoke(app, ["import", "-m", str(marian_dirs["multi"]), "-o", str(out)]).exit_code
        == 0
    )
    assert not list(tmp_path.glob(".*.lock"))  # released and removed


def test_overwrite_replaces_only_what_tmt_wrote(marian_dirs, imported, tmp_path) -> None:
    user = tmp_path / "mine"
    user.mkdir()
    (user / "import.json").write_text("{}")  # a file of that name proves nothing
    (user / "notes.txt").write_text("mine")
    args = ["import", "-m", str(marian_dirs["multi"]), "-o", str(user), "--overwrite"]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2 and "not an empty directory nor a tmt import" in one_line(refused)
    assert (user / "notes.txt").read_text() == "mine"
    # A real import with a file of the user's added: that file is never deleted.
    earlier = copy(imported["multi"], tmp_path / "earlier")
    (earlier / "notes.txt").write_text("mine")
    args = ["import", "-m", str(marian_dirs["multi"]), "-o", str(earlier), "--overwrite"]
    kept = runner.invoke(app, args)
    assert kept.exit_code == 2 and "holds notes.txt, which tmt did not write" in one_line(kept)
    assert (earlier / "notes.txt").read_text() == "mine"
    (earlier / "notes.txt").unlink()
    assert runner.invoke(app, args).exit_code == 0


def test_export_and_average_replace_only_their_own_files(trained_run, tmp_path) -> None:
    out = tmp_path / "avg"
    assert (
        runner.invoke(
            app, ["average", "-m", str(trained_run), "--last", "2", "-o", str(out)]
        ).exit_code
        == 0
    )
    (out / "notes.txt").write_text("mine")
    again = runner.invoke(app, ["average", "-m", str(trained_run), "--last", "2", "-o", str(out),
                                "--overwrite"])  # fmt: skip
    assert again.exit_code == 2 and "holds notes.txt" in one_line(again)
    exported = tmp_path / "ct2"
    assert runner.invoke(app, ["export", "-m", str(trained_run), "--format", "ctranslate2",
                               "-o", str(exported)]).exit_code == 0  # fmt: skip
    report = json.loads((exported / "tmt_export.json").read_text())
    assert "model.bin" in report["files"]
    (exported / "notes.txt").write_text("mine")
    again = runner.invoke(app, ["export", "-m", str(trained_run), "--format", "ctranslate2",
                                "-o", str(exported), "--overwrite"])  # fmt: skip
    assert again.exit_code == 2 and "holds notes.txt" in one_line(again)
    assert (exported / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("command", ["import", "clean", "translate", "average"])
def test_an_output_under_a_file_or_without_a_name_is_one_line(
    command: str, marian_dirs, trained_run, tmp_path
) -> None:
    (tmp_path / "file.txt").write_text("x")
    source = write_parallel(tmp_path / "c", [("ein Hund", "a dog")] * 3)
    base = {
        "import": ["import", "-m", str(marian_dirs["multi"])],
        "clean": ["clean", "-c", "tiny", "--set", "data.source=files", "--set",
                  f"data.train={source}", "--set", "clean.overlap=false"],
        "translate": ["translate", "-m", str(trained_run), "-i", f"{source}.de"],
        "average": ["average", "-m", str(trained_run), "--last", "2"],
    }[command]  # fmt: skip
    under = runner.invoke(app, [*base, "-o", str(tmp_path / "file.txt" / "out")])
    assert under.exit_code == 2
    assert f"the output's parent {tmp_path / 'file.txt'} is not a directory" in one_line(under)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        dot = runner.invoke(app, [*base, "-o", "."])
    finally:
        os.chdir(cwd)
    nameless = "a prefix with no name" if command == "clean" else "no file or directory of its own"
    assert dot.exit_code == 2 and nameless in one_line(dot)


def test_files_tmt_writes_honour_the_umask(marian_dirs, tmp_path) -> None:
    previous = os.umask(0o022)
    try:
        out = pretrained.import_model(marian_dirs["multi"], tmp_path / "imported")["output"]
    finally:
        os.umask(previous)
    for path in Path(out).iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


# --- import: decoding as generate, what generate does that tmt does not, foreign JSON ----------


def generate(path: Path, lines: list[str], beam: int) -> list[list[int]]:
    tokenizer = transformers.MarianTokenizer.from_pretrained(str(path))
    model = transformers.MarianMTModel.from_pretrained(str(path)).eval()
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    with torch.inference_mode():
        rows = model.generate(**batch, num_beams=beam).tolist()
    eos = model.generation_config.eos_token_id  # the target's </s> (the tokenizer's: the source's)
    return [(row[1:][: row[1:].index(eos)] if eos in row[1:] else row[1:]) for row in rows]


def tmt(model: Path, lines: list[str], *overrides: str) -> list[list[int]]:
    translator = translate.load_translator(model, list(overrides))
    return [h[0].tokens for h in decoding.translate_lines(translator, lines)]


LINES = [(">>fra<< " if i % 2 else ">>deu<< ") + line
         for i, line in enumerate(__import__("marian_models").multi30k("en", "val", 20))]  # fmt: skip


def test_beam_search_at_max_length_scores_the_forced_end_as_generate(marian_dirs, tmp_path) -> None:
    short = copy(marian_dirs["multi"], tmp_path / "short")
    generation(short, max_length=7)  # most lines reach it: the forced </s> decides the ranking
    out = pretrained.import_model(short, tmp_path / "imported")["output"]
    expected = generate(short, LINES, 4)
    assert sum(len(e) == 5 for e in expected) >= 10, "lines must reach the maximum length"
    assert tmt(Path(out), LINES) == expected
    # Scored by its log-probability (tmt's own rule), some line ranks differently: not vacuous.
    assert tmt(Path(out), LINES, "decode.forced_eos=log_prob") != expected


def test_another_eos_token_id_is_named_in_the_report(marian_dirs, tmp_path, caplog) -> None:
    other = copy(marian_dirs["multi"], tmp_path / "other")
    eos = json.loads((other / "config.json").read_text())["eos_token_id"]
    generation(other, eos_token_id=[eos, 5])
    report = pretrained.import_model(other, tmp_path / "imported")
    assert report["not_reproduced"]["eos_token_id"] == [eos, 5]
    assert "tmt does not reproduce eos_token_id" in caplog.text
    written = json.loads((tmp_path / "imported" / "import.json").read_text())
    assert written["not_reproduced"]["eos_token_id"] == [eos, 5]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_length", "abc", 'max_length="abc": expected an integer >= 1'),
        ("length_penalty", "long", 'length_penalty="long": expected a number'),
        ("early_stopping", [1], 'early_stopping=[1]: expected one of true, false, "never"'),
        ("max_new_tokens", "ten", 'max_new_tokens="ten": expected an integer >= 1'),
        ("max_new_tokens", -5, "max_new_tokens=-5: expected an integer >= 1"),
        ("num_beams", 2.5, "num_beams=2.5: expected an integer >= 1"),
        ("forced_eos_token_id", "x", 'forced_eos_token_id="x": expected a token id'),
    ],
)
def test_wrong_typed_generation_settings_are_one_line(
    marian_dirs, tmp_path, key, value, message
) -> None:
    bad = copy(marian_dirs["multi"], tmp_path / "bad")
    generation(bad, **{key: value})
    result = runner.invoke(app, ["import", "-m", str(bad), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    line = one_line(result)
    assert "generation_config.json" in line and message in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("name", "key", "value", "message"),
    [
        ("config.json", "d_model", "wide", 'd_model="wide": expected an integer >= 1'),
        ("config.json", "share_encoder_decoder_embeddings", "no", "expected true or false"),
        ("config.json", "dropout", [0.1], "dropout=[0.1]: expected a number"),
        ("tokenizer_config.json", "eos_token", ["</s>"], "eos_token: expected a token"),
        ("tokenizer_config.json", "separate_vocabs", "yes", 'separate_vocabs="yes"'),
    ],
)
def test_wrong_typed_config_values_are_one_line(
    marian_dirs, tmp_path, name, key, value, message
) -> None:
    bad = copy(marian_dirs["multi"], tmp_path / "bad")
    settings = json.loads((bad / name).read_text())
    settings[key] = value
    (bad / name).write_text(json.dumps(settings))
    result = runner.invoke(app, ["import", "-m", str(bad), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert name in one_line(result) and message in one_line(result), one_line(result)


def test_a_missing_language_is_named_as_the_file_names_it(marian_dirs, tmp_path) -> None:
    bare = copy(marian_dirs["multi"], tmp_path / "bare")
    settings = json.loads((bare / "tokenizer_config.json").read_text())
    settings.pop("source_lang", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(settings))
    result = runner.invoke(app, ["import", "-m", str(bare), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "no source_lang (the model's language); give it with --src-lang" in one_line(result)


def test_a_legacy_pytorch_model_bin_is_read(marian_dirs, tmp_path) -> None:
    legacy = copy(marian_dirs["separate"], tmp_path / "legacy")
    weights = torch.load(legacy / "pytorch_model.bin", weights_only=True)
    torch.save(weights, legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    out = pretrained.import_model(legacy, tmp_path / "imported")["output"]
    assert tmt(Path(out), LINES[:4]) == tmt(
        Path(pretrained.import_model(marian_dirs["separate"], tmp_path / "zip")["output"]),
        LINES[:4],
    )


def test_the_hugging_face_cache_layout_is_read_and_unsafe_links_are_not(
    marian_dirs, tmp_path
) -> None:
    # hf download without --local-dir: snapshots/<rev>/NAME -> ../../blobs/<hash>
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in marian_dirs["multi"].iterdir():
        blob = blobs / f"{path.name}.blob"
        shutil.copy(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    out = pretrained.import_model(snapshot, tmp_path / "imported")["output"]
    assert tmt(Path(out), LINES[:4]) == generate(marian_dirs["multi"], LINES[:4], 4)
    (snapshot / "vocab.json").unlink()
    (snapshot / "vocab.json").symlink_to("/dev/zero")
    result = runner.invoke(app, ["import", "-m", str(snapshot), "-o", str(tmp_path / "o2")])
    assert result.exit_code == 2 and "vocab.json" in one_line(result)


def test_a_hugging_face_model_id_is_imported_from_the_cache(
    marian_dirs, tmp_path, monkeypatch
) -> None:
    """`tmt import -m OWNER/NAME`, as from_pretrained takes it: the cache's snapshot (the tests
    run with HF_HUB_OFFLINE=1; a machine online fetches what the import reads from the Hub)."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    repo, revision = cache / "models--tmt-tests--opus-mt-xx", "0123456789abcdef" * 2 + "01234567"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for path in marian_dirs["multi"].iterdir():
        shutil.copy(path, repo / "blobs" / path.name)
        (snapshot / path.name).symlink_to(os.path.relpath(repo / "blobs" / path.name, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    out = tmp_path / "imported"
    result = runner.invoke(app, ["import", "-m", "tmt-tests/opus-mt-xx", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "import.json").read_text())["source"] == str(snapshot.resolve())
    assert tmt(out, LINES[:4]) == generate(marian_dirs["multi"], LINES[:4], 4)
    cases = {
        "tmt-tests/absent": "-m tmt-tests/absent: no such directory, and no Hugging Face model"
        " tmt-tests/absent in the cache or on the Hub (LocalEntryNotFoundError: ",
        "no/such/dir": "-m no/such/dir: no such directory (a MarianMTModel directory, or a"
        " Hugging Face model id OWNER/NAME)",
        "a--b/c": "-m a--b/c: no such directory (a MarianMTModel",  # not an id the Hub takes
    }
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    cases["tmt-tests/absent -o mine"] = "--output " + str(tmp_path / "mine") + ": exists and is"
    for case, message in cases.items():
        given, _, to = case.partition(" -o ")
        refused = runner.invoke(app, ["import", "-m", given, "-o", str(tmp_path / (to or "o2"))])
        assert refused.exit_code == 2, refused.output
        assert one_line(refused).startswith("tmt: error: " + message)
    assert not (tmp_path / "o2").exists()


def derive_source_ids(separate: Path, out: Path) -> Path:
    """`separate` with </s> at another id in the source vocabulary only (the encoder's rows
    swapped with it): the same function, which transformers runs with the source ids."""
    copy(separate, out)
    vocab = json.loads((out / "vocab.json").read_text())
    eos, other_piece = vocab["</s>"], next(p for p, i in vocab.items() if i == 7)
    vocab["</s>"], vocab[other_piece] = 7, eos
    (out / "vocab.json").write_text(json.dumps(vocab))
    weights = torch.load(out / "pytorch_model.bin", weights_only=True)
    for name in ("model.encoder.embed_tokens.weight", "model.shared.weight"):
        if name in weights and weights[name].size(0) == len(vocab):
            rows = weights[name].clone()
            rows[[eos, 7]] = rows[[7, eos]]
            weights[name] = rows
    torch.save(weights, out / "pytorch_model.bin")
    # A tokenizer saved before transformers 5 lists no added tokens: each side's special ids are
    # its vocabulary's (transformers 5 would otherwise fix </s> at the target's id on both).
    settings = json.loads((out / "tokenizer_config.json").read_text())
    settings.pop("added_tokens_decoder", None)
    (out / "tokenizer_config.json").write_text(json.dumps(settings))
    return out


def test_separate_vocabularies_with_their_own_end_ids_decode_as_generate(
    marian_dirs, tmp_path
) -> None:
    source = derive_source_ids(marian_dirs["separate"], tmp_path / "ids")
    out = Path(pretrained.import_model(source, tmp_path / "imported")["output"])
    tok = translate.load_translator(out).tokenizer
    assert tok.source_eos_id == 7 and tok.eos_id != 7
    expected = generate(source, LINES, 4)
    assert expected == generate(marian_dirs["separate"], LINES, 4)  # the same function
    assert tmt(out, LINES) == expected
    assert tmt(out, LINES, "decode.beam_size=1") == generate(source, LINES, 1)


# --- clean ------------------------------------------------------------------------------------

GOOD = [(f"Der Hund Nummer {i} rennt über die grüne Wiese.",
         f"Dog number {i} runs across the green meadow.") for i in range(30)]  # fmt: skip


def clean_args(cfg: str | Path, train: Path, out: Path | str, *extra: str) -> list[str]:
    return ["clean", "-c", str(cfg), "--set", "data.source=files", "--set", f"data.train={train}",
            "--set", "clean.overlap=false", "-o", str(out), *extra]  # fmt: skip


def test_a_second_clean_into_the_same_prefix_is_refused(tmp_path) -> None:
    corpus = write_parallel(tmp_path / "c", GOOD)
    lock = held(tmp_path / "out")
    try:
        result = runner.invoke(app, clean_args("tiny", corpus, tmp_path / "out"))
        assert result.exit_code == 2 and "another tmt is writing it" in one_line(result)
        assert not list(tmp_path.glob("out.*"))
    finally:
        lock.release()


def test_clean_replaces_its_outputs_all_or_nothing(tmp_path) -> None:
    first = write_parallel(tmp_path / "a", GOOD[:10])
    second = write_parallel(tmp_path / "b", GOOD[10:30])
    out = tmp_path / "out"
    assert runner.invoke(app, clean_args("tiny", first, out)).exit_code == 0
    before = {p.name: p.read_bytes() for p in tmp_path.glob("out.*")}
    failed = runner.invoke(app, clean_args("tiny", second, out, "--overwrite"),
                           env={"TMT_FAULT": "swap@1:raise"})  # fmt: skip
    assert failed.exit_code != 0
    assert {p.name: p.read_bytes() for p in tmp_path.glob("out.*")} == before
    assert not list(tmp_path.glob(".old-*")) and not list(tmp_path.glob(".swap-*"))
    # A kill between two renames: the next run puts the old set back first, then replaces it.
    command = clean_args("tiny", second, out, "--overwrite")
    killed = cli_processes.run(command, env={**os.environ, "TMT_FAULT": "swap@1:kill"},
                               timeout=300)  # fmt: skip
    assert killed.returncode == -9
    assert (tmp_path / "out.de").read_bytes() != before["out.de"]  # half replaced, for now
    done = cli_processes.run(command, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "out.report.json").read_text())
    assert report["pairs_out"] == 20 and len((tmp_path / "out.de").read_text().splitlines()) == 20
    assert not list(tmp_path.glob(".old-*")) and not list(tmp_path.glob(".swap-*"))


def test_clean_never_writes_over_the_splits_it_reads(tmp_path) -> None:
    corpus = write_parallel(tmp_path / "c", GOOD)
    valid = write_parallel(tmp_path / "valid", GOOD[:3])
    args = ["clean", "-c", "tiny", "--set", "data.source=files", "--set", f"data.train={corpus}",
            "--set", f"data.valid={valid}", "--set", f"data.test={valid}", "-o", str(valid),
            "--overwrite"]  # fmt: skip
    before = (tmp_path / "valid.de").read_bytes()
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "is the input file" in one_line(result)
    assert (tmp_path / "valid.de").read_bytes() == before


def test_language_codes_of_any_form_and_two_scripts(tmp_path) -> None:
    pytest.importorskip("py3langid")
    corpus = write_parallel(tmp_path / "c", GOOD, src="deu", tgt="eng")
    result = runner.invoke(app, clean_args("tiny", corpus, tmp_path / "o", "--set",
                                           "data.src_lang=deu", "--set", "data.tgt_lang=eng",
                                           "--set", "clean.langid=true", "--json"))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["pairs_out"] == 30
    other = write_parallel(tmp_path / "x", GOOD, src="xqz", tgt="eng")
    unknown = runner.invoke(app, clean_args("tiny", other, tmp_path / "o2", "--set",
                                            "data.src_lang=xqz", "--set", "data.tgt_lang=eng",
                                            "--set", "clean.langid=true"))  # fmt: skip
    assert unknown.exit_code == 2 and "'xqz' is not a language code" in one_line(unknown)
    # Serbian in Latin script is Serbian: the script rule keeps it.
    serbian = [(f"Pas broj {i} trči preko zelene livade.", f"Dog number {i} runs across the"
                " green meadow.") for i in range(20)]  # fmt: skip
    sr = write_parallel(tmp_path / "sr", serbian, src="sr", tgt="en")
    kept = runner.invoke(app, clean_args("tiny", sr, tmp_path / "o3", "--set", "data.src_lang=sr",
                                         "--set", "data.tgt_lang=en", "--json"))  # fmt: skip
    assert kept.exit_code == 0 and json.loads(kept.stdout)["pairs_out"] == 20, kept.output


def test_skipped_invalid_utf8_is_counted_as_encoding(tmp_path) -> None:
    corpus = write_parallel(tmp_path / "c", GOOD[:5])
    with open(f"{corpus}.de", "ab") as handle:
        handle.write(b"ein \xff Hund\n")
    with open(f"{corpus}.en", "ab") as handle:
        handle.write(b"a dog\n")
    result = runner.invoke(app, clean_args("tiny", corpus, tmp_path / "o", "--set",
                                           "data.encoding_errors=skip", "--json"))  # fmt: skip
    assert result.exit_code == 0, result.output
    removed = json.loads(result.stdout)["removed"]
    assert removed["encoding"] == 1 and removed["empty"] == 0


@pytest.mark.parametrize(
    ("extra", "out", "message"),
    [
        (
            ["--set", "clean.min_words=10", "--set", "clean.max_words=5"],
            "o",
            "clean.min_words=10 > clean.max_words=5",
        ),
        ([], "dir/", "a prefix with no name"),
    ],
)
def test_impossible_settings_and_nameless_prefixes_are_refused(
    tmp_path, extra, out, message
) -> None:
    corpus = write_parallel(tmp_path / "c", GOOD)
    (tmp_path / "dir").mkdir()
    result = runner.invoke(app, clean_args("tiny", corpus, f"{tmp_path}/{out}", *extra))
    assert result.exit_code == 2 and message in one_line(result)
    assert not list((tmp_path / "dir").iterdir())


def test_a_mixture_is_cleaned_corpus_by_corpus(tmp_path) -> None:
    first = write_parallel(tmp_path / "a", GOOD[:10])
    second = write_parallel(tmp_path / "b", GOOD[10:15])
    mixture = f"[{{split: {first}, weight: 1}}, {{split: {second}, weight: 3, tag: '<BT>'}}]"
    result = runner.invoke(app, clean_args("tiny", mixture, tmp_path / "mix", "--json"))
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert len((tmp_path / "mix.0.de").read_text().splitlines()) == 10
    assert len((tmp_path / "mix.1.de").read_text().splitlines()) == 5
    assert report["train_with"]["train"] == [
        {"split": f"{tmp_path / 'mix'}.0", "weight": 1.0, "tag": ""},
        {"split": f"{tmp_path / 'mix'}.1", "weight": 3.0, "tag": "<BT>"},
    ]


# --- distill ----------------------------------------------------------------------------------

STUDENT = ["model.n_decoder_layers=1", "train.max_steps=4", "train.average_last=2",
           "distill.beam_size=2", "distill.nbest=2", "decode.chunk_lines=100",
           "data.max_len_ratio=50"]  # fmt: skip


@pytest.fixture(scope="module")
def student_cfg(tiny_cfg: Config) -> Config:
    return apply_overrides(tiny_cfg, STUDENT)


@pytest.fixture(scope="module")
def distilled(student_cfg: Config, trained_run: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("distilled") / "d"
    distill.distill(student_cfg, [trained_run], out)
    return out


def test_a_teacher_of_another_pair_is_refused(student_cfg, trained_run, tmp_path) -> None:
    reversed_pair = apply_overrides(student_cfg, ["data.src_lang=en", "data.tgt_lang=de"])
    with pytest.raises(TmtError, match="translates de→en; the student learns en→de"):
        distill.distill(reversed_pair, [trained_run], tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_every_file_it_wrote_is_verified_exports_and_teacher_outputs_too(
    distilled, student_cfg, trained_run, tmp_path
) -> None:
    out = copy(distilled, tmp_path / "copy")  # a copy verifies its own files, not the original's
    model_bin = out / "student-ctranslate2" / "model.bin"
    model_bin.write_bytes(model_bin.read_bytes()[:-100])
    report = distill.distill(student_cfg, [trained_run], out)
    assert "export" not in report["reused"] and "student" in report["reused"]
    assert model_bin.read_bytes() == (distilled / "student-ctranslate2" / "model.bin").read_bytes()
    teacher = out / "teacher0.txt"
    teacher.write_text(teacher.read_text().replace("\t", "\t ", 1))
    report = distill.distill(student_cfg, [trained_run], out)
    assert "distilled" not in report["reused"]
    assert teacher.read_bytes() == (distilled / "teacher0.txt").read_bytes()  # made again
    record = json.loads((out / "distill.json").read_text())
    assert all(not Path(name).is_absolute() for name in record["distilled"]["files"])


def test_a_moved_directory_is_the_same_distillation(
    distilled, student_cfg, trained_run, tmp_path
) -> None:
    moved = tmp_path / "elsewhere" / "d"
    moved.parent.mkdir()
    shutil.copytree(distilled, moved)
    report = distill.distill(student_cfg, [trained_run], moved)
    assert {"originals", "distilled", "student", "evaluation", "export",
            "shortlist"} <= set(report["reused"])  # fmt: skip
    # The student's shortlist is reported where it is now, and found there.
    assert report["shortlist"]["output"] == str(moved / "student" / "average" / "shortlist.npz")
    assert (moved / "student" / "average" / "shortlist.npz").is_file()
    # The same relative -o from another directory: its own files.
    cwd = os.getcwd()
    os.chdir(moved.parent)
    try:
        again = distill.distill(student_cfg, [trained_run], Path("d"))
    finally:
        os.chdir(cwd)
    assert "student" in again["reused"]


def test_a_changed_selection_is_refused_before_anything_is_written(
    distilled, student_cfg, trained_run, tmp_path
) -> None:
    out = copy(distilled, tmp_path / "d")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    other = apply_overrides(student_cfg, ["distill.select_by=bleu"])
    with pytest.raises(TmtError, match="distill.select_by=chrf \\(not bleu\\)"):
        distill.distill(other, [trained_run], out)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


@pytest.mark.parametrize(
    "record",
    [
        {"format": 1, "originals": 5},
        {"format": 1, "teacher": {"fingerprint": 3}},
        {"format": 1, "distilled": {"selection": {}, "corpora": [{"prefix": 1}], "files": {}}},
        ["not", "an", "object"],
    ],
)
def test_a_record_that_is_not_tmts_is_one_line(student_cfg, trained_run, tmp_path, record) -> None:
    out = tmp_path / "d"
    out.mkdir()
    (out / "distill.json").write_text(json.dumps(record))
    with pytest.raises(TmtError, match="distill.json: "):
        distill.distill(student_cfg, [trained_run], out)
    assert (out / "distill.json").read_text() == json.dumps(record)


def test_the_one_writer_rule_is_the_same_lock_everywhere(tmp_path) -> None:
    # textio.OutputLock is files.Lock beside the output: a release removes the lock file, and a
    # lock taken from a file that was removed under it is taken again on the new one.
    first = textio.OutputLock(tmp_path / "out.txt")
    with (
        first,
        pytest.raises(TmtError, match="another tmt is writing it"),
        textio.OutputLock(tmp_path / "out.txt"),
    ):
        pass
    assert not (tmp_path / ".out.txt.lock").exists()
    with textio.OutputLock(tmp_path / "out.txt"):
        assert (tmp_path / ".out.txt.lock").exists()


def test_a_hugging_face_export_is_checked_on_a_sample_and_says_so(multi30k_run, tmp_path) -> None:
    from transformer_mt.exchange import export

    report = export.export(multi30k_run, "huggingface", tmp_path / "hf")
    assert report["check_lines"] == export.HF_CHECK_LINES == 200
    assert "the first 200 of the 1014 lines" in report["checked_on"]
    assert "--check-lines 0 checks all" in export.format_report(report)


@pytest.mark.parametrize(
    "command",
    [
        ["translate", "-i", "{src}", "-o", "{out}", "--overwrite"],  # the file job
        ["translate", "-o", "{out}", "--overwrite"],  # a stream into a file
        ["shortlist", "-i", "{src}", "--aligner", "ibm1", "-o", "{out}", "--overwrite"],
    ],
    ids=["file-job", "stream", "shortlist"],
)
def test_a_file_output_that_is_a_directory_is_refused_before_any_work(
    trained_run: Path, tmp_path: Path, command: list[str]
) -> None:
    # A directory holding a file of the user's, named as a file output with --overwrite: one line
    # naming it, exit 2, the file kept, and nothing translated first (the file job used to
    # translate every chunk and then fail to write, leaving OUT.tmt-job behind).
    src, out = tmp_path / "in.de", tmp_path / "mine"
    src.write_text("ka lo mi\nnu pe\n", encoding="utf-8")
    out.mkdir()
    (out / "notes.txt").write_text("precious", encoding="utf-8")
    args = [a.format(src=src, out=out) for a in command]
    result = runner.invoke(app, [args[0], "-m", str(trained_run), *args[1:]], input="ka lo\n")
    assert result.exit_code == 2, result.output
    assert one_line(result) == f"tmt: error: --output {out}: is a directory; name a file to write"
    assert (out / "notes.txt").read_text(encoding="utf-8") == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.de", "mine"]  # no job, no lock
