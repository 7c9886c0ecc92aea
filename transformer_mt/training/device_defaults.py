"""The training settings a config leaves to the device, chosen when a run starts.

data.max_tokens 0 and data.bucketing auto mean "what suits the device": on a CPU, 4,096 tokens a
batch and exact lengths (every padding token costs arithmetic; shapes cost nothing); on CUDA, the
paper's ~25,000 tokens an update (§5.1: "approximately 25000 source tokens and 25000 target
tokens"), shared by the ranks, and bounded batch shapes (data/sampler.py: a GPU builds kernels
and plans per shape). An explicit value always wins. A resumed run keeps the values it started
with, whatever device resumes it, so that its batches stay the same.

The chosen values are written into the run's config (config.yaml and every checkpoint): what the
run trained with, which `tmt train --dry-run` and a resume read back, not what it was asked.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from transformer_mt.config import BY_DEVICE, Config
from transformer_mt.data.sampler import ShapeBuckets
from transformer_mt.training.graphs import MicroBatchGraphs
from transformer_mt.training.loss import Objective

logger = logging.getLogger(__name__)

CPU_TOKENS = 4096  # data.max_tokens on a CPU: ~2,000 updates in 30 minutes on 2 cores (multi30k)
PAPER_TOKENS = 25_000  # §5.1 tokens an update on CUDA, whatever the number of ranks
# train.fused_loss=auto on a CPU: the chunked loss from this target vocabulary. On the 2-core
# AVX-512 VM it took 0.64 of the reference's time at 4,000-16,000 pieces and the multi30k
# preset's step 6 % less; under ~500 pieces its few extra operations cost more than the passes
# over the scores it saves (docs/benchmarks.md, scripts/bench_loss.py).
FUSED_LOSS_CPU_VOCAB = 4000

# train.compile_mode values that replay CUDA graphs on CUDA (one micro-batch an update).
GRAPHED_MODES = ("reduce-overhead", "cudagraphs")


def resolve(
    cfg: Config, device: torch.device, world_size: int, saved: Config | None = None
) -> Config:
    """`cfg` with data.max_tokens and data.bucketing chosen where it leaves them to the device:
    the `saved` run's values when resuming, else this device's (named in the log)."""
    data = cfg.data
    chosen = {}
    if data.max_tokens == BY_DEVICE["data.max_tokens"]:
        kept = saved.data.max_tokens if saved else 0
        chosen["max_tokens"] = kept or tokens_for(cfg, device, world_size)
    if data.bucketing == BY_DEVICE["data.bucketing"]:
        kept = saved.data.bucketing if saved else "auto"
        # A run saved before tmt bucketed (its config says auto) packed exact lengths.
        chosen["bucketing"] = kept if kept != "auto" else "off" if saved else _bucketing_for(device)
    if not chosen:
        return cfg
    why = "the run's own" if saved else f"for {device.type} × {world_size}"
    logger.info("by device (%s): %s", why, ", ".join(f"data.{k}={v}" for k, v in chosen.items()))
    return dataclasses.replace(cfg, data=dataclasses.replace(data, **chosen))


def tokens_for(cfg: Config, device: torch.device, world_size: int) -> int:
    """data.max_tokens for `device`: 4,096 on a CPU; on CUDA, each of `world_size` ranks' share
    of the paper's 25,000 tokens an update (each micro-batch of train.update_freq its part);
    never fewer than the longest pair needs."""
    tokens = CPU_TOKENS
    if device.type == "cuda":
        tokens = -(-PAPER_TOKENS // (world_size * cfg.train.update_freq))
    return max(tokens, cfg.data.max_len + 1)


def _bucketing_for(device: torch.device) -> str:
    return "on" if device.type == "cuda" else "off"


def shape_buckets(cfg: Config) -> ShapeBuckets | None:
    """The sampler's shape buckets of a resolved config (None: exact lengths)."""
    data = cfg.data
    if data.bucketing != "on":
        return None
    return ShapeBuckets(data.source_buckets, data.target_buckets, data.rows_multiple)


