"""The training loop: golden losses, exact resume after a kill, DDP ≡ one process, budgets."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import cli_processes
import pytest
import torch
from conftest import with_data

from transformer_mt.common.distributed import DistInfo
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, load_config, to_dict
from transformer_mt.runs import checkpoint, run
from transformer_mt.training.train import train

REPO = Path(__file__).resolve().parent.parent


def with_train(cfg: Config, **changes: object) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **changes))


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def numbers(run_dir: Path) -> list[dict]:
    """metrics.jsonl without wall-clock figures: what must be identical between two runs. The
    records of why a session stopped are left out: a resumed run has one more of them."""
    return [
        {k: v for k, v in r.items() if k != "tokens_per_s"}
        for r in records(run_dir)
        if "stop" not in r
    ]


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return checkpoint.read(run_dir / "checkpoints" / f"step_{step:08d}").state_dict


def cli_args(cfg: Config, run_dir: Path) -> list[str]:
    """`tmt train` arguments reproducing `cfg` exactly (every key through --set)."""
    args = ["train", "-c", "tiny", "--json"]
    for key, value in _flat(to_dict(cfg)):
        args += ["--set", f"{key}={_text(value)}"]
    return [*args, "--set", f"train.out_dir={run_dir}"]


def _flat(values: dict, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, value) of every leaf of a config dict, nested sections (data.terms) too."""
    out = []
    for key, value in values.items():
        if isinstance(value, dict):
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tmt(
    args: list[str], ranks: int = 1, fault: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    env = {**__import__("os").environ, "PYTHONUNBUFFERED": "1"}
    if fault:  # on rank 0 unless the fault names its rank ("exit@rank1")
        env.update(TMT_FAULT=fault, **({} if "@rank" in fault else {"TMT_FAULT_RANK": "0"}))
    if ranks == 1:  # in a process forked from one that imported torch (tests/cli_processes.py)
        return cli_processes.run(args, env=env, cwd=REPO, timeout=timeout)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        f"--master_port={free_port()}",
        "-m",
        "transformer_mt",
        *args,
    ]
    return subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout
    )


@pytest.fixture
def train_cfg(tiny_cfg: Config) -> Config:
    return with_train(tiny_cfg, max_steps=8, log_every=1, valid_every=4, save_every=4, keep_last=5)


def test_golden_first_five_losses(train_cfg: Config, tmp_path: Path) -> None:
    # Regenerate (only for a change meant to alter the computation): run this test with
    # GOLDEN_LOSSES = [] and copy the printed list.
    summary = train(with_train(train_cfg, out_dir=str(tmp_path), max_steps=5))
    losses = [r["loss"] for r in records(tmp_path) if "loss" in r]
    print(losses)
    assert summary["step"] == 5 and len(losses) == 5
    assert losses == pytest.approx(GOLDEN_LOSSES, abs=1e-4)


GOLDEN_LOSSES = [
    4.718446200951598,
    4.641781671853086,
    4.6462731834349595,
    4.5879990713936945,
    4.479581110264228,
]


def test_run_directory_contents(train_cfg: Config, tmp_path: Path) -> None:
    summary = train(with_train(train_cfg, out_dir=str(tmp_path)))
    assert summary["stop"] == "max_steps" and summary["step"] == 8
    # The config as resolved: what it left to the device chosen (a CPU: exact lengths).
    assert train_cfg.data.bucketing == "auto"
    resolved = with_data(with_train(train_cfg, out_dir=str(tmp_path)), bucketing="off")
    assert (tmp_path / "config.yaml").is_file()
    assert load_config(tmp_path / "config.yaml") == resolved
    assert (tmp_path / "tokenizer.model").is_file()
    rows = records(tmp_path)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert {
        "step",
        "loss",
        "nll",
        "ppl",
        "lr",
        "tokens_per_s",
        "padding_efficiency",
        "epoch",
    } <= set(steps[0])
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 8]
    assert steps[-1]["loss"] < steps[0]["loss"]
    saved = checkpoint.read(tmp_path / "checkpoints" / "step_00000008")
    assert saved.tokenizer_bytes == (tmp_path / "tokenizer.model").read_bytes()
    assert run.best(tmp_path) is not None


