"""The ``autograd.Function`` behind each collective of :mod:`shardfn.primitives.collectives`.

Each is written in the ``forward`` + ``setup_context`` style and calls the
functional collective ops (through :mod:`shardfn.primitives._comm`), so it runs
under ``torch.autograd`` and every ``torch.func`` transform. Its backward is
JAX's transpose rule, written with these Functions themselves, its jvp applies
the same Function to the tangent, and its vmap rule runs one collective on the
batched tensor. Callers validate their arguments first (see
:mod:`shardfn.primitives._collective_args`).

Example:
    >>> Psum.apply(torch.ones(3), ax, True)   # tensor([2., 2., 2.]) on 2 ranks
"""

from __future__ import annotations

import torch

from shardfn.primitives import _comm
from shardfn.primitives._comm import Axis

__all__ = ["AllGather", "AllToAll", "Broadcast", "Ppermute", "Psum", "PsumScatter", "Pvary"]


# ---- autograd.Functions -------------------------------------------------------------
#
# Each backward is written with the Functions themselves (JAX's transpose rules as
# collectives), never with the raw ``_comm`` ops: under ``vmap(grad(f))`` the incoming
# gradient is a batched tensor, and a raw op on it would hit torch's per-example
# fallback (one collective per example, racing the other ranks' ones: wrong values).
# Through ``apply`` the vmap rule below runs ONE collective on the batched tensor, and
# the backward is itself differentiable (double backward, jacrev of a vjp). The
# collectives are linear, so each jvp (forward mode: torch.func.jvp, jacfwd, hessian)
# applies the same Function to the tangent.
# Every vmap rule moves the batch dim to the front and shifts the dims it is given.


def _batch_first(x: torch.Tensor, bdim: int | None) -> torch.Tensor:
    return x if bdim is None or bdim == 0 else x.movedim(bdim, 0)


def _shift(bdim: int | None) -> int:
    """How far a dim moves when the batch dim goes in front (0 for an unbatched input)."""
    return 0 if bdim is None else 1


def _out_dim(bdim: int | None) -> int | None:
    return None if bdim is None else 0


class Psum(torch.autograd.Function):
    """psum; backward psum (``grad_psum``, the varying rule) or pvary (the invariant rule)."""

    @staticmethod
    def forward(x, ax: Axis, grad_psum: bool):
        return _comm.psum(x, ax)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.grad_psum = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        grad = Psum.apply(grad, ctx.ax, True) if ctx.grad_psum else Pvary.apply(grad, ctx.ax)
        return grad, None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return Psum.apply(tangent, ctx.ax, ctx.grad_psum)

    @staticmethod
    def vmap(info, in_dims, x, ax, grad_psum):
        return Psum.apply(x, ax, grad_psum), in_dims[0]


class Pvary(torch.autograd.Function):
    """Identity; backward psum whose own backward is the identity (transposes twice to pvary)."""

    @staticmethod
    def forward(x, ax: Axis):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return Psum.apply(grad, ctx.ax, False), None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return Pvary.apply(tangent, ctx.ax)

    @staticmethod
    def vmap(info, in_dims, x, ax):
        return Pvary.apply(x, ax), in_dims[0]


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x, ax: Axis, dim: int):
        return _comm.all_gather(x, ax, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.dim = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        return PsumScatter.apply(grad, ctx.ax, ctx.dim), None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return AllGather.apply(tangent, ctx.ax, ctx.dim)

    @staticmethod
    def vmap(info, in_dims, x, ax, dim):
        bdim = in_dims[0]
        return AllGather.apply(_batch_first(x, bdim), ax, dim + _shift(bdim)), _out_dim(bdim)


class PsumScatter(torch.autograd.Function):
    @staticmethod
    def forward(x, ax: Axis, dim: int):
        return _comm.psum_scatter(x, ax, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.dim = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        return AllGather.apply(grad, ctx.ax, ctx.dim), None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return PsumScatter.apply(tangent, ctx.ax, ctx.dim)

    @staticmethod
    def vmap(info, in_dims, x, ax, dim):
        bdim = in_dims[0]
        return PsumScatter.apply(_batch_first(x, bdim), ax, dim + _shift(bdim)), _out_dim(bdim)


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(x, ax: Axis, split_dim: int, concat_dim: int):
        return _comm.all_to_all(x, ax, split_dim, concat_dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.split_dim, ctx.concat_dim = inputs[1:]

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.apply(grad, ctx.ax, ctx.concat_dim, ctx.split_dim), None, None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return AllToAll.apply(tangent, ctx.ax, ctx.split_dim, ctx.concat_dim)

    @staticmethod
    def vmap(info, in_dims, x, ax, split_dim, concat_dim):
        bdim, k = in_dims[0], _shift(in_dims[0])
        out = AllToAll.apply(_batch_first(x, bdim), ax, split_dim + k, concat_dim + k)
        return out, _out_dim(bdim)


class Ppermute(torch.autograd.Function):
    @staticmethod
    def forward(x, ax: Axis, perm: tuple[tuple[int, int], ...]):
        return _comm.ppermute(x, ax, perm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.perm = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        inverse = tuple((dst, src) for src, dst in ctx.perm)
        return Ppermute.apply(grad, ctx.ax, inverse), None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return Ppermute.apply(tangent, ctx.ax, ctx.perm)

    @staticmethod
    def vmap(info, in_dims, x, ax, perm):
        return Ppermute.apply(x, ax, perm), in_dims[0]


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(x, ax: Axis, src: int):
        return _comm.broadcast(x, ax, src)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ax, ctx.src = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        total = Psum.apply(grad, ctx.ax, True)
        if ctx.ax.index == ctx.src:
            return total, None, None
        # zeros that stay in the graph (not zeros_like): a double backward must run the
        # psum's backward on every rank; where, not "* 0", so an inf stays out of it
        is_src = torch.zeros((), dtype=torch.bool, device=total.device)
        return torch.where(is_src, total, 0), None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return Broadcast.apply(tangent, ctx.ax, ctx.src)

    @staticmethod
    def vmap(info, in_dims, x, ax, src):
        return Broadcast.apply(x, ax, src), in_dims[0]
