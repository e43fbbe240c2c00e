"""The global sample order and the loader's position in it (:class:`DataState`).

Every epoch has one global order of the dataset's indices, drawn from ``(seed,
epoch)`` alone: a permutation (or ``0..n-1`` without shuffling) that does not depend
on the world size, the mesh or the number of workers. Global batch ``k`` of an epoch
is the slice ``[k * global_batch, (k + 1) * global_batch)`` of that order, so the
same seed gives the same global batches on 1, 2 or 4 data ranks, and a position is
just ``(epoch, offset)``: how many samples of the epoch's order were consumed.

Example:
    >>> epoch_order(5, seed=0, epoch=0, shuffle=False).tolist()
    [0, 1, 2, 3, 4]
    >>> sorted(epoch_order(5, seed=0, epoch=1).tolist())
    [0, 1, 2, 3, 4]
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import torch

__all__ = ["DataState", "LastBatch", "batches_left", "check_state", "epoch_order",
           "epoch_seed", "mix_seed"]

#: what happens to the samples after the last full global batch of an epoch:
#: ``"drop"`` leaves them out, ``"pad"`` fills the batch up with samples from the start
#: of the epoch's order and marks them (``Padded.mask``) so a loss can leave them out
LastBatch = Literal["drop", "pad"]


class DataState(NamedTuple):
    """The loader's position: everything needed to continue its exact global order.

    Ints and a bool only, equal on every rank (``sf.checkpoint.save`` stores it once,
    as a replicated leaf, and checks the ranks agree): it loads on any number of data
    ranks.

    Attributes:
        seed: the seed the orders are drawn from.
        epoch: the current epoch (0 first).
        offset: samples of this epoch's global order already handed out.
        num_samples: the dataset's length the orders were drawn for (a resume onto a
            dataset of another length would continue another order: refused).
        shuffle: whether the order is a permutation (else ``0..num_samples-1``).
    """

    seed: int
    epoch: int
    offset: int
    num_samples: int
    shuffle: bool


def mix_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (a hash: no two tuples collide in practice, unlike
    ``seed + epoch``)."""
    text = ":".join(["shardfn.data", *map(str, parts)])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of ``epoch``'s order."""
    return mix_seed("order", seed, epoch)


def epoch_order(num_samples: int, seed: int = 0, epoch: int = 0, shuffle: bool = True
                ) -> torch.Tensor:
    """The global order of ``epoch``: an int64 tensor of the ``num_samples`` indices.

    Args:
        num_samples: the dataset's length.
        seed: the run's data seed.
        epoch: the epoch.
        shuffle: False: ``arange(num_samples)``.

    Returns:
        The indices in the order they are read (``torch.randperm`` with a generator
        seeded by :func:`epoch_seed`; 8 bytes per sample, made once per epoch).
    """
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator)


def batches_left(state: DataState, global_batch: int, last_batch: LastBatch) -> int:
    """How many global batches of ``state``'s epoch remain after its offset: whole ones
    only (``"drop"``), or up to the last sample, the final one filled up (``"pad"``)."""
    remaining = state.num_samples - state.offset
    return remaining // global_batch if last_batch == "drop" else -(-remaining // global_batch)


def _int_field(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"data state: {name} must be an int >= {low}, got {value!r}")
    return int(value)


def check_state(state: DataState | Mapping[str, Any], *, seed: int, num_samples: int,
                shuffle: bool) -> DataState:
    """``state`` as a :class:`DataState`, checked against the loader it resumes.

    Args:
        state: a :class:`DataState` (as ``sf.checkpoint.load`` returns it) or a mapping
            with its fields (``state._asdict()``).
        seed, num_samples, shuffle: the loader's own.

    Returns:
        The state.

    Raises:
        TypeError: for something that is not a state.
        ValueError: a field out of range, or a seed, length or shuffle flag that differs
            from the loader's (both values named): it would continue another order.
    """
    if isinstance(state, Mapping):
        missing = [f for f in DataState._fields if f not in state]
        if missing:
            raise TypeError(f"data state: the mapping lacks {missing}; a state has the "
                            f"fields {DataState._fields}")
        state = DataState(**{f: state[f] for f in DataState._fields})
    if not isinstance(state, DataState):
        raise TypeError(f"data state must be a shardfn.data.DataState (or its _asdict()), "
                        f"got {type(state).__name__}")
    checked = DataState(_int_field("seed", state.seed, 0), _int_field("epoch", state.epoch, 0),
                        _int_field("offset", state.offset, 0),
                        _int_field("num_samples", state.num_samples, 1), state.shuffle)
    if not isinstance(checked.shuffle, bool):
        raise ValueError(f"data state: shuffle must be True or False, got {checked.shuffle!r}")
    for field, own in (("seed", seed), ("num_samples", num_samples), ("shuffle", shuffle)):
        if getattr(checked, field) != own:
            raise ValueError(
                f"data state: {field}={getattr(checked, field)!r} was saved, but this loader "
                f"has {field}={own!r}; resuming would continue another global order (build "
                f"the loader with the saved {field}, over the same dataset)")
    if checked.offset > num_samples:
        raise ValueError(f"data state: offset={checked.offset} is past the end of an epoch of "
                         f"num_samples={num_samples}")
    return checked
