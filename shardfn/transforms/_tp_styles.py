"""The tensor-parallel styles of :func:`shardfn.tensor_split`: what each splits, and checks.

A style says how one module is split over the ``tp`` axis and which collectives
go around it. Each split module is replaced, in a private copy of the model's
skeleton, by a wrapper that registers the *same* parameter names (``weight``,
``bias``), so leaf names stay ``"blocks.0.mlp.fc1.weight"``; ``functional_call``
then hands the wrapper this rank's local shards. The wrappers live by kind:
:mod:`._tp_linear` (``nn.Linear`` / ``Conv1D``), :mod:`._tp_embedding`
(``nn.Embedding``: vocabulary or embedding dim), :mod:`._tp_sequence` (sequence
parallel, per-rank RNG, user norms), :mod:`._tp_layouts` (re-layouts of a module's
inputs and outputs: ``PrepareInput`` / ``PrepareOutput``); :func:`wrap` picks one.

Uneven dims (``Colwise`` / ``Rowwise`` features, ``Vocab`` rows, ``Colwise`` on an
embedding's dim) are padded as ``sf.shard`` pads (``ceil(d / tp)`` per rank, zeros
at the end) and the padding is never computed with; fused parts and head counts
must still divide.

The rules are JAX's for a tensor-parallel region (Megatron's ``f``/``g`` pair):

* a replicated activation *enters* a split region through ``sf.pvary``
  (identity forward, psum backward: ``f``);
* a per-rank partial result *leaves* it through ``sf.psum_invariant``
  (psum forward, identity backward: ``g``), so the replicated computation after
  it (LayerNorm, residual, loss) is counted once, not once per rank.

With ``sequence_parallel=True`` (Megatron-SP, see :mod:`._tp_sequence`) the
activations between the regions are this rank's sequence chunk instead: a
colwise layer all-gathers its input along the sequence (``sf.all_gather``,
backward reduce-scatter: it replaces ``f``), a rowwise layer or vocab embedding
reduce-scatters its output along the sequence (``sf.psum_scatter``, backward
all-gather: it replaces ``g``), and the rowwise bias, added to a chunk, enters
through ``sf.pvary`` (its gradient is summed over the axis).

Example:
    >>> Colwise(gather_output=True)
    Colwise(gather_output=True, fused=1, n_heads=None, sequence_parallel=False, sequence_dim=-2)
"""

from __future__ import annotations

import dataclasses

from torch import nn

from shardfn.mesh import Mesh
from shardfn.spec import P
from shardfn.transforms._tp_embedding import ColwiseEmbedding, VocabEmbedding
from shardfn.transforms._tp_layouts import (
    PrepareInput,
    PrepareInputOutput,
    PrepareOutput,
    install_prepare,
)
from shardfn.transforms._tp_linear import ColwiseLinear, RowwiseLinear, features, is_conv1d
from shardfn.transforms._tp_sequence import PvaryParams, SequenceParallel, SplitRNG, wrap_sequence

__all__ = ["Colwise", "PrepareInput", "PrepareInputOutput", "PrepareOutput", "Replicate",
           "Rowwise", "SequenceParallel", "SplitRNG", "Style", "Vocab", "as_style", "features",
           "is_conv1d", "leaf_specs", "wrap"]


def check_fields(style: object) -> None:
    """Refuse a style whose fields have the wrong type or range, naming the field."""
    for field in dataclasses.fields(style):
        value = getattr(style, field.name)
        if field.name in ("gather_output", "sequence_parallel", "split_input", "sum_grads"):
            ok, want = isinstance(value, bool), "True or False"
        elif field.name == "sequence_dim":
            ok, want = isinstance(value, int) and not isinstance(value, bool), "an int"
        elif field.name == "fused":
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            want = "an int >= 1"
        else:  # n_heads
            ok = value is None or isinstance(value, int) and not isinstance(value, bool) \
                and value >= 1
            want = "None or an int >= 1"
        if not ok:
            raise ValueError(f"{type(style).__name__}: {field.name}={value!r} is not valid; "
                             f"give {want}")


@dataclasses.dataclass(frozen=True)
class Colwise:
    """Split an ``nn.Linear``'s output features (weight rows and bias) over the axis.

    Also takes a ``Conv1D`` (GPT-2's ``(in, out)`` weight: its columns are split) and an
    ``nn.Embedding`` (its embedding dim: the output is split on its last dim, as torch's
    ``ColwiseParallel`` on an embedding). Uneven output features are padded.

    Attributes:
        gather_output: all-gather the output's last dim, so it leaves replicated
            (its backward keeps this rank's slice of the gradient: no communication).
        fused: the output is ``fused`` equal parts side by side (``3`` for a fused
            ``[q|k|v]`` projection); each part is split separately, so rank ``r``
            holds ``q[r] | k[r] | v[r]``.
        n_heads: heads per part; checked to divide by the axis size (whole heads per rank).
        sequence_parallel: the input is this rank's sequence chunk; it is all-gathered
            along ``sequence_dim`` (backward: reduce-scatter) instead of entering via pvary.
        sequence_dim: the sequence dim of the activations (default ``-2``: ``[..., T, d]``).
    """

    gather_output: bool = False
    fused: int = 1
    n_heads: int | None = None
    sequence_parallel: bool = False
    sequence_dim: int = -2

    def __post_init__(self) -> None:
        check_fields(self)