@pytest.mark.slow  # the same promise as test_reliability.py::test_kill_and_resume_is_bit_exact
def test_exact_resume_after_kill_one_process(train_cfg: Config, tmp_path: Path) -> None:
    train(with_train(train_cfg, out_dir=str(tmp_path / "straight")))
    args = cli_args(train_cfg, tmp_path / "resumed")
    killed = run_tmt(args, fault="after_save@4:kill")
    assert killed.returncode == -9, killed.stderr
    assert [p.name for p in run.list_checkpoints(tmp_path / "resumed")] == ["step_00000004"]
    again = run_tmt(args)  # the same command again
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stderr
    assert "tmt: step 8: val_loss" in again.stderr  # validation shows without a terminal
    assert numbers(tmp_path / "resumed") == numbers(
        tmp_path / "straight"
    )  # every loss, bit for bit
    straight, resumed = (
        final_weights(tmp_path / "straight", 8),
        final_weights(tmp_path / "resumed", 8),
    )
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


# slow: make test keeps its promise with test_reliability.py::test_kill_and_resume_is_bit_exact
# (one process) and ::test_two_gloo_ranks_equal_one_process_on_the_same_global_batches (DDP == one
# process)
@pytest.mark.slow
@pytest.mark.parametrize("grad_sync", ["overlapped", "after_backward"])
def test_exact_resume_after_kill_two_gloo_ranks(
    train_cfg: Config, tmp_path: Path, grad_sync: str
) -> None:
    cfg = with_train(train_cfg, grad_sync=grad_sync)
    straight = run_tmt(cli_args(cfg, tmp_path / "straight"), ranks=2)
    assert straight.returncode == 0, straight.stderr
    args = cli_args(cfg, tmp_path / "resumed")
    killed = run_tmt(args, ranks=2, fault="after_save@4:kill")
    assert killed.returncode != 0
    again = run_tmt(args, ranks=2)
    assert again.returncode == 0, again.stderr
    assert numbers(tmp_path / "resumed") == numbers(tmp_path / "straight")
    a, b = final_weights(tmp_path / "straight", 8), final_weights(tmp_path / "resumed", 8)
    assert all(torch.equal(a[k], b[k]) for k in a)


# clip_norm 1.6 clips the first three of six updates (gradient norms 2.00, 1.89, 1.78, then 1.51,
# 1.41, 1.23): with clipping on every update or on none, Adam's scale invariance would hide a
# wrongly scaled gradient; a gradient off by the factor world_size (0.5 here) would clip none.
@pytest.mark.parametrize(
    ("clip_norm", "bucketing", "fused_loss"),
    [pytest.param(0.0, "off", "off", marks=pytest.mark.slow), (1.6, "off", "off"),
     (1.6, "on", "on")],
)  # fmt: skip
def test_two_gloo_ranks_equal_one_process_on_the_same_global_batches(
    train_cfg: Config, tmp_path: Path, clip_norm: float, bucketing: str, fused_loss: str
) -> None:
    # Without dropout, rank r's micro-batch i is global batch 2i + r, and one process with
    # update_freq 2 takes global batches 2i and 2i + 1 together: the same updates.
    cfg = dataclasses.replace(
        train_cfg,
        model=dataclasses.replace(train_cfg.model, dropout=0.0),
        optim=dataclasses.replace(train_cfg.optim, clip_norm=clip_norm),
    )
    cfg = with_data(cfg, bucketing=bucketing)  # on: the batches of bounded shapes (a GPU's)
    # The fused loss: a GPU's, and a CPU's from a 4,000-piece vocabulary (the tiny preset: 500).
    cfg = with_train(cfg, max_steps=6, valid_every=3, save_every=0, save_every_minutes=0.0,
                     fused_loss=fused_loss)  # fmt: skip
    from transformer_mt.data.batches import prepare_data
    from transformer_mt.training import device_defaults

    data = prepare_data(cfg)
    shapes = device_defaults.shape_buckets(cfg)
    sampler = data.train.sampler(cfg.data.max_tokens, cfg.train.seed, shapes=shapes)
    assert len(sampler.epoch_batches(0)) % 2 == 0
    one = train(with_train(cfg, out_dir=str(tmp_path / "one"), update_freq=2))
    two = run_tmt(cli_args(cfg, tmp_path / "two"), ranks=2)
    assert two.returncode == 0, two.stderr
    loss_one = [r.get("loss", r.get("val_loss")) for r in numbers(tmp_path / "one")]
    loss_two = [r.get("loss", r.get("val_loss")) for r in numbers(tmp_path / "two")]
    assert loss_one == pytest.approx(loss_two, rel=1e-5)
    a, b = final_weights(tmp_path / "one", one["step"]), final_weights(tmp_path / "two", 6)
    assert_same_model(a, b, cfg.model.d_model)


