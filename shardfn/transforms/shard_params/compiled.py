"""The compiled path of `shard_params`: one ``apply`` that ``torch.compile`` traces whole.

The eager path (``functions``, ``exchange``, ``prefetch``) gathers units point to point
from a background thread, frees and refills storage and steps outside ``torch.func``:
fast in eager mode, and nothing a compiler can trace. Under ``torch.compile``
(``torch.compiler.is_compiling()``) ``ShardedModel.apply`` runs this instead, the way
torchtitan's SimpleFSDP does: every sharded leaf enters the model through
:class:`GatherLeaf`, an ``autograd.Function`` over the functional collectives whose
forward all-gathers the leaf's shard over the axis (cutting the padding) and whose
backward reduce-scatters its gradient (then sums it over the HSDP replica axis) with
the eager path's divisions, so the numbers are the eager ones. The trainable sharded
leaves of each unit go through one :class:`GatherLeaf` together, as the unit's flat
buffer (``Unit.scatter``): one all-gather and one reduce-scatter per unit and dtype,
not per leaf (on gloo each an all-to-all, :mod:`shardfn.primitives._comm_traced`).
0-dim parameters enter through :class:`ReduceReplicated` (identity forward, psum
backward); buffers and ``ignored_params`` as they are (an ignored leaf's gradient is
not reduced, as in eager steps). The whole model then runs once on the full leaves
(``functional.apply``); units do not matter for the values (they only bucket the
collectives), and the compiler places and overlaps the collectives (what SimpleFSDP
leaves to it too).

Buffers and frozen parameters enter detached: the eager path refuses to differentiate
them (``refuse_differentiated_state``, which reads functorch internals no compiler
traces); a compiled step gives them zero gradients instead. Differentiate
``split_trainable(shards)[0]`` in either.

What stays in eager steps (refused with a message naming the option): ``precision``,
``offload`` and ``remat`` (each changes what is gathered, where and when, through the
eager machinery). ``reshard_after_forward`` and ``prefetch`` are memory and overlap
settings of the eager path; in a compiled step the compiler decides when the gathered
leaves are freed. Gradients are not marked as reduced (``sf.data_parallel`` cannot
see that they were): do not reduce them again.

Example:
    >>> step = torch.compile(lambda s, x: torch.func.grad(
    ...     lambda s: model.apply(s, x).square().mean())(s), fullgraph=True)
    >>> grads = step(model.init(0), x)     # the eager path's gradients
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from shardfn.primitives import _comm
from shardfn.primitives._comm import Axis
from shardfn.primitives._comm_traced import all_gather_flat, psum_scatter_flat
from shardfn.primitives.reduce_scaling import divide_factors
from shardfn.transforms.shard_params.plan import Flat, Plan

__all__ = ["GatherLeaf", "LeafReduce", "ReduceReplicated", "compiled_apply", "refuse_options"]

Params = dict[str, torch.Tensor]


class LeafReduce(NamedTuple):
    """What the backward of one leaf's entry does with its gradient (static, hashable).

    Attributes:
        ax: the sharding axis (the all-gather and the reduce-scatter run over it).
        replicate_ax: the HSDP replica axis (the shard gradient is also summed over it).
        count: the data-parallel ranks a mean divides by (both axes).
        mean: ``grad_reduce == "mean"``.
        rows: the leaf's dim-0 size (the gathered rows past it are padding).
    """

    ax: Axis
    replicate_ax: Axis | None
    count: int
    mean: bool
    rows: int


def _scaled_sum(grad: torch.Tensor, how: LeafReduce, reduce: Any) -> torch.Tensor:
    """``reduce(grad)`` with the eager path's pre/post division (``exchange.Reduction``)."""
    pre, post = divide_factors(how.count, grad.dtype)
    out = reduce(grad / pre if pre != 1.0 else grad)
    if how.mean:
        return out / post if post != 1.0 else out
    return out * pre if pre != 1.0 else out


