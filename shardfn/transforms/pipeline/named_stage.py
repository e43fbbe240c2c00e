"""A stage's module under the names of the model its units were cut from.

When the units keep the names of a root model (:class:`~.stage.ModelUnits`: a Hugging
Face model's ``"model.layers.0.mlp.up_proj.weight"``) or share a weight across stages
(an embedding tied to the head), stage ``s``'s module cannot be an ``nn.Sequential`` of
its units: its leaves would be named by the units (``"1.layer.mlp..."``), and a tied
weight by the later use (``"lm_head.weight"``), not as the root names them.

:func:`named_stage_module` builds instead the root's module tree cut down to what the
stage uses (a *mirror*): each container on the way is a shallow copy of the root's
(same class, its own leaves only those of the stage, its children only those on the way),
and the modules the units call sit at their root paths. So:

* its leaves are the root's names (a tied weight under the root's first name: the owning
  module is kept on the way, in the root's order), and ``sf.functional`` of it
  initialises them as the root's ``init`` does (same paths, same seeds; a Hugging Face
  model's ``_init_weights``, since its containers are the model's own classes);
* what looks at the module tree sees the model: ``shard_params``' default units
  (``_no_split_modules``), ``tensor_split(plan="auto")`` (the model's own plan over the
  same paths), a plan dict over the root's paths.

The mirror's root is of a subclass of the root's class (``LlamaForCausalLMStage``) whose
forward runs the stage's units in order: the first gets the stage's inputs as given, each
next one the previous one's output. Each unit runs as a shallow copy whose children are
:class:`PathCall` s: at call time they look up the module at their root path *in this
mirror*, so a transform that swaps a submodule of its copy of the mirror (``shard_params``'
unit calls, ``tensor_split``'s split layers) is the one called.

Example:
    >>> module = named_stage_module(units, stage.units, stage.names, fm.owners)
    >>> sorted(n for n, _ in module.named_parameters())[:1]
    ['model.embed_tokens.weight']
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardfn.transforms.pipeline.stage import ModelUnits, run_units

__all__ = ["PathCall", "named_stage_module"]


class PathCall(nn.Module):
    """Calls the module at ``path`` of the stage's mirror (looked up at every call)."""

    def __init__(self, stage: nn.Module, path: str) -> None:
        super().__init__()
        self.__dict__["_shardfn_stage"] = stage  # not registered: the mirror holds the leaves
        self.__dict__["_shardfn_path"] = path

    def target(self) -> nn.Module:
        """The module at this path of the mirror (as it is now)."""
        return self.__dict__["_shardfn_stage"].get_submodule(self.__dict__["_shardfn_path"])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.target()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # attributes a unit reads of its child
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.target(), name)


class _RunsUnits:
    """Mixed in before the root's class: the mirror's forward runs the stage's units."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return run_units(self.__dict__["_shardfn_units"], *args, **kwargs)


@functools.cache
def _stage_class(root_class: type) -> type:
    """``root_class`` whose forward runs the stage's units (one class per root class)."""
    return type(f"{root_class.__name__}Stage", (_RunsUnits, root_class),
                {"__module__": __name__, "__qualname__": f"{root_class.__name__}Stage"})


def named_stage_module(model: ModelUnits, unit_ids: Sequence[int], names: Collection[str],
                       full_owners: Mapping[str, str]) -> nn.Module:
    """Stage module of ``model``'s units ``unit_ids``, named as ``model.root``.

    Args:
        model: the units and the root they were cut from.
        unit_ids: the stage's units, in order.
        names: the stage's leaves (root names, as :func:`~.stage.unit_leaf_names` found).
        full_owners: root leaf name -> the path of the module registering it
            (``sf.functional(root).owners``).

    Returns:
        The mirror (see the module docstring): its leaves are exactly ``names``.

    Raises:
        ValueError: a unit that is the root itself, or holds leaves that are not the root's
            (naming it); a mirror whose leaves are not the stage's (naming the difference).

    Example:
        >>> named_stage_module(hf_units(gpt2), (3,), names, fm.owners)   # ln_f + lm_head
    """
    root = model.root
    first: dict[int, str] = {}  # module -> its first path in the root
    for path, module in root.named_modules(remove_duplicate=False):
        first.setdefault(id(module), path)
    called: set[str] = set()
    stage_cls = _stage_class(type(root))
    stage = object.__new__(stage_cls)
    proxies = tuple(_proxy(model.units[u], u, first, stage, called) for u in unit_ids)
    if "" in called:
        raise ValueError(f"pipeline: a unit of stage units {list(unit_ids)} is the model "
                         f"({type(root).__name__}) the units were cut from, not a part of it")
    wanted = set(called) | {full_owners[n] for n in names}
    mirror = _mirror(root, "", wanted, called, set(names))
    stage.__dict__.update(mirror.__dict__)
    stage.__dict__["_shardfn_units"] = proxies
    got = {n for n, _ in stage.named_parameters()} | {n for n, _ in stage.named_buffers()}
    if got != set(names):
        raise ValueError(f"pipeline: stage of units {list(unit_ids)}: its module has leaves "
                         f"{sorted(got - set(names))} it should not and lacks "
                         f"{sorted(set(names) - got)} (the units are not made of "
                         f"{type(root).__name__}'s submodules)")
    return stage


def _proxy(unit: nn.Module, index: int, first: Mapping[int, str], stage: nn.Module,
           called: set[str]) -> nn.Module:
    """``unit`` calling the mirror's modules: a :class:`PathCall` if it is a module of the
    root, else a shallow copy whose children are proxies in turn."""
    path = first.get(id(unit))
    if path is not None:
        called.add(path)
        return PathCall(stage, path)
    if any(True for _ in unit.named_parameters(recurse=False)) or \
            any(True for _ in unit.named_buffers(recurse=False)):
        raise ValueError(f"pipeline: unit {index} ({type(unit).__name__}) holds leaves of its "
                         "own, not submodules of the model the units were cut from")
    proxy = copy.copy(unit)
    proxy.__dict__["_modules"] = {  # a child set to None (a model without a head) stays None
        name: None if child is None else _proxy(child, index, first, stage, called)
        for name, child in unit._modules.items()}
    return proxy


def _mirror(module: nn.Module, path: str, wanted: set[str], called: set[str],
            names: set[str]) -> nn.Module:
    """``module`` (at ``path`` of the root) cut down to the ``wanted`` paths: a module
    that is called whole, else a shallow copy keeping the stage's own leaves and the
    children on the way to a wanted path (its other leaves stay as unregistered meta
    tensors, as the root's skeleton has them, for an ancestor's ``_init_weights``)."""
    if path in called:
        return module
    prefix = f"{path}." if path else ""
    cut = copy.copy(module)
    for table in ("_parameters", "_buffers"):
        kept, dropped = {}, {}
        for k, v in getattr(module, table).items():
            if v is not None:
                (kept if prefix + k in names else dropped)[k] = v
        cut.__dict__[table] = kept
        for k, v in dropped.items():  # not leaves of the stage, still attributes: a HF
            cut.__dict__[k] = torch.empty_like(v, device="meta")  # _init_weights reads them
    cut.__dict__["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    cut.__dict__["_modules"] = {
        k: _mirror(child, prefix + k, wanted, called, names)
        for k, child in module._modules.items()
        if child is not None and any(w == prefix + k or w.startswith(prefix + k + ".")
                                     for w in wanted)}
    return cut
