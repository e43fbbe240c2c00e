"""Values declared replicated (issue 23): check mode verifies them equal across their axis.

``pvary``'s input, ``psum_invariant`` / ``pmean_invariant``'s output, the gradient
reaching that output in backward, and ``declared.check_replicated``'s tree: each check
is shown to raise ``ConsistencyError`` on every rank when one rank's value differs, and
to stay silent when the values are equal (or differ only by rounding), on 2 ranks. A
forgotten ``pvary`` is caught where its gradient reaches a ``psum_invariant`` output, or
where the caller declares the gradients of replicated parameters replicated.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardfn.primitives._fingerprint import beyond_rounding, leaf_hash, leaf_sketch

TIMEOUT_S = 5.0


def _checked(body, *args, enable: bool = True):
    """``body(rank, mesh, *args)`` with check mode on: ``("ok", value)`` or ``("error", text)``."""
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.primitives import consistency as c

    was_on, was_timeout = c.enabled(), c.check_timeout()
    c.reset()
    c.check_consistency(enable, timeout=TIMEOUT_S)
    try:
        return ("ok", body(dist.get_rank(), sf.Mesh({"x": dist.get_world_size()}), *args))
    except c.ConsistencyError as error:
        return ("error", str(error))
    finally:
        c.check_consistency(was_on, timeout=was_timeout)
        c.reset()


def _raised_everywhere(results: list, *needles: str) -> str:
    assert all(kind == "error" for kind, _ in results), results
    message = results[0][1]
    assert len({m for _, m in results}) == 1, results  # the same message on every rank
    for needle in needles:
        assert needle in message, message
    return message


def _tree(rank: int, differ: str | None, scale: float = 1.0) -> dict:
    tree = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    if differ is not None:
        tree[differ] = tree[differ] * (1 + scale * rank)
    return tree


# ---- pvary's input ------------------------------------------------------------------------


def _pvary(rank, mesh, differ, scale):
    import shardfn as sf

    out = sf.pvary(_tree(rank, differ, scale), "x", mesh=mesh)
    return {k: v.tolist() for k, v in out.items()}


def test_pvary_of_equal_values_is_silent(worlds):
    results = worlds(2).run(_checked, _pvary, None, 1.0)
    assert results == [("ok", {k: v.tolist() for k, v in _tree(0, None).items()})] * 2


def test_pvary_of_a_varying_value_raises_naming_leaf_axis_ranks(worlds):
    message = _raised_everywhere(
        worlds(2).run(_checked, _pvary, "b", 1.0),
        "pvary input must be the same on every rank of axis 'x' (ranks [0, 1])",
        "1 of 2 leaves differ, the first is 'b'", "ranks [0] hold value", "ranks [1] hold value",
        "relative difference", "it is already varying, so drop pvary, or pass the same value",
        "rank 1: pvary input at ", "in _pvary")
    assert "'w'" not in message.splitlines()[0]


def test_pvary_tolerates_rounding_only(worlds):
    # one rank's values 1 + 1e-7 apart (other bits, same value up to float32 rounding)
    assert [kind for kind, _ in worlds(2).run(_checked, _pvary, "w", 1e-7)] == ["ok", "ok"]


def test_check_mode_off_checks_nothing(worlds):
    results = worlds(2).run(_checked, _pvary, "b", 1.0, enable=False)
    assert [kind for kind, _ in results] == ["ok", "ok"]
    assert results[0][1]["b"] != results[1][1]["b"]


# ---- psum_invariant / pmean_invariant outputs --------------------------------------------


def _invariant_output(rank, mesh, op, bug_scale):
    """``op`` of a rank-dependent value, with the reduction made to return a rank-dependent
    result (``bug_scale``: 0 = a correct reduction) to stand for a broken backend."""
    import shardfn as sf
    from shardfn.primitives import _comm

    honest = _comm.psum
    _comm.psum = lambda x, ax: honest(x, ax) * (1 + bug_scale * rank)
    try:
        return getattr(sf, op)(torch.arange(4.0) + rank, "x", mesh=mesh).tolist()
    finally:
        _comm.psum = honest


@pytest.mark.parametrize("op", ["psum_invariant", "pmean_invariant"])
def test_invariant_output_is_verified(worlds, op):
    expected = [1.0, 3.0, 5.0, 7.0] if op == "psum_invariant" else [0.5, 1.5, 2.5, 3.5]
    assert worlds(2).run(_checked, _invariant_output, op, 0.0) == [("ok", expected)] * 2
    rounding = worlds(2).run(_checked, _invariant_output, op, 1e-7)
    assert [kind for kind, _ in rounding] == ["ok", "ok"]
    _raised_everywhere(worlds(2).run(_checked, _invariant_output, op, 0.5),
                       f"{op} output must be the same on every rank of axis 'x'",
                       "the tensor differs (ranks [0] hold value", "the reduction itself")


# ---- the gradient reaching an invariant output: a forgotten pvary --------------------------


def _invariant_then(rank, mesh, use, how):
    """Gradient of ``x`` through ``psum_invariant``, then ``use`` of the result."""
    import shardfn as sf

    per_rank = torch.tensor([1.0, 2.0]) * (rank + 1)

    def loss(x):
        y = sf.psum_invariant(x * x, "x", mesh=mesh)
        if use == "same loss":
            return y.sum()
        if use == "pvary":  # the result meets per-rank values through pvary: correct
            return (sf.pvary(y, "x", mesh=mesh) * per_rank).sum()
        return (y * per_rank).sum()  # the forgotten pvary

    x = torch.tensor([3.0, 4.0])
    if how == "func":
        return torch.func.grad(loss)(x).tolist()
    if how == "vmap":
        return torch.func.vmap(torch.func.grad(loss))(torch.stack([x, 2 * x])).tolist()
    leaf = x.clone().requires_grad_()
    loss(leaf).backward()
    return leaf.grad.tolist()


@pytest.mark.parametrize("how", ["func", "autograd", "vmap"])
def test_forgotten_pvary_after_psum_invariant_is_caught_in_backward(worlds, how):
    _raised_everywhere(
        worlds(2).run(_checked, _invariant_then, "forgotten pvary", how),
        "the gradient reaching psum_invariant's output must be the same on every rank of axis "
        "'x'", "the tensor differs", "Wrap it in sf.pvary(y, 'x')", "forgotten pvary")


@pytest.mark.parametrize("how", ["func", "autograd"])
def test_invariant_gradients_are_silent_and_right(worlds, how):
    # d/dx of sum(y): 2x on every rank; with pvary: psum of the per-rank weights, times 2x
    assert worlds(2).run(_checked, _invariant_then, "same loss", how) == [("ok", [6.0, 8.0])] * 2
    assert worlds(2).run(_checked, _invariant_then, "pvary", how) == [("ok", [18.0, 48.0])] * 2


# ---- sf.check_replicated: a loss, the gradients of replicated parameters ------------------


def _declared(rank, mesh, what, exact):
    from shardfn.primitives.declared import check_replicated

    loss = torch.tensor(2.5) * (1 + (1e-7 if what == "rounding" else 0.5) * rank
                                if what != "same" else 1)
    assert check_replicated(loss, "x", mesh=mesh, what="loss", exact=exact) is loss
    return "returned"


def test_check_replicated_of_a_loss(worlds):
    assert worlds(2).run(_checked, _declared, "same", False) == [("ok", "returned")] * 2
    assert worlds(2).run(_checked, _declared, "rounding", False) == [("ok", "returned")] * 2
    _raised_everywhere(worlds(2).run(_checked, _declared, "rounding", True),
                       "loss (declared replicated by sf.check_replicated) must be the same",
                       "ranks [1] hold value")
    _raised_everywhere(worlds(2).run(_checked, _declared, "differs", False),
                       "relative difference 0.333", "same inputs, seeds and reductions")
    off = worlds(2).run(_checked, _declared, "differs", False, enable=False)
    assert off == [("ok", "returned")] * 2


def _megatron_grads(rank, mesh, with_pvary):
    """A replicated layer ``w0``, then a colwise / rowwise pair over "x"; the gradients of the
    replicated ``w0`` declared replicated (a forgotten pvary leaves them per-rank partial)."""
    import shardfn as sf
    from shardfn.primitives.declared import check_replicated

    g = torch.Generator().manual_seed(0)
    w0, x = torch.randn(4, 4, generator=g), torch.randn(3, 4, generator=g)
    w1, w2 = torch.randn(4, 4, generator=g)[2 * rank:2 * rank + 2], torch.randn(4, 4, generator=g)

    def loss(w0):
        h = torch.tanh(x @ w0.T)
        h = sf.pvary(h, "x", mesh=mesh) if with_pvary else h
        out = sf.psum_invariant(torch.tanh(h @ w1.T) @ w2[:, 2 * rank:2 * rank + 2].T, "x",
                                mesh=mesh)
        return out.square().mean()

    grad = torch.func.grad(loss)(w0)
    check_replicated({"w0": grad}, "x", mesh=mesh, what="grads of replicated params")
    return grad


def test_forgotten_pvary_on_a_replicated_parameter_shows_in_its_gradient(worlds):
    ok = worlds(2).run(_checked, _megatron_grads, True)
    assert [kind for kind, _ in ok] == ["ok", "ok"] and torch.equal(ok[0][1], ok[1][1])
    _raised_everywhere(worlds(2).run(_checked, _megatron_grads, False),
                       "grads of replicated params (declared replicated by sf.check_replicated)",
                       "the first is 'w0'")


# ---- the sketch, in this process ----------------------------------------------------------


def _fps(*tensors: torch.Tensor) -> list[dict]:
    return [{"hashes": [leaf_hash(t)], "sketches": [leaf_sketch(t)]} for t in tensors]


def test_sketch_tells_rounding_from_a_difference():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    assert beyond_rounding(_fps(x, x.clone())) == {}
    assert beyond_rounding(_fps(x, x * (1 + 1e-6))) == {}  # float32 rounding level
    swapped = x.clone()
    swapped[[3, 900]] = x[[900, 3]]  # two values trade places: same sum, same norm
    assert beyond_rounding(_fps(x, swapped))[0] > 1e-3
    nan = x.clone()
    nan[5] = math.nan
    assert beyond_rounding(_fps(x, nan)) == {0: math.inf}
    assert beyond_rounding(_fps(x.long(), x.long() + 1)) == {0: math.inf}  # integers: bits


@settings(max_examples=4, deadline=None)
@given(shape=st.lists(st.integers(0, 5), max_size=3), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64]))
def test_pvary_over_shapes_and_dtypes(worlds, shape, seed, dtype):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 10).to(dtype)
    assert worlds(2).run(_checked, _pvary_one, x, False) == [("ok", x.tolist())] * 2
    if x.numel():  # one element changed on rank 1 by far more than rounding
        _raised_everywhere(worlds(2).run(_checked, _pvary_one, x, True), "pvary input",
                           "the tensor differs")


def _pvary_one(rank, mesh, x, change):
    import shardfn as sf

    if change and rank == 1:
        x = x.clone()
        x.view(-1)[-1] = x.view(-1)[-1] * 2 + 3
    return sf.pvary(x, "x", mesh=mesh).tolist()
