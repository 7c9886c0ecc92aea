"""kernels.py: oneDNN's packed linear layers for CPU decoding, float32 and bf16 (the same model,
outputs and fingerprint; torch's kernels when asked or where oneDNN is missing), int8 and fp16
left unpacked; bf16 on a CPU without bf16 arithmetic warned of, decoding and training."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import reverse_pairs
from test_bulk import big_input, translate_args  # noqa: F401 (a fixture)
from test_model import PAD, TINY, V, tokens
from typer.testing import CliRunner

from transformer_mt.cli import app
from transformer_mt.common import faults
from transformer_mt.config import Config
from transformer_mt.network import kernels
from transformer_mt.network.model import Transformer, make_src_mask
from transformer_mt.translation import translate

pytestmark = pytest.mark.skipif(not kernels.available(), reason="this PyTorch has no oneDNN")
SOURCES = [s for s, _ in reverse_pairs(24, seed=11)]


def packed_modules(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, kernels.PackedLinear)]


@pytest.mark.parametrize("pre_norm", [False, True])
def test_a_packed_model_is_the_same_model(pre_norm: bool) -> None:
    torch.manual_seed(0)
    plain = Transformer(dataclasses.replace(TINY, pre_norm=pre_norm), V, PAD).eval()
    packed = Transformer(dataclasses.replace(TINY, pre_norm=pre_norm), V, PAD).eval()
    packed.load_state_dict(plain.state_dict())
    assert kernels.pack_linears(packed)
    linears = [n for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear)]
    assert packed_modules(packed) == linears  # every one, the tied output projection too
    assert packed.output_projection.weight is packed.embedding.weight
    before, after = plain.state_dict(), packed.state_dict()
    assert list(before) == list(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    src, tgt = tokens(3, 7), tokens(3, 5, seed=2)
    mask = make_src_mask(src, PAD)
    with torch.inference_mode():
        expected = plain.decode(tgt, plain.encode(src, mask), mask)
        found = packed.decode(tgt, packed.encode(src, mask), mask)
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)


def test_with_autograd_a_packed_layer_computes_as_a_plain_one() -> None:
    # Packed weights have no gradient: with autograd on, the layer is nn.Linear (fine-tuning a
    # model that was loaded for decoding still learns).
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 5)
    plain = torch.nn.Linear(8, 5)
    plain.load_state_dict(layer.state_dict())
    assert kernels.pack_linears(layer) and isinstance(layer, kernels.PackedLinear)
    x = torch.randn(4, 8)
    layer(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert layer.weight.grad is not None and plain.weight.grad is not None
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad)


def test_without_onednn_the_model_is_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    model = Transformer(TINY, V, PAD)
    assert not kernels.pack_linears(model) and packed_modules(model) == []


def test_the_translator_packs_on_the_cpu_unless_asked_not_to(trained_run: Path) -> None:
    default = translate.load_translator(trained_run, ["decode.device=cpu"])
    plain = translate.load_translator(trained_run, ["decode.cpu_linear=torch"])
    assert packed_modules(default.model) and not packed_modules(plain.model)
    # The weights' identity (job identity, the CTranslate2 cache's name) does not change.
    assert translate.fingerprint(default) == translate.fingerprint(plain)
    for settings in (["decode.beam_size=1"], ["decode.beam_size=3", "decode.nbest=3"]):
        found = translate.translate_lines(default_with(default, settings), SOURCES)
        expected = translate.translate_lines(default_with(plain, settings), SOURCES)
        assert [[h.tokens for h in hyps] for hyps in found] == [
            [h.tokens for h in hyps] for hyps in expected
        ]
        for hyps_a, hyps_b in zip(found, expected, strict=True):
            for a, b in zip(hyps_a, hyps_b, strict=True):
                assert a.score == pytest.approx(b.score, rel=1e-5, abs=1e-5)


def default_with(translator: translate.Translator, settings: list[str]) -> translate.Translator:
    from transformer_mt.config import apply_overrides

    return dataclasses.replace(translator, config=apply_overrides(translator.config, settings))


def test_int8_is_not_packed(trained_run: Path) -> None:
    pytest.importorskip("torchao")
    int8 = translate.load_translator(trained_run, ["decode.precision=int8"])
    assert packed_modules(int8.model) == []


def test_a_job_resumes_with_the_other_kernels(
    trained_run: Path,
    big_input: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Which kernels multiply is not part of a job's identity (like the device and batch size).
    out = tmp_path / "out.txt"
    monkeypatch.setenv("TMT_FAULT", "chunk@1:raise")
    args = [*translate_args(trained_run, big_input, out), "--set", "decode.cpu_linear=torch"]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, faults.FaultInjected)
    monkeypatch.delenv("TMT_FAULT")
    result = CliRunner().invoke(app, translate_args(trained_run, big_input, out))
    assert result.exit_code == 0, result.output
    assert "translated before" in result.stderr and "(0 translated before)" not in result.stderr


def test_a_packed_bf16_model_is_the_same_bf16_model() -> None:
    if not kernels.available(torch.bfloat16):
        pytest.skip("oneDNN packs no bf16 on this CPU (it needs AVX-512 or AVX-NE-CONVERT)")
    torch.manual_seed(0)
    plain = Transformer(TINY, V, PAD).eval().to(torch.bfloat16)
    packed = Transformer(TINY, V, PAD).eval().to(torch.bfloat16)
    packed.load_state_dict(plain.state_dict())
    assert kernels.pack_linears(packed)
    linears = [n for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear)]
    assert packed_modules(packed) == linears
    assert all(m.packed.dtype == torch.bfloat16 for m in packed.modules()
               if isinstance(m, kernels.PackedLinear))  # fmt: skip
    src, tgt = tokens(3, 7), tokens(3, 5, seed=2)
    mask = make_src_mask(src, PAD)
    with torch.inference_mode():
        expected = plain.decode(tgt, plain.encode(src, mask), mask).float()
        found = packed.decode(tgt, packed.encode(src, mask), mask).float()
    torch.testing.assert_close(found, expected, rtol=2e-2, atol=2e-2)


def test_bf16_decoding_on_the_cpu_translates_as_float32_does(trained_run: Path) -> None:
    fp32 = translate.load_translator(trained_run, ["decode.device=cpu"])
    bf16 = translate.load_translator(trained_run, ["decode.device=cpu", "decode.precision=bf16"])
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert bool(packed_modules(bf16.model)) == kernels.available(torch.bfloat16)
    for settings in (["decode.beam_size=1"], ["decode.beam_size=3", "decode.nbest=3"]):
        found = translate.translate_lines(default_with(bf16, settings), SOURCES)
        expected = translate.translate_lines(default_with(fp32, settings), SOURCES)
        same = 0
        for hyps_a, hyps_b in zip(found, expected, strict=True):
            assert len(hyps_a) == len(hyps_b) == int(settings[-1][-1])
            best_a, best_b = hyps_a[0], hyps_b[0]
            if best_a.tokens == best_b.tokens:  # the same output, scored within bf16's rounding
                same += 1
                assert best_a.score == pytest.approx(best_b.score, rel=1e-2, abs=0.05)
        # The tiny model is barely trained (close calls everywhere): 22 and 18 of its 24 best
        # outputs were fp32's on the AVX512_BF16 machine of docs/benchmarks.md.
        assert same >= len(SOURCES) // 2


@pytest.mark.parametrize(("has_bf16", "precision", "warned"), [
    (False, "bf16", True), (True, "bf16", False), (None, "bf16", False), (False, "fp32", False),
])  # fmt: skip
def test_bf16_decoding_on_a_cpu_without_bf16_arithmetic_is_warned_of(
    trained_run: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    has_bf16: bool | None,
    precision: str,
    warned: bool,
) -> None:
    monkeypatch.setattr(kernels, "cpu_has_bf16", lambda: has_bf16)
    with caplog.at_level("WARNING", logger="transformer_mt.network.kernels"):
        translate.load_translator(
            trained_run, ["decode.device=cpu", f"decode.precision={precision}"]
        )
    said = [r.getMessage() for r in caplog.records if "bf16 arithmetic" in r.getMessage()]
    assert said == (["decode.precision=bf16: this CPU has no bf16 arithmetic (AVX512_BF16 or AMX);"
                     " it is emulated, slower than fp32 here"] if warned else [])  # fmt: skip


def test_the_cpus_bf16_is_known_on_x86_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert kernels.cpu_has_bf16() is None
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert kernels.cpu_has_bf16() is False
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)  # AMX: bf16 tiles
    assert kernels.cpu_has_bf16() is True


def test_float16_is_not_packed() -> None:
    layer = torch.nn.Linear(8, 5).to(torch.float16)
    assert not kernels.available(torch.float16)
    assert not kernels.pack_linears(layer) and not isinstance(layer, kernels.PackedLinear)


@pytest.mark.parametrize("precision", ["bf16", "bf16_weights"])
def test_bf16_training_on_a_cpu_without_bf16_arithmetic_is_warned_of(
    tiny_cfg: Config,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    precision: str,
) -> None:
    from transformer_mt.training import dry_run

    train = dataclasses.replace(tiny_cfg.train, out_dir=str(tmp_path / "run"), precision=precision)
    cfg = dataclasses.replace(tiny_cfg, train=train)
    for has_bf16, warned in ((False, True), (True, False), (None, False)):
        caplog.clear()
        monkeypatch.setattr(kernels, "cpu_has_bf16", lambda has=has_bf16: has)
        with caplog.at_level("WARNING", logger="transformer_mt.network.kernels"):
            dry_run.check_before_training(cfg, torch.device("cpu"))
        said = [r.getMessage() for r in caplog.records if "bf16 arithmetic" in r.getMessage()]
        assert said == ([f"train.precision={precision}: this CPU has no bf16 arithmetic"
                         " (AVX512_BF16 or AMX); it is emulated, slower than fp32 here"]
                        if warned else [])  # fmt: skip


def test_a_bf16_job_of_an_earlier_tmt_resumes_and_is_found_done(
    trained_run: Path,
    big_input: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Until 2026-11-29 a model decoding in bf16 was named by its rounded weights (now by its
    # float32 ones): a job such a tmt started or finished is still this job.
    import json

    from transformer_mt.common import files, finished

    out = tmp_path / "out.txt"
    args = [*translate_args(trained_run, big_input, out), "--precision", "bf16"]
    bf16 = translate.load_translator(trained_run, ["decode.precision=bf16"])
    earlier = translate.rounded_fingerprint(bf16)
    assert earlier != bf16.fingerprint  # what changed

    def named_earlier(path: Path, key: str | None) -> None:
        record = json.loads(path.read_text())
        (record[key] if key else record)["model_sha256"] = earlier
        path.write_text(json.dumps(record))

    job = out.with_name(out.name + files.JOB_SUFFIX)
    monkeypatch.setenv("TMT_FAULT", "chunk@1:raise")
    assert isinstance(CliRunner().invoke(app, args).exception, faults.FaultInjected)
    monkeypatch.delenv("TMT_FAULT")
    named_earlier(job / "job.json", None)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "translated before" in result.stderr and "(0 translated before)" not in result.stderr
    named_earlier(job / finished.DONE_FILE, "identity")
    written, stamp = out.read_bytes(), out.stat().st_mtime_ns
    result = CliRunner().invoke(app, args)  # found done: nothing translated, nothing written
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == written and out.stat().st_mtime_ns == stamp
    # Another model's job is still another job.
    other = translate.load_translator(trained_run, ["decode.precision=bf16"])
    other.model.embedding.weight.data[0, 0] += 1.0
    record = json.loads((job / finished.DONE_FILE).read_text())
    record["identity"]["model_sha256"] = translate.rounded_fingerprint(other)
    (job / finished.DONE_FILE).write_text(json.dumps(record))
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "another model" in result.output


def test_only_a_rounded_models_earlier_name_is_its_own(trained_run: Path) -> None:
    # translate.named_before: what file jobs and distillations accept as an earlier tmt's name
    # for a model decoding in bf16 (its rounded weights' fingerprint), and nothing else.
    fp32 = translate.load_translator(trained_run, ["decode.device=cpu"])
    bf16 = translate.load_translator(trained_run, ["decode.device=cpu", "decode.precision=bf16"])
    earlier = translate.rounded_fingerprint(bf16)
    assert translate.fingerprint(bf16) == translate.fingerprint(fp32) != earlier
    assert translate.named_before(bf16, earlier)
    assert not translate.named_before(bf16, translate.fingerprint(fp32))  # its name now
    assert not translate.named_before(bf16, None) and not translate.named_before(bf16, "0" * 64)
    assert not translate.named_before(fp32, translate.rounded_fingerprint(fp32))  # fp32: one name
