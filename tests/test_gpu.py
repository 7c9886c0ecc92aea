"""CUDA-only paths (bf16/fp16 autocast, fused Adam, TF32, NCCL, the GPU's defaults, attention
kernels, the sync-free forward and backward, the compiled step): skipped on machines without a
GPU. Each has a CPU test beside it (test_device_defaults.py, test_train.py, test_loss.py)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from conftest import with_data
from test_decoder_graphs import BOS, EOS, PAD, batch, eager, fixed, limits, model_of, same
from test_loss import gradients, projected
from test_train import records, with_train

from transformer_mt.common.distributed import DistInfo
from transformer_mt.config import Config, load_config
from transformer_mt.data.batches import prepare_data
from transformer_mt.network import kernels, search
from transformer_mt.network.model import Transformer
from transformer_mt.training import device_defaults
from transformer_mt.training.loss import Objective, chunked_label_smoothed_nll, label_smoothed_nll
from transformer_mt.training.train import train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("precision", ["bf16", "fp16", "bf16_weights"])
def test_mixed_precision_trains_on_cuda(tiny_cfg: Config, tmp_path: Path, precision: str) -> None:
    cfg = with_train(
        tiny_cfg,
        out_dir=str(tmp_path),
        max_steps=6,
        log_every=1,
        precision=precision,
        device="cuda",
    )
    summary = train(cfg)
    losses = [r["loss"] for r in records(tmp_path) if "loss" in r]
    assert summary["step"] == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(("bucketing", "fused"), [("off", "off"), ("on", "on")])
def test_cuda_matches_cpu_in_fp32(tiny_cfg: Config, tmp_path: Path, bucketing, fused) -> None:
    """The same batches and loss on both devices (set by name: their defaults differ)."""
    cfg = dataclasses.replace(tiny_cfg, model=dataclasses.replace(tiny_cfg.model, dropout=0.0))
    cfg = with_data(cfg, bucketing=bucketing)
    cfg = with_train(cfg, max_steps=3, log_every=1, valid_every=0, save_every=0, fused_loss=fused)
    train(with_train(cfg, out_dir=str(tmp_path / "cpu"), device="cpu"))
    train(with_train(cfg, out_dir=str(tmp_path / "cuda"), device="cuda"))
    cpu = [r["loss"] for r in records(tmp_path / "cpu") if "loss" in r]
    gpu = [r["loss"] for r in records(tmp_path / "cuda") if "loss" in r]
    assert cpu == pytest.approx(gpu, rel=1e-3)  # TF32 matmuls: close, not equal


def test_a_gpu_run_chooses_gpu_batches_and_reports_their_shapes(
    tiny_cfg: Config, tmp_path: Path
) -> None:
    cfg = with_data(tiny_cfg, max_tokens=0, bucketing="auto")
    cfg = with_train(cfg, out_dir=str(tmp_path), max_steps=3, log_every=1, precision="bf16",
                     device="cuda", valid_every=0)  # fmt: skip
    train(cfg)
    saved = load_config(tmp_path / "config.yaml")
    assert (saved.data.max_tokens, saved.data.bucketing) == (25000, "on")
    logged = [r for r in records(tmp_path) if "loss" in r]
    assert logged and all(0 < r["batch_shapes"] <= 300 for r in logged)


def _model_and_batches(tiny_cfg: Config, n: int = 3):
    from transformer_mt.training import device_defaults
    from transformer_mt.training.feeder import Feeder

    cfg = with_data(tiny_cfg, bucketing="on")
    data = prepare_data(cfg)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"))
    feeder = Feeder(cfg, data, None, info)
    model = Transformer(cfg.model, data.tokenizer.vocab_size, data.tokenizer.pad_id).cuda()
    assert device_defaults.shape_buckets(cfg) is not None
    groups = [feeder.group(0, i) for i in range(n)]
    return cfg, info, feeder, model, groups


def test_forward_and_backward_wait_for_the_gpu_nowhere(tiny_cfg: Config) -> None:
    """After a first update, an update's batches (pinned, copied without waiting), forward and
    backward (fused loss, bf16) never make the host wait for the GPU; the update's one wait is
    its verdict before Adam (step.py)."""
    from transformer_mt.training import step
    from transformer_mt.training.optim import build_optimizer

    cfg, info, feeder, model, groups = _model_and_batches(tiny_cfg)
    optimizer, scheduler = build_optimizer(model.parameters(), cfg.model, cfg.optim, fused=True)
    opt = step.Optimization(optimizer, scheduler, torch.amp.GradScaler("cuda", enabled=False))
    objective = Objective(cfg.optim.label_smoothing, model.output_projection)
    cfg = with_train(cfg, precision="bf16")
    for i, group in enumerate(groups):
        if i == 0:
            micro = feeder.micro_batches(0, i, group)
            step.train_step(model, micro, opt, cfg, info, objective=objective)
            continue
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            micro = feeder.micro_batches(0, i, group)
            tokens = sum(b.n_tokens for b in micro)
            sums, oom = step._accumulate(
                model, micro, opt.scaler, objective, info, tokens, i, "bf16"
            )
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert not oom
        step._apply(opt, cfg, info, sums=sums, oom=oom)
    feeder.close()


@pytest.mark.parametrize("backend", ["auto", "flash", "efficient", "cudnn", "math"])
def test_every_attention_backend_computes_the_same_model(tiny_cfg: Config, backend: str) -> None:
    _, info, feeder, model, groups = _model_and_batches(tiny_cfg, n=1)
    (batch,) = feeder.micro_batches(0, 0, groups[0])
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        with kernels.attention("math", info.device):
            reference = model(batch.src, batch.tgt_in).float()
        with kernels.attention(backend, info.device):
            out = model(batch.src, batch.tgt_in).float()
    # Measured on an H200: flash, efficient and cuDNN differ from math by up to 0.04 in 3-16 of
    # 50,688 bf16 logits, which an elementwise 0.02 failed; bf16 arithmetic lands between 1e-3
    # and 1e-2 in norm (the device tool's METHOD.md), a wrong kernel far beyond.
    error = float((out - reference).norm() / reference.norm())
    assert torch.isfinite(out).all() and error < 1e-2, f"{backend}: relative error {error:.2e}"
    feeder.close()


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "cudagraphs"])
def test_the_compiled_step_is_the_eager_step_within_bf16(
    tiny_cfg: Config, tmp_path: Path, mode: str
) -> None:
    """Two micro-batches an update compiled; one with CUDA graphs (reduce-overhead, cudagraphs),
    which training refuses to accumulate (on an H200 the second micro-batch's backward read graph
    outputs the replay had overwritten: PyTorch issue 169545)."""
    cfg = dataclasses.replace(tiny_cfg, model=dataclasses.replace(tiny_cfg.model, dropout=0.0))
    update_freq = 1 if mode in device_defaults.GRAPHED_MODES else 2
    cfg = with_train(cfg, max_steps=3, log_every=1, valid_every=0, save_every=0, device="cuda",
                     precision="bf16", update_freq=update_freq)  # fmt: skip
    train(with_train(cfg, out_dir=str(tmp_path / "eager"), compile="off"))
    train(with_train(cfg, out_dir=str(tmp_path / "compiled"), compile="on", compile_mode=mode))
    eager = [r["loss"] for r in records(tmp_path / "eager") if "loss" in r]
    compiled = [r["loss"] for r in records(tmp_path / "compiled") if "loss" in r]
    assert len(eager) == 3 and compiled == pytest.approx(eager, rel=2e-2)


@pytest.mark.parametrize("bias", [False, True])
def test_the_fused_loss_on_cuda_is_the_reference_within_bf16(bias: bool) -> None:
    """Its products from bf16 factors written in float32 by cuBLAS (torch.mm's out_dtype: no
    conversion of the scores), the bias added after: the reference's loss and gradients."""
    from transformer_mt.training.loss import _writes_float32

    hidden, projection, target = projected(5, torch.float32, bias=bias, vocab=300, d=64)
    assert _writes_float32(hidden.cuda().bfloat16(), torch.float32)
    hidden = hidden.detach().cuda().requires_grad_()
    projection = projection.cuda()
    target = target.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        reference = label_smoothed_nll(projection(hidden), target, 0, 0.1)
        chunked = chunked_label_smoothed_nll(hidden, projection, target, 0, 0.1, chunk_rows=4)
    torch.testing.assert_close(chunked.loss, reference.loss, rtol=1e-2, atol=1e-2)
    want = gradients(reference.loss, hidden, projection)
    for a, b in zip(gradients(chunked.loss, hidden, projection), want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0.02 * b.abs().max().item())


