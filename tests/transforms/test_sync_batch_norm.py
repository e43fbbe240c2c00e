"""sync_batch_norm: outputs, gradients and running stats equal one process on the whole batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.transforms.sync_batch_norm import SyncBatchNorm, sync_batch_norm

KINDS = {"1d": nn.BatchNorm1d, "1d_seq": nn.BatchNorm1d, "2d": nn.BatchNorm2d,
         "3d": nn.BatchNorm3d}
CHANNELS = 3


def example_shape(kind: str, n: int) -> tuple[int, ...]:
    return {"1d": (n, CHANNELS), "1d_seq": (n, CHANNELS, 2), "2d": (n, CHANNELS, 2, 3),
            "3d": (n, CHANNELS, 2, 1, 2)}[kind]


def make_bn(kind: str, affine: bool, track: bool, momentum: float | None) -> nn.Module:
    return KINDS[kind](CHANNELS, affine=affine, track_running_stats=track, momentum=momentum)


def random_params(model, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Leaves away from their defaults, so that every statistic and gradient matters."""
    params = {}
    for name, value in model.init(0).items():
        if name.endswith("num_batches_tracked"):
            params[name] = torch.tensor(2)
        elif name.endswith("running_var") or name.endswith("weight"):
            params[name] = torch.rand(value.shape, generator=gen) + 0.5
        else:
            params[name] = torch.randn(value.shape, generator=gen)
    return params


def _step_on_rank(kind, affine, track, momentum, explicit_mesh, sizes, x_full, cot_full, params):
    """One rank: its slice of the batch through the synced BatchNorm; every result to compare."""
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.transforms.sync_batch_norm import sync_batch_norm

    rank = dist.get_rank() if dist.is_initialized() else 0
    lo = sum(sizes[:rank])
    x, cot = x_full[lo:lo + sizes[rank]], cot_full[lo:lo + sizes[rank]]
    mesh = sf.Mesh({"dp": len(sizes)})
    bn = make_bn(kind, affine, track, momentum)
    model = sf.functional(sync_batch_norm(bn, "dp", mesh=mesh if explicit_mesh else None))
    trainable, rest = model.split_trainable(params)

    def loss(trainable, x):
        out, new = model.apply(model.merge(trainable, rest), x, mutable=True)
        return (out * cot).sum(), (out, new)

    def run():
        (grads_t, grads_x), (out, new) = torch.func.grad(loss, argnums=(0, 1), has_aux=True)(
            trainable, x)
        leaves = {k: v.clone().requires_grad_() for k, v in trainable.items()}
        x_leaf = x.clone().requires_grad_()
        value, (_, new_autograd) = loss(leaves, x_leaf)
        value.backward()
        autograd = ({k: v.grad for k, v in leaves.items()}, x_leaf.grad)
        evaluated = model.eval().apply(params, x)
        return out, new, (grads_t, grads_x), autograd, new_autograd, evaluated

    if explicit_mesh:
        return run()
    with mesh:
        return run()


def reference(kind, affine, track, momentum, x, cot, params):
    """One process, the concatenated batch, torch's own BatchNorm."""
    model = sf.functional(make_bn(kind, affine, track, momentum))
    trainable, rest = model.split_trainable(params)

    def loss(trainable, x):
        out, new = model.apply(model.merge(trainable, rest), x, mutable=True)
        return (out * cot).sum(), (out, new)

    (grads_t, grads_x), (out, new) = torch.func.grad(loss, argnums=(0, 1), has_aux=True)(
        trainable, x)
    return out, new, grads_t, grads_x, model.eval().apply(params, x)


