"""What the training loop feeds its updates: each epoch's batches from the sampler (the same on
every rank, bounded in shape with data.bucketing), made into padded tensors and moved to the
device; and the validation batches, made once.

On CUDA the next update's batches are made on a second thread while the device works on this
update, and copied from pinned memory without making the host wait. On a CPU they are made
when needed: a second thread would take a core from the arithmetic.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from transformer_mt.common.distributed import DistInfo
from transformer_mt.config import Config
from transformer_mt.data.batches import Batch, PreparedData, SubwordSampling
from transformer_mt.data.sampler import TokenBucketSampler
from transformer_mt.training import device_defaults


class Feeder:
    """The batches of this rank's updates: train.update_freq micro-batches each."""

    def __init__(
        self,
        cfg: Config,
        data: PreparedData,
        sampling: SubwordSampling | None,
        info: DistInfo,
        ahead: bool | None = None,  # make the next update's batches meanwhile (None: on CUDA)
    ) -> None:
        self.data, self.sampling, self.info = data, sampling, info
        self.update_freq, self.start = cfg.train.update_freq, cfg.model.decoder_start
        self.sampler = data.train.sampler(
            cfg.data.max_tokens, cfg.train.seed, info.rank, info.world_size,
            shapes=device_defaults.shape_buckets(cfg),
        )  # fmt: skip
        ahead = info.device.type == "cuda" if ahead is None else ahead
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tmt-feeder") if ahead else None
        self._ahead: tuple[tuple[int, int], Future[list[Batch]]] | None = None

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches of `epoch`, in order (the sampler keeps the epoch's)."""
        return self.sampler.epoch_batches(epoch)

    def group(self, epoch: int, index: int) -> list[np.ndarray] | None:
        """The batches of the update that starts at batch `index` of `epoch`; None past its end."""
        batches = self.epoch_batches(epoch)
        return batches[index : index + self.update_freq] if index < len(batches) else None

    def micro_batches(self, epoch: int, index: int, group: list[np.ndarray]) -> list[Batch]:
        """`group` (at batch `index` of `epoch`) as batches on the device; on CUDA, the next
        update's are made meanwhile."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == (epoch, index):
            made = ahead[1].result()
        else:
            made = self._make(epoch, group)
        after = index + len(group)
        following = self.group(epoch, after)
        if self._pool is not None and following is not None:
            self._ahead = ((epoch, after), self._pool.submit(self._make, epoch, following))
        return [batch.to(self.info.device) for batch in made]

    def _make(self, epoch: int, group: list[np.ndarray]) -> list[Batch]:
        """The padded batches of `group`, on the host."""
        made = []
        for positions in group:
            pad_to = self.sampler.batch_shape(epoch, positions)
            made.append(self.data.train.batch(
                positions, self.data.tokenizer, self.sampling, epoch, self.start, pad_to
            ))  # fmt: skip
        return made

    def shapes(self, epoch: int) -> int:
        """The distinct batch shapes of `epoch`, every rank's (data.bucketing bounds them)."""
        return len(self.sampler.epoch_shapes(epoch))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def valid_batches(data: PreparedData, cfg: Config, info: DistInfo) -> list[Batch]:
    """This rank's share of the validation split, as batches on the device (none when
    validation is off, or the split has fewer pairs than ranks)."""
    if not cfg.train.valid_every or len(data.valid) < info.world_size:
        return []
    shapes = device_defaults.shape_buckets(cfg)
    sampler: TokenBucketSampler = data.valid.sampler(
        cfg.data.max_tokens, cfg.train.seed, info.rank, info.world_size, shuffle=False,
        shapes=shapes,
    )  # fmt: skip
    start, made = cfg.model.decoder_start, []
    for positions in sampler.epoch_batches(0):
        pad_to = sampler.batch_shape(0, positions)
        batch = data.valid.batch(positions, data.tokenizer, start=start, pad_to=pad_to)
        made.append(batch.to(info.device))
    return made
