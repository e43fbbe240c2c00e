"""From a state pytree and its layout sources to one :class:`Entry` per leaf (this rank's view).

``layouts`` is a prefix of the state tree whose leaves are *sources*: what
knows how a subtree is laid out over the mesh. A source may be

* ``None`` (the default everywhere): replicated, the same on every rank;
* an ``sf.Layout`` (or a bare ``sf.P`` that splits nothing over more than one
  rank), or a tensor-parallel ``FusedLayout``: one tensor leaf;
* a model with ``.specs`` (``sf.shard_params``' ``ShardedModel``,
  ``sf.tensor_split``'s ``TensorSplitModel``): its parameter tree;
* an optimizer: ``shard_opt_state``'s ``ShardedOptimizer`` (its state holds
  flat pieces of the parameters) or any plain ``GradientTransformation`` (its
  per-parameter buffers follow the parameters' layouts, e.g. under ZeRO-3).
  Both need the parameters: the subtree whose source is the one model in
  ``layouts``, else the state's ``"params"`` entry (or say which with
  :class:`OptLayout`);
* :class:`PerRank` (each rank's own value, e.g. a per-rank RNG state) or
  :class:`Skip` (not saved; ``load`` keeps the value of ``like``).

Every tensor is stored as its global tensor under a dotted key (NamedTuple fields by
name). A ``ShardedOptState`` is stored under its inner state's names, as the unsharded
optimizer's state would be (its partition record describes the mesh, not the training,
and is not saved), so a ZeRO-1 state loads into ZeRO-3 or one process and back.

Example:
    >>> entries = resolve(state, {"params": model, "opt": opt}, mesh)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import optree
import torch

from shardfn import pytree
from shardfn.checkpoint._boxes import (
    Box,
    Chunk,
    block_boxes,
    box_chunks,
    fused_layout_boxes,
    piece_chunks,
    row_split_boxes,
)
from shardfn.checkpoint.errors import structure_difference
from shardfn.mesh import Mesh
from shardfn.optim.base import GradientTransformation
from shardfn.primitives import flat, reduced
from shardfn.spec import Layout, P, spec_axes
from shardfn.transforms import FsdpTpLayout, FusedLayout, ShardedOptimizer, ShardedOptState
from shardfn.transforms._opt_state_reshard import state_roles

__all__ = ["Entry", "OptLayout", "PerRank", "Skip", "resolve"]


class PerRank(NamedTuple):
    """Layout source: every rank saves and loads its own value (same world size needed)."""


class Skip(NamedTuple):
    """Layout source: not saved; ``load`` returns ``like``'s value there."""


class OptLayout(NamedTuple):
    """Layout source: optimizer ``opt`` whose parameters are the state's subtree ``params``
    (a dotted path), for states with no single model in ``layouts``."""

    opt: Any
    params: str


class Entry(NamedTuple):
    """One state leaf as the checkpoint sees it, on this rank.

    Attributes:
        name, key: the leaf's dotted path (for messages); its checkpoint key (None: not saved).
        tensor: whether the leaf is a tensor (else a Python object stored as bytes).
        shape, chunks: the global shape and this rank's chunks of it (tensors; ``_boxes``).
        replicated: the leaf is the same on every rank (save checks it).
    """

    name: str
    key: str | None
    tensor: bool
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    replicated: bool


class _Placed(NamedTuple):
    """A tensor leaf's global shape and its local boxes (a parameter, for optimizers)."""

    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    replicated: bool = False  # no layout: the same on every rank (save checks it)


def _children(node) -> list[tuple[str, Any]] | None:
    """``(label, child)`` one level down in shardfn's pytree order, None for a leaf."""
    if isinstance(node, torch.Tensor) or optree.tree_is_leaf(node, namespace=pytree.NAMESPACE):
        return None if node is not None else []
    out = optree.tree_flatten_one_level(node, namespace=pytree.NAMESPACE)
    fields = getattr(type(node), "_fields", None)
    return [(str(fields[e] if fields and isinstance(e, int) else e), c)
            for e, c in zip(out.entries, out.children, strict=True)]


