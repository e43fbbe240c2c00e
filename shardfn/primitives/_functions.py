"""The ``autograd.Function`` behind each collective of :mod:`shardfn.primitives.collectives`.

Each is written in the ``forward`` + ``setup_context`` style and calls the
functional collective ops (through :mod:`shardfn.primitives._comm`), so it runs
under ``torch.autograd`` and every ``torch.func`` transform. Its backward is
JAX's transpose rule, written with these Functions themselves, its jvp applies
the same Function to the tangent, and its vmap rule runs one collective on the
batched tensor. Callers validate their arguments first (see
:mod:`shardfn.primitives._collective_args`).

Example:
    >>> Psum.apply(torch.ones(3), ax, True, "psum")   # tensor([2., 2., 2.]) on 2 ranks
"""

from __future__ import annotations

import torch

from shardfn.primitives import _comm, consistency
from shardfn.primitives._comm import Axis
from shardfn.primitives._compiled import tracing
from shardfn.primitives.declared import cotangent_hint

__all__ = ["AllGather", "AllToAll", "Broadcast", "Ppermute", "Psum", "PsumScatter", "Pvary",
           "traceable"]


# Each backward is written with the Functions themselves (JAX's transpose rules as
# collectives), never with the raw ``_comm`` ops: under ``vmap(grad(f))`` the incoming
# gradient is a batched tensor, and a raw op on it would hit torch's per-example
# fallback (one collective per example, racing the other ranks' ones: wrong values).
# Through ``apply`` the vmap rule runs ONE collective on the batched tensor, and the
# backward is itself differentiable (double backward, jacrev of a vjp).


class _Collective(torch.autograd.Function):
    """What every collective shares: ``ctx.args`` keeps the static arguments after ``x``.

    A collective is linear, so its jvp (forward mode: ``torch.func.jvp``, ``jacfwd``,
    ``hessian``) applies the same Function to the tangent; a collective that takes no
    dims batches by applying itself to the batched tensor.
    """

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @classmethod
    def jvp(cls, ctx, tangent, *_):
        return cls.apply(tangent, *ctx.args)

    @classmethod
    def vmap(cls, info, in_dims, x, *args):
        return cls.apply(x, *args), in_dims[0]


class _AlongDims(_Collective):
    """A collective given dims after the axis: its vmap rule moves the batch dim to the front
    and shifts those dims by one."""

    @classmethod
    def vmap(cls, info, in_dims, x, ax, *dims):
        bdim = in_dims[0]
        if bdim is None:
            return cls.apply(x, ax, *dims), None
        return cls.apply(x.movedim(bdim, 0), ax, *(d + 1 for d in dims)), 0


class Psum(_Collective):
    """psum; backward psum (``grad_psum``, the varying rule) or pvary (the invariant rule).

    ``op`` names the public call for check mode: with the invariant rule the result is
    declared replicated, so the gradient reaching it must be too (JAX: the cotangent of an
    invariant value is invariant); check mode verifies that in backward.
    """

    @staticmethod
    def forward(x, ax: Axis, grad_psum: bool, op: str):
        return _comm.psum(x, ax)

    @staticmethod
    def backward(ctx, grad):
        ax, grad_psum, op = ctx.args
        if grad_psum:
            return traceable("Psum").apply(grad, ax, True, "psum"), None, None, None
        if consistency.enabled():
            consistency.check_replicated(f"the gradient reaching {op}'s output", ax, grad,
                                         cotangent_hint(op, ax), rounding=True)
        return traceable("Pvary").apply(grad, ax), None, None, None


class Pvary(_Collective):
    """Identity; backward psum whose own backward is the identity (transposes twice to pvary)."""

    @staticmethod
    def forward(x, ax: Axis):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return traceable("Psum").apply(grad, ctx.args[0], False, "pvary's backward psum"), None


class AllGather(_AlongDims):
    """Concatenate along ``dim``; backward psum_scatter."""

    @staticmethod
    def forward(x, ax: Axis, dim: int):
        return _comm.all_gather(x, ax, dim)

    @staticmethod
    def backward(ctx, grad):
        return traceable("PsumScatter").apply(grad, *ctx.args), None, None


class PsumScatter(_AlongDims):
    """Sum and keep this rank's block of ``dim``; backward all_gather."""

    @staticmethod
    def forward(x, ax: Axis, dim: int):
        return _comm.psum_scatter(x, ax, dim)

    @staticmethod
    def backward(ctx, grad):
        return traceable("AllGather").apply(grad, *ctx.args), None, None


class AllToAll(_AlongDims):
    """Split ``split_dim``, exchange, concatenate along ``concat_dim``; backward swaps them."""

    @staticmethod
    def forward(x, ax: Axis, split_dim: int, concat_dim: int):
        return _comm.all_to_all(x, ax, split_dim, concat_dim)

    @staticmethod
    def backward(ctx, grad):
        ax, split_dim, concat_dim = ctx.args
        return traceable("AllToAll").apply(grad, ax, concat_dim, split_dim), None, None, None


class Ppermute(_Collective):
    """Send along ``perm``; backward sends along the inverse permutation."""

    @staticmethod
    def forward(x, ax: Axis, perm: tuple[tuple[int, int], ...]):
        return _comm.ppermute(x, ax, perm)

    @staticmethod
    def backward(ctx, grad):
        ax, perm = ctx.args
        inverse = tuple((dst, src) for src, dst in perm)
        return traceable("Ppermute").apply(grad, ax, inverse), None, None


class Broadcast(_Collective):
    """Copy from axis index ``src``; backward psum into ``src``, zeros elsewhere."""

    @staticmethod
    def forward(x, ax: Axis, src: int):
        return _comm.broadcast(x, ax, src)

    @staticmethod
    def backward(ctx, grad):
        ax, src = ctx.args
        total = traceable("Psum").apply(grad, ax, True, "psum")
        if ax.index == src:
            return total, None, None
        # zeros that stay in the graph (not zeros_like): a double backward must run the
        # psum's backward on every rank; where, not "* 0", so an inf stays out of it
        is_src = torch.zeros((), dtype=torch.bool, device=total.device)
        return torch.where(is_src, total, 0), None, None


# ``torch.compile`` refuses an autograd.Function that defines ``jvp`` once its input needs a
# gradient ("Unsupported custom jvp"). Traced code therefore applies a twin of each class
# whose ``jvp`` is autograd.Function's own (forward-mode AD is not traced through these).
# Dynamo can look classes up by a constant string key, not by the class itself.
_PAIRS: dict[str, tuple[type, type]] = {
    cls.__name__: (cls, type(cls.__name__, (cls,), {
        "jvp": torch.autograd.Function.jvp, "__module__": cls.__module__,
        "__qualname__": f"{cls.__name__}Traced",
        "__doc__": f"{cls.__name__} without jvp, for code torch.compile traces."}))
    for cls in (AllGather, AllToAll, Broadcast, Ppermute, Psum, PsumScatter, Pvary)}


def traceable(name: str) -> type[_Collective]:
    """The Function class ``name`` (``"Psum"``, ...), or in code that ``torch.compile`` traces
    its twin without a custom ``jvp``.

    Example:
        >>> traceable("Psum").apply(x, ax, True, "psum")
    """
    eager, twin = _PAIRS[name]
    return twin if tracing() else eager
