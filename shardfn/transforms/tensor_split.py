"""Tensor parallelism: ``tensor_split`` splits chosen layers of a functional model over an axis.

``tensor_split(fmodel, mesh, "tp", plan)`` reads a plan ``{glob over module
paths: style}`` (styles in :mod:`shardfn.transforms._tp_styles`: ``"colwise"``,
``"rowwise"``, ``"vocab"``, ``"replicate"`` or style objects with options) and
returns a :class:`TensorSplitModel` (:mod:`._tp_model`; this module builds it):

* ``init(seed)``: this rank's shards, cut from ``fmodel.init(seed)``;
* ``apply(params, ...)``: pure, torch.func-compatible: the leaves swapped into a
  private copy of the skeleton, as ``functional_call`` does (where each goes is
  worked out once), whose matched modules are replaced by wrappers holding the
  same parameter names (the user's module is never changed); each
  wrapper computes its local slice and puts the collectives around it
  (Megatron ``f`` = ``sf.pvary`` into a colwise layer, ``g`` =
  ``sf.psum_invariant`` out of a rowwise layer or a vocab embedding);
* ``specs``: ``name -> sf.Layout`` (global shape and ``P``), so
  ``sf.gather(params, model.specs, mesh) == fmodel.init(seed)``.

Fused projections (``Colwise(fused=3)`` on a ``[q|k|v]`` linear): rank ``r``
holds ``q[r] | k[r] | v[r]``, which no plain ``Layout`` describes (it is a
strided split). Their ``specs`` entry is an ``sf.FusedLayout``, which
``sf.gather``/``sf.shard`` handle like any layout (as do
``model.gather_params(params)`` and ``model.shard_params_tree(full)``).

Cost per step, per split MLP block (colwise then rowwise) on activations of
``B`` bytes over ``tp`` ranks: one psum (``2 B (tp-1)/tp`` sent) forward (the
rowwise output) and one backward (the colwise input's gradient).

Sequence parallel (Megatron-SP; ``Colwise/Rowwise/Vocab(sequence_parallel=True)``
and ``SequenceParallel()`` on the LayerNorms, position embedding and dropouts
between them, :mod:`shardfn.transforms._tp_sequence`): the activations between
the split regions are this rank's sequence chunk; the psums become an
all-gather into each colwise layer and a reduce-scatter out of each rowwise
layer (the reverse in backward), ``B (tp-1)/tp`` each.

Beyond Megatron, as torch's ``parallelize_module`` offers: ``PrepareInput`` /
``PrepareOutput`` / ``PrepareInputOutput`` re-layout a module's inputs / outputs
between replicated and split (:mod:`._tp_layouts`); ``Colwise`` on an
``nn.Embedding`` splits its embedding dim; uneven dims are padded as ``sf.shard``
pads; the plan key ``""`` (or a style given as the plan) styles the root module;
``SequenceParallel`` runs a user-written norm on the chunks.

Dropout RNG (:mod:`shardfn.transforms._tp_rng`): replicated regions draw from the
global generator (equal on every rank entered with the same RNG state);
``SplitRNG()`` / ``SequenceParallel()`` modules draw from a per-rank stream.

Example:
    >>> mlp = sf.functional(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)))
    >>> tp = sf.tensor_split(mlp, mesh, "tp", {"0": "colwise", "2": "rowwise"})
    >>> params = tp.init(0); y = tp.apply(params, x)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from shardfn.functional import FunctionalModel
from shardfn.mesh import Mesh, get_mesh
from shardfn.model import refuse_pipeline
from shardfn.spec import FusedLayout, Layout, LeafLayout, P
from shardfn.transforms._tp_hf import FusedColumnsLayout, fused_layout, hf_tp_plan, split_heads
from shardfn.transforms._tp_model import TensorSplitModel
from shardfn.transforms._tp_plan import (
    check_sequence_parallel,
    check_tied,
    detect_fused,
    match_plan,
)
from shardfn.transforms._tp_styles import (
    Colwise,
    PrepareInput,
    PrepareInputOutput,
    PrepareOutput,
    Replicate,
    Rowwise,
    SequenceParallel,
    SplitRNG,
    Style,
    Vocab,
    leaf_specs,
    wrap,
)
from shardfn.transforms.experts import ExpertParallelModel
from shardfn.transforms.precision import split_precision, with_precision

__all__ = [
    "Colwise",
    "FusedColumnsLayout",
    "FusedLayout",
    "PrepareInput",
    "PrepareInputOutput",
    "PrepareOutput",
    "Replicate",
    "Rowwise",
    "SequenceParallel",
    "SplitRNG",
    "Style",
    "TensorSplitModel",
    "Vocab",
    "hf_tp_plan",
    "tensor_split",
]


def tensor_split(fmodel: FunctionalModel, mesh: Mesh | None = None, axis: str = "tp",
                 plan: Mapping[str, object] | str | None = None) -> TensorSplitModel:
    """Split the layers named by ``plan`` over mesh axis ``axis`` (Megatron tensor parallelism).

    Args:
        fmodel: a :class:`~shardfn.FunctionalModel` (``sf.functional(module)``), or
            ``sf.with_precision(fm, p)``: then ``with_precision(tensor_split(fm, ...), p)``;
            or an ``sf.expert_parallel`` model: TP x EP (:mod:`._tp_ep`, a ``TpEpModel``).
        mesh: the mesh (default: the current one); ``axis`` must be one of its axes.
        axis: the tensor-parallel axis.
        plan: ``{fnmatch glob over module paths: style}``; a style is ``"colwise"``,
            ``"rowwise"``, ``"vocab"``, ``"replicate"``, ``"sequence_parallel"``,
            ``"split_rng"`` or ``Colwise(gather_output=..., fused=..., n_heads=...,
            sequence_parallel=...)``, ``Rowwise(sequence_parallel=...)``,
            ``Vocab(sequence_parallel=...)``, ``Replicate()``, ``SequenceParallel()``
            (LayerNorm / RMSNorm / position embedding / dropout on sequence chunks),
            ``SplitRNG()`` (a parameter-free module on split activations: its random
            ops use this rank's stream; see :mod:`shardfn.transforms._tp_rng`),
            ``PrepareInput(...)`` / ``PrepareOutput(...)`` / ``PrepareInputOutput(...)``
            (re-layout a module's inputs / outputs, :mod:`._tp_layouts`). The key ``""``
            is the root module; a style object alone is ``{"": style}``.
            ``"auto"``: a Hugging Face model's own plan, mapped by :func:`hf_tp_plan`
            (any plan splits HF attention by whole heads, :mod:`._tp_hf`).

    Returns:
        The :class:`TensorSplitModel`.

    Raises:
        ValueError: ``plan="auto"`` on a model without a plan (its config class named)
            or with an HF style shardfn cannot do exactly (style and module named); a tp
            not dividing an attention's head counts (``tp = 4 > num_key_value_heads = 2``);
            a pattern that matches no module (the paths are listed), a
            module matched twice, a style on a module it cannot split (named), fused
            parts or heads not divisible by the axis size (module, dim and sizes; plain
            colwise / rowwise / vocab dims may be uneven: they are padded), a
            split leaf that is tied to another name, an unknown axis; with sequence
            parallelism, a replicated trainable leaf whose module has no
            sequence-parallel (or explicit ``Replicate``) style. At apply, a sequence
            not divisible by the axis size (module, dim and sizes).
        TypeError: ``fmodel`` is not a FunctionalModel.

    Communication per call (activations of ``B`` bytes, ``tp`` ranks): each
    rowwise layer and vocab embedding does one psum (``2 B (tp-1)/tp``) in
    forward; each colwise layer's input does one psum in backward; a
    ``gather_output`` colwise layer one all-gather in forward. Sequence parallel:
    each of those psums becomes an all-gather (colwise input, ``B (tp-1)/tp``) or a
    reduce-scatter (rowwise / vocab output, ``B (tp-1)/tp``), and in backward the
    reverse, plus one psum per replicated leaf used on sequence chunks (its
    gradient). Memory: split leaves take ``1/tp`` of their bytes per rank.

    Example:
        >>> tp = sf.tensor_split(fmodel, mesh, "tp", {"blocks.*.mlp.fc1": "colwise",
        ...                                            "blocks.*.mlp.fc2": "rowwise"})
    """
    from shardfn.transforms.remat_model import remat_model, split_remat

    refuse_pipeline(fmodel, "tensor_split")
    fmodel, remat_policy = split_remat(fmodel)  # tensor_split(remat(fm, r)) is
    if remat_policy is not None:  # remat(tensor_split(fm), r): remat stays outermost
        return remat_model(tensor_split(fmodel, mesh, axis, plan), remat_policy)
    fmodel, policy = split_precision(fmodel)  # docs/composing.md
    if policy is not None:  # tensor_split(with_precision(fm, p)) == with_precision(split(fm), p)
        return with_precision(tensor_split(fmodel, mesh, axis, plan), policy)
    if isinstance(fmodel, ExpertParallelModel):  # tp on the attention of an ep model: _tp_ep.py
        from shardfn.transforms._tp_ep import over_expert_parallel_tp
        return over_expert_parallel_tp(tensor_split, fmodel, get_mesh(mesh), axis, plan)
    if not isinstance(fmodel, FunctionalModel):
        hint = ""
        if isinstance(fmodel, TensorSplitModel):
            hint = f"; it is split over {fmodel.axis!r} already: one tensor_split, one plan"
        elif hasattr(fmodel, "specs"):  # a sharded model: the valid order is the other one
            hint = ("; split first, then shard: shard_params(tensor_split(fm, mesh, 'tp', "
                    "plan), mesh, 'dp')")
        raise TypeError(f"tensor_split expects a FunctionalModel (sf.functional(module)), "
                        f"got {type(fmodel).__name__}{hint}")
    if plan == "auto":
        plan = hf_tp_plan(fmodel.module)
    elif isinstance(plan, Style):  # torch's parallelize_module(module, mesh, style)
        plan = {"": plan}
    if plan is not None and not isinstance(plan, Mapping):
        raise TypeError(f"tensor_split: plan must be a dict {{glob over module paths: style}}, "
                        f"e.g. {{'mlp.fc1': 'colwise', 'mlp.fc2': 'rowwise'}}; got a "
                        f"{type(plan).__name__}: {plan!r:.200}" + (
                            " (a list of (glob, style) pairs: pass dict(pairs))"
                            if isinstance(plan, list | tuple) else ""))
    bad_keys = [key for key in (plan or {}) if not isinstance(key, str)]
    if bad_keys:
        raise TypeError(f"tensor_split: plan keys must be globs over module paths (str), got "
                        f"{bad_keys!r:.200}")
    mesh = get_mesh(mesh)
    if axis not in mesh.axis_names:
        raise ValueError(f"tensor_split: axis {axis!r} is not an axis of the mesh "
                         f"{mesh.axis_names}")
    tp = mesh.size(axis)
    skeleton = copy.deepcopy(fmodel.module)
    paths = [p for p, _ in skeleton.named_modules(remove_duplicate=False)]
    styles = match_plan(plan or {}, paths)
    styles = {path: detect_fused(style, path, skeleton) for path, style in styles.items()}
    split_heads(styles, skeleton, tp, axis)  # HF attention: whole heads, local head counts
    split: dict[str, tuple[P, str, Style]] = {}  # leaf name (aliases too) -> spec, module, style
    for path, style in sorted(styles.items(), key=lambda item: item[0] == ""):  # the root last
        module = skeleton.get_submodule(path)
        for leaf, spec in leaf_specs(module, path, style, axis, tp).items():
            if getattr(module, leaf, None) is not None:
                split[f"{path}.{leaf}" if path else leaf] = (spec, path, style)
        wrapped = wrap(module, style, mesh, axis, path)
        if not path:  # a style on the root module (plan key ""): its wrapper is the skeleton
            skeleton = wrapped
            continue
        parent_path, _, child = path.rpartition(".")
        setattr(skeleton.get_submodule(parent_path), child, wrapped)
    for alias, owner_name in fmodel.tied.items():
        check_tied(alias, owner_name, split, axis)
    check_sequence_parallel(fmodel, styles, split)
    specs: dict[str, Layout | LeafLayout] = {}
    for name, shape in fmodel.param_shapes().items():
        spec, _, style = split.get(name, (P(), "", Replicate()))
        fused = isinstance(style, Colwise) and style.fused > 1
        specs[name] = (fused_layout(spec, axis, style.fused, tuple(shape.shape)) if fused
                       else Layout(spec, tuple(shape.shape)))
    specs = {name: specs[name] for name in fmodel.names}
    return TensorSplitModel(fmodel, mesh, axis, styles, skeleton, specs)
