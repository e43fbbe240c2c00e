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
and set of names. During a swapped call, layers that checkpoint themselves
(Hugging Face's ``gradient_checkpointing_enable()``) run as ``sf.remat`` of the
layer with its leaves as arguments (:func:`checkpoint_layers_with`), so the
recomputation does not meet the meta skeleton.

Example:
    >>> net = nn.Linear(2, 2)
    >>> slots = plan_slots(net, {}, {"weight", "bias"})
    >>> call_swapped(net, slots, {"weight": torch.eye(2), "bias": torch.zeros(2)},
    ...              (torch.ones(1, 2),), {})
    tensor([[1., 1.]])
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from shardfn._functional_hf import RecordInside, hf_collector

__all__ = ["Slot", "call_module", "call_swapped", "checkpoint_layers_with", "module_slots",
           "plan_slots"]

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
    layers = _self_checkpointing(module)
    with _swapped_in(slots, call_params):
        if not layers:
            return module(*args, **kwargs)
        with _layers_checkpointed_by_remat(module, layers):
            return module(*args, **kwargs)


@contextlib.contextmanager
def _swapped_in(slots: Sequence[Slot], call_params: Params) -> Iterator[None]:
    """``call_params`` in ``slots`` for the block; the skeleton's tensors back after it
    (a leaf the block reassigned written back into ``call_params``)."""
    saved: list[Any] = []
    try:
        for slot in slots:
            saved.append(slot.table[slot.attr])
            slot.table[slot.attr] = call_params[slot.leaf]
        yield
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


# ----------------------------------------------------------------------------- layers' own
# activation checkpointing (Hugging Face's ``gradient_checkpointing_enable()``): such a
# layer calls ``self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)``,
# i.e. ``torch.utils.checkpoint``, whose recomputation would run in backward, after the
# skeleton got its own tensors back (and which torch.func does not support). Inside a
# swapped call it runs as ``sf.remat`` of the layer instead, with the layer's leaves as
# arguments, so the recomputation swaps them in again.

#: ``remat(fn) -> fn``: set by :mod:`shardfn.transforms.remat` (a higher layer) on import
_REMAT: list[Callable] = []
#: module -> its submodules that have a ``gradient_checkpointing`` flag (looked up once)
_FLAGGED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def checkpoint_layers_with(remat: Callable[[Callable], Callable]) -> None:
    """Run layers' own activation checkpointing inside swapped calls with ``remat``.

    Args:
        remat: ``remat(fn) -> fn`` (``shardfn.remat``, which registers itself).
    """
    _REMAT[:] = [remat]


#: torch.utils.checkpoint's own options (remat always replays the forward's RNG and
#: autocast state); any other keyword goes to the checkpointed function, as there
_CHECKPOINT_OPTIONS = frozenset({"use_reentrant", "preserve_rng_state", "context_fn",
                                 "determinism_check", "debug", "early_stop"})


class _RematCheckpoint:
    """Stands in for a module's ``_gradient_checkpointing_func`` during a swapped call."""

    def __init__(self, owner: nn.Module):
        self.owner = owner

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        layer, call, keywords = _bound_layer(function)
        if layer is None:
            raise TypeError(
                f"{type(self.owner).__name__} (gradient_checkpointing=True) checkpoints "
                f"{function!r}, which is not a module's forward or __call__: shardfn cannot "
                "run it as sf.remat. Turn the model's own checkpointing off "
                "(model.gradient_checkpointing_disable()) and use shard_params(..., "
                "remat=sf.checkpoint_policies.nothing_saveable) or sf.remat instead")
        keywords.update((k, v) for k, v in kwargs.items() if k not in _CHECKPOINT_OPTIONS)
        values = _own_leaves(layer)
        # what HF records inside the layer (router logits, attentions) leaves the checkpoint
        # as its outputs: captured inside, it would lose its gradient
        collector = hf_collector()
        record = None if collector is None else RecordInside.of(collector)

        def layer_forward(values: Params, args: tuple, keywords: dict) -> Any:
            with _swapped_in(_slots_for(layer, tuple(values)), dict(values)):
                if record is None:
                    return call(*args, **keywords)
                return record.run(lambda: call(*args, **keywords))

        out = _REMAT[0](layer_forward)(values, args, keywords)
        if record is None:
            return out
        out, recorded = out
        record.extend(collector, recorded)
        return out


def _bound_layer(function: Callable) -> tuple[nn.Module | None, Callable, dict]:
    """``(layer, call, keywords)`` for a checkpointed ``partial(forward, layer, **keywords)``
    (Hugging Face's ``GradientCheckpointingLayer``) or ``layer.__call__`` (older models);
    ``layer`` None for anything else."""
    if (isinstance(function, functools.partial) and function.args
            and isinstance(function.args[0], nn.Module)):
        return (function.args[0], functools.partial(function.func, *function.args),
                dict(function.keywords))
    owner = getattr(function, "__self__", None)
    if isinstance(owner, nn.Module):
        return owner, function, {}
    return None, function, {}


def _own_leaves(layer: nn.Module) -> Params:
    """The tensors now in ``layer``'s parameter and buffer slots, one name per tensor."""
    return {**dict(layer.named_parameters()), **dict(layer.named_buffers())}


def _slots_for(layer: nn.Module, names: tuple[str, ...]) -> tuple[Slot, ...]:
    per_module = _CALL_SLOTS.setdefault(layer, {})
    if names not in per_module:
        per_module[names] = module_slots(layer, names)
    slots = per_module[names]
    if slots is None:
        raise TypeError(
            f"{type(layer).__name__} (gradient_checkpointing=True): shardfn cannot swap its "
            "parameters into it for the recomputation (a parametrized submodule?). Turn the "
            "model's own checkpointing off (model.gradient_checkpointing_disable()) and use "
            "shard_params(..., remat=...) or sf.remat instead")
    return slots


def _flagged(module: nn.Module) -> tuple[nn.Module, ...]:
    if torch.compiler.is_compiling():  # no cache write in a trace: dynamo would guard on it
        return tuple(m for m in module.modules() if hasattr(m, "gradient_checkpointing"))
    if module not in _FLAGGED:
        _FLAGGED[module] = tuple(m for m in module.modules()
                                 if hasattr(m, "gradient_checkpointing"))
    return _FLAGGED[module]


def _self_checkpointing(module: nn.Module) -> list[nn.Module]:
    """The submodules of ``module`` that checkpoint themselves now (HF's flag and
    function set), unless remat is not registered or already stands in."""
    if not _REMAT:
        return []
    return [m for m in _flagged(module) if m.gradient_checkpointing is True
            and "_gradient_checkpointing_func" in vars(m)
            and not isinstance(vars(m)["_gradient_checkpointing_func"], _RematCheckpoint)]


@contextlib.contextmanager
def _layers_checkpointed_by_remat(module: nn.Module, layers: list[nn.Module]
                                  ) -> Iterator[None]:
    """For the block, ``layers`` (:func:`_self_checkpointing`) checkpoint with remat;
    Hugging Face's input-grad hooks (``make_inputs_require_grads``, which reentrant
    checkpointing needs and torch.func refuses) are off."""
    before = [vars(m)["_gradient_checkpointing_func"] for m in layers]
    hooks = [h for m in module.modules() for h in vars(m).get("_require_grads_hooks", ())]
    tables = [(h.hooks_dict_ref(), h.id) for h in hooks]
    tables = [(table, key, list(table.items())) for table, key in tables
              if table is not None and key in table]
    try:
        for m in layers:
            m._gradient_checkpointing_func = _RematCheckpoint(m)
        for table, key, _ in tables:
            del table[key]
        yield
    finally:
        for m, original in zip(layers, before, strict=True):
            m._gradient_checkpointing_func = original
        for table, _, items in tables:  # back in their order
            table.clear()
            table.update(items)
