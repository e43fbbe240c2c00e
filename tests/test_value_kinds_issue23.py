"""Issue #23 point 3: trees carry what they are (:mod:`shardfn.primitives.reduced`).

``shard_params`` returns this rank's *shard* of the gradient averaged over its axis:
reduced over the axis and sharded over it. Each consumer acts on that or refuses:

* ``clip_by_global_norm`` / ``clip_grads`` / ``global_norm`` without
  ``specs=model.specs`` used to clip each rank by the norm of its own shard (0.350 and
  0.073 on two ranks for a true 0.358): now refused naming the leaf, the axis and the
  fix; with the specs the clipped gradients equal the unsharded clip;
* ``sf.checkpoint.save`` of such a gradient under a replicated layout (rank 0's rows
  written as the whole tensor) is refused; under ``layouts=model`` it round-trips;
* ``sf.testing``: ``gather_with`` whose spec does not gather a shard, or a ``Trainer``
  without ``gather``, fails naming the leaf;
* ``data_parallel`` keeps refusing a second reduction, which is separate from sharding
  (a reduced, unsharded value is refused there and accepted by a norm without specs).

Every refusal is shown to fire on the wrong use and to stay silent on the right one.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import shardfn as sf
import shardfn.checkpoint as ck
from shardfn.primitives import reduced
from shardfn.primitives._comm import Axis

MAX_NORM = 0.05  # below every norm here: clipping is active, a wrong norm changes the values


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch() -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(1))


def _loss(apply, params, x):
    return apply(params, x).square().mean()


def _refused(fn) -> str | None:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def _clip_on_rank():
    """shard_params' gradients on this rank: each clip without specs, then with them."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = sf.Mesh({"dp": n})
    fm = sf.functional(_net())
    sp = sf.shard_params(fm, mesh, "dp")
    shards = sp.shard(fm.init(0))
    x = _batch().chunk(n)[rank]
    grads = torch.func.grad(lambda s: _loss(sp.apply, s, x))(shards)
    accumulated = sp.accumulate_grads(lambda s, b: _loss(sp.apply, s, b), 2)(shards, x)[0]
    clip = sf.optim.clip_by_global_norm(MAX_NORM)
    refusals = {
        "clip_by_global_norm": _refused(lambda: clip.update(grads, clip.init(shards), shards)),
        "clip_grads": _refused(lambda: sf.optim.clip_grads(grads, MAX_NORM)),
        "global_norm": _refused(lambda: sf.optim.global_norm(grads)),
        "accumulated": _refused(lambda: sf.optim.clip_grads(accumulated, MAX_NORM)),
    }
    derived = sf.optim.global_norm({k: g * 1 for k, g in grads.items()})  # the limit: no mark
    exact = sf.optim.clip_by_global_norm(MAX_NORM, specs=sp.specs, mesh=mesh)
    clipped, _ = exact.update(grads, exact.init(shards), shards)
    pure, norm = sf.optim.clip_grads(grads, MAX_NORM, sp.specs, mesh)
    return refusals, float(derived), sp.gather(clipped), sp.gather(pure), float(norm)


def test_clip_over_shard_params_grads_refuses_without_specs_and_is_exact_with_them(worlds):
    fm = sf.functional(_net())
    params = fm.init(0)
    full = torch.func.grad(lambda p: _loss(fm.apply, p, _batch()))(params)
    expected, expected_norm = sf.optim.clip_grads(full, MAX_NORM)
    assert float(expected_norm) > 2 * MAX_NORM  # clipping is active
    results = worlds(2).run(_clip_on_rank)
    derived_norms = set()
    for rank, (refusals, derived, clipped, pure, norm) in enumerate(results):
        for what, message in refusals.items():
            assert message is not None, f"rank {rank}: {what} without specs was not refused"
            assert "shard over mesh axis 'dp'" in message, message
            assert "specs=model.specs" in message and "sf.shard_params" in message, message
            assert re.search(r"leaf '[02]\.(weight|bias)'", message), message  # by name
        assert_close(clipped, expected)
        assert_close(pure, expected)
        assert norm == pytest.approx(float(expected_norm), rel=1e-5)
        derived_norms.add(derived)
    # a tensor computed from the gradients carries no mark: the documented limit, the
    # very mistake this test guards against (each rank its own, too small norm)
    assert len(derived_norms) == 2 and max(derived_norms) < float(expected_norm)


