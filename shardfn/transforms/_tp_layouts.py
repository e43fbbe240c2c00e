"""Re-layout a module's inputs and outputs: torch's ``PrepareModuleInput`` / ``Output``.

A layout is a ``P`` over the tensor-parallel axis: ``P()`` is replicated (every rank
the whole tensor), ``P(None, "tp")`` split on dim 1 (torch's ``Shard(1)``: rank ``r``
holds the ``r``-th block, e.g. its sequence chunk). A plan entry
``PrepareInput(input_layouts, desired_input_layouts)`` converts the module's inputs
before its forward, ``PrepareOutput(output_layouts, desired_output_layouts)`` its
outputs after it, ``PrepareInputOutput`` both; the module itself is not split (it
may hold split children) and its leaf names do not change (the re-layouts are
forward hooks on the private skeleton). The plan key ``""`` styles the root module.

The re-layouts, with the JAX transpose rules of a replicated value:

* split on ``d`` -> replicated: all-gather along ``d``; backward keeps this rank's
  block of the (replicated) gradient, no communication;
* replicated -> split on ``d``: this rank's block; backward all-gathers the blocks'
  gradients, so the replicated input gets the whole gradient on every rank;
* split on ``a`` -> split on ``b``: ``all_to_all``; backward the reverse one.

``d`` must divide by the axis size (uneven blocks are refused, naming the module).

Example:
    >>> plan = {"": sf.PrepareInputOutput(P(), P("tp"), P("tp"), P()),   # batch split inside
    ...         "net1": sf.Colwise(sequence_parallel=True, sequence_dim=0),
    ...         "net2": sf.Rowwise(sequence_parallel=True, sequence_dim=0)}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardfn.mesh import Mesh
from shardfn.primitives import all_gather, all_to_all, axis_index
from shardfn.spec import P
from shardfn.transforms._tp_linear import gather_replicated
from shardfn.transforms._tp_sequence import check_sequence

__all__ = ["PrepareInput", "PrepareInputOutput", "PrepareOutput", "install_prepare"]

Layouts = P | tuple | None


def _check_layouts(style: object, have: str, want: str) -> None:
    """Refuse layouts that are not ``P`` / ``None`` / tuples of them, or pairs of unequal
    length, naming the style and the fields."""
    pair = (getattr(style, have), getattr(style, want))
    for name, value in zip((have, want), pair, strict=True):
        items = value if isinstance(value, tuple) else (value,)
        if not all(item is None or isinstance(item, P) for item in items):
            raise TypeError(f"{type(style).__name__}: {name}={value!r}: give a P (P() "
                            "replicated, P(None, 'tp') split on dim 1), None (leave as is) or "
                            "a tuple of them, one per input")
    if (pair[0] is None) != (pair[1] is None) or (
            isinstance(pair[0], tuple) and len(pair[0]) != len(_as_tuple(pair[1]))):
        raise ValueError(f"{type(style).__name__}: {have}={pair[0]!r} and {want}={pair[1]!r} "
                         "must have the same length (one layout per input)")


def _check_kwarg_layouts(style: object) -> None:
    have, want = style.input_kwarg_layouts, style.desired_input_kwarg_layouts
    if have is None and want is None:
        return
    if not isinstance(have, Mapping) or not isinstance(want, Mapping) or set(have) != set(want):
        raise ValueError(f"{type(style).__name__}: input_kwarg_layouts={have!r} and "
                         f"desired_input_kwarg_layouts={want!r} must be dicts with the same "
                         "keyword names")


def _as_tuple(layouts: Layouts) -> tuple:
    return layouts if isinstance(layouts, tuple) else (layouts,)


@dataclasses.dataclass(frozen=True)
class PrepareInput:
    """Convert a module's inputs from ``input_layouts`` to ``desired_input_layouts``.

    Attributes:
        input_layouts: the layouts the positional inputs arrive in: one ``P`` (one
            input), or a tuple with one ``P`` or ``None`` (not converted) per input.
        desired_input_layouts: the layouts the module's forward gets, same length.
        input_kwarg_layouts, desired_input_kwarg_layouts: the same for keyword inputs,
            ``{name: P}``.

    Example:
        >>> sf.PrepareInput(P(None, "tp"), P())    # gather the sequence chunks (Shard(1))
        >>> sf.PrepareInput(input_kwarg_layouts={"hidden_states": P(None, "tp")},
        ...                 desired_input_kwarg_layouts={"hidden_states": P()})
    """

    input_layouts: Layouts = None
    desired_input_layouts: Layouts = None
    input_kwarg_layouts: Mapping[str, P] | None = None
    desired_input_kwarg_layouts: Mapping[str, P] | None = None

    def __post_init__(self) -> None:
        _check_layouts(self, "input_layouts", "desired_input_layouts")
        _check_kwarg_layouts(self)

    @property
    def sequence_parallel(self) -> bool:
        """Some layout is split: the model's activations differ between ranks (read by the
        checks, as for the sequence-parallel styles)."""
        return _any_split(self)


@dataclasses.dataclass(frozen=True)
class PrepareOutput:
    """Convert a module's outputs from ``output_layouts`` to ``desired_output_layouts``.

    Attributes:
        output_layouts: the layouts the forward returns: one ``P`` (a tensor output), or a
            tuple with one ``P`` or ``None`` per element of a tuple output.
        desired_output_layouts: the layouts the caller gets, same length.

    Example:
        >>> sf.PrepareOutput(P(), P(None, "tp"))   # keep this rank's sequence chunk
    """

    output_layouts: Layouts = None
    desired_output_layouts: Layouts = None

    def __post_init__(self) -> None:
        _check_layouts(self, "output_layouts", "desired_output_layouts")

    @property
    def sequence_parallel(self) -> bool:
        """Some layout is split (see :class:`PrepareInput`)."""
        return _any_split(self)


@dataclasses.dataclass(frozen=True)
class PrepareInputOutput:
    """:class:`PrepareInput` and :class:`PrepareOutput` on one module (torch's
    ``PrepareModuleInputOutput``); the fields are theirs.

    Example:
        >>> sf.PrepareInputOutput(P(), P("tp"), P("tp"), P())   # split the batch inside
    """

    input_layouts: Layouts = None
    desired_input_layouts: Layouts = None
    output_layouts: Layouts = None
    desired_output_layouts: Layouts = None
    input_kwarg_layouts: Mapping[str, P] | None = None
    desired_input_kwarg_layouts: Mapping[str, P] | None = None

    def __post_init__(self) -> None:
        _check_layouts(self, "input_layouts", "desired_input_layouts")
        _check_layouts(self, "output_layouts", "desired_output_layouts")
        _check_kwarg_layouts(self)

    @property
    def sequence_parallel(self) -> bool:
        """Some layout is split (see :class:`PrepareInput`)."""
        return _any_split(self)


def _any_split(style: object) -> bool:
    for field in dataclasses.fields(style):
        value = getattr(style, field.name)
        items = value.values() if isinstance(value, Mapping) else _as_tuple(value)
        if any(isinstance(item, P) and any(part is not None for part in item) for item in items):
            return True
    return False


# ---------------------------------------------------------------- the re-layouts


class _Scatter(torch.autograd.Function):
    """This rank's block of ``dim`` of a replicated tensor; backward all-gathers the blocks'
    gradients (the replicated input's gradient is whole on every rank)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, axis: str, mesh: Mesh, dim: int, start: int, block: int):
        return x.narrow(dim, start, block).clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    def backward(ctx, grad):
        axis, mesh, dim, _, _ = ctx.args
        return all_gather(grad, axis, dim=dim, mesh=mesh), None, None, None, None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        _, _, dim, start, block = ctx.args
        return tangent.narrow(dim, start, block).clone()


class _ScatterTraced(_Scatter):
    """``_Scatter`` for code ``torch.compile`` traces: dynamo refuses a Function that
    defines its own ``jvp`` (forward-mode AD is not traced through it)."""

    jvp = staticmethod(torch.autograd.Function.jvp)


def _dim(layout: P | None, axis: str, path: str, what: str) -> int | None:
    """The dim a layout splits over ``axis`` (None: replicated), after checking it."""
    if layout is None:
        return None
    split = [d for d, part in enumerate(layout) if part is not None]
    if any(layout[d] != axis for d in split) or len(split) > 1:
        raise ValueError(f"tensor_split: module {path!r}: {what} layout {layout} must be P() "
                         f"or split on one dim over the tensor-parallel axis {axis!r} "
                         f"(e.g. P(None, {axis!r}))")
    return split[0] if split else None


def relayout(x: Any, have: P | None, want: P | None, axis: str, mesh: Mesh, path: str,
             what: str) -> Any:
    """``x`` from layout ``have`` to ``want`` (``None`` either side: unchanged).

    Raises:
        ValueError: a layout that is not over ``axis``, a non-tensor ``x`` with a layout,
            a split dim ``x`` does not have or that does not divide by the axis size.
    """
    if have is None or want is None:
        return x
    src, dst = _dim(have, axis, path, what), _dim(want, axis, path, what)
    if src == dst:
        return x
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"tensor_split: module {path!r}: {what} is a {type(x).__name__}, "
                         f"not a tensor, but is given the layouts {have} -> {want}")
    tp = mesh.size(axis)
    for dim in (src, dst):
        if dim is not None and dim >= x.dim():
            raise ValueError(f"tensor_split: module {path!r}: {what} of shape "
                             f"{tuple(x.shape)} has no dim {dim} for the layouts "
                             f"{have} -> {want}")
    if dst is None:
        return gather_replicated(x, axis, mesh, src)
    check_sequence(x, dst, tp, path, axis)
    if src is None:
        block = x.shape[dst] // tp
        if tp == 1:
            return x
        start = axis_index(axis, mesh=mesh) * block
        if torch.compiler.is_compiling():  # through a view: see shard_params/compiled.py
            return _ScatterTraced.apply(x.view_as(x), axis, mesh, dst, start, block)
        return _Scatter.apply(x, axis, mesh, dst, start, block)
    return all_to_all(x, axis, split_dim=dst, concat_dim=src, mesh=mesh).contiguous()