def fused_loss(cfg: Config, device: torch.device, vocab_size: int) -> bool:
    """train.fused_loss: auto is on with CUDA (no batch × vocabulary float32 log-probabilities
    kept for the backward pass), and on a CPU for a target vocabulary of FUSED_LOSS_CPU_VOCAB
    pieces or more (faster there too); a smaller one keeps the reference loss."""
    if cfg.train.fused_loss != "auto":
        return cfg.train.fused_loss == "on"
    return device.type == "cuda" or vocab_size >= FUSED_LOSS_CPU_VOCAB


def grad_sync(cfg: Config) -> str:
    """train.grad_sync: auto averages the ranks' gradients after the backward pass where CUDA
    graphs record it (DDP's hooks cannot run inside a recording), else overlapped with it."""
    if cfg.train.grad_sync != "auto":
        return cfg.train.grad_sync
    return "after_backward" if cfg.train.cuda_graphs == "on" else "overlapped"


def graphs(
    model: torch.nn.Module, objective: Objective, cfg: Config, device: torch.device
) -> MicroBatchGraphs | None:
    """train.cuda_graphs=on: the micro-batches' graphs on CUDA; None on a CPU, which has none to
    record, or with "off" (what dry_run.check_before_training refuses it never gets here)."""
    if cfg.train.cuda_graphs != "on":
        return None
    if device.type != "cuda":
        logger.info("train.cuda_graphs=on: a %s has no CUDA graphs to record; training"
                    " without them", device.type)  # fmt: skip
        return None
    return MicroBatchGraphs(model, objective, cfg.train.precision, device)


def compiled(model: torch.nn.Module, cfg: Config, device: torch.device) -> torch.nn.Module:
    """The model as training runs it: itself, or torch.compile'd with train.compile=on (auto is
    off until measured to pay: scripts/bench_gpu.sh) in train.compile_mode. With CUDA graphs
    ("reduce-overhead" and "cudagraphs" on CUDA) each forward starts a new graph step, and a
    graph is recorded per batch shape, as many as data.bucketing allows (torch warns past 8 by
    default). "cudagraphs" generates no code: the model's own kernels, traced once for every
    shape (dynamic: ~20 s on the 2-core CPU of docs/benchmarks.md, where Inductor's
    "reduce-overhead" took 93 s of an H200's 96-second budget for its first two shapes); a CPU
    runs the same trace without graphs."""
    if cfg.train.compile != "on":
        return model
    mode, on_cuda = cfg.train.compile_mode, device.type == "cuda"
    if mode == "cudagraphs":
        backend = "cudagraphs" if on_cuda else "aot_eager"
        optimized = torch.compile(model, backend=backend, dynamic=True)
    elif mode == "reduce-overhead" and not on_cuda:
        # CUDA graphs need CUDA; torch would skip them with a warning a shape
        optimized = torch.compile(model, mode="default")
    else:
        optimized = torch.compile(model, mode=mode)
    if not on_cuda or mode not in GRAPHED_MODES:
        return optimized
    import torch._inductor.config as inductor

    inductor.triton.cudagraph_dynamic_shape_warn_limit = None
    return _GraphSteps(optimized)


class _GraphSteps(torch.nn.Module):
    """A model compiled with CUDA graphs, each call a new graph step: an update's forward comes
    after the backward of the one before, so no earlier output is still needed, and
    torch.compile's graph trees need not keep them alive (or refuse to overwrite them). Not
    micro-batches: a gradient the first one's backward left in a graph's memory is overwritten
    by the second's replay (PyTorch issue 169545; training refuses train.update_freq > 1)."""

    def __init__(self, optimized: torch.nn.Module) -> None:
        super().__init__()
        self.optimized = optimized

    def forward(
        self, src: torch.Tensor, tgt_in: torch.Tensor, project: bool = True
    ) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return self.optimized(src, tgt_in, project=project)