def _graph_twins(tiny_cfg: Config, passes: int, world_size: int = 1, precision: str = "bf16"):
    """Two runs of the same updates, eager and with train.cuda_graphs (bf16 or bf16_weights, no
    dropout, two micro-batches an update, bounded shapes): epoch 0's batches `passes` times, so
    that every shape is recorded in the first pass and replayed in the later ones. Returns, per
    run, the loss sums of the updates, the final weights and the graphs (None: eager)."""
    from transformer_mt.training import step
    from transformer_mt.training.feeder import Feeder
    from transformer_mt.training.graphs import MicroBatchGraphs
    from transformer_mt.training.master_weights import MasterWeights
    from transformer_mt.training.optim import build_optimizer

    cfg = dataclasses.replace(tiny_cfg, model=dataclasses.replace(tiny_cfg.model, dropout=0.0))
    cfg = with_train(with_data(cfg, bucketing="on"), precision=precision, update_freq=2)
    data = prepare_data(cfg)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"))
    feeder = Feeder(cfg, data, None, info)  # one process's batches, whatever world_size says
    starts = range(0, len(feeder.epoch_batches(0)), 2)
    stepped = dataclasses.replace(info, world_size=world_size)  # the ranks train_step counts
    runs = []
    for graphed in (False, True):
        torch.manual_seed(0)
        model = Transformer(cfg.model, data.tokenizer.vocab_size, data.tokenizer.pad_id).cuda()
        master = MasterWeights(model) if precision == "bf16_weights" else None
        params = master.params if master else model.parameters()
        optimizer, scheduler = build_optimizer(params, cfg.model, cfg.optim, fused=True)
        scaler = torch.amp.GradScaler("cuda", enabled=False)
        opt = step.Optimization(optimizer, scheduler, scaler, master)
        objective = Objective(cfg.optim.label_smoothing, model.output_projection)
        graphs = MicroBatchGraphs(model, objective, precision, info.device) if graphed else None
        losses = []
        for _ in range(passes):
            for i in starts:
                micro = feeder.micro_batches(0, i, feeder.group(0, i))
                stats = step.train_step(model, micro, opt, cfg, stepped, objective=objective,
                                        graphs=graphs)  # fmt: skip
                assert stats.skipped is None
                losses.append(stats.loss_sum)
        runs.append((losses, [p.detach().float() for p in model.parameters()], graphs))
    shapes = {(b.src.shape, b.tgt_in.shape) for i in starts
              for b in feeder.micro_batches(0, i, feeder.group(0, i))}  # fmt: skip
    feeder.close()
    return runs, shapes, cfg, info, feeder