def _sharded_grads(mesh_size: int = 1):
    fm = sf.functional(_net())
    sp = sf.shard_params(fm, sf.Mesh({"dp": mesh_size}), "dp")
    shards = sp.shard(fm.init(0))
    grads = torch.func.grad(lambda s: _loss(sp.apply, s, _batch()))(shards)
    plain = torch.func.grad(lambda p: _loss(fm.apply, p, _batch()))(fm.init(0))
    return sp, grads, plain


def test_clip_refuses_at_axis_size_one_and_passes_unmarked_grads():
    sp, grads, plain = _sharded_grads()
    with pytest.raises(ValueError, match=r"clip_grads: leaf '0\.bias' .* axis 'dp'"):
        sf.optim.clip_grads(grads, MAX_NORM)
    with pytest.raises(ValueError, match="clip_grads: leaf '0.bias'.*over \\('tp',\\)"):
        sf.optim.clip_grads(grads, MAX_NORM, {k: sf.P("tp") for k in grads},
                            sf.Mesh({"dp": 1, "tp": 1}))
    with sf.optim.sharded_over("dp", sp.mesh):  # an enclosing wrapper's axis counts too
        sf.optim.global_norm(grads)
    sf.optim.clip_grads(grads, MAX_NORM, sp.specs, sp.mesh)
    assert_close(sf.optim.global_norm(plain), sf.optim.global_norm(grads, sp.specs, sp.mesh))


def test_checkpoint_refuses_a_gradient_shard_saved_as_replicated(tmp_path):
    sp, grads, plain = _sharded_grads()
    for layouts in (None, {"grads": sf.P()}, {"grads": {"0.weight": sf.Layout(sf.P(), (8, 4))}}):
        with pytest.raises(ValueError, match=r"checkpoint save: leaf 'grads\.0\.(weight|bias)' "
                                             r"is this rank's shard over mesh axis 'dp'"):
            ck.save(str(tmp_path / "bad"), {"grads": grads}, sp.mesh, layouts)
    with pytest.raises(ValueError, match="shard over mesh axis 'dp'"):  # before the CPU copy
        ck.save(str(tmp_path / "bad"), {"grads": grads}, sp.mesh, async_=True).wait()
    path = ck.save(str(tmp_path / "good"), {"grads": grads}, sp.mesh, {"grads": sp})
    loaded = ck.load(path, {"grads": plain})  # the unsharded gradients of the same batch
    assert_close(loaded["grads"], plain)
    ck.save(str(tmp_path / "per_rank"), {"grads": grads}, sp.mesh, {"grads": ck.PerRank()})
    ck.save(str(tmp_path / "plain"), {"grads": plain})  # unmarked: replicated as before


