"""``MeshSampler``: this rank's sample indices, one list per step, from a position on.

A batch sampler for ``torch.utils.data.DataLoader(batch_sampler=...)``: for each
remaining global batch of the epoch (see :mod:`shardfn.data.order`) it yields the
indices of this rank's block (:mod:`shardfn.data.layout`). Ranks with the same data
index (tp, sp, pp peers) get the same lists; the blocks of all data ranks, in data
index order, are the global batch. :func:`shardfn.data.loader` wraps it and tracks
the position; use the sampler alone to drive a ``DataLoader`` of your own.

Example:
    >>> layout = split_global_batch(4, data_ranks=2, data_index=1)
    >>> list(MeshSampler(8, layout, shuffle=False))
    [[2, 3], [6, 7]]
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from shardfn.data.layout import BatchLayout
from shardfn.data.order import DataState, LastBatch, batches_left, check_state, epoch_order

__all__ = ["MeshSampler", "local_positions"]


def local_positions(offset: int, layout: BatchLayout) -> torch.Tensor:
    """Positions in the epoch's global order of this rank's block of the global batch that
    starts at ``offset`` (positions past the dataset's end are padding)."""
    start = offset + layout.local_start
    return torch.arange(start, start + layout.local_batch)


class MeshSampler(Sampler[list[int]]):
    """This rank's indices for the rest of the epoch at :attr:`state`.

    Args:
        num_samples: the dataset's length.
        layout: this rank's :class:`~shardfn.data.layout.BatchLayout`.
        seed: the data seed (orders depend on it and the epoch only).
        shuffle: a new permutation each epoch (False: the dataset's order).
        last_batch: ``"drop"`` the samples after the last full global batch, or
            ``"pad"`` the last batch with samples from the start of the epoch's order
            (:func:`padding_mask` says which are real).
        state: the position to start from (default: epoch 0, offset 0); checked against
            ``seed``, ``num_samples`` and ``shuffle``.

    Raises:
        ValueError: with ``"drop"``, a dataset smaller than one global batch (an epoch
            would have no batch); a bad ``last_batch`` or state.
    """

    def __init__(self, num_samples: int, layout: BatchLayout, *, seed: int = 0,
                 shuffle: bool = True, last_batch: LastBatch = "drop",
                 state: DataState | None = None):
        if last_batch not in ("drop", "pad"):
            raise ValueError(f"last_batch must be 'drop' or 'pad', got {last_batch!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be True or False, got {shuffle!r}")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"the dataset must have at least one sample, got {num_samples!r}")
        if last_batch == "drop" and num_samples < layout.global_batch:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than one global batch of "
                f"{layout.global_batch}: with last_batch='drop' an epoch would have no batch "
                "(use last_batch='pad', or a smaller global batch)")
        self.num_samples = num_samples
        self.layout = layout
        self.seed = seed
        self.shuffle = shuffle
        self.last_batch: LastBatch = last_batch
        self.state = self.start_state() if state is None else state

    @property
    def state(self) -> DataState:
        """The position the next ``iter()`` starts from."""
        return self._state

    @state.setter
    def state(self, state: DataState) -> None:
        self._state = check_state(state, seed=self.seed, num_samples=self.num_samples,
                                  shuffle=self.shuffle)

    def start_state(self, epoch: int = 0) -> DataState:
        """The position at the start of ``epoch``."""
        return DataState(self.seed, epoch, 0, self.num_samples, self.shuffle)

    def __len__(self) -> int:
        """The global batches left in the epoch from :attr:`state`."""
        return batches_left(self.state, self.layout.global_batch, self.last_batch)

    def __iter__(self) -> Iterator[list[int]]:
        state, layout = self.state, self.layout
        count = batches_left(state, layout.global_batch, self.last_batch)
        if count == 0:
            return
        order = epoch_order(self.num_samples, state.seed, state.epoch, state.shuffle)
        for k in range(count):
            positions = local_positions(state.offset + k * layout.global_batch, layout)
            yield order[positions % self.num_samples].tolist()

    def padding_mask(self, offset: int) -> torch.Tensor:
        """Which samples of this rank's block of the batch at ``offset`` are real (bool,
        ``local_batch`` long); False: padding that repeats a sample of the epoch."""
        return local_positions(offset, self.layout) < self.num_samples
