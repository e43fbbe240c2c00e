"""Stage values: what crosses a pipeline boundary, one tensor or a tuple of them.

A stage returns a tensor or a tuple/list of tensors (and Nones), and the next
stage receives it as its one argument, as in ``nn.Sequential``. Floating entries
get gradients; integer ones (masks) travel forward only; an entry the next
stage does not use gets no gradient (None: nothing flows back through it).
These helpers turn such values into autograd's lists and back, and compare a
value with its declared (or inferred) shapes.

Example:
    >>> x = grad_leaves((hidden, mask))           # hidden requires grad, mask does not
    >>> needing_grad(x)                           # [hidden]
    >>> input_grads(x, [g])                       # (g, None): the gradient message
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from shardfn.transforms.pipeline._p2p import (
    Declared,
    DeclaredValue,
    declared_entries,
    declared_of_value,
    entries_of,
)

__all__ = ["check_value", "describe", "detach", "grad_declared", "grad_flags", "grad_leaves",
           "input_grads",
           "grad_roots", "mismatch", "needing_grad"]


def _needs_grad(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


def grad_declared(found: DeclaredValue) -> DeclaredValue | None:
    entries = [d if d is not None and (d.dtype.is_floating_point or d.dtype.is_complex)
               else None for d in declared_entries(found)]
    if all(d is None for d in entries):
        return None  # no payload: the header alone
    return entries[0] if isinstance(found, Declared) else tuple(entries)


def detach(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(detach(e) for e in value)
    return None if value is None else value.detach()


def _grad_leaf(x: Any, wanted: bool = True) -> Any:
    if wanted and isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
        return x.detach().requires_grad_(True)
    return x


def grad_flags(value: Any) -> tuple[bool, ...]:
    """Per entry of a stage output (one tensor, or a tuple's entries): requires grad."""
    entries = value if isinstance(value, (tuple, list)) else [value]
    return tuple(_needs_grad(e) for e in entries)


def grad_leaves(x: Any, flags: Sequence[bool] | None = None) -> Any:
    """A received activation as the stage's input: floating tensors (each entry of a
    tuple) become leaves requiring grad; integer ones (masks) stay as they are. With
    ``flags`` (the sender's :func:`grad_flags`) only the entries that required grad on
    the sender do: one that did not arrives as a plain tensor, as in the unsplit model
    (an in-place op on it works there, and would fail on a leaf requiring grad)."""
    if isinstance(x, (tuple, list)):
        wanted = [True] * len(x) if flags is None else flags
        return type(x)(_grad_leaf(e, w) for e, w in zip(x, wanted, strict=False))
    return _grad_leaf(x, True if not flags else flags[0])


def needing_grad(x: Any) -> list[torch.Tensor]:
    """The tensors of a stage input (one, or a tuple's entries) that get a gradient."""
    entries = x if isinstance(x, (tuple, list)) else [x]
    return [e for e in entries if _needs_grad(e)]


def input_grads(x: Any, found: Sequence[torch.Tensor | None]) -> Any:
    """The gradient message for stage input ``x``: ``found`` (one per :func:`_needing_grad`
    entry) put back in ``x``'s structure, None where an entry has no gradient."""
    if not isinstance(x, (tuple, list)):
        return found[0] if found else None
    rest = iter(found)
    return type(x)(next(rest) if _needs_grad(e) else None for e in x)


def grad_roots(out: Any, grad: Any) -> tuple[list, list | None]:
    """``(outputs, gradients)`` to differentiate: the entries of ``out`` (a tensor, a
    graph edge or a tuple) that need grad and got a gradient; ``grad`` None: ``out``
    itself (the scaled loss), the backward's start."""
    if grad is None:
        return ([out] if isinstance(out, GradientEdge) or _needs_grad(out) else []), None
    if isinstance(out, GradientEdge) or not isinstance(out, (tuple, list)):
        out, grad = [out], [grad]
    pairs = [(o, g) for o, g in zip(out, grad, strict=True) if g is not None and
             (isinstance(o, GradientEdge) or _needs_grad(o))]
    return [o for o, _ in pairs], [g for _, g in pairs]


def mismatch(found: DeclaredValue, declared: DeclaredValue) -> tuple[str, str, str] | None:
    """``(where, what it is, what was declared)`` of the first difference, or None."""
    one = isinstance(declared, Declared)  # one tensor, not a tuple of entries
    if one != isinstance(found, Declared):
        return "", _text(found, "shape "), _text(declared)
    got, want = declared_entries(found), declared_entries(declared)
    if len(got) != len(want):
        return "", f"{len(got)} entries", f"{len(want)}: {_text(declared)}"
    for j, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            return ("" if one else f", entry {j},"), _text(a, "shape "), _text(b)
    return None


def _text(d: Any, prefix: str = "") -> str:
    if d is None:
        return "no tensor" if prefix else "None"
    if not isinstance(d, Declared):  # a tuple of entries
        return prefix + "(" + ", ".join(_text(e) for e in d) + ")"
    return f"{prefix}{tuple(d.shape)} {d.dtype}"


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def check_value(out: Any, declared: DeclaredValue | None, where: str, rank: int,
                inferred: bool = False) -> None:
    """Refuse a value that cannot cross a stage boundary, or that breaks ``declared``.

    Args:
        out: the stage's output.
        declared: its declared shapes (None: not declared, only the kind is checked).
        where: which stage and micro-batch, for the message.
        rank: this pp rank, for the message.
        inferred: ``declared`` was inferred by a first step (not ``shapes=``): the
            message says how to opt out.

    Raises:
        TypeError: not a tensor or a tuple/list of tensors and Nones.
        ValueError: a structure, entry count, shape or dtype other than declared.
    """
    try:
        entries_of(out)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{where} is {describe(out)}: only a tensor or a tuple/list of "
                        "tensors (and None) can travel between pp ranks; the next stage gets "
                        f"it as its one argument ({error}; on pp rank {rank})") from None
    problem = None if declared is None else mismatch(declared_of_value(out), declared)
    if problem is None:
        return
    source = "the first step with this batch signature inferred" if inferred else \
        "shapes= declared"
    text = f"{where}{problem[0]} has {problem[1]}, but {source} {problem[2]} (on pp rank {rank})"
    if inferred:
        text += ("; for stages whose output shapes change from step to step pass "
                 "shapes='dynamic' to pipeline_stages (a shape header with every message)")
    raise ValueError(text)