# In the slow set, which .ci/run runs too (15 s of make test's, near its 5 minutes on the 2-core
# VM: 303-312 s): make test keeps the averaging itself (test_gradients_are_averaged_in_buckets_
# of_one_dtype) and DDP == one process; grad_sync=after_backward is CUDA graphs' with several ranks.
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16_weights"])
def test_gradients_averaged_after_the_backward_are_ddp_s_to_the_bit(
    train_cfg: Config, tmp_path: Path, precision: str
) -> None:
    """train.grad_sync=after_backward (what CUDA graphs need with several ranks): two gloo ranks
    train what DDP's overlapped all-reduces train, every loss and weight to the bit, through
    accumulated micro-batches (no_sync in DDP) and clipped updates."""
    cfg = dataclasses.replace(train_cfg, optim=dataclasses.replace(train_cfg.optim, clip_norm=1.6))
    cfg = with_train(cfg, max_steps=6, valid_every=3, save_every=3, update_freq=2,
                     precision=precision)  # fmt: skip
    for sync in ("overlapped", "after_backward"):
        done = run_tmt(cli_args(with_train(cfg, grad_sync=sync), tmp_path / sync), ranks=2)
        assert done.returncode == 0, done.stderr
        how = "inside" if sync == "overlapped" else "after"
        assert f"2 ranks average their gradients {how} the backward pass" in done.stderr
    assert numbers(tmp_path / "overlapped") == numbers(tmp_path / "after_backward")
    a, b = (final_weights(tmp_path / sync, 6) for sync in ("overlapped", "after_backward"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_gradients_are_averaged_in_buckets_of_one_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """distributed.average_gradients: buckets of at most SYNC_BUCKET_NUMBERS numbers of one
    dtype, in the parameters' order, each gradient back in its own tensor (CUDA graphs hold
    them); a gradient missing (a rank out of memory) sent as zeros, a frozen parameter left
    out. A gloo group of one process stands for two ranks: each gradient divided by 2, the sum
    over one."""
    import torch.distributed as dist

    from transformer_mt.common import distributed

    monkeypatch.setattr(distributed, "SYNC_BUCKET_NUMBERS", 6)
    sent: list[tuple[int, torch.dtype]] = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, op: sent.append((t.numel(), t.dtype))
                        or real(t, op=op))  # fmt: skip
    params = [torch.nn.Parameter(torch.ones(n, dtype=dtype)) for n, dtype in
              [(3, torch.float32), (2, torch.float32), (4, torch.float32), (2, torch.bfloat16),
               (5, torch.float32), (1, torch.float32)]]  # fmt: skip
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    for i, p in enumerate(params[:-1]):
        p.grad = torch.full_like(p, float(i + 1))
    held = [p.grad for p in params[:-1]]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        info = DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
        distributed.average_gradients([*params, frozen], info)
    finally:
        dist.destroy_process_group()
    assert sent == [(5, torch.float32), (4, torch.float32), (2, torch.bfloat16),
                    (6, torch.float32)]  # fmt: skip
    for i, p in enumerate(params[:-1]):
        assert p.grad is held[i] and torch.equal(p.grad, torch.full_like(p, (i + 1) / 2))
    assert torch.equal(params[-1].grad, torch.zeros(1)) and frozen.grad is None


def assert_same_model(a: dict, b: dict, d: int) -> None:
    """Two trainings' weights equal to float32's rounding, every parameter but the attention's
    key biases: those get an exactly-zero gradient (a key bias shifts every score of a query by
    the same amount, which softmax ignores), so they only see rounding noise, which Adam scales
    up to full steps. The query and value biases are compared."""
    for key in a:
        x, y = a[key], b[key]
        if key.endswith("in_proj.bias"):
            x, y = torch.cat([x[:d], x[2 * d :]]), torch.cat([y[:d], y[2 * d :]])
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=key)


