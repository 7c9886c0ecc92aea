"""Keep the promises, round 5 (issue 61): models in linked stores, an OPUS-MT checkpoint whose two
vocabularies place their specials apart, a drain cut short, and a finished file job run again;
each case with a test that failed before its fix (docs/reliability.md, P61-P68). The glossary
cases of the round are tests/test_glossary.py's and tests/test_constraints.py's."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import cli_processes
import pytest
from conftest import multi30k_sentences

from transformer_mt.common.exits import TmtError
from transformer_mt.translation import translate

SOURCES = multi30k_sentences(6)


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("tmt: error")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


# --- M1: a model or run directory made of symbolic links -------------------------------------


@pytest.fixture
def linked(trained_run: Path, tmp_path: Path) -> Path:
    """The trained run as `cp -rs` copies it: real directories, every file a symbolic link to
    the original (as a Hugging Face cache's snapshot, git-annex and DVC keep files)."""
    store = tmp_path / "linked"
    subprocess.run(["cp", "-rs", str(trained_run.resolve()), str(store)], check=True)
    assert (store / "checkpoints" / "step_00000030" / "manifest.json").is_symlink()
    return store


def test_a_run_in_a_linked_store_translates_evaluates_and_exports(
    linked: Path, trained_run: Path, tmp_path: Path
) -> None:
    """It was refused: "manifest.json: cannot read: a symbolic link; checkpoint files are plain
    files" -> "the run has no complete checkpoint". Reading through a link is harmless."""
    want = translate.translate_text(translate.load_translator(trained_run), SOURCES)
    assert translate.translate_text(translate.load_translator(linked), SOURCES) == want
    text = "".join(line + "\n" for line in SOURCES)
    translated = cli_processes.run(["translate", "-m", str(linked)], input=text, timeout=120)
    assert translated.returncode == 0, translated.stderr
    assert translated.stdout.splitlines() == want
    checkpoint = linked / "checkpoints" / "step_00000030"
    (tmp_path / "src.de").write_text(text)
    (tmp_path / "ref.en").write_text("".join(line + "\n" for line in want))
    files = ["-i", str(tmp_path / "src.de"), "--ref", str(tmp_path / "ref.en"), "--json"]
    scores = []
    for model in (checkpoint, trained_run / "checkpoints" / "step_00000030"):
        scored = cli_processes.run(["evaluate", "-m", str(model), *files], timeout=120)
        assert scored.returncode == 0, scored.stderr
        scores.append(json.loads(scored.stdout.splitlines()[-1]))
    assert scores[0]["bleu"] == scores[1]["bleu"] and scores[0]["chrf"] == scores[1]["chrf"]
    exported = cli_processes.run(["export", "-m", str(linked), "--format", "ctranslate2", "-o",
                                  str(tmp_path / "ct2")], timeout=300)  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    # The export, itself made a linked store, decodes as the original export does.
    subprocess.run(["cp", "-rs", str(tmp_path / "ct2"), str(tmp_path / "ct2_linked")], check=True)
    engine = ["decode.engine=ctranslate2"]
    alone = translate.load_translator(tmp_path / "ct2", engine)
    again = translate.load_translator(tmp_path / "ct2_linked", engine)
    assert translate.translate_text(again, SOURCES) == translate.translate_text(alone, SOURCES)


def test_a_server_serves_a_model_in_a_linked_store(linked: Path, trained_run: Path) -> None:
    from test_serve import Server

    want = translate.translate_text(translate.load_translator(trained_run), SOURCES)
    server = Server(linked)
    try:
        answer = server.client.post("/v1/translate", json={"text": SOURCES})
        assert answer.status_code == 200 and answer.json()["translations"] == want
    finally:
        assert server.stop() == 0


def test_training_refuses_to_write_into_a_linked_store(linked: Path) -> None:
    before = sorted(str(p.relative_to(linked)) for p in linked.rglob("*"))
    result = cli_processes.run(["train", "-c", "tiny", "--set", f"train.out_dir={linked}",
                                "--set", "train.max_steps=40"], timeout=120)  # fmt: skip
    assert result.returncode == 2
    line = one_line(result)
    assert "a store of symbolic links" in line and "cp -rL" in line
    assert sorted(str(p.relative_to(linked)) for p in linked.rglob("*")) == before


def test_a_link_to_a_device_is_still_refused(trained_run: Path, tmp_path: Path) -> None:
    """Reading through links follows them to plain files only: a link to /dev/zero would never
    end (F9's promise stands)."""
    store = tmp_path / "bad"
    subprocess.run(["cp", "-r", str(trained_run), str(store)], check=True)
    model = store / "checkpoints" / "step_00000030" / "model.pt"
    model.unlink()
    model.symlink_to("/dev/zero")
    with pytest.raises(TmtError, match="model.pt: not a plain file"):
        translate.load_translator(store / "checkpoints" / "step_00000030")


# --- S1: a drain cut by serve.drain_seconds ---------------------------------------------------


def test_a_request_a_drain_cuts_short_gets_503_and_one_log_line(trained_run: Path) -> None:
    """It got a 500 and the log tracebacks (uvicorn cancels what is still running when the drain
    runs out of time). Here the batcher would wait 8 s for company; the drain has 1 s."""
    import signal
    import threading
    import time

    import httpx
    from test_serve import Server

    server = Server(trained_run, "--set", "serve.max_wait_ms=8000", "--set", "serve.gap_ms=8000",
                    "--set", "serve.drain_seconds=1")  # fmt: skip
    answers: list[httpx.Response] = []
    request = threading.Thread(target=lambda: answers.append(
        server.client.post("/v1/translate", json={"text": SOURCES[:2]})))  # fmt: skip
    request.start()
    time.sleep(0.5)  # the request waits in the batcher
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    request.join(30)
    assert server.process.wait(30) == 0
    assert time.monotonic() - started < 8  # the drain's bound, not the batcher's wait
    assert answers and answers[0].status_code == 503, answers[0].text if answers else None
    assert "serve.drain_seconds" in answers[0].json()["error"]
    assert answers[0].headers.get("retry-after") == "1"
    log = "".join(server.log)
    assert "Traceback" not in log and " 500 " not in log, log
    assert sum("/v1/translate 503" in line for line in server.log) == 1, log


# --- J1: a finished job run again ----------------------------------------------------------------


def test_a_finished_file_job_run_again_says_done_or_names_what_differs(
    trained_run: Path, tmp_path: Path
) -> None:
    """As a finished `tmt train` run again: the same command says it is done and writes nothing
    (it asked for --overwrite); other settings are refused in one line naming what differs;
    --overwrite translates again; an output changed since is no longer the job's."""
    source = tmp_path / "in.de"
    source.write_text("".join(line + "\n" for line in SOURCES))
    out = tmp_path / "out.en"
    args = ["translate", "-m", str(trained_run), "-i", str(source), "-o", str(out)]
    first = cli_processes.run(args, timeout=120)
    assert first.returncode == 0, first.stderr
    written, stamp = out.read_bytes(), out.stat().st_mtime_ns
    again = cli_processes.run(args, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "done: this job (input, model and settings) finished before" in again.stderr
    assert out.read_bytes() == written and out.stat().st_mtime_ns == stamp  # nothing written
    other = cli_processes.run([*args, "--beam", "3"], timeout=120)
    assert other.returncode == 2
    line = one_line(other)
    assert "the output of a finished job with other decoding options" in line
    assert "decode.beam_size: 2 -> 3" in line and "--overwrite" in line
    redone = cli_processes.run([*args, "--beam", "3", "--overwrite"], timeout=120)
    assert redone.returncode == 0, redone.stderr
    assert "done:" not in redone.stderr and out.stat().st_mtime_ns != stamp
    # The job with beam 3 is the recorded one now; the same command says done again.
    assert "done:" in cli_processes.run([*args, "--beam", "3"], timeout=120).stderr
    # A user's edit makes the file theirs: tmt asks before replacing it.
    out.write_text("my own edits\n")
    edited = cli_processes.run([*args, "--beam", "3"], timeout=120)
    assert edited.returncode == 2 and "exists; add --overwrite" in one_line(edited)
    assert out.read_text() == "my own edits\n"


# --- M2: an OPUS-MT tc-big checkpoint whose two vocabularies place their specials apart --------


@pytest.mark.parametrize("beam", [1, 4])
def test_a_checkpoint_whose_sides_place_their_specials_apart_imports_exact(
    marian_dirs: dict[str, Path], tmp_path: Path, beam: int
) -> None:
    """It was refused ("pad_token_id=787, but its tokenizer says 827"); transformers runs it:
    the import decodes as generate does, token for token and text for text."""
    transformers = pytest.importorskip("transformers")
    import marian_models
    import torch

    from transformer_mt.exchange import pretrained
    from transformer_mt.translation import decoding

    apart = marian_models.derive_apart(marian_dirs["multi"], tmp_path / "apart")
    config = json.loads((apart / "config.json").read_text())
    target = json.loads((apart / "target_vocab.json").read_text())
    assert target["<pad>"] != config["pad_token_id"] and target["</s>"] != config["eos_token_id"]
    pretrained.import_model(apart, tmp_path / "imported")
    lines = [(">>fra<< " if i % 2 else ">>deu<< ") + line
             for i, line in enumerate(marian_models.multi30k("en", "val", 12))]  # fmt: skip
    tokenizer = transformers.MarianTokenizer.from_pretrained(str(apart))
    model = transformers.MarianMTModel.from_pretrained(str(apart)).eval()
    with torch.inference_mode():
        generated = model.generate(**tokenizer(lines, return_tensors="pt", padding=True),
                                   num_beams=beam).tolist()  # fmt: skip
    eos = config["eos_token_id"]
    expected = [row[1:][: row[1:].index(eos)] if eos in row[1:] else row[1:] for row in generated]
    assert len({tuple(row) for row in expected}) > 6  # the outputs are not one for every line
    ours = translate.load_translator(tmp_path / "imported", [f"decode.beam_size={beam}"])
    assert [h[0].tokens for h in decoding.translate_lines(ours, lines)] == expected
    assert translate.translate_text(ours, lines) == tokenizer.batch_decode(
        generated, skip_special_tokens=True
    )
