"""``apply`` without ``functional_call``'s per-call work: the leaves swapped into the skeleton.

``torch.func.functional_call(module, params, args, kwargs, tie_weights=True,
strict=True)`` works out on every call which registered names are tied and
checks the keys (about 0.1 ms per module, which a pipeline stage of a few blocks
pays per micro-batch). ``FunctionalModel`` checks the keys itself, so the slots
each leaf goes into (tied aliases included) are worked out once
(:func:`plan_slots`) and :func:`call_swapped` does the rest of what
``functional_call`` does: put the leaves in, call the module, put the
skeleton's tensors back (also when the forward raises), and write a leaf the
forward reassigned (``self.buf = ...``) back into the call's dict. Callers that
hold a skeleton and the module's own names (``shard_params``' units,
``tensor_split``) use :func:`call_module`, which plans the slots once per module
and set of names.

Example:
    >>> net = nn.Linear(2, 2)
    >>> slots = plan_slots(net, {}, {"weight", "bias"})
    >>> call_swapped(net, slots, {"weight": torch.eye(2), "bias": torch.zeros(2)},
    ...              (torch.ones(1, 2),), {})
    tensor([[1., 1.]])
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["Slot", "call_module", "call_swapped", "module_slots", "plan_slots"]

Params = dict[str, torch.Tensor]


class Slot(NamedTuple):
    """One registered name of the skeleton: the dict it lives in, its key, its leaf."""

    table: dict  # the submodule's ``_parameters`` or ``_buffers``
    attr: str
    leaf: str  # the leaf's name (the owner's name for a tied alias)
    owner: bool  # this is the leaf's own name (not a tied alias)


def call_swapped(module: nn.Module, slots: Sequence[Slot], call_params: Params,
                  args: tuple, kwargs: dict) -> Any:
    """``module(*args, **kwargs)`` with ``call_params`` swapped into ``slots``, as
    ``functional_call(module, call_params, args, kwargs, tie_weights=True, strict=True)``
    does: the skeleton's tensors are put back afterwards, and a leaf the forward
    reassigned (``self.buf = ...``) is written back into ``call_params``."""
    saved: list[Any] = []
    try:
        for slot in slots:
            saved.append(slot.table[slot.attr])
            slot.table[slot.attr] = call_params[slot.leaf]
        return module(*args, **kwargs)
    finally:
        for slot, original in zip(slots, saved, strict=False):
            current = slot.table.get(slot.attr)
            if slot.owner and current is not None:
                call_params[slot.leaf] = current
            slot.table[slot.attr] = original


def plan_slots(module: nn.Module, tied: Mapping[str, str], leaves: set[str]
               ) -> tuple[Slot, ...] | None:
    """Every registered name of ``module``'s parameters and buffers (aliases included)
    as a :class:`Slot`, or None when ``functional_call`` must do the call: a
    parametrized submodule, a name that is not a leaf, or a leaf with no slot.

    Args:
        module: the skeleton.
        tied: alias name -> the leaf it shares.
        leaves: every leaf name.
    """
    if any(nn.utils.parametrize.is_parametrized(m) for m in module.modules()):
        return None
    slots = []
    named = [*module.named_parameters(remove_duplicate=False),
             *module.named_buffers(remove_duplicate=False)]
    for name, _ in named:
        leaf = tied.get(name, name)
        path, _, attr = name.rpartition(".")
        owner = module.get_submodule(path)
        table = owner._parameters if attr in owner._parameters else owner._buffers
        if leaf not in leaves or attr not in table:
            return None
        slots.append(Slot(table, attr, leaf, leaf == name))
    if {slot.leaf for slot in slots} != leaves:
        return None
    return tuple(slots)


def module_slots(module: nn.Module, names: Sequence[str]) -> tuple[Slot, ...] | None:
    """:func:`plan_slots` for a call given ``names`` (the module's own registered names),
    as ``functional_call(..., tie_weights=True, strict=True)`` reads them: a registered
    name that is not in ``names`` takes the value of one that is and shares its tensor
    in the skeleton (a tied alias). None: ``functional_call`` must do the call (also when
    ``names`` holds several names of one tied tensor: it checks they get one value)."""
    present = set(names)
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in [*module.named_parameters(remove_duplicate=False),
                         *module.named_buffers(remove_duplicate=False)]:
        by_tensor.setdefault(id(tensor), []).append(name)
    tied = {}
    for group in by_tensor.values():
        owners = [n for n in group if n in present]
        if len(owners) > 1:
            return None
        tied.update({n: owners[0] for n in group if owners and n not in present})
    return plan_slots(module, tied, present)


#: module -> {the names a call gives: its slots, or None}: worked out on a module's first
#: call with those names (weakly keyed: a copied or dropped skeleton gets its own)
_CALL_SLOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def call_module(module: nn.Module, call_params: Params, args: tuple, kwargs: dict) -> Any:
    """``functional_call(module, call_params, args, kwargs, tie_weights=True, strict=True)``,
    with the slots of ``module`` for these names worked out once (:func:`module_slots`)
    and the leaves swapped in by :func:`call_swapped`; ``functional_call`` itself where
    the slots cannot be planned (a parametrized module, names that do not match).

    Example:
        >>> net = nn.Linear(2, 2)
        >>> call_module(net, {"weight": torch.eye(2), "bias": torch.zeros(2)},
        ...             (torch.ones(1, 2),), {})
        tensor([[1., 1.]])
    """
    per_module = _CALL_SLOTS.setdefault(module, {})
    key = tuple(call_params)
    if key not in per_module:
        per_module[key] = module_slots(module, key)
    slots = per_module[key]
    if slots is None:
        return torch.func.functional_call(module, call_params, args, kwargs, tie_weights=True,
                                          strict=True)
    return call_swapped(module, slots, call_params, args, kwargs)