def test_bucketed_batches_have_their_buckets_shapes_and_resume_bit_exact(
    train_cfg: Config, tmp_path: Path
) -> None:
    """data.bucketing=on (a GPU's default) on the CPU: every batch the loop trains on has one of
    the epoch's bounded shapes, metrics.jsonl reports how many, and a run stopped at step 4 and
    resumed is the straight run, bit for bit."""
    from transformer_mt.data.batches import prepare_data
    from transformer_mt.training import device_defaults
    from transformer_mt.training.feeder import Feeder

    cfg = with_data(train_cfg, bucketing="on")
    data = prepare_data(cfg)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    feeder = Feeder(cfg, data, None, info)
    shapes = feeder.sampler.epoch_shapes(0)
    exact = data.train.sampler(cfg.data.max_tokens, cfg.train.seed)
    assert len(shapes) <= len(exact.epoch_shapes(0))
    for index, _ in enumerate(feeder.epoch_batches(0)):
        (batch,) = feeder.micro_batches(0, index, feeder.group(0, index))
        assert (batch.src.shape[0], batch.src.shape[1], batch.tgt_out.shape[1]) in shapes
        assert batch.n_tokens == int((batch.tgt_out != batch.pad_id).sum())
    assert device_defaults.shape_buckets(cfg) == feeder.sampler.shapes
    train(with_train(cfg, out_dir=str(tmp_path / "straight")))
    train(with_train(cfg, out_dir=str(tmp_path / "resumed"), max_steps=4))
    train(with_train(cfg, out_dir=str(tmp_path / "resumed")))
    assert numbers(tmp_path / "resumed") == numbers(tmp_path / "straight")
    logged = [r for r in records(tmp_path / "straight") if "loss" in r]
    assert logged and all(r["batch_shapes"] == len(shapes) for r in logged)
    a, b = final_weights(tmp_path / "straight", 8), final_weights(tmp_path / "resumed", 8)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_fused_loss_trains_the_model_the_reference_loss_trains(
    train_cfg: Config, tmp_path: Path
) -> None:
    """train.fused_loss=on (a GPU's default) on the CPU, in float32: the same losses and model
    as the reference loss, to float32's rounding."""
    cfg = dataclasses.replace(train_cfg, model=dataclasses.replace(train_cfg.model, dropout=0.0))
    cfg = with_train(cfg, max_steps=4, valid_every=2, save_every=4)
    train(with_train(cfg, out_dir=str(tmp_path / "reference")))
    train(with_train(cfg, out_dir=str(tmp_path / "fused"), fused_loss="on"))
    reference = [r.get("loss", r.get("val_loss")) for r in numbers(tmp_path / "reference")]
    fused = [r.get("loss", r.get("val_loss")) for r in numbers(tmp_path / "fused")]
    assert len(reference) == 6 and fused == pytest.approx(reference, rel=1e-5)
    a, b = final_weights(tmp_path / "reference", 4), final_weights(tmp_path / "fused", 4)
    assert_same_model(a, b, cfg.model.d_model)


