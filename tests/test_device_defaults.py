"""Settings a config leaves to the device: data.max_tokens and data.bucketing (chosen when a run
starts, kept by its resumes, an explicit value always winning), decode.max_tokens (by free memory
on CUDA), train.fused_loss, model.attention_backend and train.compile_mode. The choice for CUDA
is a function of the device's type, tested here without one; what a GPU does with it is
tests/test_gpu.py's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import with_data
from test_train import records, with_train

from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, load_config
from transformer_mt.network import kernels
from transformer_mt.training import device_defaults
from transformer_mt.training.train import train
from transformer_mt.translation import batch_budget

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def by_device(cfg: Config) -> Config:
    """`cfg` leaving batch size and shapes to the device (configs/tiny.yaml names its size)."""
    return with_data(cfg, max_tokens=0, bucketing="auto")


def test_a_cpu_keeps_its_batches_and_cuda_gets_the_papers(tiny_cfg: Config) -> None:
    cfg = by_device(tiny_cfg)
    on_cpu = device_defaults.resolve(cfg, CPU, world_size=1)
    assert (on_cpu.data.max_tokens, on_cpu.data.bucketing) == (4096, "off")
    on_gpu = device_defaults.resolve(cfg, CUDA, world_size=1)
    assert (on_gpu.data.max_tokens, on_gpu.data.bucketing) == (25000, "on")
    # The paper's 25,000 tokens an update, shared by the ranks and the accumulated micro-batches.
    assert device_defaults.resolve(cfg, CUDA, world_size=4).data.max_tokens == 6250
    accumulated = with_train(cfg, update_freq=2)
    assert device_defaults.resolve(accumulated, CUDA, world_size=8).data.max_tokens == 1563
    # Never fewer than the longest pair needs.
    assert device_defaults.resolve(cfg, CUDA, world_size=1000).data.max_tokens == 101
    # Everything else stays as it was.
    assert dataclasses.replace(on_gpu, data=cfg.data) == cfg


def test_an_explicit_value_always_wins(tiny_cfg: Config) -> None:
    explicit = with_data(tiny_cfg, max_tokens=777, bucketing="off")
    assert device_defaults.resolve(explicit, CUDA, 1) == explicit
    saved = with_data(tiny_cfg, max_tokens=2000, bucketing="on")
    assert device_defaults.resolve(explicit, CUDA, 1, saved=saved) == explicit


def test_a_resumed_run_keeps_its_own_whatever_the_device(tiny_cfg: Config) -> None:
    cfg = by_device(tiny_cfg)
    saved_on_gpu = with_data(tiny_cfg, max_tokens=25000, bucketing="on")
    resumed = device_defaults.resolve(cfg, CPU, 1, saved=saved_on_gpu)
    assert (resumed.data.max_tokens, resumed.data.bucketing) == (25000, "on")
    # A run saved before tmt bucketed says auto: it packed exact lengths, and goes on so.
    older = with_data(tiny_cfg, max_tokens=4096, bucketing="auto")
    assert device_defaults.resolve(cfg, CUDA, 1, saved=older).data.bucketing == "off"


def test_the_run_saves_what_it_chose_and_a_resume_keeps_it(
    tiny_cfg: Config, tmp_path: Path
) -> None:
    cfg = with_train(by_device(tiny_cfg), out_dir=str(tmp_path), max_steps=2, save_every=2)
    train(cfg)
    saved = load_config(tmp_path / "config.yaml")
    assert (saved.data.max_tokens, saved.data.bucketing) == (4096, "off")
    # The same command again, extended: nothing counts as changed.
    assert train(with_train(cfg, max_steps=4))["step"] == 4
    # Bucketing asked for by name, on a run that packed exact lengths: another experiment.
    with pytest.raises(TmtError, match="data.bucketing off -> on"):
        train(with_train(with_data(cfg, bucketing="on"), max_steps=6))


def test_train_dry_run_reports_the_choice_and_the_shapes(tiny_cfg: Config) -> None:
    from transformer_mt.training import dry_run

    cfg = by_device(tiny_cfg)
    report = dry_run.dry_run(cfg)
    assert (report["max_tokens"], report["bucketing"]) == (4096, "off")
    assert 0 < report["batch_shapes"] <= report["batches"]
    text = dry_run.format_report(report, cfg)
    assert "max_tokens: 4096" in text and "bucketing: 'off'" in text
    assert f"{report['batch_shapes']} shapes (data.bucketing=off)" in text
    bucketed = dry_run.dry_run(with_data(cfg, bucketing="on"))
    assert bucketed["batch_shapes"] <= report["batch_shapes"]


def test_decoding_batches_by_device(tiny_cfg: Config) -> None:
    def translator(device: torch.device, **decode: object) -> SimpleNamespace:
        cfg = dataclasses.replace(tiny_cfg, decode=dataclasses.replace(tiny_cfg.decode, **decode))
        return SimpleNamespace(config=cfg, device=device, tokenizer=SimpleNamespace(vocab_size=500))

    assert tiny_cfg.decode.max_tokens == 0
    assert batch_budget.batch_tokens(translator(CPU)) == 4096
    assert batch_budget.batch_tokens(translator(CPU, max_tokens=60)) == 60
    assert batch_budget.batch_tokens(translator(CUDA, max_tokens=60)) == 60  # no GPU asked


def test_a_gpus_decoding_batch_is_what_half_its_free_memory_holds() -> None:
    base = load_config("base")  # d_model 512, 6 decoder layers, beam 4
    bf16 = dataclasses.replace(base, decode=dataclasses.replace(base.decode, precision="bf16"))
    per_token = 4 * (6 * 2 * 512 * 2 * 2 * (1 + 50 / 16) + 37000) + 8 * 512 * 2
    room = int(per_token * 10_000)
    assert batch_budget.gpu_batch_tokens(room, bf16, 37000) == 10_000
    # Bounded: never under the CPU's, never over 32,768 (a card's worth of long sentences).
    assert batch_budget.gpu_batch_tokens(1, bf16, 37000) == 4096
    assert batch_budget.gpu_batch_tokens(room * 100, bf16, 37000) == 32768
    # A wider beam or float32 holds fewer.
    beam8 = dataclasses.replace(bf16, decode=dataclasses.replace(bf16.decode, beam_size=8))
    assert batch_budget.gpu_batch_tokens(room, beam8, 37000) < 10_000
    assert batch_budget.gpu_batch_tokens(room, base, 37000) < 10_000


def test_the_fused_loss_and_the_attention_kernels_by_device(tiny_cfg: Config) -> None:
    # auto: on with CUDA; on a CPU from FUSED_LOSS_CPU_VOCAB pieces (the tiny preset has 500).
    large = device_defaults.FUSED_LOSS_CPU_VOCAB
    assert not device_defaults.fused_loss(tiny_cfg, CPU, 500)
    assert not device_defaults.fused_loss(tiny_cfg, CPU, large - 1)
    assert device_defaults.fused_loss(tiny_cfg, CPU, large)
    assert device_defaults.fused_loss(tiny_cfg, CUDA, 500)
    fused_on = with_train(tiny_cfg, fused_loss="on")
    assert device_defaults.fused_loss(fused_on, CPU, 500)
    fused_off = with_train(tiny_cfg, fused_loss="off")
    assert not device_defaults.fused_loss(fused_off, CUDA, large)
    assert not device_defaults.fused_loss(fused_off, CPU, large)
    assert kernels.attention_kernels("auto", CPU) is None  # PyTorch's own choice
    names = [k.name for k in kernels.attention_kernels("auto", CUDA)]
    assert names == ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]
    cudnn = [k.name for k in kernels.attention_kernels("cudnn", CUDA)]
    assert cudnn[0] == "CUDNN_ATTENTION" and sorted(cudnn) == sorted(names)


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_an_attention_kernel_named_on_a_cpu_trains_the_same_model(
    tiny_cfg: Config, tmp_path: Path, backend: str
) -> None:
    cfg = dataclasses.replace(tiny_cfg, model=dataclasses.replace(tiny_cfg.model, dropout=0.0))
    cfg = with_train(cfg, max_steps=3, log_every=1, valid_every=0, save_every=0)
    train(with_train(cfg, out_dir=str(tmp_path / "auto")))
    chosen = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, attention_backend=backend)
    )
    train(with_train(chosen, out_dir=str(tmp_path / backend)))
    auto = [r["loss"] for r in records(tmp_path / "auto") if "loss" in r]
    named = [r["loss"] for r in records(tmp_path / backend) if "loss" in r]
    assert len(auto) == 3 and named == pytest.approx(auto, rel=1e-5)
    # It says how the model runs, not what it is: a model decodes with any other value.
    from transformer_mt.translation.translate import load_translator

    model = tmp_path / backend / "checkpoints" / "step_00000003"
    other = "auto" if backend != "auto" else "math"
    translator = load_translator(model, [f"model.attention_backend={other}"])
    assert translator.config.model.attention_backend == other
    assert translator.translate(["ein Hund"]) == load_translator(model, []).translate(["ein Hund"])


def test_the_training_benchmark_updates_with_the_attention_kernels_tmt_trains_with(
    tiny_cfg: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scripts/bench_train.py's tmt update once entered its kernels' context and let it go: the
    garbage collector closed it as the set-up returned, and three GPU runs measured PyTorch's
    own kernel order (cuDNN's, on an H200) where they named tmt's."""
    from transformer_mt.training import step

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_train import tmt_step

    seen = []
    monkeypatch.setattr(
        step, "train_step", lambda *a, **k: seen.append(torch._C._get_sdp_priority_order())
    )
    flash = dataclasses.replace(
        tiny_cfg, model=dataclasses.replace(tiny_cfg.model, attention_backend="flash")
    )
    before = torch._C._get_sdp_priority_order()
    args = SimpleNamespace(device="cpu", precision="fp32", compile=None)
    run = tmt_step(torch.nn.Linear(2, 2), flash, SimpleNamespace(vocab_size=8), args)
    import gc

    gc.collect()  # what closed the context before
    run(None)
    run(None)
    order = [int(k) for k in kernels.attention_kernels("flash", CPU)]
    assert [o[: len(order)] for o in seen] == [order, order]
    assert torch._C._get_sdp_priority_order() == before  # and only during the update


