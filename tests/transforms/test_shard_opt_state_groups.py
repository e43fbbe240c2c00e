"""Per-group hyper-parameters (multi_transform) and frozen groups under shard_opt_state."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

import shardfn as sf
from tests.transforms import _models

LABELS = {"emb": "embed", "w1": "body", "b1": "no_decay", "w2": "body", "scale": "frozen"}


def _opt():
    import shardfn as sf

    return sf.optim.chain(
        sf.optim.clip_by_global_norm(0.5),
        sf.optim.multi_transform(
            {
                "embed": sf.optim.adam(3e-2),
                "body": sf.optim.adamw(1e-2, weight_decay=0.2),
                "no_decay": sf.optim.sgd(0.1, momentum=0.9),
                "frozen": sf.optim.set_to_zero(),
            },
            LABELS,
        ),
    )


def _train(n: int, shape: tuple[int, int, int], seed: int, sharded: bool):
    import torch.distributed as dist

    import shardfn as sf
    from tests.transforms import _models

    rank = dist.get_rank() if sharded and dist.is_initialized() else 0
    params = _models.init_params(*shape, seed)
    opt = _opt()
    if sharded:
        opt = sf.shard_opt_state(opt, sf.Mesh({"dp": n}), "dp", bucket_bytes=48)
    state = opt.init(params)
    for step in range(4):
        batch = _models.make_batch(2 * n, shape[0], seed + step)
        if sharded:
            batch = _models.rank_slice(batch, rank, n)
        grads = torch.func.grad(_models.loss_fn)(params, batch)
        updates, state = opt.update(grads, state, params)
        params = sf.optim.apply_updates(params, updates)
    return params


@given(n=st.integers(1, 4), vocab=st.integers(5, 17), d=st.integers(1, 6),
       hidden=st.integers(1, 6), seed=st.integers(0, 1000))
def test_multi_transform_groups_match_single_process(worlds, n, vocab, d, hidden, seed):
    shape = (vocab, d, hidden)
    expected = _train(n, shape, seed, sharded=False)
    initial = _models.init_params(*shape, seed)
    assert torch.equal(expected["scale"], initial["scale"])  # the frozen group stays put
    for rank, params in enumerate(worlds(n).run(_train, n, shape, seed, True)):
        assert_close(params, expected, msg=lambda m, r=rank: f"rank {r}: {m}")


def test_groups_really_differ():
    """Guard: the groups' hyper-parameters matter, so the comparison above can fail."""
    shape, seed = (9, 3, 4), 1
    grouped = _train(1, shape, seed, sharded=False)
    params = _models.init_params(*shape, seed)
    opt = sf.optim.chain(sf.optim.clip_by_global_norm(0.5), sf.optim.adamw(1e-2, weight_decay=0.2))
    state = opt.init(params)
    for step in range(4):
        grads = torch.func.grad(_models.loss_fn)(params, _models.make_batch(2, 9, seed + step))
        updates, state = opt.update(grads, state, params)
        params = sf.optim.apply_updates(params, updates)
    assert not torch.allclose(grouped["emb"], params["emb"])