def test_a_cpu_trains_with_the_fused_loss_from_its_vocabulary_threshold(
    train_cfg: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.fused_loss=auto on a CPU: the losses of `on` from FUSED_LOSS_CPU_VOCAB target
    pieces, of `off` below it, bit for bit (the tiny preset's few hundred pieces are far below;
    the threshold is moved to the model's vocabulary here). The two losses differ in float32's
    last bits, so each run shows which it trained with."""
    from transformer_mt.data.tokenizer import Tokenizer
    from transformer_mt.training import device_defaults

    cfg = with_train(train_cfg, max_steps=3, log_every=1, valid_every=0, save_every=0)

    def losses(name: str, fused: str) -> list[float]:
        train(with_train(cfg, out_dir=str(tmp_path / name), fused_loss=fused))
        return [r["loss"] for r in records(tmp_path / name) if "loss" in r]

    on, off = losses("on", "on"), losses("off", "off")
    assert on != off and on == pytest.approx(off, rel=1e-5)
    assert losses("auto", "auto") == off
    vocab = Tokenizer((tmp_path / "on" / "tokenizer.model").read_bytes()).vocab_size
    monkeypatch.setattr(device_defaults, "FUSED_LOSS_CPU_VOCAB", vocab + 1)
    assert losses("auto_below", "auto") == off
    monkeypatch.setattr(device_defaults, "FUSED_LOSS_CPU_VOCAB", vocab)
    assert losses("auto_at", "auto") == on


def test_epoch_and_time_budgets(train_cfg: Config, tmp_path: Path) -> None:
    by_epoch = train(
        with_train(
            train_cfg,
            out_dir=str(tmp_path / "e"),
            max_steps=0,
            max_epochs=2,
            valid_every=0,
            save_every=0,
        )
    )
    assert by_epoch["stop"] == "max_epochs" and by_epoch["epoch"] == 2
    assert run.latest_valid(tmp_path / "e").name == f"step_{by_epoch['step']:08d}"
    by_time = train(
        with_train(train_cfg, out_dir=str(tmp_path / "t"), max_steps=0, max_minutes=1e-6)
    )
    assert by_time["stop"] == "max_minutes" and by_time["step"] == 0  # stopped before any update


def test_resuming_a_run_with_another_model_is_refused(train_cfg: Config, tmp_path: Path) -> None:
    train(with_train(train_cfg, out_dir=str(tmp_path), max_steps=2))
    other = dataclasses.replace(train_cfg, model=dataclasses.replace(train_cfg.model, d_ff=128))
    with pytest.raises(TmtError, match="another model \\(model.d_ff 64 -> 128; its checkpoint"):
        train(with_train(other, out_dir=str(tmp_path), max_steps=4))
    extended = train(
        with_train(train_cfg, out_dir=str(tmp_path), max_steps=4)
    )  # a longer budget is fine
    assert extended["step"] == 4


def test_keep_last_and_best(train_cfg: Config, tmp_path: Path) -> None:
    train(
        with_train(
            train_cfg, out_dir=str(tmp_path), max_steps=12, save_every=2, keep_last=2, valid_every=4
        )
    )
    names = [p.name for p in run.list_checkpoints(tmp_path)]
    best = run.best(tmp_path)
    assert best is not None and best.name in names
    assert names[-2:] == ["step_00000010", "step_00000012"]
    assert len(names) <= 3


def test_bf16_autocast_trains_on_cpu(train_cfg: Config, tmp_path: Path) -> None:
    summary = train(with_train(train_cfg, out_dir=str(tmp_path), precision="bf16", max_steps=4))
    losses = [r["loss"] for r in records(tmp_path) if "loss" in r]
    assert summary["step"] == 4 and all(math.isfinite(x) for x in losses)
    saved = checkpoint.read(tmp_path / "checkpoints" / "step_00000004")
    assert all(t.dtype == torch.float32 for t in saved.state_dict.values())  # weights stay fp32


def test_a_bf16_update_casts_each_weight_once_and_computes_what_a_cast_per_micro_batch_does(
    train_cfg: Config,
) -> None:
    """Autocast keeps its weight copies for the whole update (step.py): with update_freq 3 each
    weight is cast to bf16 once, where a region per micro-batch cast it three times; the loss
    sums and gradients are those of a region per micro-batch, bit for bit (the shared embedding's
    to float32's rounding). The exception to once: cross-attention's stacked in_proj, used as
    two slices (W^Q; W^K and W^V), which are views, and autocast keeps copies of whole
    parameters only: two casts each micro-batch."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    from transformer_mt.data.batches import prepare_data
    from transformer_mt.network.model import Transformer
    from transformer_mt.training import step
    from transformer_mt.training.feeder import Feeder
    from transformer_mt.training.loss import Objective

    cfg = dataclasses.replace(train_cfg, model=dataclasses.replace(train_cfg.model, dropout=0.0))
    cfg = with_train(cfg, update_freq=3, precision="bf16")
    data = prepare_data(cfg)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    feeder = Feeder(cfg, data, None, info)
    micro = feeder.micro_batches(0, 0, feeder.group(0, 0))
    feeder.close()
    assert len(micro) == 3
    torch.manual_seed(0)
    model = Transformer(cfg.model, data.tokenizer.vocab_size, data.tokenizer.pad_id)
    # By storage: a slice of a parameter counts as the parameter.
    weights = {p.untyped_storage().data_ptr(): name for name, p in model.named_parameters()}
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    objective = Objective(cfg.optim.label_smoothing)
    tokens = sum(b.n_tokens for b in micro)

    _TO_COPY = torch.ops.aten._to_copy.default

    class WeightCasts(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            storage = args[0].untyped_storage().data_ptr() if func is _TO_COPY else None
            if storage in weights:
                self.counts[weights[storage]] += 1
            return func(*args, **(kwargs or {}))

    with WeightCasts() as casts:
        together, oom = step._accumulate(model, micro, scaler, objective, info, tokens, 1, "bf16")
    assert not oom and casts.counts  # the linear layers' weights and biases
    sliced = {name for name in casts.counts if ".cross_attn.in_proj." in name}
    assert sliced and all(casts.counts[name] == 2 * len(micro) for name in sliced), casts.counts
    assert all(casts.counts[name] == 1 for name in casts.counts.keys() - sliced), casts.counts
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    apart = torch.zeros(2, dtype=torch.float64)
    for batch in micro:  # a region each
        apart += step._accumulate(model, [batch], scaler, objective, info, tokens, 1, "bf16")[0]
    assert torch.equal(apart, together)
    for name, p in model.named_parameters():
        if name != "embedding.weight":
            assert torch.equal(p.grad, grads[name]), name
    # The shared embedding's gradient adds its three uses (two lookups, the output projection's
    # cast) in the order autograd runs them; the kept cast, made in the first micro-batch, runs
    # later in the others: equal to float32's rounding (7e-9 of 0.2 here).
    torch.testing.assert_close(model.embedding.weight.grad, grads["embedding.weight"],
                               rtol=1e-5, atol=1e-7)  # fmt: skip


@pytest.mark.slow
def test_torch_compile_trains_the_same_model(train_cfg: Config, tmp_path: Path) -> None:
    cfg = with_train(
        dataclasses.replace(train_cfg, model=dataclasses.replace(train_cfg.model, dropout=0.0)),
        max_steps=3,
        valid_every=0,
        save_every=0,
    )
    train(with_train(cfg, out_dir=str(tmp_path / "eager")))
    train(with_train(cfg, out_dir=str(tmp_path / "compiled"), compile="on"))
    # Losses, not weights: Adam turns a rounding-level gradient difference on a near-zero
    # gradient into a full-size update, so weights may differ by ~lr while the model agrees.
    eager = [r["loss"] for r in records(tmp_path / "eager") if "loss" in r]
    compiled = [r["loss"] for r in records(tmp_path / "compiled") if "loss" in r]
    assert len(eager) == 3 and compiled == pytest.approx(eager, rel=1e-4)


def test_patience_stops_when_validation_stops_improving(train_cfg: Config, tmp_path: Path) -> None:
    # A zero learning rate never changes the model: the first validation is the best there is.
    frozen = dataclasses.replace(
        train_cfg, optim=dataclasses.replace(train_cfg.optim, lr_scale=0.0)
    )
    summary = train(
        with_train(frozen, out_dir=str(tmp_path), max_steps=50, valid_every=2, patience=2)
    )
    assert summary["stop"] == "patience" and summary["step"] == 6
    assert summary["best_step"] == 2


def test_best_by_bleu_and_average_at_the_end(train_cfg: Config, tmp_path: Path) -> None:
    cfg = with_train(
        train_cfg,
        out_dir=str(tmp_path),
        max_steps=6,
        save_every=2,
        valid_every=3,
        bleu_every=3,
        best_metric="val_bleu",
        average_last=2,
    )
    summary = train(cfg)
    bleus = [r for r in records(tmp_path) if "val_bleu" in r]
    assert [r["step"] for r in bleus] == [3, 6]
    # The best is the first validation with the highest BLEU; checkpoints/best points at it.
    best = max(bleus, key=lambda r: (r["val_bleu"], -r["step"]))
    assert (summary["best_metric"], summary["best_value"]) == ("val_bleu", best["val_bleu"])
    assert summary["best_step"] == best["step"]
    assert run.best(tmp_path).name == f"step_{best['step']:08d}"
    # The validation BLEU of training is the BLEU tmt evaluate reports for the same model: for
    # the checkpoint of step 6 and for the final average.
    from transformer_mt.translation import evaluate, translate

    step6 = translate.load_translator(run.checkpoint_dir(tmp_path, 6), ["decode.beam_size=1"])
    report = evaluate.evaluate(step6, split="valid")
    assert (report["bleu"], report["chrf"]) == (bleus[-1]["val_bleu"], bleus[-1]["val_chrf"])
    average = summary["average"]
    assert average["checkpoints"] == 2
    assert checkpoint.verify(Path(average["path"])) is None
    t = translate.load_translator(Path(average["path"]), ["decode.beam_size=1"])
    report = evaluate.evaluate(t, split="valid")
    assert (report["bleu"], report["chrf"]) == (average["val_bleu"], average["val_chrf"])


# --- the last records of a run, the budget schedule, subword regularization ----------------------


def test_the_last_updates_are_logged_and_the_last_record_says_why_the_run_stopped(
    train_cfg: Config, tmp_path: Path
) -> None:
    # 7 updates, a record every 5: updates 6 and 7 make a partial record at step 7.
    train(with_train(train_cfg, out_dir=str(tmp_path), max_steps=7, log_every=5, valid_every=0))
    rows = records(tmp_path)
    logged = [r for r in rows if "loss" in r]
    assert [(r["step"], r.get("partial"), r.get("updates")) for r in logged] == [
        (5, None, None),
        (7, True, 2),
    ]
    assert rows[-1] == {"step": 7, "epoch": logged[-1]["epoch"], "stop": "max_steps"}
    # Early stopping too: the record of the stop comes last, and the curves reach it.
    frozen = dataclasses.replace(
        train_cfg, optim=dataclasses.replace(train_cfg.optim, lr_scale=0.0)
    )
    cfg = with_train(frozen, out_dir=str(tmp_path / "p"), max_steps=50, log_every=4)
    train(with_train(cfg, valid_every=2, patience=2))
    rows = records(tmp_path / "p")
    assert rows[-1]["stop"] == "patience" and rows[-2]["step"] == rows[-1]["step"] == 6
    from transformer_mt.runs import plot

    assert plot.read_curves(tmp_path / "p")["loss"][-1][0] == 6
    # And a signal: SIGTERM after update 6, a record every 4, so updates 5 and 6 are partial.
    signalled = run_tmt(
        cli_args(with_train(train_cfg, log_every=4, valid_every=0), tmp_path / "s"),
        fault="step@6:sigterm",
    )
    assert signalled.returncode == 143, signalled.stderr
    rows = records(tmp_path / "s")
    logged = [(r["step"], r.get("partial"), r.get("updates")) for r in rows if "loss" in r]
    assert logged == [(4, None, None), (6, True, 2)]
    assert rows[-1] == {"step": 6, "epoch": rows[-2]["epoch"], "stop": "sigterm"}


def both_options(cfg: Config) -> Config:
    """The budget schedule and subword regularization on both sides."""
    return dataclasses.replace(
        cfg,
        optim=dataclasses.replace(cfg.optim, schedule="budget"),
        data=dataclasses.replace(cfg.data, subword_alpha=0.2, subword_sides="both"),
    )


# slow: make test keeps its promise with
# test_train.py::test_a_time_budget_is_planned_once_and_a_resume_keeps_the_plan and
# test_data.py::test_sampled_batches_keep_the_text_vary_by_epoch_and_repeat_by_seed
@pytest.mark.slow
def test_exact_resume_after_kill_with_the_budget_schedule_and_subword_sampling(
    train_cfg: Config, tmp_path: Path
) -> None:
    cfg = both_options(train_cfg)
    train(with_train(cfg, out_dir=str(tmp_path / "straight")))
    args = cli_args(cfg, tmp_path / "resumed")
    killed = run_tmt(args, fault="after_save@4:kill")
    assert killed.returncode == -9, killed.stderr
    again = run_tmt(args)
    assert again.returncode == 0, again.stderr
    rows = numbers(tmp_path / "resumed")
    assert rows == numbers(tmp_path / "straight")  # every loss and learning rate, bit for bit
    lrs = [r["lr"] for r in rows if "lr" in r]  # planned for 8 updates: warmup 6, then down
    assert lrs[5] == max(lrs) and lrs == sorted(lrs[:6]) + sorted(lrs[6:], reverse=True)
    a, b = final_weights(tmp_path / "straight", 8), final_weights(tmp_path / "resumed", 8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Neither option is the default (the paper's recipe): the runs differ from it.
    plain = train(with_train(train_cfg, out_dir=str(tmp_path / "plain")))
    assert plain["step"] == 8 and numbers(tmp_path / "plain") != rows


def test_a_time_budget_is_planned_again_before_its_decay_so_that_the_decay_fits(
    train_cfg: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A clock that updates move: 1 s each while the rate is measured, 1.1 s after (validations
    # and checkpoints that the first measure did not see). Planned at 1/s for 60 updates, the
    # decay would start after update 48 and the clock would stop the run at 55, at half the
    # peak; checked again two updates before the decay, the plan is what the clock allows, 55,
    # and the decay fits.
    from transformer_mt.training import train as train_module

    clock = {"now": 0.0, "planned": False}

    class Clock:
        @staticmethod
        def monotonic() -> float:
            return clock["now"]

    real_step = train_module.train_step

    def timed_step(*args: object, **kwargs: object) -> object:
        clock["now"] += 1.1 if clock["planned"] else 1.0
        stats = real_step(*args, **kwargs)
        clock["planned"] = clock["planned"] or stats.plan > 0
        return stats

    monkeypatch.setattr(train_module, "time", Clock)
    monkeypatch.setattr(train_module, "train_step", timed_step)
    cfg = with_train(
        both_options(train_cfg), max_steps=0, max_minutes=1.0, log_every=1, valid_every=0,
        save_every=0,
    )  # fmt: skip
    summary = train(with_train(cfg, out_dir=str(tmp_path)))
    rows = records(tmp_path)
    plans = [r for r in rows if "planned_updates" in r]
    # Measured over the 5 updates after the first (whose one-off costs are not timed); 48 - 2.
    assert [p["step"] for p in plans] == [6, 46]
    assert [p["planned_updates"] for p in plans] == [6 + 54, 46 + 9]
    assert summary["step"] == 55 and summary["stop"] == "max_minutes"
    lrs = [r["lr"] for r in rows if "lr" in r]  # lrs[k - 1]: the rate of update k
    peak = max(lrs)
    assert lrs[47] == peak and lrs[-1] == pytest.approx(peak / 8)  # down to zero at 56
    steps = [b - a for a, b in itertools.pairwise(lrs[47:])]
    assert max(steps) == pytest.approx(min(steps)) and max(steps) < 0  # one linear decay


def test_a_time_budget_is_planned_once_and_a_resume_keeps_the_plan(
    train_cfg: Config, tmp_path: Path
) -> None:
    # A minute's budget, its rate measured over the first 3 seconds; SIGTERM once it is planned
    # (the run saves and stops), then 3 more updates of the resumed run.
    cfg = with_train(
        both_options(train_cfg), max_steps=0, max_minutes=1.0, log_every=1, valid_every=0,
        save_every=0,
    )  # fmt: skip
    args = cli_args(cfg, tmp_path)
    stopped = run_tmt(args, fault="plan@1:sigterm")
    assert stopped.returncode == 143, stopped.stderr
    plans = [r for r in records(tmp_path) if "planned_updates" in r]
    assert len(plans) == 1 and plans[0]["step"] >= 5  # at least 5 updates measured
    saved = run.latest_valid(tmp_path)
    state = torch.load(saved / checkpoint.STATE_FILE, weights_only=True)
    saved_plan = state["scheduler"]["lr_lambdas"][0]
    assert saved_plan["total"] == plans[0]["planned_updates"] and saved_plan["timed"]
    step = checkpoint.read_manifest(saved)["step"]
    again = run_tmt(args, fault=f"step@{step + 3}:sigterm")
    assert again.returncode == 143, again.stderr
    rows = records(tmp_path)
    assert [r for r in rows if "planned_updates" in r] == plans  # not planned again
    from transformer_mt.training.optim import BudgetSchedule

    schedule = BudgetSchedule(cfg.model, cfg.optim)
    vars(schedule).update(saved_plan)
    resumed = [r for r in rows if "lr" in r and r["step"] > step]
    assert [r["step"] for r in resumed] == [step + 1, step + 2, step + 3]
    assert [r["lr"] for r in resumed] == [schedule.lr(r["step"]) for r in resumed]
    assert (rows[-1]["step"], rows[-1]["stop"]) == (step + 3, "sigterm")


def test_batches_made_ahead_are_the_batches_made_when_needed(train_cfg: Config) -> None:
    """The feeder's second thread (on by default on CUDA) changes nothing of what an update
    gets, in order, out of order (a resume starts anywhere) and across epochs."""
    from transformer_mt.data.batches import prepare_data
    from transformer_mt.training.feeder import Feeder

    cfg = with_train(with_data(train_cfg, bucketing="on"), update_freq=2)
    data = prepare_data(cfg)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    now, ahead = Feeder(cfg, data, None, info), Feeder(cfg, data, None, info, ahead=True)
    visits = [(0, 0), (0, 2), (1, 0), (1, 2), (0, 2), (0, 0), (1, 2)]
    for epoch, index in visits:
        group = now.group(epoch, index)
        assert [b.tolist() for b in group] == [b.tolist() for b in ahead.group(epoch, index)]
        for a, b in zip(now.micro_batches(epoch, index, group),
                        ahead.micro_batches(epoch, index, group), strict=True):  # fmt: skip
            assert torch.equal(a.src, b.src) and torch.equal(a.tgt_in, b.tgt_in)
            assert torch.equal(a.tgt_out, b.tgt_out) and a.counts == b.counts
    assert now.group(0, len(now.epoch_batches(0))) is None
    now.close()
    ahead.close()