def test_compiling_is_off_until_asked_and_cuda_graphs_need_cuda(
    tiny_cfg: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _Source()
    for compile in ("auto", "off"):
        assert device_defaults.compiled(model, with_train(tiny_cfg, compile=compile), CPU) is model
    plain = device_defaults.compiled(model, with_train(tiny_cfg, compile="on"), CPU)
    assert isinstance(plain, torch._dynamo.eval_frame.OptimizedModule) and plain._orig_mod is model
    # The mode each device gets (the choice is the device's type; compiling is torch's).
    asked = []
    monkeypatch.setattr(torch, "compile", lambda m, **how: asked.append(how) or m)
    graphs = with_train(tiny_cfg, compile="on", compile_mode="reduce-overhead")
    assert device_defaults.compiled(model, graphs, CPU) is model  # a CPU has no graphs to replay
    on_cuda = device_defaults.compiled(model, graphs, CUDA)
    assert asked == [{"mode": "default"}, {"mode": "reduce-overhead"}]
    assert on_cuda.optimized is model
    # cudagraphs: one trace for every shape, replayed as graphs on CUDA, without them on a CPU.
    traced = with_train(tiny_cfg, compile="on", compile_mode="cudagraphs")
    assert device_defaults.compiled(model, traced, CPU) is model
    assert device_defaults.compiled(model, traced, CUDA).optimized is model
    assert asked[2:] == [{"backend": "aot_eager", "dynamic": True},
                         {"backend": "cudagraphs", "dynamic": True}]  # fmt: skip
    # Each call of the graphed model starts a graph step (as a micro-batch's forward does).
    steps = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1))
    src = torch.ones(2, 3)
    assert on_cuda(src, torch.ones(2, 1), project=False) is src and steps == [1]