@dataclasses.dataclass(frozen=True)
class Rowwise:
    """Split an ``nn.Linear``'s input features (weight columns) over the axis.

    The input is this rank's feature slice (what a ``Colwise`` before it gives);
    the partial products are summed with ``psum_invariant`` and the (replicated)
    bias is added once, after the sum. Also takes a ``Conv1D`` (its weight rows).

    Attributes:
        sequence_parallel: reduce-scatter the partial products along ``sequence_dim``
            (backward: all-gather) instead of psum; the bias enters through ``sf.pvary``.
        sequence_dim: the sequence dim of the activations (default ``-2``).
        split_input: the input is replicated (all features); each rank takes its slice
            (through ``sf.pvary``: the input's gradient is summed over the axis).
            HF's ``"rowwise_split_input"``.
    """

    sequence_parallel: bool = False
    sequence_dim: int = -2
    split_input: bool = False

    def __post_init__(self) -> None:
        check_fields(self)


@dataclasses.dataclass(frozen=True)
class Vocab:
    """Split an ``nn.Embedding``'s rows (the vocabulary) over the axis.

    Each rank looks up only the ids in its range (the others give zeros), and
    ``psum_invariant`` sums the lookups: the output is replicated.

    Attributes:
        sequence_parallel: reduce-scatter the lookups along ``sequence_dim`` of the
            output (backward: all-gather): the output is this rank's sequence chunk.
        sequence_dim: the sequence dim of the output (default ``-2``: ``[..., T, d]``).
    """

    sequence_parallel: bool = False
    sequence_dim: int = -2

    def __post_init__(self) -> None:
        check_fields(self)


@dataclasses.dataclass(frozen=True)
class Replicate:
    """Leave the module whole on every rank (no communication).

    Attributes:
        sum_grads: the module runs on split activations (a per-head norm on this rank's
            heads, as Qwen3's ``q_norm``): its parameters enter through ``sf.pvary``, so
            their gradients are summed over the axis (HF's
            ``"replicated_with_grad_allreduce"``). Without it each rank's gradient would
            be only its heads' part.
    """

    sum_grads: bool = False

    def __post_init__(self) -> None:
        check_fields(self)


Style = (Colwise | Rowwise | Vocab | Replicate | SequenceParallel | SplitRNG | PrepareInput
         | PrepareOutput | PrepareInputOutput)
_BY_NAME = {"colwise": Colwise, "rowwise": Rowwise, "vocab": Vocab, "replicate": Replicate,
            "sequence_parallel": SequenceParallel, "split_rng": SplitRNG,
            "colwise_sp": lambda: Colwise(sequence_parallel=True),
            "rowwise_sp": lambda: Rowwise(sequence_parallel=True),
            "vocab_sp": lambda: Vocab(sequence_parallel=True)}


def as_style(style: object, pattern: str) -> Style:
    """A style object from a plan value (a name such as ``"colwise"`` or a style object).

    ``"colwise_sp"`` / ``"rowwise_sp"`` / ``"vocab_sp"`` name the sequence-parallel
    forms (``Colwise(sequence_parallel=True)``, ...), ``"sequence_parallel"`` is
    ``SequenceParallel()`` and ``"split_rng"`` is ``SplitRNG()``.
    """
    if isinstance(style, Style):
        return style
    if isinstance(style, str) and style in _BY_NAME:
        return _BY_NAME[style]()
    raise ValueError(f"tensor_split: plan[{pattern!r}] = {style!r} is not a style; use one of "
                     f"{sorted(_BY_NAME)} or Colwise(...)/Rowwise()/Vocab()/Replicate()/"
                     "SequenceParallel()/SplitRNG()/PrepareInput(...)/PrepareOutput(...)/"
                     "PrepareInputOutput(...)")


# ---------------------------------------------------------------- checks and specs


def _need(module: nn.Module, kind: type, path: str, style: Style) -> None:
    if type(module) is not kind and not (kind is nn.Linear and is_conv1d(module)):
        also = " or a Conv1D" if kind is nn.Linear else ""
        also += " or an nn.Embedding" if isinstance(style, Colwise) else ""
        raise ValueError(f"tensor_split: style {style} on module {path!r} needs an "
                         f"nn.{kind.__name__}{also}, but {path!r} is a {type(module).__name__}")