def test_testing_kit_refuses_a_shard_it_would_compare_as_whole():
    sp, grads, plain = _sharded_grads()
    values = {"grads": grads, "loss": torch.tensor(1.0)}
    wrong = sf.testing.gather_with({"grads": {k: sf.P() for k in grads}}, sp.mesh)
    with pytest.raises(ValueError, match=r"gather_with: leaf \"grads\['0\.bias'\]\" is "
                                         r"this rank's shard over mesh axis 'dp'"):
        wrong(values)
    gathered = sf.testing.gather_with({"grads": sp.specs}, sp.mesh)(values)
    assert_close(gathered["grads"], plain)
    run = sf.testing.matches._run_trainer
    trainer = sf.testing.loss_trainer(sp.init(0), lambda s, x: _loss(sp.apply, s, x))
    params_only = trainer._replace(gather=sf.testing.gather_with({"params": sp.specs}, sp.mesh))
    for kept in (trainer, params_only):  # no gather; a gather_with without "grads"
        with pytest.raises(ValueError, match=r"not gathered\): leaf \"grads\['0\.bias'\]\""):
            run(kept, [_batch()], None, sp.mesh, ("loss", "grads"))
        run(kept, [_batch()], None, sp.mesh, ("loss",))  # the shards are not compared
    fm = sf.functional(_net())  # full values, no gather: compared as they are
    run(sf.testing.loss_trainer(fm.init(0), lambda p, x: _loss(fm.apply, p, x)), [_batch()],
        None, None, ("loss", "grads"))


def test_reduced_and_sharded_are_separate_facts():
    """A value reduced over dp but whole (sharded=()) refuses a second reduction and
    needs no specs; a shard over tp not reduced over it needs tp in its layout."""
    mesh = sf.Mesh({"dp": 1})
    dp = Axis(("dp",), 1, 0, None, (0,))
    whole = {"w": torch.ones(3)}
    reduced.mark_reduced(whole.values(), dp, "test", sharded=())
    assert reduced.value_kind(whole["w"]) == reduced.ValueKind(("dp",), frozenset({0}), "test", ())
    with pytest.raises(ValueError, match="already reduced over axis 'dp'"):
        sf.data_parallel(mesh, "dp").reduce_grads(whole)
    assert_close(sf.optim.global_norm(whole), torch.tensor(3.0).sqrt())
    shard = {"w": torch.ones(3)}
    reduced.mark_reduced(shard.values(), dp, "test", sharded=("tp",))
    assert reduced.missing_axes(reduced.value_kind(shard["w"]), ("dp",)) == ("tp",)
    assert reduced.missing_axes(reduced.value_kind(shard["w"]), ("dp", "tp")) == ()


def test_mark_reduced_default_keeps_shard_params_meaning():
    ax = Axis(("dp", "rep"), 4, 0, None, (0, 1, 2, 3))  # HSDP: shard dp, replica rep
    vector, scalar = torch.randn(4), torch.randn(())
    reduced.mark_reduced([vector, scalar], ax, "sf.shard_params")
    assert reduced.value_kind(vector).sharded is None  # some of dp+rep, not said which
    assert reduced.value_kind(scalar).sharded == ()  # a 0-dim leaf is replicated
    assert reduced.missing_axes(reduced.value_kind(vector), ("dp",)) == ()  # model.specs
    assert reduced.missing_axes(reduced.value_kind(vector), ()) == ("dp", "rep")
    assert reduced.missing_axes(reduced.value_kind(scalar), ()) == ()
    reduced.mark_reduced([vector], ax, "sf.shard_params", sharded=Axis(("dp",), 2, 0, None,
                                                                         (0, 1)))
    assert reduced.missing_axes(reduced.value_kind(vector), ("rep",)) == ("dp",)


def _axes(min_size: int = 0):
    names = st.sampled_from(["dp", "tp", "rep", "pp"])
    return st.sets(names, min_size=min_size, max_size=3).map(sorted).map(tuple)


@settings(max_examples=30, deadline=None)
@given(sharded=_axes(), reduced_over=_axes(1), layout=_axes(), said=st.booleans())
def test_missing_axes_is_what_the_layout_leaves_out(sharded, reduced_over, layout, said):
    kind = reduced.ValueKind(reduced_over, frozenset({0}), "test", sharded if said else None)
    missing = reduced.missing_axes(kind, layout)
    if said:
        assert set(missing) == set(sharded) - set(layout)
    else:  # unsaid: a layout naming none of the reduced axes cannot have gathered it
        assert missing == (() if set(reduced_over) & set(layout) else reduced_over)
