"""CUDA graphs of a training micro-batch (train.cuda_graphs=on): its forward, loss and backward
recorded once per batch shape, then replayed, one launch where the host would launch the ~800
kernels of the step one by one.

A GPU trains the small models host-bound: on an H200 the Multi30k recipe's update took ~48 ms of
host time for 4.5 ms of kernels (docs/benchmarks.md), and torch.compile's graphs spent 93 s of a
96-second budget compiling. This records the model's own kernels with torch.cuda.graph, no code
generated: PyTorch's whole-network capture (the CUDA graphs notes), per shape, which
data.bucketing keeps to a few dozen an epoch on Multi30k.

- The first micro-batch of a shape runs eagerly on a side stream (the warm-up a capture needs:
  cuBLAS's workspace, the attention kernels' first calls), and counts as a micro-batch; the
  shape's graph is recorded after it. Its later micro-batches copy their tensors into the graph's
  inputs and replay it.
- Gradients accumulate in the parameters' own .grad tensors, allocated before any capture and
  zeroed in place after an update (never set to None), so a replay adds into them as eager
  backward does, and micro-batches accumulate (train.update_freq), recorded or not.
- The shapes' graphs share one memory pool: they never run at once, and a replay's only outputs
  (the loss sums) are added into the update's sums on the same stream before another replays.
- Autocast's weight cache is off inside a recording: a cast served from the cache would be
  recorded as a read of a stale copy, never cast again after Adam changes the weight.
- Dropout's random numbers come from the CUDA generator, which each replay advances as eager
  kernels would.

Several ranks average their gradients after the update's replays, outside any graph
(train.grad_sync=after_backward, auto's choice here: DDP's all-reduces inside the backward cannot
be recorded). Not with fp16's loss scaler or torch.compile (train.compile=on):
dry_run.check_before_training refuses them, and overlapped gradients with several ranks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from transformer_mt.common.exits import TmtError
from transformer_mt.data.batches import Batch
from transformer_mt.training.loss import Objective

logger = logging.getLogger(__name__)


@dataclass
class _Recorded:
    """One shape's graph, its inputs (outside the graph's memory, kept) and its outputs."""

    graph: torch.cuda.CUDAGraph
    src: torch.Tensor  # (B, S)
    tgt_in: torch.Tensor  # (B, T)
    tgt_out: torch.Tensor  # (B, T)
    loss: torch.Tensor  # ()
    nll: torch.Tensor  # ()


class MicroBatchGraphs:
    """A micro-batch's forward, loss and backward (loss × the update's scale) on CUDA, replayed
    from a graph per batch shape after the shape's first, eager, micro-batch."""

    def __init__(
        self, model: torch.nn.Module, objective: Objective, precision: str, device: torch.device
    ) -> None:
        self.model, self.objective, self.device = model, objective, device
        # bf16: autocast's; bf16_weights: none (the model is bf16 itself); fp16: refused (its
        # loss scaler)
        self.dtype = {"bf16": torch.bfloat16}.get(precision)
        self.scale = torch.zeros((), device=device)  # world_size / the update's global tokens
        self.stream = torch.cuda.Stream(device)
        self.pool: tuple | None = None  # the graphs' shared memory pool, once one is recorded
        self.recorded: dict[tuple[tuple[int, ...], ...], _Recorded] = {}
        self.recording_s = 0.0  # host time of the shapes' first micro-batches and recordings
        self.replays = 0
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def __len__(self) -> int:
        return len(self.recorded)

    def describe(self) -> str:
        """What the run recorded and replayed, for its log."""
        return (
            f"train.cuda_graphs: {len(self)} batch shapes recorded in {self.recording_s:.1f} s"
            f" (their first micro-batches included), {self.replays} micro-batches replayed"
        )

    def forward_backward(self, batch: Batch, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's loss and NLL sums (on the device), its gradients (of loss × scale)
        added into the parameters' .grad."""
        self.scale.fill_(scale)
        key = (tuple(batch.src.shape), tuple(batch.tgt_in.shape))
        recorded = self.recorded.get(key)
        if recorded is None:
            start = time.perf_counter()
            sums = self._first(key, batch)
            self.recording_s += time.perf_counter() - start
            return sums
        self.replays += 1
        recorded.src.copy_(batch.src, non_blocking=True)
        recorded.tgt_in.copy_(batch.tgt_in, non_blocking=True)
        recorded.tgt_out.copy_(batch.tgt_out, non_blocking=True)
        recorded.graph.replay()
        return recorded.loss, recorded.nll

    def _micro(
        self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor, pad_id: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        enabled = self.dtype is not None
        with torch.autocast("cuda", dtype=self.dtype, enabled=enabled, cache_enabled=False):
            out = self.model(src, tgt_in, project=self.objective.wants_logits)
            sums = self.objective(out, tgt_out, pad_id)
            loss = sums.loss * self.scale
        with torch.autocast("cuda", enabled=False):
            loss.backward()
        return sums.loss.detach(), sums.nll

    def _first(
        self, key: tuple[tuple[int, ...], ...], batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A shape's first micro-batch, eager on the side stream; then its graph, recorded."""
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        try:  # out of memory here is the step's to handle, after the side stream's work
            with torch.cuda.stream(self.stream):
                loss, nll = self._micro(batch.src, batch.tgt_in, batch.tgt_out, batch.pad_id)
                inputs = batch.src.clone(), batch.tgt_in.clone(), batch.tgt_out.clone()
        finally:
            main.wait_stream(self.stream)
        for t in (loss, nll, *inputs):  # made on the side stream, used on the main one
            t.record_stream(main)
        self.recorded[key] = self._record(key, inputs, batch.pad_id)
        if len(self.recorded) == 1:
            logger.info("train.cuda_graphs: the first batch shape recorded (%s)", key)
        return loss, nll

    def _record(
        self, key: tuple[tuple[int, ...], ...], inputs: tuple[torch.Tensor, ...], pad_id: int
    ) -> _Recorded:
        graph = torch.cuda.CUDAGraph()
        # As torch.compile's graph trees record: cuBLAS's workspaces made anew inside the
        # recording (kept by the graph's pool, not freed under it by eager code), and only this
        # thread held to what a recording forbids: the feeder's thread pins and copies the next
        # update's batches meanwhile (an event query there would end a "global" recording).
        _clear_cublas_workspaces()
        try:
            with torch.cuda.graph(
                graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
            ):
                outputs = self._micro(*inputs, pad_id)
        except RuntimeError as err:  # out of memory too: the graphs' pool is their own
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise TmtError(
                f"train.cuda_graphs=on: recording the step of a batch of shape {key} failed"
                f" ({reason}); train.cuda_graphs=off trains without CUDA graphs"
            ) from None
        finally:
            _clear_cublas_workspaces()
        self.pool = self.pool or graph.pool()
        return _Recorded(graph, *inputs, *outputs)


def _clear_cublas_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # CUDA builds
    if clear is not None:
        clear()
