"""A pipeline's trees: this rank's leaves of a full tree, and the full leaves of every rank's.

``shard`` needs no communication: each stage model of this rank cuts its leaves
(``model.shard``, e.g. ZeRO-3 shards), plain stages keep theirs whole. ``gather``
first rebuilds each stage model's full leaves (its own ``gather``, over its mesh),
then exchanges them over the pp axis: each pp rank sends the other ranks a mask of
the leaves it passes, then those leaves, so every rank returns the union, whatever
subset each passed (parameters, a gradient tree, the trainable part). A failure on
any rank reaches every rank (error headers, :func:`~.guard.settle_and_raise`): none
waits forever.

Example:
    >>> full = gather_over_pp(ax, device, full_model.names, layout, this_rank_full_leaves)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardfn import spec
from shardfn.transforms.pipeline._p2p import Messenger
from shardfn.transforms.pipeline.guard import settle_and_raise
from shardfn.transforms.pipeline.kinds import MessageKind

__all__ = ["CLIP_HELD", "gather_over_pp", "stage_gather", "stage_shard"]

Params = dict[str, torch.Tensor]

#: what a consumer that takes a pipeline's gradients for the whole tree should do instead
CLIP_HELD = ("A pipeline's gradients are this stage's leaves only: clip inside `with "
             "sf.optim.sharded_over('pp', mesh):` (with specs=pp.specs) to sum over every stage.")


def stage_shard(model: Any, tree: Mapping[str, torch.Tensor]) -> Params:
    """This rank's leaves of ``model`` (a stage model) from full leaves, any subset.

    Args:
        model: a stage model (``model.shard``, else ``sf.shard`` with its ``specs``).
        tree: full leaves, some of ``model.names``.

    Returns:
        ``name -> local leaf`` for the names of ``tree``.
    """
    if not tree:
        return {}
    shard = getattr(model, "shard", None)
    if shard is not None:
        return dict(shard(dict(tree)))
    return dict(spec.shard(dict(tree), {n: model.specs[n] for n in tree}, model.mesh))


def stage_gather(model: Any, tree: Mapping[str, torch.Tensor]) -> Params:
    """The full leaves of ``model``'s local leaves ``tree`` (any subset; the ranks of the
    stage's mesh pass the same names): ``model.gather``, else ``sf.gather`` with its specs.

    Args:
        model: a stage model.
        tree: local leaves, some of ``model.names``.

    Returns:
        ``name -> full leaf`` for the names of ``tree``.
    """
    if not tree:
        return {}
    gather = getattr(model, "gather", None)
    if gather is not None:
        return dict(gather(dict(tree)))
    return dict(spec.gather(dict(tree), {n: model.specs[n] for n in tree}, model.mesh))


def gather_over_pp(ax: Any, device: torch.device, names: Sequence[str],
                   layout: Mapping[str, int], local_full: Any) -> Params:
    """Every pp rank's full leaves, on every pp rank, in ``names`` order.

    Args:
        ax: the resolved pp axis.
        device: where messages live.
        names: every leaf of the full model, in order.
        layout: leaf -> the pp index that holds it.
        local_full: ``() -> {name: full leaf}`` of this rank's leaves passed (run inside
            the error handling: a failure there stops every pp rank).

    Returns:
        The full leaves every pp rank passed (each rank its own subset).

    Raises:
        The error of the rank that failed (there), ``PeerFailed`` on the others.
    """
    mine, count = ax.index, len(names)
    peers = [peer for peer in range(ax.size) if peer != mine]
    mask_key = (MessageKind.LEAF, 0, count)  # the index after the last leaf: the mask
    messenger = Messenger(ax, lambda key: key[2], device=device)
    owed = [(mask_key, peer) for peer in peers]
    expected = [(mask_key, peer) for peer in peers]
    try:
        leaves = local_full()
        present = torch.tensor([n in leaves for n in names], dtype=torch.int8, device=device)
        for peer in peers:
            messenger.send(mask_key, peer, present)
        masks = {peer: messenger.recv(mask_key, peer).bool().tolist() for peer in peers}
        sending = [k for k, n in enumerate(names) if n in leaves]
        owed += [((MessageKind.LEAF, 0, k), peer) for k in sending for peer in peers]
        expected += [((MessageKind.LEAF, 0, k), layout[n]) for k, n in enumerate(names)
                     if layout[n] != mine and masks[layout[n]][k]]
        for k in sending:
            for peer in peers:
                messenger.send((MessageKind.LEAF, 0, k), peer, leaves[names[k]])
        full: Params = {}
        for k, name in enumerate(names):
            holder = layout[name]
            if holder == mine and name in leaves:
                full[name] = leaves[name]
            elif holder != mine and masks[holder][k]:
                full[name] = messenger.recv((MessageKind.LEAF, 0, k), holder)
        messenger.finish()
    except BaseException as error:  # the others stop too (error headers), then raise
        settle_and_raise(messenger, owed, expected, error, f"pipeline gather on pp rank {mine}")
    return full
