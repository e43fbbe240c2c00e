"""Gradient accumulation of `shard_params` with one reduction per step (``reduce_once``).

While an :class:`Accumulator` is active (``with Accumulator(token):``, a ContextVar),
the backward of every ``apply`` of the model with ``token`` adds its units' *full*
gradients to it (in the master dtype) instead of reduce-scattering them;
:func:`reduce_accumulated` then reduces every unit once. Used by
``ShardedModel.accumulate_grads(mode="reduce_once")``.

Example:
    >>> step = reduce_once(sf.accumulate_grads(grad_and_value_fn, 4), 4, plan.token, plan_for)
    >>> with Accumulator(plan.token) as acc:
    ...     grads, loss = grad_fn(shards, micro_batch)       # no reduce-scatter
    >>> shard_grads = reduce_accumulated(plan, acc, grads)   # one per unit
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

import torch

from shardfn.primitives.reduced import mark_reduced
from shardfn.transforms.shard_params.exchange import Reduction, Tags
from shardfn.transforms.shard_params.plan import Plan

__all__ = ["AccumulateMode", "Accumulator", "NoReduce", "check_accumulate", "reduce_accumulated",
           "reduce_once"]

#: ``accumulate_grads(mode=)``: one reduction per step (:func:`reduce_once`), or one per
#: micro-batch (``sf.accumulate_grads`` over the normal path)
AccumulateMode = Literal["reduce_once", "reduce_each"]

Params = dict[str, torch.Tensor]

_ACCUMULATORS: contextvars.ContextVar[tuple[Accumulator, ...]] = contextvars.ContextVar(
    "shardfn_shard_params_accumulators", default=())  # innermost last


class Accumulator:
    """Full gradients of each unit summed locally over micro-batches (``reduce_once``).

    Args:
        token: the model's ``plan.token``: only its ``apply`` calls add here.
    """

    def __init__(self, token: object):
        self.token = token
        self.grads: dict[int, dict[str, torch.Tensor]] = {}  # unit index (-1 root) -> full
        self.masters: Mapping[str, torch.dtype] | None = None  # the leaves' dtypes, as run
        self._reset: contextvars.Token | None = None

    def add(self, index: int, grads: Mapping[str, torch.Tensor],
            masters: Mapping[str, torch.dtype]) -> None:
        """Add one backward's full gradients of unit ``index`` (``name -> tensor``)."""
        self.masters = masters
        sums = self.grads.setdefault(index, {})
        for name, grad in grads.items():
            grad = grad.detach()
            if name in sums:  # out of place: an in-place add under torch.func.grad fails
                sums[name] = sums[name] + grad.to(sums[name].dtype)
            else:
                sums[name] = grad.to(masters[name], copy=True)

    def __enter__(self) -> Accumulator:
        self._reset = _ACCUMULATORS.set((*_ACCUMULATORS.get(), self))
        return self

    def __exit__(self, *exc) -> None:
        _ACCUMULATORS.reset(self._reset)

    @staticmethod
    def current(token: object) -> Accumulator | None:
        """The innermost active accumulator of the model with ``token``, or None."""
        return next((a for a in reversed(_ACCUMULATORS.get()) if a.token is token), None)


class NoReduce:
    """Stands in for a unit's reduction while accumulating: it has nothing to return."""

    def wait(self) -> dict[str, Any]:
        return {}


def reduce_accumulated(plan: Plan, accumulator: Accumulator,
                       names: Collection[str]) -> Params:
    """Reduce every unit's summed full gradients of ``names`` once.

    Args:
        plan: the model's plan for the dtypes the micro-batches ran in
            (``accumulator.masters``).
        accumulator: the sums (emptied).
        names: the leaves a gradient was asked for.

    Returns:
        ``name -> shard gradient`` of the sums (not divided by the micro-batch count).
    """
    some = [g for grads in accumulator.grads.values() for g in grads.values()]
    tags = Tags()
    device = some[0].device if some else (plan.place.compute or plan.mesh.device)
    wanted = frozenset(n for n in plan.trainable_set if n in names)
    wanted = None if len(wanted) == len(plan.trainable_set) else wanted
    out: Params = {}
    for unit in (*plan.units, plan.root):  # every rank reduces every unit, in order
        grads = accumulator.grads.pop(unit.index, {})
        for name in unit.owned_grads:  # a unit no micro-batch called: zeros
            if name not in grads and (wanted is None or name in wanted):
                grads[name] = torch.zeros(plan.specs[name].shape, dtype=plan.masters[name],
                                          device=device)
        out.update(Reduction(plan, unit, grads, tags(), wanted).wait())
    return out


def check_accumulate(mode: Any, num_micro_batches: Any) -> None:
    """Raise ``ValueError`` unless ``model.accumulate_grads`` can take ``mode`` and ``k``.

    Example:
        >>> check_accumulate("reduce_once", 4)
    """
    if mode not in ("reduce_once", "reduce_each"):
        raise ValueError(f"accumulate_grads: mode must be 'reduce_once' or 'reduce_each', "
                         f"got {mode!r}")
    if (isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int)
            or num_micro_batches < 1):
        raise ValueError(f"accumulate_grads: num_micro_batches must be an int >= 1, got "
                         f"{num_micro_batches!r}")


def reduce_once(mean_fn: Callable, k: int, token: object,
                plan_for: Callable[[Mapping[str, torch.dtype] | None], Plan]) -> Callable:
    """``mean_fn`` (``sf.accumulate_grads`` of a ``grad_and_value``) with every unit's
    reduction held back and made once, after the last of the ``k`` micro-batches.

    Args:
        mean_fn: ``fn(shards, batch, *rest) -> (grads, loss)``, the mean over ``k``
            micro-batches of a loss calling the model's ``apply``.
        k: the number of micro-batches.
        token: the model's ``plan.token``.
        plan_for: the model's plan for the leaves' dtypes as run (name -> dtype; None
            when no backward ran: the model's own).

    Returns:
        ``fn(shards, batch, *rest) -> (grads, loss)``, ``grads`` a mapping like ``shards``.
    """

    def fn(shards: Any, batch: Any, *rest: Any) -> tuple[Any, torch.Tensor]:
        if not isinstance(shards, Mapping):
            raise TypeError(f"accumulate_grads(mode='reduce_once') needs the shards as a "
                            f"mapping name -> tensor, got {type(shards).__name__}")
        if torch.compiler.is_compiling():  # the accumulator is a ContextVar: eager only
            raise NotImplementedError("accumulate_grads(mode='reduce_once') runs in eager "
                                      "steps only; a compiled step takes mode='reduce_each'")
        with Accumulator(token) as accumulator:  # every backward adds: no reduction
            grads, loss = mean_fn(shards, batch, *rest)
        grads = dict(grads)  # zeros for the reduced leaves: their sums are all here
        plan = plan_for(accumulator.masters)  # every rank reduces every unit, in order
        for name, grad in reduce_accumulated(plan, accumulator, grads).items():
            if name in grads:
                grads[name] = grads[name] + grad / k
                if name in plan.ignored:  # returned untouched: the caller reduces it
                    continue
                mark_reduced((grads[name],), plan.all_ax, "sf.shard_params",
                             sharded=plan.ax if grads[name].dim() else ())
        return grads, loss

    return fn