# The reference loss's trace (8 s) in the slow set, which .ci/run runs too: the default suite is
# near its 5 minutes on the 2-core machine (288 s), and keeps the fused loss CUDA trains with.
@pytest.mark.parametrize("fused_loss", [pytest.param("off", marks=pytest.mark.slow), "on"])
def test_the_traced_model_trains_as_the_eager_one(
    tiny_cfg: Config, tmp_path: Path, fused_loss: str
) -> None:
    """train.compile_mode=cudagraphs traces the model once for every shape (what CUDA replays as
    graphs); on a CPU the trace itself runs: the same losses as eager over batches of new
    shapes, and no recompilation for them; also with the fused loss CUDA trains with (the
    trace then ends at the last states, which the loss projects outside it)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # an earlier trace in this process counted too
    cfg = dataclasses.replace(tiny_cfg, model=dataclasses.replace(tiny_cfg.model, dropout=0.0))
    cfg = with_train(cfg, max_steps=4, log_every=1, valid_every=0, save_every=0,
                     fused_loss=fused_loss)  # fmt: skip
    train(with_train(cfg, out_dir=str(tmp_path / "eager")))
    frames = torch._dynamo.utils.counters["frames"]
    train(
        with_train(cfg, out_dir=str(tmp_path / "traced"), compile="on", compile_mode="cudagraphs")
    )
    eager = [r["loss"] for r in records(tmp_path / "eager") if "loss" in r]
    traced = [r["loss"] for r in records(tmp_path / "traced") if "loss" in r]
    assert len(eager) == 4 and traced == pytest.approx(eager, rel=1e-5)
    assert frames["ok"] == 1, dict(frames)  # one trace, whatever the batch shapes


@pytest.mark.parametrize("precision", ["bf16", "bf16_weights"])
def test_bf16_on_a_gpu_without_it_is_refused_or_warned_of(
    tiny_cfg: Config, trained_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, precision: str,
) -> None:  # fmt: skip
    """A card before Ampere (a T4, a V100): bf16 refused in one line naming fp16 where PyTorch
    cannot emulate it, before training writes anything or decoding loads a model; a warning
    where it emulates it; nothing on a card with bf16, on a CPU, or at fp16."""
    from transformer_mt.common import distributed
    from transformer_mt.training import dry_run
    from transformer_mt.translation import translate

    native, emulated = [False], [False]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: native[0] or
                        (including_emulation and emulated[0]))  # fmt: skip
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    cfg = with_train(tiny_cfg, out_dir=str(tmp_path / "run"), precision=precision)
    with pytest.raises(TmtError, match=f"train.precision={precision}: Tesla T4 has no bf16") as e:
        dry_run.check_before_training(cfg, CUDA)
    assert "train.precision=fp16" in str(e.value) and not (tmp_path / "run").exists()
    if precision == "bf16":  # decoding's: refused before the model is put on the card
        monkeypatch.setattr(distributed, "resolve_device", lambda *a, **k: CUDA)
        with pytest.raises(TmtError, match="decode.precision=bf16: Tesla T4 has no bf16"):
            translate.load_translator(trained_run, ["decode.precision=bf16"])
    kernels.check_bf16("train.precision", "fp16", CUDA)
    monkeypatch.setattr(kernels, "cpu_has_bf16", lambda: True)  # a CPU's: test_kernels.py
    kernels.check_bf16("train.precision", precision, CPU)
    emulated[0] = True
    with caplog.at_level("WARNING"):
        kernels.check_bf16("train.precision", precision, CUDA)
    assert [r.getMessage() for r in caplog.records] == [
        f"train.precision={precision}: Tesla T4 emulates bf16, slowly; train.precision=fp16 runs"
        " on its tensor cores"
    ]
    native[0] = True
    caplog.clear()
    kernels.check_bf16("train.precision", precision, CUDA)
    assert not caplog.records


def test_cuda_graphs_are_refused_gradients_to_accumulate(tiny_cfg: Config, tmp_path: Path) -> None:
    """On an H200 the second micro-batch's backward read graph outputs the replay had overwritten
    (PyTorch issue 169545): refused before training writes anything, on CUDA, where the graphs
    are made; a CPU compiles the default mode and accumulates as ever."""
    from transformer_mt.training.dry_run import check_before_training

    for mode in device_defaults.GRAPHED_MODES:
        graphs = with_train(tiny_cfg, out_dir=str(tmp_path / "run"), compile="on",
                            compile_mode=mode, update_freq=2)  # fmt: skip
        with pytest.raises(TmtError, match="train.update_freq 2") as refused:
            check_before_training(graphs, CUDA)
        assert f"train.compile_mode={mode}" in str(refused.value)
        check_before_training(graphs, CPU)
        check_before_training(with_train(graphs, update_freq=1), CPU)
    assert not (tmp_path / "run").exists()


def test_cuda_graphs_are_recorded_on_cuda_and_refused_what_they_cannot_record(
    tiny_cfg: Config, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """train.cuda_graphs=on records a micro-batch's step on CUDA only (a CPU trains as with off)
    and is refused on CUDA, before anything is written, with torch.compile, fp16's loss scaler
    or several ranks whose gradients DDP averages inside the backward (train.grad_sync
    overlapped; auto averages them after it with graphs). The graphs themselves are
    test_gpu.py's."""
    from transformer_mt.training.dry_run import _check_graphs, check_before_training
    from transformer_mt.training.loss import Objective

    assert tiny_cfg.train.cuda_graphs == "off"
    on = with_train(tiny_cfg, out_dir=str(tmp_path / "run"), cuda_graphs="on")
    with caplog.at_level("INFO"):
        assert device_defaults.graphs(_Source(), Objective(0.1), on, CPU) is None
    assert "a cpu has no CUDA graphs to record" in caplog.text  # said, not silently ignored
    assert device_defaults.graphs(_Source(), Objective(0.1), tiny_cfg, CUDA) is None
    refused = [({"compile": "on"}, 1, "train.compile=on"),
               ({"precision": "fp16"}, 1, "train.precision=fp16"),
               ({"grad_sync": "overlapped"}, 2, "2 ranks and train.grad_sync=overlapped")]  # fmt: skip
    for changes, ranks, named in refused:
        cfg = with_train(on, **changes)
        with pytest.raises(TmtError, match="train.cuda_graphs=on cannot record") as error:
            check_before_training(cfg, CUDA, world_size=ranks)
        assert named in str(error.value) and "train.cuda_graphs=off" in str(error.value)
        check_before_training(cfg, CPU, world_size=ranks)
    for precision in ("fp32", "bf16"):  # what it records: accepted
        _check_graphs(with_train(on, precision=precision), CUDA, world_size=1)
    for sync in ("auto", "after_backward"):  # several ranks, averaging after the replays
        _check_graphs(with_train(on, grad_sync=sync), CUDA, world_size=2)
    assert device_defaults.grad_sync(on) == "after_backward"
    assert device_defaults.grad_sync(tiny_cfg) == "overlapped"  # without graphs: DDP's
    assert not (tmp_path / "run").exists()


