"""Decoding engines: CTranslate2 behind translate (stream and job), evaluate, the Python API and
serve, its export cache, int8 of the torch engine, and the combinations that are refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import cli_processes
import pytest
from conftest import reverse_pairs
from test_bulk import big_input, translate_args  # noqa: F401 (a fixture)
from test_train import run_tmt
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.common.exits import TmtError
from transformer_mt.exchange import export
from transformer_mt.translation import ct2, translate

pytest.importorskip("ctranslate2")
runner = CliRunner()
SOURCES = [s for s, _ in reverse_pairs(24, seed=11)]


@pytest.fixture
def run_copy(trained_run: Path, tmp_path: Path) -> Path:
    """The trained run in a directory of the test's own: the cache is written beside the model."""
    copy = tmp_path / "run"
    shutil.copytree(trained_run, copy, symlinks=True)
    return copy


def caches(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("**/ctranslate2-*"))


def tmt(*args: str, stdin: str = "") -> tuple[int, str, str]:
    result = runner.invoke(app, list(args), input=stdin)
    return result.exit_code, result.stdout, result.stderr


def test_greedy_is_tmts_own_and_the_cache_is_made_once(
    run_copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ours = translate.load_translator(run_copy, ["decode.beam_size=1"])
    theirs = translate.load_translator(
        run_copy, ["decode.beam_size=1", "decode.engine=ctranslate2"]
    )
    assert theirs.model is None and theirs.engine is not None
    assert translate.translate_text(theirs, SOURCES) == translate.translate_text(ours, SOURCES)
    (cache,) = caches(run_copy)
    assert cache.parent == ours.path  # beside the model that was read
    assert json.loads((cache / ct2.REPORT_FILE).read_text())["sha256"]["model.bin"]
    made = (cache / "model.bin").stat().st_mtime_ns
    with caplog.at_level("INFO"):
        again = translate.load_translator(run_copy, ["decode.engine=ctranslate2"])
    assert "making the CTranslate2 export" not in caplog.text
    assert (cache / "model.bin").stat().st_mtime_ns == made and caches(run_copy) == [cache]
    assert again.fingerprint == theirs.fingerprint != translate.fingerprint(ours)


def test_the_command_line_engines_agree_line_for_line(run_copy: Path) -> None:
    text = "\n".join([*SOURCES[:8], "", *SOURCES[8:12]]) + "\n"
    code, torch_out, _ = tmt("translate", "-m", str(run_copy), "--beam", "1", stdin=text)
    assert code == 0
    code, ct2_out, err = tmt(
        "translate", "-m", str(run_copy), "--beam", "1", "--engine", "ctranslate2", stdin=text
    )
    assert code == 0, err
    assert ct2_out == torch_out and ct2_out.count("\n") == 13
    # Beam search is CTranslate2's own; n-best rows keep tmt's format and line count.
    code, rows, err = tmt("translate", "-m", str(run_copy), "--engine", "ctranslate2",
                          "--beam", "4", "--nbest", "2", stdin=text)  # fmt: skip
    assert code == 0, err
    indices = [int(row.split("\t")[0]) for row in rows.splitlines()]
    assert indices == [i for i in range(13) for _ in range(2)]


def test_the_python_api_takes_the_engine(run_copy: Path) -> None:
    from transformer_mt import Translator

    theirs = Translator.load(run_copy, device="cpu", engine="ctranslate2", beam_size=1)
    ours = Translator.load(run_copy, device="cpu", beam_size=1)
    assert theirs.translate(SOURCES[:5]) == ours.translate(SOURCES[:5])
    with pytest.raises(TmtError, match="engine: set when loading"):
        theirs.translate(SOURCES[:1], engine="torch")


def test_an_export_directory_is_a_model_for_ctranslate2(run_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "exported"
    export.export(run_copy, "ctranslate2", out, check_lines=20)
    text = "\n".join(SOURCES[:6]) + "\n"
    code, expected, _ = tmt("translate", "-m", str(run_copy), "--beam", "1", stdin=text)
    # Its config says ctranslate2: no --engine needed, and nothing is written beside it.
    code, found, err = tmt("translate", "-m", str(out), "--beam", "1", stdin=text)
    assert code == 0, err
    assert found == expected
    code, _, err = tmt("translate", "-m", str(out), "--engine", "torch", stdin=text)
    assert code == 2 and "decode it with decode.engine=ctranslate2" in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = tmt(
        "export", "-m", str(out), "--format", "huggingface", "-o", str(tmp_path / "hf")
    )
    assert code == 2 and "a CTranslate2 export already" in err
    # Its config is read back as strictly as a checkpoint's: an unknown key is one line.
    report = json.loads((out / ct2.REPORT_FILE).read_text())
    (out / ct2.REPORT_FILE).write_text(json.dumps({**report, "config": {"decode": {"bem": 4}}}))
    code, _, err = tmt("translate", "-m", str(out), stdin=text)
    assert code == 2 and "unknown key decode.bem" in err and len(err.strip().splitlines()) == 1
    (out / ct2.REPORT_FILE).write_text(json.dumps(report))
    # A damaged export is refused, naming the file; a cache is made again instead.
    with open(out / "model.bin", "r+b") as handle:
        handle.seek(100)
        handle.write(b"\x00\x01\x02")
    code, _, err = tmt("translate", "-m", str(out), stdin=text)
    assert code == 2 and "model.bin: does not match its checksum" in err


def test_a_damaged_cache_is_made_again(run_copy: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = translate.load_translator(run_copy, ["decode.engine=ctranslate2", "decode.beam_size=1"])
    expected = translate.translate_text(first, SOURCES[:6])
    (cache,) = caches(run_copy)
    (cache / "model.bin").write_bytes(b"not a model")
    killed = cache.parent / f".tmp-{cache.name}-999999"  # what a kill mid-making leaves
    shutil.copytree(cache, killed)
    with caplog.at_level("WARNING"):
        again = translate.load_translator(
            run_copy, ["decode.engine=ctranslate2", "decode.beam_size=1"]
        )
    assert "does not match its checksum" in caplog.text
    assert translate.translate_text(again, SOURCES[:6]) == expected
    assert not killed.exists() and caches(run_copy) == [cache]


def test_a_conversion_that_differs_is_refused_and_leaves_nothing(
    run_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_convert = ct2.convert

    def tampered(*args):
        spec = real_convert(*args)
        projection = spec.decoder.projection.weight
        projection.array = projection.array[::-1].copy()
        return spec

    monkeypatch.setattr(ct2, "convert", tampered)
    with pytest.raises(TmtError, match="CTranslate2 conversion differs from tmt on line 1"):
        translate.load_translator(run_copy, ["decode.engine=ctranslate2"])
    assert caches(run_copy) == []
    assert not list(run_copy.glob("**/.tmp-ctranslate2-*"))


def test_the_job_keeps_the_engine_in_its_identity(
    run_copy: Path,
    big_input: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    out = tmp_path / "out.txt"
    engine = ["--engine", "ctranslate2", "--beam", "1"]
    code, _, err = tmt(*translate_args(run_copy, big_input, out, *engine))
    assert code == 0, err
    code, streamed, _ = tmt("translate", "-m", str(run_copy), "--beam", "1",
                            stdin=big_input.read_bytes().decode(errors="replace"))  # fmt: skip
    assert out.read_text() == streamed  # tmt's greedy output, line for line
    # An unfinished job of one engine is not finished by the other.
    killed = tmp_path / "killed.txt"
    assert run_tmt(translate_args(run_copy, big_input, killed, "--beam", "1"),
                   fault="chunk@3:kill").returncode == -9  # fmt: skip
    code, _, err = tmt(*translate_args(run_copy, big_input, killed, *engine))
    assert code == 2 and "decode.engine: 'torch' -> 'ctranslate2'" in err, err


# slow: make test keeps its promise with
# test_engine.py::test_a_second_process_waits_for_the_cache_the_first_is_making and
# test_bulk.py::test_two_gloo_processes_write_the_bytes_of_one
@pytest.mark.slow
def test_two_ranks_share_the_cache_and_write_the_bytes_of_one(
    run_copy: Path,
    big_input: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    engine = ["--engine", "ctranslate2"]
    assert tmt(*translate_args(run_copy, big_input, one, *engine))[0] == 0
    shutil.rmtree(caches(run_copy)[0])  # both ranks find no cache: one makes it, one waits
    done = run_tmt(translate_args(run_copy, big_input, two, *engine), ranks=2)
    assert done.returncode == 0, done.stderr[-2000:]
    assert two.read_bytes() == one.read_bytes()
    assert len(caches(run_copy)) == 1


def test_a_job_started_by_an_earlier_tmt_resumes(
    run_copy: Path,
    big_input: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    out = tmp_path / "out.txt"
    args = translate_args(run_copy, big_input, out)
    assert run_tmt(args, fault="chunk@3:kill").returncode == -9
    job_file = out.with_name(out.name + ".tmt-job") / "job.json"
    job = json.loads(job_file.read_text())
    del job["decode"]["engine"]  # the job as tmt 0.2 wrote it: it had no engine option
    job_file.write_text(json.dumps(job))
    code, _, err = tmt(*args)
    assert code == 0, err
    assert "(3 translated before)" in err


def test_evaluate_with_ctranslate2_scores_tmts_greedy_output(run_copy: Path) -> None:
    scores = []
    for engine in ("torch", "ctranslate2"):
        code, out, err = tmt("evaluate", "-m", str(run_copy), "--split", "valid", "--beam", "1",
                             "--engine", engine, "--json")  # fmt: skip
        assert code == 0, err
        scores.append(json.loads(out))
    assert scores[0]["bleu"] == scores[1]["bleu"] and scores[0]["chrf"] == scores[1]["chrf"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--engine", "ctranslate2", "--sampling", "topk:5"], "decode.sampling=topk:5: not with"),
        (["--engine", "ctranslate2", "--precision", "fp16"], "decode.precision=fp16 needs a GPU"),
        (["--precision", "fp16"], "decode.precision=fp16 needs a GPU"),
        (["--engine", "ctranslate2", "--precision", "bf16"], "CTranslate2 has no bfloat16"),
        (["--engine", "tensorrt"], "decode.engine"),
    ],
)
def test_impossible_combinations_are_one_line_and_write_nothing(
    run_copy: Path, tmp_path: Path, args: list[str], named: str
) -> None:
    out = tmp_path / "out.txt"
    source = tmp_path / "in.txt"
    source.write_text("kalo mi\n")
    code, _, err = tmt("translate", "-m", str(run_copy), "-i", str(source), "-o", str(out), *args)
    assert code == 2 and named in err, err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob("out.txt*"))


def test_int8_is_refused_off_the_cpu_for_torch() -> None:
    import torch

    from transformer_mt.config import Config, apply_overrides

    cfg = apply_overrides(Config(), ["decode.precision=int8"])
    with pytest.raises(TmtError, match="quantizes on CPU only"):
        translate.check_engine(cfg, torch.device("cuda"))
    translate.check_engine(cfg, torch.device("cpu"))


def test_without_the_packages_the_engine_and_int8_say_what_to_install(
    run_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import fails
    with pytest.raises(TmtError, match=r"needs the ctranslate2 package: pip install"):
        translate.load_translator(run_copy, ["decode.engine=ctranslate2"])
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    with pytest.raises(TmtError, match=r"needs the torchao package: pip install"):
        translate.load_translator(run_copy, ["decode.precision=int8"])


def test_int8_torch_translates_every_line_close_to_fp32(run_copy: Path) -> None:
    import torch

    fp32 = translate.load_translator(run_copy, ["decode.device=cpu"])
    int8 = translate.load_translator(run_copy, ["decode.device=cpu", "decode.precision=int8"])
    # the model; its precision is in the options
    assert int8.fingerprint == translate.fingerprint(fp32)
    assert any("Int8" in type(m.weight).__name__ for m in int8.model.modules()
               if isinstance(m, torch.nn.Linear))  # fmt: skip
    text = "\n".join([*SOURCES, ""]) + "\n"
    code, out, err = tmt("translate", "-m", str(run_copy), "--precision", "int8", stdin=text)
    assert code == 0, err
    assert out.count("\n") == len(SOURCES) + 1 and out.endswith("\n\n")  # 1:1, empty stays
    together = out.splitlines()[:-1]
    # A 30-step model's outputs are fragile (long repetitions): int8 keeps most of them.
    same = sum(a == b for a, b in zip(together, translate.translate_text(fp32, SOURCES)))
    assert same >= len(SOURCES) // 2


def test_a_second_process_waits_for_the_cache_the_first_is_making(run_copy: Path) -> None:
    command = ["translate", "-m", str(run_copy), "--engine", "ctranslate2", "--beam", "1"]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    procs = [cli_processes.popen(command, text=True, **pipes) for _ in range(2)]
    outputs = [p.communicate("\n".join(SOURCES[:5]) + "\n", timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0] and outputs[0][0].count("\n") == 5
    assert len(caches(run_copy)) == 1
    assert not list(run_copy.glob("**/.tmp-ctranslate2-*"))