def _convert(values: tuple, have: Layouts, want: Layouts, axis: str, mesh: Mesh, path: str,
             what: str) -> tuple:
    have, want = _as_tuple(have), _as_tuple(want)
    if len(values) != len(have):
        raise ValueError(f"tensor_split: module {path!r} got {len(values)} {what}s, but its "
                         f"style gives layouts for {len(have)} ({have}); give one layout "
                         "(or None) per input")
    return tuple(relayout(v, h, w, axis, mesh, path, f"{what} {i}")
                 for i, (v, h, w) in enumerate(zip(values, have, want, strict=True)))


def install_prepare(module: nn.Module, style: PrepareInput | PrepareOutput | PrepareInputOutput,
                    mesh: Mesh, axis: str, path: str) -> nn.Module:
    """Register the re-layouts of ``style`` as forward hooks on ``module`` (the private
    skeleton's); returns ``module``, its leaf names unchanged."""
    for field in dataclasses.fields(style):  # check the layouts' axis now, naming the module
        value = getattr(style, field.name)
        for layout in value.values() if isinstance(value, Mapping) else _as_tuple(value):
            _dim(layout, axis, path or "<root>", field.name)
    where = path or "<root>"
    have_in = getattr(style, "input_layouts", None)
    have_kw = getattr(style, "input_kwarg_layouts", None)
    if have_in is not None or have_kw is not None:
        want_in, want_kw = style.desired_input_layouts, style.desired_input_kwarg_layouts

        def prepare_input(_module, args, kwargs):
            if have_in is not None:
                args = _convert(tuple(args), have_in, want_in, axis, mesh, where, "input")
            for name, layout in (have_kw or {}).items():
                if name in kwargs:
                    kwargs[name] = relayout(kwargs[name], layout, want_kw[name], axis, mesh,
                                            where, f"keyword input {name!r}")
            return args, kwargs

        module.register_forward_pre_hook(prepare_input, with_kwargs=True)
    if getattr(style, "output_layouts", None) is not None:
        have_out, want_out = style.output_layouts, style.desired_output_layouts

        def prepare_output(_module, _args, output):
            if isinstance(have_out, tuple):
                if not isinstance(output, tuple):
                    raise ValueError(f"tensor_split: module {where!r} returned a "
                                     f"{type(output).__name__}, but its style gives layouts for "
                                     f"a tuple of {len(have_out)}")
                return _convert(output, have_out, want_out, axis, mesh, where, "output")
            return relayout(output, have_out, want_out, axis, mesh, where, "output")

        module.register_forward_hook(prepare_output)
    return module