def named_leaves(tree, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted name, leaf)`` of every leaf, NamedTuple fields by name, in pytree order."""
    kids = _children(tree)
    if kids is None:
        return [(prefix or "<root>", tree)]
    return [item for label, child in kids
            for item in named_leaves(child, f"{prefix}.{label}" if prefix else label)]


def _join(prefix: str, label: str) -> str:
    return f"{prefix}.{label}" if prefix else label


def _is_model(source) -> bool:
    return isinstance(getattr(source, "specs", None), Mapping) and not isinstance(source, Mapping)


def _is_opt(source) -> bool:
    return isinstance(source, (ShardedOptimizer, GradientTransformation, OptLayout))


def _is_source(source) -> bool:
    kinds = (Layout, P, FusedLayout, FsdpTpLayout, PerRank, Skip)
    return source is None or isinstance(source, kinds) or _is_model(source) or _is_opt(source)


def _child_source(source, label: str):
    if isinstance(source, Mapping):
        return source.get(label, source.get(int(label)) if label.isdigit() else None)
    fields = getattr(type(source), "_fields", None)
    if fields:
        return getattr(source, label, None)
    if isinstance(source, (list, tuple)) and label.isdigit() and int(label) < len(source):
        return source[int(label)]
    raise TypeError(f"layouts: {type(source).__name__} is neither a layout source nor a "
                    "container of them (dict/list/tuple/NamedTuple)")


def _boxes_of(name: str, x: torch.Tensor, spec, mesh: Mesh | None) -> _Placed:
    """The global shape and boxes of tensor leaf ``x`` under a Layout/P/FusedLayout/None."""
    if mesh is None and isinstance(spec, (Layout, P)) and not spec_axes(spec):
        spec = None  # replicated: no mesh needed
    if spec is None:
        return _Placed(tuple(x.shape), (Box((0,) * x.dim(), (0,) * x.dim(), tuple(x.shape)),),
                       True)
    if mesh is None:
        raise ValueError(f"checkpoint: leaf {name!r} has the layout {spec}: pass mesh= (or set "
                         "a current mesh)")
    if isinstance(spec, FsdpTpLayout):  # a dp split (shard_params) of a tp shard
        return _fsdp_tp_boxes(name, x, spec, mesh)
    if isinstance(spec, FusedLayout):  # parts of dim spec.dim (0: Linear, 1: Conv1D)
        try:
            want = spec.local_shape(mesh)
        except ValueError as error:  # an uneven split: it names the sizes
            raise ValueError(f"checkpoint: leaf {name!r}: {error}") from None
        if tuple(x.shape) != want:
            raise ValueError(f"checkpoint: leaf {name!r} has local shape {tuple(x.shape)}, its "
                             f"{spec} gives {want}")
        return _Placed(tuple(spec.shape), tuple(fused_layout_boxes(spec, mesh)))
    parts = tuple(spec.spec if isinstance(spec, Layout) else spec)
    if len(parts) > x.dim():
        raise ValueError(f"checkpoint: leaf {name!r}: spec {spec} has more entries than the "
                         f"tensor has dims (shape {tuple(x.shape)})")
    for axis in (a for p in parts if p is not None for a in ((p,) if isinstance(p, str) else p)):
        if axis not in mesh.axis_names:
            raise ValueError(f"checkpoint: leaf {name!r}: spec {spec} names axis {axis!r}, "
                             f"which the mesh does not have (axes: {mesh.axis_names})")
    split = [None if p is None else (mesh.size(p), mesh.index(p)) for p in parts]
    if isinstance(spec, Layout):
        shape = tuple(spec.shape)
        want = tuple(math.ceil(d / s[0]) if s else d
                     for d, s in zip(shape, split + [None] * (len(shape) - len(split)),
                                     strict=True))
        if tuple(x.shape) != want:
            raise ValueError(f"checkpoint: leaf {name!r} has local shape {tuple(x.shape)} but "
                             f"its layout {spec} on this mesh gives {want}")
    else:
        for dim, s in enumerate(split):
            if s is not None and s[0] > 1:
                raise ValueError(
                    f"checkpoint: leaf {name!r} is split on dim {dim} over {parts[dim]!r} by a "
                    f"bare {spec}, which cannot tell the global size (padding); give an "
                    "sf.Layout (sf.layout_of, or the model object / its .specs)")
        shape = tuple(x.shape)
    return _Placed(shape, tuple(block_boxes(shape, split)))


def _fsdp_tp_boxes(name: str, x: torch.Tensor, spec: FsdpTpLayout, mesh: Mesh) -> _Placed:
    """Boxes of this rank's dp block of its tp shard: the tp shard's boxes (one, or one per
    fused part) cut to the dp block's rows; padding rows lie outside every box."""
    shape = tuple(spec.shape)
    if isinstance(spec.tp, FusedLayout):  # dp splits dim 0 of the tp shard, whatever spec.tp.dim
        tp_boxes, tp_shape = fused_layout_boxes(spec.tp, mesh), spec.tp.local_shape(mesh)
    else:
        tp_parts = tuple(spec.tp.spec)
        split = [None if p is None else (mesh.size(p), mesh.index(p)) for p in tp_parts]
        tp_boxes = block_boxes(shape, split)
        tp_shape = tuple(math.ceil(d / s[0]) if s else d
                         for d, s in zip(shape, split + [None] * (len(shape) - len(split)),
                                         strict=True))
    dp_axes = spec_axes(spec.dp)
    if not dp_axes or not tp_shape:
        boxes, local = tp_boxes, tp_shape
    else:
        dp_n, dp_i = mesh.size(dp_axes), mesh.index(dp_axes)
        boxes = row_split_boxes(tp_boxes, tp_shape[0], dp_n, dp_i)
        local = (math.ceil(tp_shape[0] / dp_n), *tp_shape[1:])
    if tuple(x.shape) != tuple(local):
        raise ValueError(f"checkpoint: leaf {name!r} has local shape {tuple(x.shape)} but its "
                         f"layout {spec} on this mesh gives {tuple(local)}")
    return _Placed(shape, tuple(boxes))