def check_against_reference(world, kind, affine, track, momentum, explicit_mesh, sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(example_shape(kind, sum(sizes)), generator=gen) * 2 + 0.5
    cot = torch.randn(x.shape, generator=gen)
    params = random_params(sf.functional(make_bn(kind, affine, track, momentum)), gen)
    results = world.run(_step_on_rank, kind, affine, track, momentum, explicit_mesh, sizes, x,
                        cot, params)
    out, new, grads_t, grads_x, evaluated = reference(kind, affine, track, momentum, x, cot,
                                                      params)
    assert_close(torch.cat([r[0] for r in results]), out)
    for _, rank_new, _, _, new_autograd, _ in results:  # every rank: the global statistics
        assert_close(rank_new, new)
        assert_close(new_autograd, new)
    for how in (2, 3):  # torch.func.grad, autograd
        # the loss is the sum over ranks: parameter gradients add up, input gradients split
        summed = {k: sum(r[how][0][k] for r in results) for k in grads_t}
        assert_close(summed, grads_t)
        assert_close(torch.cat([r[how][1] for r in results]), grads_x)
    # eval: the running statistics, per rank (no collectives); without them the batch's, synced
    assert_close(torch.cat([r[5] for r in results]), evaluated)


@st.composite
def cases(draw, world_size):
    kind = draw(st.sampled_from(sorted(KINDS)))
    per_example = 1 if kind == "1d" else 2
    sizes = draw(st.lists(st.integers(0, 4), min_size=world_size, max_size=world_size)
                 .filter(lambda s: sum(s) * per_example > 1))
    return dict(kind=kind, affine=draw(st.booleans()), track=draw(st.booleans()),
                momentum=draw(st.sampled_from([0.1, 0.3, None])),
                explicit_mesh=draw(st.booleans()), sizes=sizes,
                seed=draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_matches_one_process_on_the_concatenated_batch(worlds, world_size, data):
    case = data.draw(cases(world_size))
    check_against_reference(worlds(world_size), **case)


@pytest.mark.parametrize("sizes", [[4, 1], [0, 5], [3, 3]])
@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_unequal_batches_weigh_every_example_the_same(worlds, sizes, kind):
    check_against_reference(worlds(2), kind, True, True, 0.1, False, sizes, seed=1)


def test_conversion_keeps_everything_but_the_class():
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=0.2, eps=1e-3),
                        nn.Sequential(nn.Flatten(), nn.BatchNorm1d(4, affine=False)))
    net.eval()
    converted = sync_batch_norm(net, "dp")
    assert isinstance(net[1], nn.BatchNorm2d) and not isinstance(net[1], SyncBatchNorm)
    assert isinstance(converted[1], SyncBatchNorm) and isinstance(converted[2][1], SyncBatchNorm)
    assert (converted[1].momentum, converted[1].eps, converted[1].axis) == (0.2, 1e-3, "dp")
    assert not converted[1].training and converted[2][1].weight is None
    assert converted.state_dict().keys() == net.state_dict().keys()
    for name, value in net.state_dict().items():
        assert torch.equal(converted.state_dict()[name], value)
        assert converted.state_dict()[name].data_ptr() != value.data_ptr()  # a copy
    single = sync_batch_norm(nn.BatchNorm1d(2), ("dp",))
    assert isinstance(single, SyncBatchNorm)
    with torch.device("meta"):
        meta = sync_batch_norm(nn.BatchNorm1d(2), "dp")
    assert sf.functional(meta).init(0)["running_var"].tolist() == [1.0, 1.0]


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="expects an nn.Module"):
        sync_batch_norm(torch.zeros(2), "dp")
    with pytest.raises(TypeError, match="axis must be a mesh axis name"):
        sync_batch_norm(nn.BatchNorm1d(2), 3)
    model = sf.functional(sync_batch_norm(nn.BatchNorm1d(2), "dp"))
    params = model.init(0)
    with sf.Mesh({"dp": 1}):
        with pytest.raises(ValueError, match="more than 1 value per channel over axis 'dp'"):
            model.apply(params, torch.ones(1, 2))
        with pytest.raises(ValueError, match="3 channels"):
            model.apply(params, torch.ones(4, 3))
    with pytest.raises(ValueError, match="axis"):  # an axis the mesh does not have
        with sf.Mesh({"tp": 1}):
            model.apply(params, torch.ones(4, 2))