class _Source(torch.nn.Module):
    """A model's call signature: returns the source."""

    def forward(
        self, src: torch.Tensor, tgt_in: torch.Tensor, project: bool = True
    ) -> torch.Tensor:
        return src


def test_the_training_benchmark_says_where_a_warm_update_spends_its_time(
    tiny_cfg: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench_train.py --profile-steps: the profiled updates' operators (kernels and their
    kinds on CUDA), per update; a failure is the row's message, never the benchmark's end."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_gpu import _busy
    from bench_train import kernel_kind, profile_updates

    model = torch.nn.Linear(4, 4)
    profiled = profile_updates(lambda x: model(x).sum().backward(), [torch.ones(2, 4)] * 3, "cpu")
    assert profiled["updates"] == 3 and profiled["host_op_ms"] > 0
    assert "aten::addmm" in profiled["top_ms"]
    assert profile_updates(lambda x: None, [], "cpu") is None

    def fails(x: torch.Tensor) -> None:
        raise RuntimeError("CUPTI not initialised")

    assert profile_updates(fails, [torch.ones(1)], "cpu") == {
        "error": "RuntimeError: CUPTI not initialised"
    }
    # Kernel names as the third H200 run's profile printed them (cuDNN's attention first: its
    # name also holds a matrix product's mark).
    kinds = {
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1": "attention",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel<float>": "layer_norm",
        "void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda": "copy",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>": "reduction",
        "void at::native::embedding_backward_feature_kernel<float>": "other",
    }  # fmt: skip
    assert {name: kernel_kind(name) for name in kinds} == kinds
    row = {"warm_ms_per_update": 50.0, "warm_profile": {
        "gpu_busy_ms": 5.0, "kinds_ms": {"matmul": 3.0, "attention": 2.0}, "launches": 824.0}}  # fmt: skip
    assert _busy(row) == (
        " (a warm update 50.0 ms, its kernels 5.0 ms: 10% busy; matmul 3.0, attention 2.0 ms;"
        " 824.0 launches)"
    )
    assert _busy({"warm_profile": {"error": "E"}}) == " (warm profile failed: E)"


