"""``loader``: a ``torch.utils.data.DataLoader`` laid out by the mesh, with a position.

``sf.data.loader(dataset, mesh, global_batch=...)`` gives each rank its block of every
global batch (:mod:`shardfn.data.layout`), in a global order drawn from one seed
(:mod:`shardfn.data.order`), and keeps its position as a :class:`DataState` that
``sf.checkpoint`` saves and loads: a loader built with ``state=`` continues the exact
global order, on any number of data ranks, with any number of workers.

The batches are loaded by a plain ``DataLoader`` over :class:`MeshSampler` (workers,
``collate_fn``, ``pin_memory`` as usual); the position counts the batches handed to
the caller, not those the workers prefetched. Under a pipeline, ``reads=`` loads only
what this pp rank reads (:mod:`shardfn.data.fields`).

Example:
    >>> data = loader(dataset, mesh, global_batch=32, accumulation=2, seed=0)
    >>> for batch in data:                     # one epoch from the position
    ...     params, opt_state = step(params, opt_state, batch)
    ...     state = {"params": params, "opt": opt_state, "data": data.state}
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from shardfn.data.fields import (
    FieldCollate,
    Fields,
    SampleFields,
    StageBatch,
    StageReads,
    check_fields,
)
from shardfn.data.layout import BatchLayout, batch_layout
from shardfn.data.order import DataState, LastBatch, batches_left, mix_seed
from shardfn.data.sampler import MeshSampler
from shardfn.mesh import AxisName, Mesh

__all__ = ["MeshLoader", "Padded", "loader", "worker_context"]


def worker_context() -> str | None:
    """The start method of the loader's workers when none is given: ``"fork"`` on Linux
    in a process that multiprocessing started with ``spawn`` (it inherits ``spawn`` as
    its default, and each spawned worker would import torch and shardfn again: tens of
    seconds on a busy machine); else None, the process's own default.

    Example:
        >>> worker_context()   # the main process of a script: its default
    """
    spawned = multiprocessing.parent_process() is not None and \
        multiprocessing.get_start_method(allow_none=True) == "spawn"
    return "fork" if sys.platform.startswith("linux") and spawned else None


class Padded(NamedTuple):
    """A batch of a ``last_batch="pad"`` loader: the data and which samples are real.

    Attributes:
        data: the collated batch (``local_batch`` samples).
        mask: bool, ``(local_batch,)``: False where the sample is padding (a repeat of
            one from the start of the epoch), only in an epoch's last batch.
    """

    data: Any
    mask: torch.Tensor

    @property
    def weight(self) -> int:
        """The number of real samples (for ``data_parallel(...).reduce_grads(weight=)``)."""
        return int(self.mask.sum())


class MeshLoader:
    """Iterates one epoch from its position; see :func:`loader` (which builds it).

    Attributes:
        dataset: the map-style dataset.
        layout: this rank's :class:`~shardfn.data.layout.BatchLayout`.
        sampler: the :class:`MeshSampler` the ``DataLoader`` reads.
        dataloader: the ``torch.utils.data.DataLoader``; None on a pp rank that reads
            nothing (``reads=StageReads(False, False)``: it yields ``StageBatch(None,
            None)`` and never indexes the dataset).
        reads: what this rank reads of each sample (``reads=``), or None: all of it.
    """

    def __init__(self, dataset: Dataset, layout: BatchLayout, sampler: MeshSampler,
                 dataloader_kwargs: dict[str, Any], reads: StageReads | None = None,
                 fields: Fields = None):
        self.dataset = dataset
        self.layout = layout
        self.sampler = sampler
        self.reads = reads
        self._state = sampler.state
        self._generation = 0  # which iterator may advance the position
        self._generator = torch.Generator()  # workers' base seed: never torch's global RNG
        if reads is not None:  # each sample cut to the sides this rank reads, each collated
            dataset = SampleFields(dataset, fields, reads)
            dataloader_kwargs = {**dataloader_kwargs, "collate_fn": FieldCollate(
                reads, dataloader_kwargs.get("collate_fn"))}
        self.dataloader = None if reads is not None and not any(reads) else DataLoader(
            dataset, batch_sampler=sampler, generator=self._generator, **dataloader_kwargs)

    @property
    def state(self) -> DataState:
        """The position after the batches handed out so far (save it after the step that
        used the last one; a loader built with ``state=`` continues after it)."""
        return self._state

    def load_state(self, state: DataState) -> None:
        """Continue from ``state`` (checked as in :func:`loader`); an iterator already
        running stops with an error at its next batch."""
        self.sampler.state = state
        self._state = self.sampler.state
        self._generation += 1

    @property
    def batches_per_epoch(self) -> int:
        """Global batches in a whole epoch."""
        return batches_left(self.sampler.start_state(), self.layout.global_batch,
                            self.sampler.last_batch)

    def __len__(self) -> int:
        """The batches the next ``for`` loop yields: the rest of the current epoch (or the
        whole next one when this one is done)."""
        left = batches_left(self._state, self.layout.global_batch, self.sampler.last_batch)
        return left or self.batches_per_epoch

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch; after its last batch the position is the start
        of the next epoch. Starting a new iterator retires the previous one."""
        self._generation += 1
        return self._epoch(self._generation)

    def _epoch(self, generation: int) -> Iterator[Any]:
        global_batch, pad = self.layout.global_batch, self.sampler.last_batch == "pad"
        state = self._state
        if batches_left(state, global_batch, self.sampler.last_batch) == 0:
            state = self._state = self.sampler.start_state(state.epoch + 1)
        count = batches_left(state, global_batch, self.sampler.last_batch)
        self.sampler.state = state
        self._generator.manual_seed(mix_seed("workers", state.seed, state.epoch,
                                             self.layout.data_index))
        batches = iter(self.dataloader) if self.dataloader is not None else None
        for k in range(count):
            self._check_current(generation)
            data = StageBatch(None, None) if batches is None else next(batches)
            self._check_current(generation)
            offset = state.offset + k * global_batch
            self._state = state._replace(offset=offset + global_batch) if k + 1 < count \
                else self.sampler.start_state(state.epoch + 1)
            yield Padded(data, self.sampler.padding_mask(offset)) if pad else data

    def _check_current(self, generation: int) -> None:
        if generation != self._generation:
            raise RuntimeError("this loader iterator was retired: a newer iter(loader) or "
                               "load_state() moved the loader's position; iterate the newest")

    def __repr__(self) -> str:
        s, layout = self._state, self.layout
        return (f"MeshLoader(global_batch={layout.global_batch}, microbatch={layout.microbatch}"
                f", accumulation={layout.accumulation}, data rank {layout.data_index} of "
                f"{layout.data_ranks}, epoch={s.epoch}, offset={s.offset}/{s.num_samples})")