class _Params(NamedTuple):
    """What optimizer sources need: the local parameter tree and each leaf's placement."""

    tree: Any
    placed: list[_Placed]


def resolve(state, layouts, mesh: Mesh, rank: int) -> list[Entry]:
    """One :class:`Entry` per leaf of ``state`` (pytree order), for this rank.

    Raises:
        ValueError / TypeError: naming the leaf, for a layout that does not fit its
            leaf, an optimizer whose parameters cannot be found, or two leaves that
            would get the same key.
    """
    ctx = {"__models__": _model_paths(layouts, ""), "__mesh__": mesh, "__state__": state,
           "__layouts__": layouts}
    out: list[Entry] = []
    _walk(state, layouts, "", mesh, rank, ctx, out)
    seen: dict[str, str] = {}
    for e in out:
        if e.key is not None and seen.setdefault(e.key, e.name) != e.name:
            raise ValueError(f"checkpoint: leaves {seen[e.key]!r} and {e.name!r} get the same key "
                             f"{e.key!r}; rename one")
    return out


def _model_paths(source, prefix: str) -> list[tuple[str, Any]]:
    if _is_model(source):
        return [(prefix, source)]
    if _is_source(source):
        return []
    if isinstance(source, Mapping):
        items = source.items()
    elif isinstance(source, (list, tuple)):
        fields = getattr(type(source), "_fields", None)
        items = zip(fields or range(len(source)), source, strict=True)
    else:
        return []
    return [m for k, v in items for m in _model_paths(v, _join(prefix, str(k)))]


def _subtree(state, path: str):
    node = state
    for label in path.split(".") if path else []:
        kids = dict(_children(node) or [])
        if label not in kids:
            raise ValueError(f"checkpoint: the optimizer's parameters {path!r} are not in the "
                             f"state (at {label!r})")
        node = kids[label]
    return node


