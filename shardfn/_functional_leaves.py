"""The leaves of a module as :func:`shardfn.functional` sees them: found once, then checked.

A *leaf* is one parameter or buffer, found on a meta-device copy of the module
(:func:`meta_skeleton`, which holds none of the user's tensors) and named as in
``named_parameters()`` / ``named_buffers()``. A tensor registered under two
names (tied weights) is one leaf, under the first name; the other is an alias.
:func:`check_params` is the check every ``FunctionalModel`` call makes of a
params dict, with messages that name the leaf and say what would be valid.

Example:
    >>> leaves, tied, paths, owned = find_leaves(meta_skeleton(torch.nn.Linear(3, 2)))
    >>> list(leaves), owned[""]
    (['weight', 'bias'], ['weight', 'bias'])
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from shardfn._torch_internals import is_differentiated

__all__ = [
    "Leaf",
    "check_params",
    "describe_unknown",
    "find_leaves",
    "floating",
    "meta_skeleton",
    "refuse_differentiated_state",
    "reject_lazy",
    "suggest",
    "vmap_buffer_error",
]


class Leaf(NamedTuple):
    """One parameter or buffer of a module, as found on its meta-device skeleton."""

    name: str  # canonical dotted name ("blocks.0.weight")
    owner: str  # path of the submodule registering it ("blocks.0"; "" for the root)
    key: str  # attribute name inside the owner ("weight")
    is_buffer: bool
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool

    @property
    def trainable(self) -> bool:
        """A parameter that requires grad, of a floating (or complex) dtype."""
        return not self.is_buffer and self.requires_grad and floating(self.dtype)


def find_leaves(
    skeleton: nn.Module,
) -> tuple[dict[str, Leaf], dict[str, str], tuple[str, ...], dict[str, list[str]]]:
    """The leaves of ``skeleton``, its tied aliases, its submodule paths and who owns what.

    Returns:
        ``(leaves, tied, module_paths, owned)``: leaf name -> :class:`Leaf` (parameters
        first, each tied tensor once, under its first name), alias -> that name, every
        submodule path (``""`` is the root), path -> the names of the leaves it registers.
    """
    leaves: dict[str, Leaf] = {}
    kinds = ((False, skeleton.named_parameters()), (True, skeleton.named_buffers()))
    for is_buffer, named in kinds:
        for name, tensor in named:
            owner, _, key = name.rpartition(".")
            leaves[name] = Leaf(
                name,
                owner,
                key,
                is_buffer,
                tensor.shape,
                tensor.dtype,
                bool(tensor.requires_grad) and not is_buffer,
            )
    canonical = {id(t): n for n, t in skeleton.named_parameters()}
    canonical.update({id(t): n for n, t in skeleton.named_buffers()})
    tied = {}
    for named in (
        skeleton.named_parameters(remove_duplicate=False),
        skeleton.named_buffers(remove_duplicate=False),
    ):
        for name, tensor in named:
            if canonical[id(tensor)] != name:
                tied[name] = canonical[id(tensor)]

    module_paths = tuple(path for path, _ in skeleton.named_modules())
    owned: dict[str, list[str]] = {path: [] for path in module_paths}
    for leaf in leaves.values():
        owned[leaf.owner].append(leaf.name)
    return leaves, tied, module_paths, owned


def meta_skeleton(module: nn.Module) -> nn.Module:
    """Deep copy of ``module`` whose parameters and buffers are on the meta device (ties kept)."""
    memo: dict[int, Any] = {}
    for param in module.parameters():
        memo[id(param)] = nn.Parameter(
            torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
        )
    for buffer in module.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    try:
        return copy.deepcopy(module, memo)
    except Exception as error:  # a module holding a lock, a process group, ...
        raise TypeError(
            f"functional() could not copy {type(module).__name__} into a meta-device skeleton "
            f"(copy.deepcopy failed: {error}); keep non-copyable objects out of the module"
        ) from error


def floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def reject_lazy(module: nn.Module) -> None:
    named = list(module.named_parameters()) + list(module.named_buffers())
    lazy = [name for name, tensor in named if nn.parameter.is_lazy(tensor)]
    if lazy:
        raise ValueError(
            f"functional(): {lazy} are uninitialised lazy parameters/buffers; run the module "
            f"once on an example input (or give explicit sizes) before calling functional()"
        )


def check_params(
    params: Mapping[str, torch.Tensor],
    leaves: Mapping[str, Leaf],
    tied: Mapping[str, str],
    model_name: str,
    shapes: bool,
) -> None:
    """``FunctionalModel.check``: ``params`` has exactly these leaves (and shapes).

    Raises:
        TypeError: not a mapping, or a value that is not a tensor (named).
        ValueError: missing or unexpected names, or a wrong shape.
    """
    if not isinstance(params, Mapping):
        raise TypeError(
            f"params must be a mapping name -> Tensor (as returned by init), "
            f"got {type(params).__name__}"
        )
    if params.keys() != leaves.keys():
        missing = [name for name in leaves if name not in params]
        unexpected = [name for name in params if name not in leaves]
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unexpected:
            described = [describe_unknown(name, tied) for name in unexpected]
            parts.append(f"unexpected [{', '.join(described)}]")
        raise ValueError(
            f"params do not match {model_name}: {'; '.join(parts)}"
        )
    for name, leaf in leaves.items():
        value = params[name]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"params[{name!r}] must be a Tensor, got {type(value).__name__}")
        if shapes and value.shape != leaf.shape:
            raise ValueError(
                f"params[{name!r}] has shape {tuple(value.shape)}, expected {tuple(leaf.shape)}"
            )


def describe_unknown(name: str, tied: Mapping[str, str], candidates: Sequence[str] = ()) -> str:
    """``name`` for a message about a name that is not a leaf: its owner if tied, or close names."""
    if name in tied:
        return f"{name!r} (tied to {tied[name]!r}; pass only that one)"
    return f"{name!r}{suggest(name, candidates)}" if candidates else repr(name)


def suggest(name: str, candidates: Iterator[str] | Sequence[str] | Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=3)
    return f"; did you mean {close}?" if close else ""


def vmap_buffer_error(model_name: str, buffer_names: Sequence[str], error: Exception) -> Exception:
    """The error for a forward that updates an unbatched buffer in place under ``vmap``."""
    return RuntimeError(
        f"{model_name}.apply under torch.func.vmap: the forward updates "
        f"in place a tensor that vmap does not batch, typically a buffer (BatchNorm's "
        f"running statistics in training mode; buffers: {list(buffer_names)}), "
        f"which vmap cannot do, as for torch modules. Batch the buffers too (vmap over "
        f"the params tree, in_dims=0, as for an ensemble), or use model.eval() or "
        f"track_running_stats=False. torch said: {error}"
    )


#: where the design is written (linked from every refusal)
BUFFERS_DOC = "docs/functional.md#buffers-are-state"


def refuse_differentiated_state(
    params: Mapping[str, torch.Tensor],
    buffer_names: Sequence[str],
    frozen_names: Sequence[str],
    where: str,
) -> None:
    """Raise if a buffer or a frozen parameter of ``params`` is being differentiated.

    Buffers are model state and frozen parameters (``requires_grad=False`` in the
    module) are not trained: neither may get a gradient, or an optimizer would move
    it (weight decay included). Every model kind's ``apply`` calls this at its entry,
    so sharded and unsharded code refuse alike. A leaf counts as differentiated when
    it requires grad (autograd) or a ``torch.func`` grad level tracks it
    (:func:`~shardfn._torch_internals.is_differentiated`). Names absent from
    ``params`` are skipped (a pipeline stage holds a subset). Cost: a
    ``requires_grad`` read per buffer and frozen parameter (under 1 us each).

    Args:
        params: ``name -> Tensor`` as the model's ``apply`` got it.
        buffer_names / frozen_names: the model's buffers and frozen parameters.
        where: the caller, for the message (``"FunctionalModel(Net).apply"``).

    Raises:
        ValueError: naming the first few offending leaves and their count, and
            saying how to differentiate only the trainable parameters.

    Example:
        >>> refuse_differentiated_state({"running_mean": torch.zeros(2)}, ["running_mean"],
        ...                             [], "apply")
    """
    buffers = [n for n in buffer_names if n in params and is_differentiated(params[n])]
    frozen = [n for n in frozen_names if n in params and is_differentiated(params[n])]
    if buffers or frozen:
        raise ValueError(differentiated_state_message(buffers, frozen, where))


def differentiated_state_message(buffers: Sequence[str], frozen: Sequence[str],
                                 where: str) -> str:
    """The message of :func:`refuse_differentiated_state`."""

    def few(names: Sequence[str]) -> str:
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        return f"{list(names[:5])}{more} ({len(names)} in all)"

    parts = []
    if buffers:
        parts.append(f"buffers {few(buffers)}")
    if frozen:
        parts.append(f"frozen parameters (requires_grad=False in the module) {few(frozen)}")
    return (
        f"{where}: {' and '.join(parts)} are being differentiated (torch.func.grad/vjp, or "
        f"requires_grad=True under autograd). Buffers are state, not parameters, and frozen "
        f"parameters are not trained: neither may get a gradient or an optimizer update. "
        f"Differentiate only the trainable part: `trainable, rest = model.split_trainable("
        f"params)`, then `torch.func.grad(lambda t: loss(model.apply(model.merge(t, rest), "
        f"x)))(trainable)` (under autograd, set requires_grad on `trainable` only); buffers "
        f"updated by the forward come back from `apply(..., mutable=True)`. See {BUFFERS_DOC}."
    )