def loader(dataset: Dataset, mesh: Mesh | None = None, *, global_batch: int,
           data_axes: AxisName = ("dp",), microbatch: int | None = None,
           accumulation: int = 1, shuffle: bool = True, seed: int = 0,
           last_batch: LastBatch = "drop", state: DataState | None = None,
           reads: StageReads | None = None, fields: Fields = None,
           num_workers: int = 0, collate_fn: Callable | None = None,
           pin_memory: bool = False, **dataloader_kwargs: Any) -> MeshLoader:
    """A loader that gives this rank its block of every global batch, and resumes exactly.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``; any
            ``torch.utils.data.Dataset``, e.g. :class:`~shardfn.data.TokenFile`). Its items
            must depend on the index alone for the order to be exact (draw random
            augmentations from a generator seeded by the index).
        mesh: the mesh; None: one process.
        global_batch: samples per optimizer step over all data ranks.
        data_axes: the axes the batch is split over (``"dp"``; HSDP ``("replica", "dp")``);
            ranks that differ only on other axes (tp, sp, pp) get the same batches.
        microbatch: samples per micro-batch (default: what ``global_batch`` leaves).
        accumulation: micro-batches per step; each batch holds ``microbatch *
            accumulation`` samples (``sf.accumulate_grads(fn, accumulation)`` splits it).
        shuffle: a new permutation of the dataset every epoch.
        seed: the data seed; the order depends on it and the epoch only.
        last_batch: ``"drop"`` the samples after the last full global batch, or ``"pad"``:
            fill it up with repeats and yield every batch as :class:`Padded`.
        state: a :class:`DataState` to continue from (``loader.state`` as saved).
        reads: under a pipeline, what this pp rank reads (``sf.data.stage_reads(pp)``):
            each batch is then a :class:`~shardfn.data.StageBatch` ``(inputs, targets)``
            with None for a side it does not read, and a rank that reads neither never
            indexes the dataset (:mod:`shardfn.data.fields`). None: whole samples, as
            collated.
        fields: with ``reads``, how a sample splits into ``(inputs, targets)``: None (it is
            a pair), ``(inputs_key, targets_key)`` or a callable ``sample -> (inputs,
            targets)``; each side is collated on its own by ``collate_fn``.
        num_workers, collate_fn, pin_memory, **dataloader_kwargs: for the
            ``DataLoader`` (``prefetch_factor``, ``persistent_workers``,
            ``worker_init_fn``, ``multiprocessing_context``, ``timeout``, ...). With
            workers and no ``multiprocessing_context``, a process that ``spawn`` started
            on Linux (a local-world rank, ``torch.multiprocessing.spawn``) starts them
            with ``"fork"``, torchrun's default there (see :func:`worker_context`).

    Returns:
        A :class:`MeshLoader`: ``for batch in it`` runs the rest of the epoch;
        ``it.state`` is the position.

    Raises:
        ValueError: ``global_batch != microbatch x accumulation x data ranks`` (naming all
            four), a data axis not in the mesh, a dataset smaller than a global batch
            with ``"drop"``, or a ``state`` of another seed, dataset length or shuffle.
        TypeError: an iterable-style dataset, DataLoader options this loader sets, or
            ``reads``/``fields`` of another kind.

    Example:
        >>> mesh = sf.Mesh({"dp": 2, "tp": 2})
        >>> data = sf.data.loader(sf.data.TokenFile("train.bin", 256), mesh,
        ...                       global_batch=64, accumulation=4, seed=0)
        >>> inputs, targets = next(iter(data))   # 8 x 256 each; tp peers alike
        >>> data = sf.data.loader(dataset, mesh, global_batch=64, reads=sf.data.stage_reads(pp))
    """
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__") \
            or not hasattr(dataset, "__len__"):
        raise TypeError(f"loader takes a map-style dataset (__getitem__ and __len__), got "
                        f"{type(dataset).__name__}; an iterable dataset has no index to "
                        "lay out over the mesh or to resume from")
    taken = sorted({"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last",
                    "generator"} & set(dataloader_kwargs))
    if taken:
        raise TypeError(f"loader sets the DataLoader's {taken} itself: use global_batch, "
                        "microbatch, accumulation, shuffle, seed and last_batch")
    layout = batch_layout(mesh, data_axes, global_batch=global_batch, microbatch=microbatch,
                          accumulation=accumulation)
    sampler = MeshSampler(len(dataset), layout, seed=seed, shuffle=shuffle,
                          last_batch=last_batch, state=state)
    if reads is not None and not isinstance(reads, StageReads):
        raise TypeError(f"reads= must be a StageReads (sf.data.stage_reads(pp)), got "
                        f"{type(reads).__name__}")
    if reads is None and fields is not None:
        raise TypeError("fields= says how samples split into (inputs, targets) for reads=; "
                        "without reads= the loader yields whole samples")
    if num_workers > 0 and dataloader_kwargs.get("multiprocessing_context") is None:
        dataloader_kwargs["multiprocessing_context"] = worker_context()
    kwargs = dict(num_workers=num_workers, collate_fn=collate_fn, pin_memory=pin_memory,
                  **dataloader_kwargs)
    return MeshLoader(dataset, layout, sampler, kwargs, reads, check_fields(fields))