def _divides(path: str, what: str, size: int, parts: int, why: str) -> None:
    if size % parts:
        raise ValueError(f"tensor_split: module {path!r}: {what} = {size} is not divisible "
                         f"by {parts} ({why}); only plain colwise / rowwise / vocab splits "
                         "may be uneven (padded)")


def _colwise_embedding(module: nn.Embedding, path: str, style: Colwise, axis: str
                       ) -> dict[str, P]:
    """Colwise on an ``nn.Embedding``: its embedding dim (weight columns) is split."""
    if style.fused > 1 or style.n_heads is not None or style.sequence_parallel:
        raise ValueError(f"tensor_split: module {path!r} (nn.Embedding): {style} splits the "
                         "embedding dim; fused, n_heads and sequence_parallel are for linear "
                         "layers (use Vocab(sequence_parallel=True) for sequence parallelism)")
    if module.max_norm is not None or module.sparse:
        raise ValueError(f"tensor_split: module {path!r}: Colwise on an nn.Embedding does not "
                         "support max_norm (it needs whole rows) or sparse")
    return {"weight": P(None, axis)}


def leaf_specs(module: nn.Module, path: str, style: Style, axis: str, tp: int) -> dict[str, P]:
    """``{leaf name inside the module: spec}`` for a matched module, after checking it fits.

    A ``Conv1D``'s weight is ``(in, out)``: colwise splits its dim 1, rowwise its dim 0."""
    if isinstance(style, Replicate | SequenceParallel | SplitRNG | PrepareInput | PrepareOutput
                  | PrepareInputOutput):
        return {}
    if isinstance(style, Vocab):  # uneven vocabularies are padded (ids never reach the pad)
        _need(module, nn.Embedding, path, style)
        if module.max_norm is not None or module.sparse:
            raise ValueError(f"tensor_split: module {path!r}: Vocab does not support "
                             "max_norm or sparse yet")
        return {"weight": P(axis, None)}
    if isinstance(style, Colwise) and type(module) is nn.Embedding:
        return _colwise_embedding(module, path, style, axis)
    _need(module, nn.Linear, path, style)
    conv = is_conv1d(module)
    _, out_features = features(module)
    if isinstance(style, Rowwise):  # uneven in_features: padded
        return {"weight": P(axis, None) if conv else P(None, axis), "bias": P()}
    if style.fused < 1:
        raise ValueError(f"tensor_split: module {path!r}: Colwise(fused={style.fused}) "
                         "must be >= 1")
    if style.fused > 1 and style.gather_output:
        raise ValueError(f"tensor_split: module {path!r}: Colwise(fused=..., gather_output=True) "
                         "is not supported (the gathered parts would be interleaved)")
    if style.fused > 1:  # plain colwise: uneven out_features are padded
        _divides(path, "out_features", out_features, style.fused * tp,
                 f"{style.fused} fused parts x size {tp} of axis {axis!r}")
    if style.n_heads is not None:
        if style.n_heads % tp:
            raise ValueError(f"tensor_split: module {path!r}: n_heads = {style.n_heads} is not "
                             f"divisible by the axis size {tp} (axis {axis!r}): each rank "
                             "needs whole heads")
        _divides(path, "out_features / fused", out_features // style.fused,
                 style.n_heads, "n_heads")
    return {"weight": P(None, axis) if conv else P(axis, None), "bias": P(axis)}


def wrap(module: nn.Module, style: Style, mesh: Mesh, axis: str, path: str = "") -> nn.Module:
    """The module that runs ``module`` under ``style`` (``module`` itself for Replicate, and
    for the Prepare styles, with their re-layouts as forward hooks)."""
    if isinstance(style, PrepareInput | PrepareOutput | PrepareInputOutput):
        return install_prepare(module, style, mesh, axis, path)
    if isinstance(style, SequenceParallel | SplitRNG):
        return wrap_sequence(module, style, mesh, axis, path)
    if isinstance(style, Replicate):
        if not style.sum_grads:
            return module
        return PvaryParams(module, mesh, axis, path, "Replicate(sum_grads=True)")
    sequence_dim = style.sequence_dim if style.sequence_parallel else None
    if isinstance(style, Colwise) and type(module) is nn.Embedding:
        return ColwiseEmbedding(module, mesh, axis, style.gather_output, path)
    if isinstance(style, Colwise):
        return ColwiseLinear(module, mesh, axis, style.gather_output, path, sequence_dim)
    if isinstance(style, Rowwise):
        return RowwiseLinear(module, mesh, axis, path, sequence_dim, style.split_input)
    return VocabEmbedding(module, mesh, axis, path, sequence_dim)
