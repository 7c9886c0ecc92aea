"""Process groups from torchrun's environment: NCCL on GPUs, gloo on CPUs, with timeouts.

Every collective has a timeout (train.distributed_timeout_s), so a rank that dies or stalls makes
the others fail instead of hanging forever.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from transformer_mt.common.exits import TmtError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup(device: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK), if any."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = _local_rank()
    target = resolve_device(device, key="train.device")
    use_cuda = target.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=target if use_cuda else None,
        )
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=target)


def _local_rank() -> int:
    """This process's index on its machine (torchrun's LOCAL_RANK; 0 outside torchrun)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def resolve_device(spec: str, key: str = "device") -> torch.device:
    """auto (CUDA when there is a GPU), cpu, cuda or cuda:N. "cuda" is this process's own GPU:
    under torchrun each process trains or decodes on GPU LOCAL_RANK. Asking for a GPU where there
    is none is an error naming `key`, not a traceback from deep inside torch."""
    index = _local_rank()
    if spec.startswith("cuda"):
        index = int(spec.removeprefix("cuda:")) if spec.startswith("cuda:") else index
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
            raise TmtError(
                f"{key}={spec}: no CUDA device on this machine (torch {torch.__version__}, {build})"
            )
        if index >= torch.cuda.device_count():
            raise TmtError(f"{key}={spec}: this machine has {torch.cuda.device_count()} GPU(s)")
        return torch.device("cuda", index)
    if spec == "auto" and torch.cuda.is_available():
        return torch.device("cuda", index)
    return torch.device("cpu")


# --- memory ------------------------------------------------------------------------------------


def is_out_of_memory(err: BaseException) -> bool:
    """Whether an exception is an allocation that failed (on the CPU or a GPU)."""
    if isinstance(err, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(err)
    return "DefaultCPUAllocator: not enough memory" in text or "can't allocate memory" in text


def free_memory(device: torch.device) -> int:
    """Bytes this process can still allocate on `device`: what CUDA reports free on a GPU; on the
    CPU, MemAvailable plus SwapFree (/proc/meminfo), else the free physical pages."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return sum(int(fields[k].split()[0]) * 1024 for k in ("MemAvailable", "SwapFree"))
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"


def check_room(nbytes: int, device: torch.device, what: str) -> None:
    """Refuse in one line, before allocating, `what` needing `nbytes` on `device` when less is
    free there (a kernel that overcommits would otherwise let it start and kill it later)."""
    free = free_memory(device)
    if nbytes > free:
        raise TmtError(f"{what} needs {_gib(nbytes)}; {device} has {_gib(free)} free")


@contextlib.contextmanager
def allocating(what: str, nbytes: int, device: torch.device) -> Iterator[None]:
    """An allocation failure inside the block is the same one line as check_room's."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError, MemoryError) as err:
        if not is_out_of_memory(err):
            raise
        raise TmtError(
            f"{what} needs {_gib(nbytes)}; allocating it failed on {device}"
            f" ({_gib(free_memory(device))} free)"
        ) from None


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum over ranks, in place; a no-op in a single process."""
    if info.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gather_to_main(value: Any, info: DistInfo) -> list[Any] | None:
    """Every rank's `value` on rank 0 (in rank order), None elsewhere. Values travel pickled
    between this job's own processes; nothing is unpickled from files."""
    if not info.distributed:
        return [value]
    gathered: list[Any] = [None] * info.world_size if info.is_main else None  # type: ignore[assignment]
    dist.gather_object(value, gathered, dst=0)
    return gathered


def wrap(model: torch.nn.Module, info: DistInfo, grad_sync: str = "overlapped") -> torch.nn.Module:
    """`model` for data-parallel training: with several ranks, DDP-wrapped (train.grad_sync
    overlapped), or itself with rank 0's weights (after_backward: average_gradients after the
    backward passes)."""
    if not info.distributed:
        return model
    if grad_sync == "after_backward":
        with torch.no_grad():  # as DDP starts: every rank from rank 0's weights and buffers
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0)
        return model
    device_ids = [info.local_rank] if info.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def syncs_in_backward(model: torch.nn.Module) -> bool:
    """Whether `model`'s backward pass averages the ranks' gradients (DDP's hooks)."""
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


# Gradients all-reduced at once by average_gradients: at most this many numbers (256 MB in
# float32) copied into one buffer, so a large model's sync needs no second copy of all of them.
SYNC_BUCKET_NUMBERS = 1 << 26


def average_gradients(params: list[torch.nn.Parameter], info: DistInfo) -> None:
    """Every rank's gradients replaced by their mean over the ranks, as DDP leaves them (each
    divided by the number of ranks, then summed), in a few all-reduces of flat buckets after the
    update's backward passes (train.grad_sync=after_backward). A parameter without a gradient
    (a rank that ran out of memory before its backward) takes part with zeros: every rank sends
    the same sizes."""
    if not info.distributed:
        return
    trained = [p for p in params if p.requires_grad]
    for p in trained:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: list[list[torch.Tensor]] = []
    size = 0  # numbers in the last bucket
    for grad in (p.grad for p in trained):  # in order; a bucket is of one dtype
        if (
            not buckets
            or buckets[-1][0].dtype != grad.dtype
            or size + grad.numel() > SYNC_BUCKET_NUMBERS
        ):
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += grad.numel()
    with torch.no_grad():
        for grads in buckets:
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(info.world_size)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            for grad, mean in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                grad.copy_(mean.view_as(grad))


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


class Heartbeat:
    """Every rank records the step it reached in the process group's key-value store (kept by
    torchrun's agent, so it outlives a dead rank). When a collective fails, `report()` names the
    ranks that stopped before this one: which rank died or stalled, not just "a timeout"."""

    def __init__(self, info: DistInfo) -> None:
        self.info = info
        self.step = -1
        self.store = None
        if info.distributed:
            try:
                self.store = dist.distributed_c10d._get_default_store()
                self.store.set_timeout(datetime.timedelta(seconds=5))
            except (RuntimeError, AttributeError, ValueError):
                self.store = None  # no store: reports fall back to "another rank"

    def beat(self, step: int) -> None:
        self.step = step
        if self.store is not None:
            self.store.set(f"tmt/heartbeat/{self.info.rank}", f"{step} {time.time():.3f}")

    def report(self) -> str:
        """The other ranks' last reports, the likely culprits first: those behind this rank or
        silent for more than 2 s ("rank 1 last reported step 3, 5.0 s ago")."""
        others = []
        for rank in range(self.info.world_size):
            if rank == self.info.rank or self.store is None:
                continue
            try:
                step, seen = self.store.get(f"tmt/heartbeat/{rank}").decode().split()
                others.append((int(step), time.time() - float(seen), rank))
            except (RuntimeError, ValueError):  # never reported, or the store is gone too
                others.append((-1, float("inf"), rank))
        suspects = [o for o in others if o[0] < self.step or o[1] > 2.0] or others
        parts = [
            f"rank {rank} never reported"
            if step < 0
            else f"rank {rank} last reported step {step}, {age:.1f} s ago"
            for step, age, rank in sorted(suspects, key=lambda o: (o[0], -o[1]))
        ]
        here = f"this is rank {self.info.rank} at step {self.step}"
        return f"{'; '.join(parts)} ({here})" if parts else f"another rank failed ({here})"


def is_collective_failure(err: BaseException) -> bool:
    """Errors of a collective whose peer died, stalled past the timeout or closed the connection."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        mark in text
        for mark in (
            "gloo",
            "Gloo",
            "NCCL",
            "Connection closed by peer",
            "Timed out",
            "Connection reset",
        )
    )
