"""shard_params(remat=policy): what each unit keeps from forward for backward.

* values and gradients equal the single-process reference for every policy
  (with dropout: the replayed recomputation draws the forward's random numbers);
* an op count (a dispatch mode around the step) shows the recomputation that
  dots_saveable / everything_saveable skip: no matmul and no tanh runs twice;
* the memory tracker shows the trade-off: more activation memory kept from forward
  to backward with dots_saveable and more with everything_saveable, but never a
  gathered parameter.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

import shardfn as sf
from shardfn.transforms.remat import DOT_OPS, checkpoint_name, checkpoint_policies
from shardfn.transforms.shard_params import shard_params
from tests.transforms.test_shard_params import Block

POLICIES = {
    "default": None,
    "nothing_saveable": checkpoint_policies.nothing_saveable,
    "dots_saveable": checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything_saveable": checkpoint_policies.everything_saveable,
    "save_only_these_names(hidden)": checkpoint_policies.save_only_these_names("hidden"),
}



class NamedBlock(nn.Module):
    """A block with a tagged hidden value, dropout and a parameter used twice."""

    def __init__(self, d: int, hidden: int, dropout: float):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        h = checkpoint_name(torch.tanh(self.up(self.ln(x))), "hidden")
        return x + self.drop(self.down(h)) * self.ln.weight.sum()


class Net(nn.Module):
    def __init__(self, d: int, hiddens: list[int], dropout: float):
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.blocks = nn.ModuleList(NamedBlock(d, h, dropout) for h in hiddens)
        self.out = nn.Linear(d, 2)
        self.scale = nn.Parameter(torch.tensor(0.75))

    def forward(self, x):
        x = torch.relu(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.out(x).float() * self.scale


def make_net(case):
    torch.manual_seed(0)
    return Net(case["d"], case["hiddens"], case["dropout"])


def _grads_on_rank(case, inputs):
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.transforms.shard_params import shard_params

    rank = dist.get_rank() if dist.is_initialized() else 0
    fmodel = sf.functional(make_net(case))
    mesh = sf.Mesh({"dp": case["n"]})
    model = shard_params(fmodel, mesh, "dp", units=NamedBlock if case["units"] else None,
                         reshard_after_forward=case["reshard"], remat=POLICIES[case["policy"]])
    shards = model.init(0)
    x = inputs[rank]
    torch.manual_seed(rank)
    if case["how"] == "func":
        grads, out = torch.func.grad(
            lambda p: (model.apply(p, x).square().mean(), model.apply(p, x)), has_aux=True)(shards)
    else:
        leaves = {k: t.detach().requires_grad_() for k, t in shards.items()}
        loss = model.apply(leaves, x).square().mean()
        out = model.apply(leaves, x).detach()
        loss.backward()
        grads = {k: t.grad for k, t in leaves.items()}
    return sf.gather(grads, model.specs, mesh), out


def _reference(case, inputs):
    fmodel = sf.functional(make_net(case))
    params = fmodel.init(0)
    grads, outs = [], []
    for rank, x in enumerate(inputs):
        torch.manual_seed(rank)
        g, out = torch.func.grad(
            lambda p, x=x: (fmodel.apply(p, x).square().mean(), fmodel.apply(p, x)),
            has_aux=True)(params)
        grads.append(g)
        outs.append(out)
    return {k: sum(g[k] for g in grads) / len(inputs) for k in params}, outs


@settings(max_examples=10)
@given(n=st.integers(1, 4), policy=st.sampled_from(sorted(POLICIES)), units=st.booleans(),
       reshard=st.booleans(), how=st.sampled_from(["func", "autograd"]),
       dropout=st.sampled_from([0.0, 0.3]), d=st.integers(2, 6),
       hiddens=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       seed=st.integers(0, 2**16))
def test_values_and_gradients_equal_the_reference(worlds, n, policy, units, reshard, how,
                                                  dropout, d, hiddens, seed):
    case = dict(n=n, policy=policy, units=units, reshard=reshard, how=how, dropout=dropout,
                d=d, hiddens=hiddens)
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(4, 3, generator=gen) for _ in range(n)]
    ref_grads, ref_outs = _reference(case, inputs)
    for rank, (grads, out) in enumerate(worlds(n).run(_grads_on_rank, case, inputs)):
        assert_close(out, ref_outs[rank])
        assert_close(grads, ref_grads)


# ---------------------------------------------------------------- what runs, what is kept


class OpCounter(TorchDispatchMode):
    """Counts the ops that actually run (a replayed op returns its saved output instead)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))

    def dots(self) -> int:
        return sum(c for op, c in self.counts.items() if op in DOT_OPS)