@pytest.mark.parametrize("precision", ["bf16", "bf16_weights"])
def test_cuda_graphs_replay_the_eager_updates(tiny_cfg: Config, precision: str) -> None:
    """train.cuda_graphs: a shape's first micro-batch runs eagerly and is recorded, its later
    ones replay the graph, the micro-batches of an update adding into the same gradients: the
    losses and weights of eager updates within bf16, one graph per shape; also with the model in
    bf16 and Adam's float32 masters (train.precision=bf16_weights)."""
    runs, shapes, _, _, feeder = _graph_twins(tiny_cfg, passes=3, precision=precision)
    (eager, eager_weights, _), (graphed, graphed_weights, graphs) = runs
    assert len(graphs) == len(shapes) > 1  # each replayed in the second and third passes
    assert graphs.replays == 3 * len(feeder.epoch_batches(0)) - len(shapes)
    assert f"{len(shapes)} batch shapes recorded" in graphs.describe()
    assert len(eager) == len(graphed)
    assert graphed == pytest.approx(eager, rel=1e-2)
    for a, b in zip(graphed_weights, eager_weights, strict=True):
        assert float((a - b).norm() / b.norm().clamp_min(1e-6)) < 1e-2


def test_graphed_updates_average_their_gradients_after_the_replays(tiny_cfg: Config) -> None:
    """train.grad_sync=after_backward, what several ranks with CUDA graphs run: the gradients
    averaged after an update's replays (distributed.average_gradients, in place) are the ones
    the graphs add into. A gloo group of one process stands for two ranks (each loss scaled by
    2, the sum over the one rank divided by 2; the same batches): the updates of one process,
    within bf16."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        two, _, _, _, _ = _graph_twins(tiny_cfg, passes=2, world_size=2)
    finally:
        dist.destroy_process_group()
    one, _, _, _, _ = _graph_twins(tiny_cfg, passes=2)
    (losses, weights, graphs), (want_losses, want_weights, _) = two[1], one[1]
    assert graphs.replays > 0
    assert losses == pytest.approx(want_losses, rel=1e-3)
    for a, b in zip(weights, want_weights, strict=True):
        assert float((a - b).norm() / b.norm().clamp_min(1e-6)) < 1e-3


def test_a_replayed_update_waits_for_the_gpu_nowhere(tiny_cfg: Config) -> None:
    """Once its shapes are recorded, a graphed update's forward and backward (inputs copied into
    the graph's, the replay, the sums) never make the host wait for the GPU."""
    from transformer_mt.training import step

    (_, (_, _, graphs)), _, cfg, info, feeder = _graph_twins(tiny_cfg, passes=1)
    model, objective = graphs.model, graphs.objective
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    feeder = type(feeder)(cfg, feeder.data, None, info)
    for i in range(0, len(feeder.epoch_batches(0)), 2):
        micro = feeder.micro_batches(0, i, feeder.group(0, i))
        tokens = sum(b.n_tokens for b in micro)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            sums, oom = step._accumulate(model, micro, scaler, objective, info, tokens, i, "bf16",
                                         graphs=graphs)  # fmt: skip
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert not oom and torch.isfinite(sums).all()
        graphs.model.zero_grad(set_to_none=False)
    feeder.close()


