"""Under a pipeline, only what each stage reads: the inputs on the first, the targets on the last.

``sf.data.loader(dataset, mesh, ..., reads=sf.data.stage_reads(pp))`` yields each batch as a
:class:`StageBatch` ``(inputs, targets)`` with None for a side this pp rank does not read
(as Megatron builds data iterators only on its first and last stages): the rank of stage 0
gets the inputs, the rank of the last stage the targets (one rank holding both, as under
a schedule that puts the last stage with the first, gets both). A rank that reads neither
never indexes the dataset; one that reads one side indexes each of its samples once and
drops the other side before collation (no collation, pinning or copy of it). Every rank
keeps the same position (:class:`~shardfn.data.DataState`), so checkpoints and resume are
as without ``reads``.

How a sample splits into its two sides (``fields=``):

* None (default): the sample is a pair ``(inputs, targets)`` (``TokenFile``,
  ``TensorDataset(x, y)``);
* ``(inputs_key, targets_key)``: ``sample[key]`` for each (an int for a tuple sample, a
  string for a dict one); a key that is a tuple of keys gives a tuple (a dict, for a dict
  sample) of those fields: ``fields=(("input_ids", "attention_mask"), "labels")``;
* a callable ``sample -> (inputs, targets)``.

Example:
    >>> pp = sf.pipeline_stages(units, mesh, "pp", balance=[2, 2], microbatches=4,
    ...                         loss_fn=mse, dp_axis="dp")
    >>> data = sf.data.loader(dataset, mesh, global_batch=16, reads=sf.data.stage_reads(pp))
    >>> for inputs, targets in data:                   # None where this rank reads nothing
    ...     loss, grads = pp.value_and_grad(params, inputs, targets)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from torch.utils.data import Dataset, default_collate

from shardfn.transforms.pipeline.batch import StageReads

__all__ = ["FieldCollate", "Fields", "SampleFields", "StageBatch", "StageReads", "check_fields",
           "pick_fields", "stage_reads"]

Key = int | str | tuple
#: how a sample splits into ``(inputs, targets)`` (see the module docstring)
Fields = tuple[Key, Key] | Callable[[Any], tuple[Any, Any]] | None


class StageBatch(NamedTuple):
    """A batch as one pp rank reads it: None for a side it does not read.

    Attributes:
        inputs: the collated inputs (on the rank of stage 0), else None.
        targets: the collated targets (on the rank of the last stage), else None.
    """

    inputs: Any
    targets: Any


def stage_reads(model: Any) -> StageReads:
    """What this rank reads of each batch under ``model``'s pipeline (``pp.reads``).

    Args:
        model: a pipeline model (``sf.pipeline_stages(...)``) built on this rank.

    Returns:
        ``StageReads(inputs, targets)``: the inputs if this rank holds stage 0, the targets
        if it holds the last stage.

    Raises:
        TypeError: ``model`` is not a pipeline model.

    Example:
        >>> sf.data.stage_reads(pp)                    # rank 0 of a 2-stage 1F1B pipeline
        StageReads(inputs=True, targets=False)
    """
    reads = getattr(model, "reads", None)
    if not isinstance(reads, StageReads):
        raise TypeError(f"stage_reads takes a pipeline model (sf.pipeline_stages(...)), got "
                        f"{type(model).__name__}; or pass reads=sf.data.StageReads(inputs=..., "
                        "targets=...) yourself")
    return reads


def _check_key(key: Any) -> None:
    keys = key if isinstance(key, tuple) else (key,)
    if not keys or not all(isinstance(k, (int, str)) and not isinstance(k, bool) for k in keys):
        raise TypeError(f"fields: a key must be an int (a tuple sample), a str (a dict sample) "
                        f"or a non-empty tuple of them, got {key!r}")


def check_fields(fields: Any) -> Fields:
    """``fields`` if it is one of the forms of the module docstring, else a TypeError."""
    if fields is None or callable(fields):
        return fields
    if isinstance(fields, (tuple, list)) and len(fields) == 2:
        _check_key(fields[0])
        _check_key(fields[1])
        return tuple(fields)
    raise TypeError(f"fields= must be None (samples are (inputs, targets) pairs), a pair "
                    f"(inputs_key, targets_key) or a callable sample -> (inputs, targets), "
                    f"got {fields!r}")


def _take(sample: Any, key: Key) -> Any:
    if not isinstance(key, tuple):
        try:
            return sample[key]
        except (KeyError, IndexError, TypeError) as error:
            raise KeyError(f"fields: a sample of type {type(sample).__name__} has no field "
                           f"{key!r} ({error!r})") from None
    if isinstance(sample, Mapping):
        return {k: _take(sample, k) for k in key}
    return tuple(_take(sample, k) for k in key)


def pick_fields(sample: Any, fields: Fields) -> tuple[Any, Any]:
    """``(inputs, targets)`` of one sample.

    Args:
        sample: what the dataset returned for one index.
        fields: see the module docstring.

    Returns:
        The two sides.

    Raises:
        TypeError: with ``fields=None``, a sample that is not a pair (naming what it is).
        KeyError: a key the sample does not have.

    Example:
        >>> pick_fields({"ids": 1, "mask": 2, "labels": 3}, (("ids", "mask"), "labels"))
        ({'ids': 1, 'mask': 2}, 3)
    """
    if fields is None:
        if isinstance(sample, Sequence) and not isinstance(sample, str) and len(sample) == 2:
            return sample[0], sample[1]
        what = f"a {type(sample).__name__} of {len(sample)}" if isinstance(sample, Sequence) \
            else f"a {type(sample).__name__}"
        raise TypeError(f"reads=: a sample of the dataset is {what}, not an (inputs, targets) "
                        "pair; say which fields are which with fields=(inputs_key, "
                        "targets_key) or fields=lambda sample: (inputs, targets)")
    if callable(fields):
        found = fields(sample)
        if not isinstance(found, tuple) or len(found) != 2:
            raise TypeError(f"fields= must return an (inputs, targets) pair, got "
                            f"{type(found).__name__}")
        return found
    return _take(sample, fields[0]), _take(sample, fields[1])


class SampleFields(Dataset):
    """``dataset`` whose items are ``(inputs or None, targets or None)``: the sides a rank
    reads (:func:`pick_fields`), the rest dropped before collation."""

    def __init__(self, dataset: Dataset, fields: Fields, reads: StageReads):
        self.dataset, self.fields, self.reads = dataset, fields, reads

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        inputs, targets = pick_fields(self.dataset[index], self.fields)
        return (inputs if self.reads.inputs else None, targets if self.reads.targets else None)


class FieldCollate:
    """Collate each side that is read on its own (``collate_fn``, default
    ``torch.utils.data.default_collate``) into a :class:`StageBatch`."""

    def __init__(self, reads: StageReads, collate_fn: Callable | None = None):
        self.reads, self.collate_fn = reads, collate_fn or default_collate

    def __call__(self, samples: list[tuple[Any, Any]]) -> StageBatch:
        inputs = self.collate_fn([s[0] for s in samples]) if self.reads.inputs else None
        targets = self.collate_fn([s[1] for s in samples]) if self.reads.targets else None
        return StageBatch(inputs, targets)