def _counts_on_rank(n: int):
    import torch.distributed as dist

    import shardfn as sf
    import shardfn.memory as mem
    from shardfn.transforms.shard_params import shard_params

    rank = dist.get_rank() if dist.is_initialized() else 0
    d, hidden = 64, 128
    torch.manual_seed(0)
    fmodel = sf.functional(nn.Sequential(nn.Linear(d, d), Block(d, hidden), Block(d, hidden),
                                         nn.Linear(d, d)))
    x = torch.randn(8, d, generator=torch.Generator().manual_seed(rank))
    mesh = sf.Mesh({"dp": n})
    out = {}
    for label in ("default", "nothing_saveable", "dots_saveable", "everything_saveable"):
        model = shard_params(fmodel, mesh, units=Block, remat=POLICIES[label])
        shards = model.init(0)
        loss = lambda p, model=model: model.apply(p, x).square().mean()  # noqa: E731
        with torch.no_grad(), OpCounter() as forward:
            model.apply(shards, x)
        with OpCounter() as step:
            grads = torch.func.grad(loss)(shards)
        leaves = {k: t.detach().requires_grad_() for k, t in shards.items()}
        with mem.track() as t:
            value = loss(leaves)
            mem.mark("after forward")  # what forward left for backward
            value.backward()
        out[label] = dict(forward_dots=forward.dots(), step_dots=step.dots(),
                          forward_tanh=forward.counts[torch.ops.aten.tanh.default],
                          step_tanh=step.counts[torch.ops.aten.tanh.default],
                          kept=t.marks["after forward"],
                          grads=sf.gather(grads, model.specs, mesh),
                          autograd=sf.gather({k: v.grad for k, v in leaves.items()},
                                             model.specs, mesh))
    unit = sum(p.numel() * 4 for p in fmodel.module[1].parameters())
    return out, unit, 8 * d * 4


@pytest.mark.parametrize("n", [1, 3])
def test_saved_ops_are_not_recomputed_and_cost_memory(worlds, n):
    for out, unit, boundary in worlds(n).run(_counts_on_rank, n):
        keep, full = out["default"], out["nothing_saveable"]
        dots, every = out["dots_saveable"], out["everything_saveable"]
        for res in (full, dots, every):
            assert_close(res["grads"], keep["grads"])
            assert_close(res["autograd"], keep["grads"])
        fwd = full["forward_dots"]
        assert fwd == 6  # 2 linears in the root, 2 in each block
        # full recompute: every forward matmul runs again in backward
        backward = full["step_dots"] - 2 * fwd
        assert backward > 0
        # saving matmul outputs (or everything): forward matmuls run once, backward the same
        assert dots["step_dots"] == every["step_dots"] == fwd + backward
        # the default keeps every activation: nothing is recomputed
        assert keep["step_dots"] == fwd + backward
        # tanh is not a dot: dots_saveable recomputes it, everything_saveable does not
        assert full["step_tanh"] == dots["step_tanh"] == 2 * full["forward_tanh"]
        assert every["step_tanh"] == every["forward_tanh"] == keep["step_tanh"] == 2
        # the trade-off: what forward leaves for backward grows with what the policy saves
        assert full["kept"] < dots["kept"] < every["kept"]
        assert full["kept"] < keep["kept"]
        # ... by activations only: a block's full parameters (32 x a boundary activation)
        # are never among them (the default frees their storage until backward)
        for res in (every, keep):
            assert res["kept"] - full["kept"] < unit, (res["kept"], full["kept"], unit)
            assert res["kept"] - full["kept"] >= 6 * boundary  # the 6 matmul outputs at least


def test_bad_remat():
    fmodel = sf.functional(make_net(dict(d=3, hiddens=[2], dropout=0.0)))
    with pytest.raises(TypeError, match="remat must be a policy"):
        shard_params(fmodel, sf.Mesh({"dp": 1}), remat="dots")
