"""One `shard_params` ``apply`` call (:class:`ApplyCall`): the holder of its parts.

The call runs through :class:`~.functions.RootFn` (the whole apply) and, per unit
call inside the root, :class:`~.functions.UnitFn`; the work is done by functions
over the call: :mod:`.forward`, :mod:`.backward` and the steps both take
(:mod:`.steps`). The call only holds its named parts (:mod:`.record`): its frozen
:class:`~.record.CallConfig` and :class:`~.record.CallInputs`, what its forward did
(:class:`~.record.ForwardState` while it runs, then the sealed
:class:`~.record.ForwardRecord`), its :class:`~.record.Progress`, the message
:class:`~.exchange.Tags`, a :class:`~.prefetch.Prefetcher` (gathers ahead) and
:class:`~.deferred.DeferredReductions` (reduce-scatters waited one call later).
``docs/architecture.md`` walks through a call step by step.

Example:
    >>> call = ApplyCall(plan, guess, arg_spec, arg_tensors, keep=False, record=True)
    >>> outputs = RootFn.apply(call, *leaves, *arg_tensors)
    >>> out = call.out_spec.build(outputs[:call.n_outputs])
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from shardfn._torch_internals import is_functorch_wrapped
from shardfn.primitives import autocast_state
from shardfn.transforms.shard_params.accumulator import Accumulator
from shardfn.transforms.shard_params.deferred import DeferredReductions
from shardfn.transforms.shard_params.exchange import Tags
from shardfn.transforms.shard_params.plan import Plan
from shardfn.transforms.shard_params.prefetch import Prefetcher, PrefetchGuess
from shardfn.transforms.shard_params.record import (
    CallConfig,
    CallInputs,
    ForwardRecord,
    ForwardState,
    Progress,
)
from shardfn.transforms.shard_params.steps import start_gather
from shardfn.transforms.shard_params.tree import TreeSpec, is_float

__all__ = ["ApplyCall"]


class ApplyCall:
    """One ``apply`` call: its parts, read and set by the functions over it
    (:mod:`.forward`, :mod:`.backward`, :mod:`.steps`).

    Args:
        plan: the model's plan, for the dtypes of the shards given.
        guess: the model's guess of the unit order (updated after this forward).
        arg_spec, arg_tensors: the call's arguments, taken apart.
        keep: keep the full parameters for backward (``reshard_after_forward=False``).
        keep_root: keep the root's (``reshard_after_forward="units"``).
        record: a backward may follow (grad mode): save what it needs.
        mutable: also return the buffers as the forward left them.

    Attributes:
        config: the :class:`~.record.CallConfig`.
        inputs: the :class:`~.record.CallInputs` (set when the forward starts).
        forward_state: the :class:`~.record.ForwardState` while the forward runs, else
            None.
        forward: the :class:`~.record.ForwardRecord`, sealed when the forward ends
            (None before).
        progress: the :class:`~.record.Progress`: what changes after that.
        tags, prefetcher, deferred: message tags, gathers ahead, reductions waited later.
    """

    def __init__(self, plan: Plan, guess: PrefetchGuess, arg_spec: TreeSpec,
                 arg_tensors: Sequence[torch.Tensor], keep: bool, record: bool,
                 mutable: bool = False, keep_root: bool = False):
        self.config = CallConfig(
            plan, guess, arg_spec,
            tuple(is_float(t) and (t.requires_grad or is_functorch_wrapped(t))
                  for t in arg_tensors),
            keep, record, mutable, Accumulator.current(plan.token),
            # a recompute in backward runs under the forward's autocast state
            autocast_state.capture() if record and not plan.save else None,
            keep or keep_root)
        self.inputs = CallInputs({}, {})
        self.forward_state: ForwardState | None = None
        self.forward: ForwardRecord | None = None
        self.progress = progress = Progress()
        self.tags = Tags()  # message tags of this call's exchanges
        self.prefetcher = Prefetcher(plan, guess, functools.partial(start_gather, self),
                                     progress.kept.__contains__)
        self.deferred = DeferredReductions()

    @property
    def plan(self) -> Plan:
        return self.config.plan

    @property
    def out_spec(self) -> TreeSpec:
        """The output tree of the forward, its tensors taken out."""
        return self.forward.root.out_spec

    @property
    def n_outputs(self) -> int:
        """The model's own output tensors (before the buffers, ``mutable=True``)."""
        return self.forward.root.n_outputs
