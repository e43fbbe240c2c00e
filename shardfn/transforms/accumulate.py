"""`accumulate_grads`: gradient accumulation over micro-batches with no communication.

``accumulate_grads(grad_fn, k)`` splits a batch into ``k`` equal micro-batches
along dim 0, calls ``grad_fn`` on each and averages the results locally. No
collective runs inside, so pairing it with ``data_parallel``'s
``reduce_grads`` or a ``shard_opt_state`` optimizer gives exactly one gradient
reduction per optimizer step (DDP/FSDP ``no_sync`` semantics): ``k`` times fewer
collectives than reducing every micro-batch, for one accumulated gradient tree
of memory.

For equal micro-batches and a loss that is a mean over the batch, the result
equals ``grad_fn`` on the whole batch (up to float round-off). Only the running
sum stays alive between micro-batches. ``ShardedModel.accumulate_grads`` is built
on it (``reduce_each``: as is; ``reduce_once``: with the unit reductions held back
until after the last micro-batch).

Example:
    >>> step_grads = sf.accumulate_grads(torch.func.grad_and_value(loss), 4)
    >>> grads, loss_value = step_grads(params, batch)
    >>> updates, state = opt.update(grads, state, params)   # one reduction
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardfn import pytree
from shardfn.primitives.reduced import carry_marks, marks_of

__all__ = ["accumulate_grads", "split_batch"]


def split_batch(batch: Any, k: int) -> list:
    """Split every tensor leaf of ``batch`` into ``k`` equal pieces along dim 0.

    Raises:
        ValueError: naming the leaf whose dim 0 does not divide by ``k``.
    """
    names, leaves, treedef = pytree.tree_flatten_with_path(batch)
    for name, leaf in zip(names, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.shape[0] % k:
            shape = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise ValueError(f"accumulate_grads: batch leaf {name!r} ({shape}) cannot be split "
                             f"into {k} equal micro-batches along dim 0")
    pieces = [leaf.chunk(k) for leaf in leaves]
    return [pytree.tree_unflatten(treedef, [p[i] for p in pieces]) for i in range(k)]


def accumulate_grads(grad_fn: Callable, num_micro_batches: int) -> Callable:
    """Average ``grad_fn(params, micro_batch, *rest)`` over equal micro-batches of the batch.

    Args:
        grad_fn: returns a gradient tree, or any tree of tensors (e.g. the
            ``(grads, loss)`` of ``torch.func.grad_and_value``); every tensor leaf
            is averaged.
        num_micro_batches: ``k``; dim 0 of every batch leaf must divide by it.

    Returns:
        ``fn(params, batch, *rest)`` with ``grad_fn``'s output structure.

    Example:
        >>> grads = sf.accumulate_grads(torch.func.grad(loss), 2)(params, batch)
    """
    if not isinstance(num_micro_batches, int) or num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be an int >= 1, got {num_micro_batches!r}")

    def fn(params, batch, *rest):
        total, marks = None, []
        for micro in split_batch(batch, num_micro_batches):
            out = grad_fn(params, micro, *rest)
            if total is None:  # shard_params' gradient shards stay marked (what they are:
                marks = marks_of(pytree.tree_leaves(out))  # reduced and sharded over its axis)
            total = out if total is None else pytree.tree_map(torch.add, total, out)
            del out  # only the running sum stays alive between micro-batches
        mean = pytree.tree_map(lambda t: t / num_micro_batches, total)
        carry_marks(marks, pytree.tree_leaves(mean))  # refused by a 2nd reduction, a clip...
        return mean

    return fn
