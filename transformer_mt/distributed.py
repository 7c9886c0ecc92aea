"""Process groups from torchrun's environment: NCCL on GPUs, gloo on CPUs, with timeouts.

Every collective has a timeout (train.distributed_timeout_s), so a rank that dies or stalls makes
the others fail instead of hanging forever.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


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
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        target = torch.device("cuda", local_rank)
    else:
        target = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=target if use_cuda else None,
        )
    return DistInfo(rank, world_size, local_rank, target)


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


def scatter_from_main(values: list[Any] | None, info: DistInfo) -> Any:
    """Rank r receives values[r] from rank 0."""
    if not info.distributed:
        return values[0] if values else None
    received: list[Any] = [None]
    dist.scatter_object_list(received, values if info.is_main else None, src=0)
    return received[0]


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()
