"""``DistributedBatchSampler``: a ``torch.utils.data.DataLoader`` batch sampler for
data-parallel training that survives a change in the number of ranks (elastic jobs,
``mpistrat run --min-ranks``; docs/elastic.md).

Each epoch's order is fixed by ``(seed, epoch)`` over the whole dataset, whatever the
number of ranks, and cut into **global batches** of ``global_batch_size`` samples; each
rank takes its contiguous share of every global batch, the shares as even as possible
(their sizes differ by at most one). With fewer ranks after a relaunch, each rank takes a
larger share of the same global batches, in the same order.

**Step boundaries.** The sampler marks one (:func:`mpistrat.elastic.hooks.step_boundary`)
each time the loader asks it for a batch, with the position ``(kind, i)``: ``i`` global
batches of this epoch handed out, and trained on, before. That is the only place a torch
training loop with this sampler marks a boundary (mpistrat.torch's DistributedDataParallel
marks none), so each step counts once; they are the steps of ``mpistrat run --trace``
too (the loader's loading of the batch, which follows, is in its step). With
``num_workers=0`` (torch's default) the loader asks for batch ``i`` when the loop asks for
it, once step ``i - 1`` is done, so the boundary is exact. Worker processes make the loader
ask ahead (``num_workers * prefetch_factor`` batches): then load through
:class:`DataLoader` (torch's, which tells the sampler each batch the loop takes): the
sampler marks the boundary when the loop asks for its batch, and :attr:`global_size` and
:attr:`loss_scale` follow the batch the loop trains on, not the one loaded ahead. With
``mark_steps=False`` the sampler marks none: call :func:`mpistrat.elastic.step` yourself —
the snapshot then holds no input position and a restore replays the epoch from its start.

**Resuming.** After a relaunch, :meth:`mpistrat.checkpoint.CheckpointManager.
restore_or_initialize` restores the snapshot's position, and the first iteration of a
sampler of the same kind (the same dataset size, global batch size and ``drop_last``)
skips the global batches trained on already (:func:`mpistrat.elastic.hooks.take_resume`).

**The gradient of the global batch.** The shares differ in size when the global batch
size is not a multiple of the number of ranks, so the mean of the ranks' mean losses is
not the mean over the global batch. Sum the loss over the rank's samples and multiply it
by :attr:`DistributedBatchSampler.loss_scale` (``world size / size of the global batch
just handed out``): DistributedDataParallel's mean over the ranks then makes the gradient
``sum over the global batch / its size``, as one process computes it::

    loss = F.cross_entropy(model(x), y, reduction="sum") * sampler.loss_scale

(equivalently: ``DistributedDataParallel(net, op="sum")`` and divide the summed loss by
:attr:`DistributedBatchSampler.global_size`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..elastic import hooks
from ..runtime._mpi import Comm, world

__all__ = ["DistributedBatchSampler", "DataLoader", "share"]


def share(count: int, ranks: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s share of ``count`` items over ``ranks`` ranks:
    contiguous, in rank order, sizes differing by at most one (the first
    ``count % ranks`` ranks take one more)."""
    base, extra = divmod(count, ranks)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class DistributedBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields this rank's share of each global batch, as lists of dataset indices (give
    it to ``DataLoader(dataset, batch_sampler=...)``).

    Args:
        dataset_size: the number of samples (``len(dataset)``).
        global_batch_size: samples per step over all ranks (at least the number of ranks).
        shuffle: a new order every epoch, from ``(seed, epoch)``; else the dataset's.
        seed: the shuffle's seed (the same on every rank and every launch).
        drop_last: leave out the last global batch when it is not full; when kept it
            must hold at least one sample per rank.
        comm: the ranks that train together (default ``COMM_WORLD``).
        mark_steps: mark a step boundary before each batch (see the module docstring).

    Attributes:
        epoch: the epoch :meth:`set_epoch` set.
        global_size: the size of the global batch handed out last.
    """

    def __init__(self, dataset_size: int, global_batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, comm: Comm | None = None,
                 mark_steps: bool = True) -> None:
        for name, value, low in (("dataset_size", dataset_size, 1),
                                 ("global_batch_size", global_batch_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        self.comm = world() if comm is None else comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.mark_steps = bool(mark_steps)
        if global_batch_size < self.size:
            raise ValueError(f"global_batch_size {global_batch_size} is below the number of "
                             f"ranks ({self.size}): every rank needs a sample of every batch")
        last = dataset_size % global_batch_size
        if not self.drop_last and 0 < last < self.size:
            raise ValueError(f"the last global batch holds {last} samples, fewer than the "
                             f"{self.size} ranks: give drop_last=True, or a global batch "
                             f"size that leaves at least one sample per rank")
        if len(self) == 0:
            raise ValueError(f"{dataset_size} samples make no full global batch of "
                             f"{global_batch_size} (drop_last=True)")
        self.epoch = 0
        self.global_size = global_batch_size
        self._first = 0  # the global batch this iteration started at (a restored position)
        self._loader_marks = False  # the next iteration's boundaries: a DataLoader's

    @property
    def kind(self) -> str:
        """What names this sampler's input position across a relaunch (independent of
        the number of ranks)."""
        return (f"DistributedBatchSampler/{self.dataset_size}/{self.global_batch_size}/"
                f"{int(self.drop_last)}")

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from the next iteration on (every rank alike)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """Global batches per epoch (every rank yields as many batches)."""
        if self.drop_last:
            return self.dataset_size // self.global_batch_size
        return -(-self.dataset_size // self.global_batch_size)

    @property
    def loss_scale(self) -> float:
        """The factor for a loss summed over this rank's samples, so that the ranks'
        mean (DistributedDataParallel's) is the mean over the global batch handed out
        last: ``world size / global_size``."""
        return self.size / self.global_size

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The dataset's indices in epoch ``epoch``'s order (default :attr:`epoch`)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return np.arange(self.dataset_size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)

    def global_batch(self, index: int, epoch: int | None = None) -> list[int]:
        """Global batch ``index`` of an epoch (every rank's samples, in rank order)."""
        order = self.order(epoch)
        return [int(i) for i in order[index * self.global_batch_size:
                                      (index + 1) * self.global_batch_size]]

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        steps = len(self)
        skip = hooks.take_resume(self.kind) if self.mark_steps else 0
        if skip > steps:
            raise ValueError(f"the restored input position is global batch {skip}, but an "
                             f"epoch has {steps}: the sampler is not the one the snapshot "
                             f"was taken with")
        self._first = skip
        # (this iteration's batches reach the loop through a DataLoader with workers, which
        # marks the boundaries: said for this iteration only, see DataLoader.__iter__)
        loader_marks, self._loader_marks = self._loader_marks, False
        for index in range(skip, steps):
            batch = order[index * self.global_batch_size:(index + 1) * self.global_batch_size]
            if not loader_marks:
                if self.mark_steps:
                    hooks.step_boundary((self.kind, index))
                self.global_size = len(batch)
            start, stop = share(len(batch), self.size, self.rank)
            yield [int(i) for i in batch[start:stop]]

    def _taking(self, taken: int) -> None:
        """The loop asks :class:`DataLoader` for the batch after the ``taken`` it took in
        this iteration: global batch ``first + taken`` (batches reach the loop in order):
        its boundary and its size."""
        index = self._first + taken
        if index < len(self):
            if self.mark_steps:
                hooks.step_boundary((self.kind, index))
            self.global_size = min(self.global_batch_size,
                                   self.dataset_size - index * self.global_batch_size)

    def __repr__(self) -> str:
        return (f"DistributedBatchSampler(dataset_size={self.dataset_size}, "
                f"global_batch_size={self.global_batch_size}, rank {self.rank} of "
                f"{self.size}, epoch={self.epoch})")


class DataLoader(torch.utils.data.DataLoader):
    """torch's ``DataLoader``, unchanged but for one thing: given a
    :class:`DistributedBatchSampler` as ``batch_sampler`` and worker processes, which
    load batches ahead of the loop, its iterator tells the sampler each batch the loop
    takes, so that the sampler's step boundaries (an elastic job's snapshots, the trace's
    steps) and its :attr:`~DistributedBatchSampler.loss_scale` follow the loop (the
    module docstring). Without worker processes, or with another sampler, it is torch's
    as it is.

    Raises:
        ValueError: ``in_order=False`` with such a sampler and workers (batches could
            reach the loop out of order, and the sampler would not know which it trains).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        sampler = self.batch_sampler
        if isinstance(sampler, DistributedBatchSampler) and self.num_workers:
            if getattr(self, "in_order", True) is False:
                raise ValueError("DataLoader(in_order=False) hands batches to the loop out "
                                 "of order, so a DistributedBatchSampler cannot tell which "
                                 "it trains; leave in_order=True")

    def __iter__(self) -> Any:
        sampler = self.batch_sampler
        if not (isinstance(sampler, DistributedBatchSampler) and self.num_workers):
            return super().__iter__()
        # (the iteration torch's iterator starts, asking for its first batches ahead,
        # leaves the boundaries to this loader's iterator)
        sampler._loader_marks = True
        try:
            return _Taking(super().__iter__(), sampler)
        finally:
            sampler._loader_marks = False


class _Taking:
    """torch's iterator of a :class:`DataLoader` with workers, telling its sampler
    (:meth:`DistributedBatchSampler._taking`) before each batch it hands the loop; every
    other attribute is the iterator's."""

    def __init__(self, iterator: Any, sampler: DistributedBatchSampler) -> None:
        self._iterator = iterator
        self._sampler = sampler
        self._taken = 0

    def __iter__(self) -> _Taking:
        return self

    def __next__(self) -> Any:
        self._sampler._taking(self._taken)
        batch = next(self._iterator)
        self._taken += 1
        return batch

    def __len__(self) -> int:
        return len(self._iterator)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iterator, name)
