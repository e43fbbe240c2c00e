"""Buffer donation: opt-in permission to overwrite inputs that are dead after a call.

JAX's ``donate_argnums`` for shardfn's optimizers. By default an update
allocates its results and leaves every input as it was. A *donated* input is
one the caller promises never to read again, so the update may write its
results into that input's memory instead of allocating: the Adam moments are
updated in place and the updates are written into the gradients, the way
``torch.optim`` works, and nothing large is allocated per step.

* ``donating(opt)`` (in :mod:`shardfn.optim.base`): an optimizer whose
  ``update(grads, state, params)``
  donates ``grads`` and ``state`` (``params`` are only read).
* ``apply_updates(params, updates, donate=True)``: adds in place into ``params``.
* ``data_parallel(..., donate=True)`` / ``shard_opt_state(..., donate=True)``:
  the same for the gradient reduction and the sharded update.

Donation is a permission, not a requirement: a transform that does not
support it (or an input it cannot safely write, e.g. two leaves sharing
memory, or a tensor inside a ``torch.func`` transform) just allocates as
usual; so does code that ``torch.compile`` traces (its graph is functional).
Results are bitwise identical either way. A custom transform used under
donation must not return, as its updates, tensors it keeps in its state
(later transforms may overwrite the updates they receive).

Example:
    >>> opt = sf.optim.donating(sf.optim.adamw(1e-3))
    >>> updates, state = opt.update(grads, state, params)   # grads, old state: dead
    >>> params = sf.optim.apply_updates(params, updates, donate=True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import torch

from shardfn._torch_internals import is_functorch_wrapped
from shardfn.optim._scoped import Scoped
from shardfn.primitives._compiled import tracing

__all__ = ["Donation", "current_donation", "donated", "writable_in_place"]


class Donation(NamedTuple):
    """What an optimizer update may overwrite.

    Attributes:
        updates: the ``updates`` (gradients) passed to ``update``.
        state: the optimizer state passed to ``update``.
    """

    updates: bool = False
    state: bool = False


_DONATION: Scoped[Donation] = Scoped("shardfn_optim_donation", Donation())


def current_donation() -> Donation:
    """The donation in force for the update running now (nothing by default).

    Nothing in code that ``torch.compile`` traces: a compiled graph is functional, and
    inductor reuses buffers itself (the values are bitwise the same either way).
    """
    if tracing():
        return Donation()
    return _DONATION.get()


@contextlib.contextmanager
def donated(updates: bool = True, state: bool = True) -> Iterator[None]:
    """Within this context, optimizer updates may overwrite their ``updates`` and/or ``state``.

    For wrappers that call an optimizer on buffers they own (``shard_opt_state``
    donates the local gradient pieces it made itself). Contexts do not add up:
    the innermost one is in force.

    Args:
        updates: the ``updates`` argument is dead after the call.
        state: the ``state`` argument is dead after the call.

    Example:
        >>> with donated(updates=True, state=False):
        ...     updates, state = opt.update(my_temporary_grads, state, params)
    """
    with _DONATION.bound(Donation(bool(updates), bool(state))):
        yield


def writable_in_place(tensors: Iterable[torch.Tensor | None], *,
                      allow_requires_grad: bool = False) -> bool:
    """Whether every tensor may be written in place without changing any other one.

    False if two of them share memory (tied leaves, overlapping views), if one
    is wrapped by a ``torch.func`` transform, or (unless ``allow_requires_grad``)
    if one requires grad while grad mode is on, and always in code that
    ``torch.compile`` traces. None entries are ignored.

    Example:
        >>> w = torch.zeros(4)
        >>> writable_in_place([w, torch.zeros(2)]), writable_in_place([w, w[:2]])
        (True, False)
    """
    if tracing():  # storage addresses cannot be traced; donation is off there anyway
        return False
    spans: list[tuple[int, int, int]] = []
    grad_mode = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if _wrapped(t) or (t.requires_grad and grad_mode and not allow_requires_grad):
            return False
        if t.numel() == 0:
            continue
        storage = t.untyped_storage().data_ptr()
        start = t.storage_offset()
        span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))
        size = t.element_size()
        spans.append((storage, start * size, (start + span) * size))
    spans.sort()
    for (s1, _, end1), (s2, start2, _) in zip(spans, spans[1:], strict=False):
        if s1 == s2 and start2 < end1:
            return False
    return True


def same_dtypes(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether ``a[i]`` and ``b[i]`` have the same dtype for every ``i``."""
    return all(x.dtype == y.dtype for x, y in zip(a, b, strict=True))


def _wrapped(t: torch.Tensor) -> bool:
    return bool(is_functorch_wrapped(t))