def test_the_decoding_profile_counts_the_search_steps_it_times(
    trained_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench_gpu.py decode_profile on the CPU (what it can check there: the script, not a
    figure): the steps it counts (the output projection's calls) are the search's steps; its
    row in the table says what it found. Its GPU figures (kernels busy against wall time) are a
    GPU's."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_gpu import _summary, _training_lines, decode_profile

    from transformer_mt.translation import decoding, translate

    args = SimpleNamespace(device="cpu", model=trained_run, lines=4, out=tmp_path, set=None)
    found = decode_profile(args)
    # The oracle: the same 4 lines decoded again, counting the steps the beam search asks of
    # the model (the warm-up's not among them).
    asked: list[int] = []
    real = decoding.beam_search

    def counting(step_fn, *rest, **options):
        return real(lambda *a: asked.append(1) or step_fn(*a), *rest, **options)

    monkeypatch.setattr(decoding, "beam_search", counting)
    translate.translate_text(translate.load_translator(trained_run), _training_lines(4)[0])
    assert found["steps"] == len(asked) > 0
    assert found["lines"] == 4 and found["steps"] > 0 and found["rows_per_step"] >= 1
    assert found["wall_s"] > 0 and found["profile"]["host_op_ms"] > 0
    assert 0 < found["model_step_share"] < 1  # the search and the encoder take the rest
    assert "gpu_busy_share" not in found
    row = _summary("decode_profile", found)
    assert row.startswith(f"4 lines in {found['wall_s']} s, {found['steps']} steps of") and (
        row.endswith("; no GPU figures")
    )


def test_the_decoding_profile_counts_the_steps_of_the_decoder_s_graphs(
    trained_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """decode_profile --set decode.cuda_graphs=on times and counts the graphed beam search's
    steps (beam_graphs: one more than beam_search's, the step that learns all are done) and the
    rows they computed (finished sentences' included), with their batches, recordings and
    replays. A CPU records none: the steps run eagerly here, chosen as a GPU would choose
    them."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_gpu import _summary, decode_profile

    from transformer_mt.network.decoder_graphs import DecoderGraphs
    from transformer_mt.translation import decoding

    class Eager(DecoderGraphs):
        def __init__(self, *args, record: bool = False, **options) -> None:
            super().__init__(*args, record=False, **options)

    monkeypatch.setattr(decoding, "DecoderGraphs", Eager)
    monkeypatch.setattr(decoding, "_records_graphs", lambda cfg, *_: cfg.decode.cuda_graphs == "on")
    args = SimpleNamespace(device="cpu", model=trained_run, lines=4, out=tmp_path,
                           set=["decode.cuda_graphs=on"])  # fmt: skip
    found = decode_profile(args)
    plain = decode_profile(SimpleNamespace(**{**vars(args), "set": None}))
    assert found["steps"] == plain["steps"] + 1 and found["rows_per_step"] >= plain["rows_per_step"]
    assert found["graphs"] == {"batches": 1, "recorded": 0, "replays": 0, "recording_s": 0.0}
    assert 0 < found["model_step_share"] < 1 and "graphs" not in plain
    row = _summary("decode_profile_graphs", found)  # the part's label in bench_gpu.sh
    assert row.endswith(
        "; no GPU figures; graphs {'batches': 1, 'recorded': 0, 'replays': 0, 'recording_s': 0.0}"
    )


def test_the_decoding_row_names_a_failed_variant_and_the_lines_unlike_tmt_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bench_gpu.py decode's line in the table: a variant that failed (a recording the card
    refused) is its error, not the end of the part; the graphs' lines against tmt's own."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_gpu import _summary

    found = {
        "lines": 10, "beam": 5, "tmt_over_generate": 4.5, "length_penalty_form": "power",
        "rows": {"tmt": {"sentences_per_s": 3000.0, "bleu": 72.9},
                 "tmt_graphs": {"error": "RuntimeError: operation not permitted"}},
        "lines_unlike_generate": {"tmt": 3}, "lines_unlike_tmt": {"tmt_bf16": 40},
    }  # fmt: skip
    row = _summary("decode", found)
    assert "tmt 3,000 sent/s BLEU 72.90; tmt_graphs: RuntimeError: operation not permitted" in row
    assert row.endswith("lines unlike generate's: tmt 3; unlike tmt's: tmt_bf16 40")


def test_the_attention_part_times_each_kernel_first_and_warm_and_names_a_refusal(
    tiny_cfg: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench_gpu.py attention: each kernel's updates over the batches, then over them again
    (warm: with train.cuda_graphs=on, replays); a kernel the card refuses is its row's error,
    and the fastest are chosen among the others."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_gpu
    import bench_train

    batches = [SimpleNamespace(n_tokens=10, src=torch.zeros(2, 3), tgt_out=torch.zeros(2, 4),
                               to=lambda device: None)] * 3  # fmt: skip
    monkeypatch.setattr(bench_train, "load_batches", lambda *a: (tiny_cfg, None, batches))
    monkeypatch.setattr(bench_train, "build_tmt", lambda cfg, tok: torch.nn.Linear(1, 1))
    updates: list[str] = []

    def step(model, cfg, tok, args):
        def run(batch) -> None:
            if cfg.model.attention_backend == "cudnn":
                raise RuntimeError("cuDNN refused\nmore")
            updates.append(cfg.model.attention_backend)

        return run

    monkeypatch.setattr(bench_train, "tmt_step", step)
    found = bench_gpu.attention(SimpleNamespace(device="cpu", steps=3, set=None))
    assert updates == [b for b in ("flash", "efficient", "math", "auto") for _ in range(6)]
    assert found["rows"]["cudnn"] == {"error": "cuDNN refused"}
    for backend in ("flash", "efficient", "math", "auto"):
        assert set(found["rows"][backend]) == {"seconds", "tokens_per_s", "warm_seconds",
                                               "warm_tokens_per_s"}  # fmt: skip
    assert found["fastest"] in ("flash", "efficient", "math")
    assert found["updates"] == 3 and found["batch_shapes"] == 1
    row = bench_gpu._summary("attention_graphs", found)
    assert row.startswith("first 3 updates (1 shapes), then the same again warm: cudnn: cuDNN")
    assert " s (warm " in row and f"fastest {found['fastest']}, warm " in row


def test_the_gpu_benchmark_s_resume_part_names_what_its_runs_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench_gpu.py resume with a setting its training runs refuse: their own one-line error in
    its result, where it read a checkpoint the runs never wrote ("no such file")."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_gpu import resume

    args = SimpleNamespace(device="cpu", out=tmp_path, label=None, set=["train.nope=1"])
    found = resume(args)
    assert found["exit_codes"] == [2]  # the straight run refused: the others not run
    assert "unknown key train.nope" in found["error"][0]


@pytest.mark.slow  # three runs of tmt train (13 s): a benchmark's verdict, not the product's
def test_the_gpu_benchmark_s_resume_part_gives_no_verdict_without_a_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs that end before the checkpoint the kill waits for (as when another run in the same
    --out had it): no kill, no resume, so no verdict on one (it said "bit_exact": true)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_gpu import resume

    args = SimpleNamespace(device="cpu", out=tmp_path, label=None, set=["train.max_steps=2"])
    found = resume(args)
    assert found["exit_codes"] == [0, 0, 0] and "bit_exact" not in found
    assert "ended with exit 0" in found["error"][0]


def test_the_gpu_benchmark_refuses_a_machine_without_cuda_in_one_line(tmp_path: Path) -> None:
    """scripts/bench_gpu.sh on a machine with no CUDA device stops before its first part, with
    one line that says why (it ran every part to its own failure, a traceback among them); with
    one, no part named (PARTS=" ") is the card's line and an empty table."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PY": sys.executable, "OUT": str(tmp_path / "bench"), "PARTS": " "}
    done = subprocess.run(["bash", "scripts/bench_gpu.sh"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    if torch.cuda.is_available():
        assert done.returncode == 0, done.stderr
        return
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.startswith("bench_gpu.sh:")]
    assert len(lines) == 1 and "no CUDA device" in lines[0] and torch.__version__ in lines[0]
    assert not (tmp_path / "bench" / "parts.jsonl").read_text()  # no part ran


def test_every_part_of_the_gpu_benchmark_is_described_and_summarised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each part bench_gpu.sh runs (`wanted NAME`) is described in its header, and its row in
    the table is a train or e2e row where it is one of those (bf16_weights' parts, new)."""
    import re

    repo = Path(__file__).resolve().parents[1]
    script = (repo / "scripts" / "bench_gpu.sh").read_text()
    parts = re.findall(r"^wanted (\w+)", script, flags=re.M)
    header = script.split("NO_ARGS=1", 1)[0]
    assert len(parts) >= 15 and "train_bf16_weights" in parts and "e2e_bf16_weights" in parts
    assert [p for p in parts if not re.search(rf"^#\s+{p}\s", header, flags=re.M)] == []
    monkeypatch.syspath_prepend(str(repo / "scripts"))
    from bench_gpu import _summary

    row = {"tokens_per_s": 1.0, "mfu": 0.1, "steps": 200, "batch_shapes": 26}
    trained = {"results": {"tmt": row}, "ratios": {}}
    assert _summary("train_bf16_weights", trained) == _summary("train_graphs", trained)
    ran = {"train_rc": 0, "wall_s": 50.0, "updates": 2000, "test2016_bleu": 41.0}
    assert _summary("e2e_bf16_weights", ran) == _summary("e2e", ran)
