"""Misuse checks of :func:`shardfn.tensor_split`: plans, replicated values, token ids.

A tensor-parallel group computes one model together, so some things must be the
same on every rank of the ``tp`` axis; when they are not, the result is silently
wrong (or the ranks hang in mismatched collectives). In check mode
(``sf.check_consistency``, on in ``sf.testing``'s local worlds) these are compared
with one exchange each (:func:`shardfn.primitives.consistency.check_same`):

* the plan (every matched module's style, every leaf's layout): at ``init`` and at
  every ``apply``;
* the inputs of ``apply`` when the plan has no sequence-parallel style (every
  input then enters a split region replicated), and the token ids entering a
  sequence-parallel ``Vocab`` embedding;
* the initial parameters (``init(seed)`` with a rank-dependent seed).

Token ids outside ``[0, vocab)`` in a ``Vocab`` embedding raise ``IndexError`` in
every mode (the unsplit ``nn.Embedding`` raises it; the split one would look them
up as zeros): one ``aminmax`` of the ids, no communication (the ids are
replicated, so every rank raises). On CUDA outside check mode the check is an
asynchronous device assert (no host sync), as ``nn.Embedding``'s own.

Example:
    >>> check_apply(tp, (x,), {})     # check mode: plan and inputs equal on every tp rank
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from shardfn import pytree as pt
from shardfn._torch_internals import assert_async, unwrap_functorch
from shardfn.primitives import _comm, consistency
from shardfn.primitives._fingerprint import describe_leaf, leaf_hash
from shardfn.transforms._tp_sequence import SequenceParallel

if TYPE_CHECKING:
    from shardfn.transforms.tensor_split import TensorSplitModel

__all__ = ["check_apply", "check_ids", "check_init", "checking", "note_plan", "plan_values",
           "value_hashes"]

_PLAN_HINT = ("build every rank's model with the same tensor_split plan, pass the same inputs "
              "to every rank of the tp group, and call init with the same seed")


def checking(model: TensorSplitModel) -> bool:
    """Whether the checks run: check mode on and an axis of more than one rank."""
    return consistency.enabled() and model.mesh.size(model.axis) > 1


def is_sequence_parallel(model: TensorSplitModel) -> bool:
    """Whether some style of the plan runs on sequence chunks (inputs may differ per rank)."""
    return any(isinstance(s, SequenceParallel) or getattr(s, "sequence_parallel", False)
               for s in model.styles.values())


def plan_values(model: TensorSplitModel) -> dict[str, str]:
    """The plan as ``check_same`` values: each styled module, and a digest of the layouts."""
    values = {f"plan[{path!r}]": repr(style) for path, style in sorted(model.styles.items())}
    layouts = repr(sorted((name, repr(layout)) for name, layout in model.specs.items()))
    values["leaf layouts"] = hashlib.blake2b(layouts.encode(), digest_size=8).hexdigest()
    return values


def value_hashes(tree: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``name -> hash of the tensor's bytes`` (what ``check_same`` compares)."""
    return {f"leaf {name!r}": leaf_hash(x) for name, x in tree.items()}


def check_init(model: TensorSplitModel, hashes: Mapping[str, str], what: str) -> None:
    """In check mode: the plan and the full (unsplit) leaves ``hashes`` describe agree.

    Raises:
        ConsistencyError: naming the module or leaf that differs and every rank's value.
    """
    if checking(model):
        consistency.check_same(what, _comm.resolve(model.axis, model.mesh),
                               {**plan_values(model), **hashes},
                               "Did every rank call init with the same seed (and the same "
                               "plan)? " + _PLAN_HINT)


def check_apply(model: TensorSplitModel, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """In check mode: the plan, and (no sequence parallelism) the inputs, agree over the axis.

    Raises:
        ConsistencyError: naming the input (``args[0]``, ``kwargs['mask']``) or the
            module whose style differs, with every rank's value.
    """
    if not checking(model):
        return
    values: dict[str, Any] = plan_values(model)
    if not is_sequence_parallel(model):
        names, leaves, _ = pt.tree_flatten_with_path({"args": tuple(args),
                                                      "kwargs": dict(kwargs)})
        for name, leaf in zip(names, leaves, strict=True):
            tensor = isinstance(leaf, torch.Tensor)
            values[f"input {name}"] = leaf if tensor else describe_leaf(leaf)
    consistency.check_same("tensor_split.apply", _comm.resolve(model.axis, model.mesh), values,
                           _PLAN_HINT)


@contextlib.contextmanager
def note_plan(model: TensorSplitModel) -> Iterator[None]:
    """Add the plan to a ``RuntimeError`` raised by the split model (type and traceback kept):
    a torch shape error there is usually a plan whose split activations reach unsplit code.
    Not in a compiled step (dynamo cannot trace ``add_note``)."""
    if torch.compiler.is_compiling():
        yield
        return
    try:
        yield
    except RuntimeError as error:
        styles = {path: type(style).__name__ for path, style in model.styles.items()}
        error.add_note(f"(raised inside tensor_split over axis {model.axis!r} with the plan "
                       f"{styles}; a Colwise layer without gather_output gives this rank's "
                       "slice of its output features, which only a Rowwise layer, or code "
                       "written for the slice, can take)")
        raise


def check_ids(ids: torch.Tensor, vocab: int, path: str, mesh: Any, axis: str,
              sequence_parallel: bool) -> None:
    """Token ids entering a ``Vocab`` embedding are in ``[0, vocab)`` (every mode) and, in
    check mode with sequence parallelism, the same on every rank.

    Raises:
        IndexError: an id outside the vocabulary (the min and max id and ``vocab`` named).
        ConsistencyError: (check mode) ids that differ between the ranks of ``axis``.
    """
    if torch.compiler.is_compiling():
        return
    check = consistency.enabled() and mesh.size(axis) > 1
    if check and sequence_parallel:
        consistency.check_same(f"tensor_split: token ids into Vocab embedding {path!r}",
                               _comm.resolve(axis, mesh), {"ids": ids}, _PLAN_HINT)
    plain = unwrap_functorch(ids)  # under vmap: every example's ids at once
    if plain.numel() == 0:
        return
    low, high = torch.aminmax(plain.detach())
    if plain.is_cuda and not check:  # no host sync: fails the step asynchronously
        assert_async((low >= 0) & (high < vocab),
                     f"tensor_split: token id out of range [0, {vocab}) in {path!r}")
        return
    if low < 0 or high >= vocab:
        raise IndexError(f"tensor_split: module {path!r} (Vocab): token ids must be in "
                         f"[0, {vocab}) (the vocabulary size is {vocab}), got min id "
                         f"{int(low)} and max id {int(high)}; nn.Embedding raises IndexError "
                         "for these too")