def _params_for(ctx: dict, explicit: str | None) -> _Params:
    models = ctx["__models__"]
    if explicit is not None:
        path = explicit
    elif len(models) == 1:
        path = models[0][0]
    elif not models and isinstance(ctx["__state__"], Mapping) and "params" in ctx["__state__"]:
        path = "params"
    else:
        raise ValueError(
            "checkpoint: an optimizer in layouts needs its parameters: give layouts exactly one "
            f"model (found {[p for p, _ in models]}), or a state with a 'params' entry, or "
            "say which with sf.checkpoint.OptLayout(opt, params='path.to.params')")
    if path not in ctx:
        source = dict(models).get(path)
        tree = _subtree(ctx["__state__"], path)
        if source is not None:
            specs = dict(source.specs)
        else:  # the layouts given for the parameters themselves (a tree of Layouts), if any
            specs = _layouts_at(ctx["__layouts__"], path)
        placed = [_boxes_of(_join(path, n), x, None if specs is None else specs.get(n),
                            ctx["__mesh__"]) for n, x in named_leaves(tree)]
        ctx[path] = _Params(tree, placed)
    return ctx[path]


def _layouts_at(layouts, path: str) -> dict | None:
    """The leaf layouts ``layouts`` gives the subtree at ``path`` (dotted leaf name below
    it -> source), or None when it gives none (the parameters are replicated)."""
    node = layouts
    for label in path.split(".") if path else []:
        if node is None or _is_source(node):
            break
        node = _child_source(node, label)
    if node is None:
        return None
    if _is_source(node):
        return _AllLeaves(node)
    return {name: leaf for name, leaf in named_leaves(node)}


class _AllLeaves(dict):
    """One layout source for every leaf of a subtree."""

    def __init__(self, source) -> None:
        super().__init__()
        self.source = source

    def get(self, key, default=None):
        return self.source


def _walk(node, source, name: str, mesh: Mesh, rank: int, ctx: dict, out: list) -> None:
    if not _is_source(source):
        kids = _children(node)
        if kids is None:
            raise ValueError(f"checkpoint: layouts has a subtree at {name or '<root>'!r} where "
                             "the state has a leaf")
        for label, child in kids:
            _walk(child, _child_source(source, label), _join(name, label), mesh, rank, ctx, out)
        return
    if _is_model(source):
        if not isinstance(node, Mapping):
            raise TypeError(f"checkpoint: layouts gives a model at {name!r}, whose state is a "
                            f"{type(node).__name__}, not its parameter dict")
        unknown = sorted(set(node) - set(source.specs))
        if unknown:
            raise ValueError(f"checkpoint: leaves {unknown} under {name!r} are not in the "
                             f"model's specs ({sorted(source.specs)[:8]}...)")
        for label, child in _children(node):
            _walk(child, source.specs[label], _join(name, label), mesh, rank, ctx, out)
        return
    if _is_opt(source):
        _opt_entries(node, source, name, mesh, rank, ctx, out)
        return
    for leaf_name, x in named_leaves(node, name):
        out.append(_leaf_entry(leaf_name, x, source, mesh, rank))


def _leaf_entry(name: str, x, source, mesh: Mesh, rank: int) -> Entry:
    if isinstance(source, Skip):
        return Entry(name, None, isinstance(x, torch.Tensor), (), (), False)
    key = f"{name}@rank{rank}" if isinstance(source, PerRank) else name
    if not isinstance(x, torch.Tensor):
        if isinstance(source, (Layout, P, FusedLayout, FsdpTpLayout)) and source != P():
            raise TypeError(f"checkpoint: leaf {name!r} is a {type(x).__name__} but its layout "
                            f"{source} describes a tensor")
        return Entry(name, key, False, (), (), not isinstance(source, PerRank))
    spec = None if isinstance(source, PerRank) else source
    if not isinstance(source, PerRank):  # a gradient shard saved as the whole tensor: refused
        reduced.check_layouts("checkpoint save", [x], [spec_axes(spec)], lambda: [name])
    placed = _boxes_of(name, x, spec, mesh)
    return Entry(name, key, True, placed.shape, tuple(box_chunks(placed.boxes)),
                 spec is None and not isinstance(source, PerRank))


