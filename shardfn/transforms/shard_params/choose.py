"""What a `shard_params` model is told to choose: its units (``units=``) and the leaves
it leaves alone (``ignored_params=``).

By default (``units=None``) a Hugging Face model's units are the instances of its
``_no_split_modules`` classes (its decoder or encoder layers, as Hugging Face's FSDP
auto-wrap chooses them); any other model is one unit. An empty list asks for one unit.

Example:
    >>> resolve_units(fmodel, Block)        # every Block, outermost first
    ('blocks.0', 'blocks.1')
    >>> resolve_units(sf.functional(llama), None)
    ('model.layers.0', 'model.layers.1')
    >>> resolve_ignored(fmodel, lambda name, leaf: name.endswith("experts.down_proj"))
    frozenset({'moe.experts.down_proj'})
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Sequence

from torch import nn

from shardfn._functional_hf import no_split_classes
from shardfn._functional_layout import ShapeDtype
from shardfn.functional import FunctionalModel

__all__ = ["IgnoredPolicy", "UnitPolicy", "resolve_ignored", "resolve_units", "suggest"]

UnitPolicy = type | tuple[type, ...] | int | Sequence[str] | None
"""A module class (or tuple of classes), a minimum parameter count, module paths, or None."""

IgnoredPolicy = Collection[str] | Callable[[str, ShapeDtype], bool] | None
"""Parameter names, a predicate ``(name, ShapeDtype) -> bool`` over them, or None (none)."""


def resolve_units(model: FunctionalModel, units: UnitPolicy) -> tuple[str, ...]:
    """The module paths of the units ``units`` chooses, outermost, in registration order.

    Args:
        model: the functional model whose skeleton the paths are in.
        units: a module class or tuple of classes, a minimum parameter count, a list of
            module paths (empty: no unit but the root), or None: the modules of a Hugging
            Face model's ``_no_split_modules`` classes, else no unit but the root.

    Returns:
        The unit paths (the root unit, everything outside them, is implicit).

    Raises:
        TypeError / ValueError: a policy of the wrong kind, or one that matches nothing
            (the message lists what exists).

    Example:
        >>> resolve_units(fmodel, 1000)     # the smallest modules of >= 1000 elements
        ('blocks.0.attn', 'blocks.0.mlp', 'blocks.1.attn', 'blocks.1.mlp')
    """
    named = dict(model.module.named_modules())
    if units is None:
        return _no_split_units(named)
    if isinstance(units, Sequence) and not isinstance(units, str) and len(units) == 0:
        return ()
    if isinstance(units, type) or (isinstance(units, tuple) and units
                                   and all(isinstance(u, type) for u in units)):
        classes = units if isinstance(units, tuple) else (units,)
        chosen = [p for p, m in named.items() if p and isinstance(m, classes)]
        what = f"units={'/'.join(c.__name__ for c in classes)}"
    elif isinstance(units, int) and not isinstance(units, bool):
        if units < 1:
            raise ValueError(f"units={units}: a minimum parameter count must be >= 1")
        chosen = []
        _by_size("", model.module, units, chosen)
        what = f"units={units} (min parameters per unit)"
    elif isinstance(units, Sequence) and not isinstance(units, str) and all(
            isinstance(p, str) for p in units):
        for path in units:
            if path == "":
                raise ValueError("units: '' is the root, which is always the root unit")
            if path not in named:
                raise ValueError(f"units: no submodule at path {path!r}"
                                 + suggest([path], list(named)))
        chosen = list(units)
        what = f"units={list(units)}"
    else:
        raise TypeError(f"units must be a module class, a tuple of classes, an int (min "
                        f"parameters) or a list of module paths; got {units!r}")
    chosen = [p for p in named if p in set(chosen)]  # registration order
    outermost = [p for p in chosen if not any(p.startswith(q + ".") for q in chosen if q != p)]
    if not outermost:
        kinds = sorted({type(m).__name__ for p, m in named.items() if p})
        raise ValueError(f"{what} matches no submodule of {type(model.module).__name__}; its "
                         f"submodule classes are {kinds}")
    for path in outermost:
        if not _callable(named[path]):
            raise ValueError(f"unit {path!r} is a {type(named[path]).__name__}, which has no "
                             f"forward to run; choose the modules inside it")
    return tuple(outermost)


def _no_split_units(named: dict[str, nn.Module]) -> tuple[str, ...]:
    """The outermost modules whose class a Hugging Face model names in ``_no_split_modules``."""
    classes = no_split_classes(named[""])
    chosen = [p for p, m in named.items() if p and type(m).__name__ in classes and _callable(m)]
    return tuple(p for p in chosen if not any(p.startswith(q + ".") for q in chosen if q != p))


def _callable(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def _by_size(path: str, module: nn.Module, min_numel: int, chosen: list[str]) -> bool:
    """Post-order: a callable module with no unit inside holding >= min_numel becomes one."""
    inside = False
    for name, child in module.named_children():
        inside |= _by_size(f"{path}.{name}" if path else name, child, min_numel, chosen)
    if not inside and path and _callable(module):
        if sum(p.numel() for p in module.parameters()) >= min_numel:
            chosen.append(path)
            return True
    return inside


def suggest(names: Sequence[str], candidates: Sequence[str]) -> str:
    """A "did you mean" hint for the first few ``names`` (or '')."""
    hints = [m for name in names[:3] for m in difflib.get_close_matches(name, candidates, n=1)]
    return f"; did you mean {hints}?" if hints else ""


def resolve_ignored(model: FunctionalModel, ignored: IgnoredPolicy) -> frozenset[str]:
    """The parameters ``ignored_params=`` names: held whole, never gathered nor reduced.

    Args:
        model: the functional model.
        ignored: parameter names (the model's own: a tied leaf by its first name), a
            predicate ``(name, ShapeDtype) -> bool`` called on every parameter, or None.

    Returns:
        The names (empty for None).

    Raises:
        TypeError: ``ignored`` is a single string or of another kind.
        ValueError: a name that is not a leaf, a buffer (never sharded anyway) or the
            alias of a tied leaf (the message names the leaf to give instead).

    Example:
        >>> resolve_ignored(fmodel, ["lm_head.weight"])
        frozenset({'lm_head.weight'})
    """
    if ignored is None:
        return frozenset()
    shapes = model.param_shapes()
    if callable(ignored):
        return frozenset(n for n in model.param_names if ignored(n, shapes[n]))
    if isinstance(ignored, str) or not isinstance(ignored, Collection) or not all(
            isinstance(n, str) for n in ignored):
        raise TypeError(f"ignored_params must be a collection of parameter names or a "
                        f"predicate (name, ShapeDtype) -> bool; got {ignored!r}")
    params, buffers = set(model.param_names), set(model.buffer_names)
    for name in ignored:
        if name in params:
            continue
        if name in model.tied:
            raise ValueError(f"ignored_params: {name!r} is tied to {model.tied[name]!r} (one "
                             f"leaf for every use); name the leaf {model.tied[name]!r}")
        if name in buffers:
            raise ValueError(f"ignored_params: {name!r} is a buffer; buffers are held whole "
                             f"on each rank already (never gathered nor reduced)")
        raise ValueError(f"ignored_params: {name!r} is not a parameter of "
                         f"{type(model.module).__name__}" + suggest([name], model.param_names))
    return frozenset(ignored)
