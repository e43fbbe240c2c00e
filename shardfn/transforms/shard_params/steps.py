"""The steps a unit call takes both in forward and in backward, as functions over the
call (``call.ApplyCall``): gather the unit's full parameters (or refill the storage
its forward kept), build what its module gets, reduce its gradients.

:mod:`.forward` and :mod:`.backward` are made of these; the call itself only holds
its parts.

Example:
    >>> full, gather = gathered(call, unit, Phase.FORWARD, position)
    >>> out = call_module(unit, params_for(call, unit, full, buffers), args, kwargs)
    >>> reduction = reduce(call, unit, grads)   # its .wait() gives the shard gradients
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from shardfn.transforms.shard_params.accumulator import NoReduce
from shardfn.transforms.shard_params.exchange import Reduction, UnitGather
from shardfn.transforms.shard_params.plan import Unit
from shardfn.transforms.shard_params.prefetch import Phase

if TYPE_CHECKING:
    from shardfn.transforms.shard_params.call import ApplyCall

__all__ = ["gather", "gathered", "params_for", "reduce", "start_gather"]

Params = dict[str, torch.Tensor]


def gather(call: ApplyCall, unit: Unit) -> UnitGather:
    """Issue a new gather of ``unit``'s full parameters from the call's shards."""
    plan = call.config.plan
    return UnitGather(unit, call.inputs.shards, plan.ax, plan.place, call.tags())


def start_gather(call: ApplyCall, unit: Unit, phase: Phase, position: int) -> UnitGather:
    """Issue the gather for a call: in backward, into the storage its forward kept."""
    if phase is Phase.BACKWARD:
        kept = call.forward.records[position].gather
        if kept is not None:
            return kept.start(call.inputs.shards, call.tags())
    return gather(call, unit)


def gathered(call: ApplyCall, unit: Unit, phase: Phase,
             position: int) -> tuple[Params, UnitGather | None]:
    """Full parameters of ``unit`` for its call at ``position``, and their gather (None
    when kept from forward); prefetch the next ones."""
    kept = call.progress.kept
    if unit.index in kept:
        return kept[unit.index], None
    prefetcher = call.prefetcher
    pending = prefetcher.take(phase, position, unit)
    full = pending.wait()
    if phase is Phase.FORWARD:
        prefetcher.ahead(phase, position)
        if call.config.keep:
            kept[unit.index] = full
    else:
        prefetcher.ahead(phase, position, call.forward.order)
    return full, pending


def reduce(call: ApplyCall, unit: Unit, grads: dict[str, torch.Tensor]) -> Reduction | NoReduce:
    """Start reducing ``unit``'s full gradients (or add them to the accumulator); only
    those of the leaves a gradient is wanted for."""
    config, wanted = call.config, call.progress.wanted
    accumulator = config.accumulator
    if accumulator is not None:
        if wanted is not None:
            grads = {n: g for n, g in grads.items() if n in wanted}
        accumulator.add(unit.index, grads, config.plan.masters)
        return NoReduce()
    return Reduction(config.plan, unit, grads, call.tags(), wanted)


def params_for(call: ApplyCall, unit: Unit, full: Params, buffers: Params,
               override: Mapping = ()) -> Params:
    """What ``functional_call`` on the unit's module gets, by the module's own names.

    Args:
        call: the running call (its local leaves, and the root's full parameters for
            those the unit shares with it).
        unit: the unit.
        full: its full parameters.
        buffers: where its buffers come from and go (the forward's, as it has updated
            them so far; a recompute's own), filled on first use with private copies
            the unit may update in place.
        override: leaves to use instead (the ones a graph is recorded for).

    Returns:
        ``name inside the unit's module -> tensor``.
    """
    params = {}
    local, buffer_set = call.inputs.local, call.config.plan.buffer_set
    for name, rel in unit.rel:
        if name in override:
            params[rel] = override[name]
        elif name in full:
            params[rel] = full[name]
        elif name in buffer_set:
            if name not in buffers:  # first use: a private copy
                buffers[name] = local[name].clone()
            params[rel] = buffers[name]
        elif name in unit.external:
            params[rel] = call.progress.run.plain[name]
        else:  # a replicated (0-dim) or ignored parameter, as given
            params[rel] = local[name]
    return params
