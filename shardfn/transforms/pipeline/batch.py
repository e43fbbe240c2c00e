"""A pipeline batch of several tensors: the first unit's positional and keyword inputs.

``value_and_grad(params, inputs, targets)`` and ``apply(params, inputs)`` take ``inputs``
as one tensor (the first unit's one argument), a tuple or list (its positional
arguments), a dict (its keyword arguments) or a :class:`UnitInputs` (both), as
``torch.distributed.pipelining``'s ``schedule.step(*args, **kwargs)`` does. ``targets``
is None, a tensor, or a tuple/list/dict of them (any nesting): ``loss_fn`` gets each
micro-batch's piece of it whole.

Every tensor leaf is split on dim 0 into the micro-batches (``torch.tensor_split``: sizes
differ by at most one), so micro-batch ``i`` holds the same rows of every leaf. Unlike
torch's ``split_args_kwargs_into_chunks``, which cuts each tensor into chunks on its own,
every tensor leaf of the inputs and targets must have the batch's rows: leaves of other
lengths would pair unrelated rows, so they are refused naming the leaf. Values that are
not tensors (None, ints, strings) go whole to every micro-batch; a 0-dim tensor has no
rows to split and is refused (pass a Python number instead).

Example:
    >>> x, mask = torch.randn(6, 4), torch.ones(6, 4)
    >>> pieces = split_microbatches(as_unit_inputs({"x": x, "mask": mask, "scale": 2}), 3)
    >>> pieces[0].kwargs["x"].shape, pieces[0].kwargs["scale"]
    (torch.Size([2, 4]), 2)
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from shardfn import pytree as pt
from shardfn.transforms.pipeline.values import describe

__all__ = ["READS_ALL", "StageReads", "UnitInputs", "as_unit_inputs", "batch_digest", "batch_rows",
           "batch_signature", "call_unit", "check_batch", "microbatch_rows", "shape_digest",
           "split_microbatches"]

#: plain values that go whole to every micro-batch and are compared by value across ranks
_PLAIN = (int, float, bool, str, type(None))
#: the keyword ``FunctionalModel.apply`` keeps for itself
_RESERVED = "mutable"


class StageReads(NamedTuple):
    """What one pp rank reads of a batch: the inputs if it holds stage 0, the targets if it
    holds the last stage (both on one pp rank, or under a schedule that places the last
    stage with the first; neither on a middle rank). A side it does not read may be None.

    Example:
        >>> pp.reads                                   # on the rank of stage 0 of 2 ranks
        StageReads(inputs=True, targets=False)
    """

    inputs: bool
    targets: bool


#: a rank that reads the whole batch (one rank holding every stage)
READS_ALL = StageReads(True, True)


class UnitInputs(NamedTuple):
    """The first unit's arguments: ``unit(*args, **kwargs)`` (of the whole batch, or of one
    micro-batch once split).

    Example:
        >>> UnitInputs((x,), {"mask": mask})       # first unit: forward(x, mask=mask)
    """

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = {}


def as_unit_inputs(inputs: Any) -> Any:
    """``inputs`` as the runtime takes them: a tensor (or anything unchecked) as given, a
    tuple/list as positional arguments, a dict as keyword arguments. Never raises (it runs
    before the step's checks, on every rank alike).

    Example:
        >>> as_unit_inputs((x, mask))
        UnitInputs(args=(tensor(...), tensor(...)), kwargs={})
    """
    if isinstance(inputs, UnitInputs):
        return inputs
    if isinstance(inputs, (tuple, list)):
        return UnitInputs(tuple(inputs), {})
    if isinstance(inputs, Mapping):
        return UnitInputs((), dict(inputs))
    return inputs


def call_unit(apply: Callable[..., Any], params: Mapping[str, torch.Tensor], x: Any,
              **options: Any) -> Any:
    """``apply(params, x, **options)``; for :class:`UnitInputs` ``x``, its arguments spread.

    Example:
        >>> call_unit(model.apply, params, UnitInputs((x,), {"mask": m}), mutable=True)
    """
    if isinstance(x, UnitInputs):
        return apply(params, *x.args, **x.kwargs, **options)
    return apply(params, x, **options)


def _named_leaves(tree: Any, what: str) -> list[tuple[str, Any]]:
    """``(name, leaf)`` per leaf: ``"inputs"`` for a bare tensor, ``"inputs.mask"``,
    ``"inputs.args.0"`` (a :class:`UnitInputs`) or ``"targets.1"`` inside a pytree."""
    names, leaves, _ = pt.tree_flatten_with_path(tree)
    return [(what if name == "<root>" else f"{what}.{name}", leaf)
            for name, leaf in zip(names, leaves, strict=True)]


def batch_rows(tree: Any) -> int:
    """Rows on dim 0 of the first tensor leaf with a dim (the batch size of a checked batch);
    -1 when there is none, -2 for None.

    Example:
        >>> batch_rows({"x": torch.zeros(6, 4), "n": 3})
        6
    """
    if tree is None:
        return -2
    for leaf in pt.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.dim():
            return int(leaf.shape[0])
    return -1


def microbatch_rows(rows: int, m: int, i: int) -> int:
    """Rows of micro-batch ``i`` when ``rows`` are split into ``m`` (``torch.tensor_split``:
    the first ``rows % m`` get one more).

    Example:
        >>> [microbatch_rows(5, 3, i) for i in range(3)]
        [2, 2, 1]
    """
    return rows // m + (1 if i < rows % m else 0)


def _leaf_text(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"rows {leaf.shape[0]}" if leaf.dim() else "0-dim"
    return repr(leaf) if isinstance(leaf, _PLAIN) else type(leaf).__name__


def batch_digest(tree: Any) -> int:
    """A 31-bit digest of ``tree``'s structure, every tensor leaf's rows and every plain
    value: what pp ranks compare to see that they were given the same batch (the tensor
    values are compared only in check mode).

    Example:
        >>> batch_digest((torch.zeros(4), 1)) == batch_digest((torch.ones(4), 1))
        True
    """
    _, leaves, spec = pt.tree_flatten_with_path(tree)
    text = f"{spec}|" + "|".join(_leaf_text(leaf) for leaf in leaves)
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def batch_signature(tree: Any) -> tuple | None:
    """What inferred shapes are cached under for one side of the batch: the structure, each
    tensor leaf's shape and dtype and each plain value; None (no cache) when a leaf is
    something else (it might change the activations' shapes unseen).

    Example:
        >>> batch_signature({"x": torch.zeros(2, 3)})
        ("PyTreeSpec({'x': *})", (((2, 3), torch.float32),))
    """
    leaves, spec = pt.tree_flatten(tree)
    found = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            found.append((tuple(leaf.shape), leaf.dtype))
        elif isinstance(leaf, _PLAIN):
            found.append((type(leaf).__name__, leaf))
        else:
            return None
    return str(spec), tuple(found)


def shape_digest(tree: Any) -> int:
    """A 63-bit digest of :func:`batch_signature` (structure, each tensor leaf's shape and
    dtype, each plain value): pp ranks that pass a side compare it, and the shapes a first
    step inferred are cached under the agreed digests, the same key on every pp rank
    (also on one that passed None); -1 when there is no signature (nothing cached).

    Example:
        >>> shape_digest(torch.zeros(2, 3)) == shape_digest(torch.ones(2, 3))
        True
    """
    found = batch_signature(tree)
    if found is None:
        return -1
    return int.from_bytes(hashlib.blake2b(repr(found).encode(), digest_size=8).digest(),
                          "little") & 0x7FFFFFFFFFFFFFFF


def _check_rows(tree: Any, what: str, rows: int | None) -> int | None:
    """The rows every tensor leaf of ``tree`` has (``rows`` if given), or None (no tensor).

    Raises:
        ValueError: a 0-dim tensor leaf, or a leaf whose rows differ (naming both leaves).
    """
    first = None if rows is None else "the inputs"
    for name, leaf in _named_leaves(tree, what):
        if not isinstance(leaf, torch.Tensor):
            continue
        if leaf.dim() == 0:
            raise ValueError(f"pipeline {name} is a 0-dim tensor: it has no batch dim 0 to "
                             "split into micro-batches; give it a batch dim, or pass a Python "
                             "number (given whole to every micro-batch)")
        if rows is None:
            rows, first = int(leaf.shape[0]), name
        elif leaf.shape[0] != rows:
            raise ValueError(f"pipeline {name} has {leaf.shape[0]} rows on dim 0, but "
                             f"{first} {'have' if first == 'the inputs' else 'has'} {rows}: "
                             "every tensor of the inputs and targets is split on dim 0 into "
                             "the same micro-batches, so all need the batch's rows (pass a "
                             "value that is not per row as a Python number)")
    return rows


def _check_inputs(inputs: Any) -> int:
    """The batch size of ``inputs`` (see the module docstring), or raise."""
    kinds = ("a tensor with a batch dim 0, a tuple/list of tensors (the first unit's "
             "positional arguments), a dict of them (its keyword arguments) or a UnitInputs")
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 0:
        raise TypeError(f"pipeline inputs must be {kinds}, got a 0-dim tensor")
    if not isinstance(inputs, (torch.Tensor, tuple, list, Mapping)):
        raise TypeError(f"pipeline inputs must be {kinds}, got {type(inputs).__name__}")
    kwargs = inputs.kwargs if isinstance(inputs, UnitInputs) else \
        inputs if isinstance(inputs, Mapping) else {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"pipeline UnitInputs.kwargs must be a dict, got "
                        f"{type(kwargs).__name__}")
    bad = [k for k in kwargs if not isinstance(k, str) or k == _RESERVED]
    if bad:
        raise TypeError(f"pipeline inputs: keyword names {bad} cannot be given to the first "
                        f"unit (names must be strings, and {_RESERVED!r} is the "
                        "functional model's own keyword)")
    rows = _check_rows(inputs, "inputs", None)
    if rows is None:
        raise TypeError(f"pipeline inputs hold no tensor, so there is no batch to split into "
                        f"micro-batches: give {kinds}")
    return rows


def check_batch(inputs: Any, targets: Any, microbatches: int, declared: bool,
                reads: StageReads = READS_ALL) -> int:
    """Refuse a batch the step cannot split (on this rank); return its rows.

    Args:
        inputs: the batch's inputs (see the module docstring); None on a pp rank that does
            not read them (``reads.inputs`` False).
        targets: None, a tensor, or a tuple/list/dict pytree of them.
        microbatches: the micro-batch count.
        declared: ``shapes=`` was declared (the batch must split evenly).
        reads: what this pp rank reads (whether it holds stage 0 and the last stage).

    Returns:
        The batch's rows (the inputs', else the targets'); -2 when this rank was given
        neither (it reads neither: nothing to check).

    Raises:
        TypeError: inputs of another kind, a 0-dim tensor, no tensor at all, keyword names
            that are not strings (or ``"mutable"``).
        ValueError: None inputs on a rank that reads them, tensor leaves whose rows differ
            (naming the leaf), fewer rows than micro-batches, targets of another batch
            size, or a batch that does not split evenly when shapes were declared.

    Example:
        >>> check_batch({"x": torch.zeros(4, 2), "mask": torch.ones(4)}, torch.zeros(4), 2,
        ...             False)
        4
        >>> check_batch(None, torch.zeros(4), 2, False, StageReads(False, True))
        4
    """
    m = microbatches
    if inputs is None and reads.inputs:
        raise ValueError("pipeline: this pp rank holds stage 0, which reads the inputs, but "
                         "was given inputs=None; pass the batch's inputs here (only ranks "
                         "without stage 0 may pass None)")
    if inputs is not None:
        batch = _check_inputs(inputs)
    elif isinstance(targets, (tuple, list, Mapping)):
        batch = _check_rows(targets, "targets", None)
        if batch is None:
            return -2
    elif isinstance(targets, torch.Tensor) and targets.dim():
        batch = int(targets.shape[0])
    elif targets is None:
        return -2
    else:
        raise ValueError(f"pipeline targets must be a tensor with a batch dim 0 (or a "
                         f"tuple/list/dict of such tensors), got {describe(targets)}")
    if batch < m:
        raise ValueError(f"pipeline: a batch of {batch} rows cannot be split into {m} "
                         "micro-batches (each needs at least one row)")
    if isinstance(targets, (tuple, list, Mapping)):
        _check_rows(targets, "targets", batch)
    elif targets is not None and (not isinstance(targets, torch.Tensor)
                                  or targets.dim() == 0 or targets.shape[0] != batch):
        raise ValueError(f"pipeline targets must be a tensor with the inputs' batch size "
                         f"{batch} on dim 0 (or a tuple/list/dict of such tensors), got "
                         f"{describe(targets)}")
    if declared and batch % m:
        raise ValueError(f"pipeline: shapes= declares one shape per micro-batch, so the "
                         f"batch ({batch} rows) must split evenly into {m} micro-batches")
    return batch


def split_microbatches(tree: Any, m: int) -> list[Any]:
    """``m`` micro-batches of ``tree``: every tensor leaf split on dim 0
    (``torch.tensor_split``: sizes differ by at most one), every other leaf whole in each.

    Args:
        tree: a tensor, None, or a pytree (a :class:`UnitInputs`, a tuple, a dict ...),
            checked by :func:`check_batch` beforehand.
        m: the micro-batch count.

    Returns:
        ``m`` trees of ``tree``'s structure.

    Example:
        >>> [len(piece) for piece in split_microbatches(torch.zeros(5, 2), 2)]
        [3, 2]
        >>> split_microbatches({"x": torch.arange(4), "n": 7}, 2)[1]
        {'x': tensor([2, 3]), 'n': 7}
    """
    leaves, spec = pt.tree_flatten(tree)
    pieces = [torch.tensor_split(leaf, m, dim=0) if isinstance(leaf, torch.Tensor)
              else (leaf,) * m for leaf in leaves]
    return [pt.tree_unflatten(spec, [piece[i] for piece in pieces]) for i in range(m)]