def test_a_run_with_cuda_graphs_trains_validates_and_saves(
    tiny_cfg: Config, tmp_path: Path
) -> None:
    """`tmt train` with train.cuda_graphs=on, dropout on: the loss falls, validation and
    checkpoints as ever, and the same seed gives the same losses (within bf16: attention's
    backward may sum in any order)."""
    cfg = with_data(tiny_cfg, bucketing="on")
    cfg = with_train(cfg, max_steps=12, log_every=1, valid_every=6, save_every=6,
                     precision="bf16", device="cuda", cuda_graphs="on")  # fmt: skip
    runs = []
    for name in ("a", "b"):
        summary = train(with_train(cfg, out_dir=str(tmp_path / name)))
        assert summary["step"] == 12
        runs.append([r["loss"] for r in records(tmp_path / name) if "loss" in r])
    assert all(math.isfinite(x) for x in runs[0]) and runs[0][-1] < runs[0][0]
    assert runs[0] == pytest.approx(runs[1], rel=1e-3)
    assert any("val_loss" in r for r in records(tmp_path / "a"))
    assert (tmp_path / "a" / "checkpoints").is_dir()


def test_each_replay_draws_new_dropout(tiny_cfg: Config) -> None:
    """A recorded step's dropout masks come from the CUDA generator at each replay, not frozen
    at the recording: the same batch and weights, replayed twice, give two losses."""
    from transformer_mt.training.graphs import MicroBatchGraphs

    cfg, info, feeder, model, groups = _model_and_batches(tiny_cfg, n=1)
    assert cfg.model.dropout > 0
    (batch,) = feeder.micro_batches(0, 0, groups[0])
    objective = Objective(cfg.optim.label_smoothing, model.output_projection)
    graphs = MicroBatchGraphs(model, objective, "bf16", info.device)
    losses = [float(graphs.forward_backward(batch, 1.0)[0]) for _ in range(3)]  # eager, 2 replays
    assert len(graphs) == 1 and all(math.isfinite(x) for x in losses)
    assert losses[1] != losses[2]
    feeder.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_replayed_decoder_steps_search_as_eager_ones(precision: str) -> None:
    """decode.cuda_graphs: beam search and greedy over the decoder's recorded steps give what the
    same fixed-shape steps give run eagerly, to the bit (the same kernels), through every key's
    recording (finished sentences shrink the buffers, outputs pass 16, 32 and 64 positions); in
    fp32 also the tokens of DecoderCache's steps."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model, src = model_of().to("cuda", dtype), batch(23).cuda()
    with torch.inference_mode():
        runs, states = [], []
        for build in (eager, fixed, lambda m, s: fixed(m, s, record=True)):
            step, state = build(model, src)
            runs.append(search.beam_search(step, state, limits(23), BOS, EOS, beam_size=3,
                                           nbest=3, banned=(PAD, BOS)))  # fmt: skip
            states.append(state)
        step, state = fixed(model, src, record=True)
        greedy = search.greedy(step, state, limits(23), BOS, EOS, banned=(PAD, BOS))
        step, state = fixed(model, src)
        assert greedy == search.greedy(step, state, limits(23), BOS, EOS, banned=(PAD, BOS))
    assert runs[2] == runs[1]
    if precision == "fp32":
        same(runs[0], runs[2])
    recorded = states[2]
    assert recorded.recorded >= 5 and recorded.replays > recorded.recorded
    assert recorded.recording_s > 0 and states[1].recording_s == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_beam_search_of_replayed_steps_is_the_eager_one(precision: str) -> None:
    """graphed_beam_search: each step (decoder, ranking, pools, stopping test, the cache's
    reorder) replayed from its key's graph gives the eager steps' hypotheses to the bit, through
    gathers into smaller buckets, forced steps (prefixes, EOS at maximum lengths) and positions
    past 64; the host read the count of live sentences a step late. In fp32, search.beam_search's
    hypotheses over the same steps."""
    from test_decoder_graphs import searched_both

    from transformer_mt.network import beam_graphs

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model, src = model_of().to("cuda", dtype), batch(23).cuda()
    prefixes = [[5 + row, 6][: row % 3] for row in range(23)]
    options = {"beam_size": 3, "nbest": 2, "banned": (PAD, BOS), "prefixes": prefixes}
    plain, eager_graphed, _ = searched_both(model, src, limits(23), **options)
    if precision == "fp32":  # beam_search's rows, fewer as sentences end: other kernels' sums
        same(plain, eager_graphed)
    _, graphs = fixed(model, src, record=True)
    with torch.inference_mode():
        replayed = beam_graphs.graphed_beam_search(graphs, limits(23), BOS, EOS, **options)
    assert replayed == eager_graphed
    assert graphs.recorded >= 5 and graphs.replays > 2 * graphs.recorded


def test_a_beam_search_of_replayed_steps_waits_for_the_gpu_less_than_once_a_step() -> None:
    """The eager search waits for the GPU two or three times a step (has a hypothesis ended,
    which sentences are done; a vocabulary of no whole blocks of 64); the graphed one where it
    moves something (the first step's widening, a gather into a smaller bucket), to read its
    inputs and results, and at most once a step for the count of live sentences, a step late
    (an event's wait, if torch counts it): counted by torch's sync debug mode."""
    import warnings

    from test_decoder_graphs import searched_both

    from transformer_mt.network import beam_graphs

    model, src = model_of().cuda(), batch(23).cuda()
    options = {"beam_size": 3, "banned": (PAD, BOS)}
    searched_both(model, src, limits(23), **options)  # warm-up: kernels, cuBLAS
    waits, steps = {}, {}
    for name in ("eager", "graphed"):
        step, state = fixed(model, src, record=name == "graphed")
        calls = [0]

        def counted(tokens, s, step=step, calls=calls):
            calls[0] += 1
            return step(tokens, s)

        torch.cuda.synchronize()
        with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                if name == "eager":
                    search.beam_search(counted, state, limits(23), BOS, EOS, **options)
                else:
                    beam_graphs.graphed_beam_search(state, limits(23), BOS, EOS, **options)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        waits[name] = sum("synchroniz" in str(w.message) for w in caught)
        steps[name] = calls[0] if name == "eager" else state.replays + 1
    assert steps["eager"] > 20 and waits["eager"] >= 2 * steps["eager"], (waits, steps)
    assert waits["graphed"] <= steps["graphed"] + 20, (waits, steps)


def test_translation_with_decode_cuda_graphs_is_the_same(trained_run: Path) -> None:
    from transformer_mt.translation import decoding, translate

    path = trained_run / "checkpoints" / "step_00000030"
    lines = [" ".join("abcdefghij"[: 1 + i % 9]) for i in range(40)]
    off = translate.load_translator(path, ["decode.device=cuda"])
    on = translate.load_translator(path, ["decode.device=cuda", "decode.cuda_graphs=on"])
    same(decoding.translate_lines(on, lines), decoding.translate_lines(off, lines))