class GatherLeaf(torch.autograd.Function):
    """A sharded leaf's full value: all-gather over ``how.ax``; backward reduce-scatter.

    Forward: every rank's shard concatenated on dim 0, cut to ``how.rows``. Backward:
    the gradient zero-padded to whole shards, summed and scattered over ``how.ax``,
    summed over ``how.replicate_ax``, divided by ``how.count`` for a mean.
    """

    @staticmethod
    def forward(shard: torch.Tensor, how: LeafReduce) -> torch.Tensor:
        full = all_gather_flat(shard.reshape(-1), how.ax).view(how.ax.size * shard.shape[0],
                                                               *shard.shape[1:])
        return full[:how.rows] if full.shape[0] != how.rows else full

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.how = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        how = ctx.how
        grad = grad.detach()
        pad = how.ax.size * -(-how.rows // how.ax.size) - how.rows
        if pad:
            grad = torch.cat([grad, grad.new_zeros((pad, *grad.shape[1:]))])

        def reduce(g: torch.Tensor) -> torch.Tensor:
            out = psum_scatter_flat(g.reshape(-1), how.ax).view(g.shape[0] // how.ax.size,
                                                           *g.shape[1:])
            if how.replicate_ax is not None and how.replicate_ax.size > 1:
                out = _comm.psum(out, how.replicate_ax)
            return out

        return _scaled_sum(grad, how, reduce), None


class ReduceReplicated(torch.autograd.Function):
    """A replicated (0-dim) parameter: identity; backward psum over every data-parallel rank."""

    @staticmethod
    def forward(x: torch.Tensor, how: LeafReduce, all_ax: Axis) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.how, ctx.all_ax = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _scaled_sum(grad.detach(), ctx.how,
                           lambda g: _comm.psum(g, ctx.all_ax)), None, None


def refuse_options(model: Any) -> None:
    """Raise unless a compiled step can run ``model`` (a ``ShardedModel``).

    Raises:
        NotImplementedError: ``precision``, ``offload`` or ``remat`` set, named.
    """
    for option in ("precision", "offload", "remat"):
        if getattr(model, option) is not None:  # (no repr of it: dynamo traces this raise)
            raise NotImplementedError(
                f"shard_params(..., {option}=...) runs in eager steps only; a step "
                f"compiled with torch.compile takes shard_params without {option}= "
                "(docs/compile.md)")


def _gathered_flat(flat: Flat, shards: Mapping[str, torch.Tensor], how: LeafReduce
                   ) -> Params:
    """The full leaves of one of a unit's flat buffers, moved by one :class:`GatherLeaf`.

    The shards go end to end (``flat.offsets``) into this rank's chunk; the gathered
    ``(ranks, chunk)`` buffer holds every rank's chunk, and leaf ``i`` is its columns
    ``offsets[i]:offsets[i] + size``, rows in rank order, cut to the leaf's rows. In
    backward the gradients land in those columns (zeros in the padding) and the whole
    buffer is reduce-scattered once: per element the sums and divisions of the per-leaf
    path, so the same numbers.
    """
    ranks = how.ax.size
    local = torch.cat([shards[name].reshape(-1) for name in flat.names])
    full = GatherLeaf.apply(local, how._replace(rows=ranks * flat.chunk)).view(ranks, flat.chunk)
    out: Params = {}
    for name, shape, local_shape, at in zip(flat.names, flat.shapes, flat.local_shapes,
                                            flat.offsets, strict=True):
        leaf = full[:, at:at + math.prod(local_shape)].reshape(ranks * local_shape[0],
                                                               *local_shape[1:])
        out[name] = leaf[:shape[0]] if leaf.shape[0] != shape[0] else leaf
    return out


def full_leaves(plan: Plan, shards: Mapping[str, torch.Tensor]) -> Params:
    """Every leaf at full size: sharded ones gathered, the rest entered as they are.

    The trainable sharded leaves of each unit move as the unit's flat buffers
    (``Unit.scatter``: one all-gather, and in backward one reduce-scatter, per unit and
    dtype, as the eager path moves them); frozen sharded leaves one by one.

    Args:
        plan: the model's plan.
        shards: ``name -> local shard`` (checked by the caller).

    Returns:
        ``name -> full tensor``, differentiable w.r.t. the shards (see :class:`GatherLeaf`).
    """
    count, mean = plan.all_ax.size, plan.grad_reduce == "mean"
    bucket = LeafReduce(plan.ax, plan.replicate_ax, count, mean, 0)
    out: Params = {}
    for unit in (*plan.units, plan.root):
        for flat in unit.scatter:
            out.update(_gathered_flat(flat, shards, bucket))
    for name in plan.names:
        if name in out:
            continue
        x = shards[name]
        if name not in plan.trainable_set:  # buffers and frozen: no gradient (see below)
            x = x.detach()
        if name in plan.buffer_set:
            out[name] = x.clone()  # private copies, as FunctionalModel.apply gives
            continue
        if name in plan.ignored:  # held whole: used as given, its gradient unreduced
            out[name] = x
            continue
        rows = plan.specs[name].shape[0] if x.dim() else 0
        how = bucket._replace(rows=rows)
        # through a view: dynamo (torch 2.13) fails on an autograd.Function applied to a
        # tensor torch.func differentiates directly (its collective sees the grad wrapper)
        x = x.view_as(x)
        out[name] = GatherLeaf.apply(x, how) if x.dim() else \
            ReduceReplicated.apply(x, how, plan.all_ax)
    return {name: out[name] for name in plan.names}


def compiled_apply(model: Any, shards: Mapping[str, torch.Tensor], args: tuple,
                   kwargs: dict, mutable: bool) -> Any:
    """``ShardedModel.apply`` in a step being compiled: gather every leaf, run the model.

    Args:
        model: the ``ShardedModel``.
        shards, args, kwargs, mutable: as ``ShardedModel.apply`` takes them.

    Returns:
        What ``ShardedModel.apply`` returns (``(output, new_buffers)`` with ``mutable``).

    Example:
        >>> out = compiled_apply(model, shards, (x,), {}, False)   # inside torch.compile
    """
    refuse_options(model)
    model.check(shards)
    if not isinstance(mutable, bool):
        raise TypeError(f"apply: mutable must be True or False, got {mutable!r}")
    plan = model._plan
    full = full_leaves(plan, shards)
    # FunctionalModel.apply's own entry (refuse_differentiated_state) reads functorch
    # internals dynamo cannot trace: run its forward on the checked, private leaves
    out = plan.functional._forward(full, args, kwargs)
    return (out, {name: full[name] for name in plan.buffer_names}) if mutable else out