def inner_optimizer(opt: ShardedOptimizer) -> GradientTransformation:
    """The optimizer ``shard_opt_state`` wraps (``ShardedOptimizer.inner``).

    Raises:
        TypeError: if it is not known (a ShardedOptimizer not made by shard_opt_state).
    """
    inner = getattr(opt, "inner", None)
    if isinstance(inner, GradientTransformation):
        return inner
    raise TypeError("checkpoint: cannot find the optimizer this ShardedOptimizer wraps; "
                    "make it with sf.shard_opt_state")


def _opt_entries(node, source, name: str, mesh: Mesh, rank: int, ctx: dict, out: list) -> None:
    explicit = source.params if isinstance(source, OptLayout) else None
    opt = source.opt if isinstance(source, OptLayout) else source
    params = _params_for(ctx, explicit)
    if isinstance(opt, ShardedOptimizer):
        if not isinstance(node, ShardedOptState):
            raise TypeError(f"checkpoint: layouts gives a ShardedOptimizer at {name!r}, whose "
                            f"state is a {type(node).__name__}, not a ShardedOptState")
        part = opt.partition(params.tree)
        inner, roles = node.inner, _roles(inner_optimizer(opt), params.tree, part, name,
                                          node.inner)
        pieces = part.pieces()
        for (leaf_name, x), role in zip(named_leaves(inner, name), roles, strict=True):
            if role is None:
                out.append(_leaf_entry(leaf_name, x, None, mesh, rank))
                continue
            p = params.placed[role]
            if tuple(x.shape) != (part.local_sizes[role],):
                raise ValueError(f"checkpoint: optimizer leaf {leaf_name!r} has shape "
                                 f"{tuple(x.shape)}, this rank's piece of parameter "
                                 f"{part.names[role]!r} has {part.local_sizes[role]} elements")
            out.append(Entry(leaf_name, leaf_name, True, p.shape,
                             tuple(piece_chunks(pieces[role], part.shapes[role], p.boxes)), False))
        out.append(Entry(_join(name, "partition"), None, True, (), (), False))
        return
    part = flat.FlatPartition.of(params.tree, 1, 0)
    roles = _roles(opt, params.tree, part, name, node)
    for (leaf_name, x), role in zip(named_leaves(node, name), roles, strict=True):
        if role is None:
            out.append(_leaf_entry(leaf_name, x, None, mesh, rank))
            continue
        p = params.placed[role]
        if tuple(x.shape) != part.shapes[role]:
            raise ValueError(f"checkpoint: optimizer leaf {leaf_name!r} has shape "
                             f"{tuple(x.shape)}, its parameter {part.names[role]!r} has "
                             f"{part.shapes[role]}")
        out.append(Entry(leaf_name, leaf_name, True, p.shape, tuple(box_chunks(p.boxes)),
                         p.replicated))


_ROLES: dict = {}  # (optimizer, parameter treedef, dtypes) -> (state treedef, roles)


def _roles(opt: GradientTransformation, params, part: flat.FlatPartition, name: str, state
           ) -> list[int | None]:
    """Per state leaf, its parameter leaf (or None); memoized per optimizer, parameter
    structure and dtypes (what ``state_roles``'s probe ``init`` depends on)."""
    try:
        key = (opt, part.treedef, tuple(x.dtype for x in pytree.tree_leaves(params)))
        hit = _ROLES.get(key)
    except TypeError:  # an unhashable optimizer: no memo
        key, hit = None, None
    if hit is None:
        hit = state_roles(opt, params, part)[:2]
        if key is not None:
            if len(_ROLES) >= 64:
                _ROLES.clear()
            _ROLES[key] = hit
    treedef, roles = hit
    if (got := pytree.tree_structure(state)) != treedef:
        raise ValueError(f"checkpoint: the optimizer state at {name!r} is not its optimizer's "
                         f"init of these params ({structure_difference(got, treedef)}): "
                         "save the params it was made for, or say which: OptLayout(opt, params)")
    return list(roles)
