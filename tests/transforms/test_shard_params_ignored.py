"""``shard_params(..., ignored_params=...)`` (FSDP2's ``ignored_params``): an ignored leaf is
held whole on each rank, with a value of its own per rank, never gathered nor reduced. On 2
ranks, with one ignored leaf inside a unit and one in the root: the gradients of the other
leaves are the mean (``"sum"``: the sum) of the ranks' gradients as without the option, an
ignored leaf's is the rank's own, under torch.func.grad, autograd, remat and
``accumulate_grads``; no exchange carries an ignored leaf; misuse is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardfn as sf

IGNORED = ("blocks.0.weight", "head.bias")
VARIANTS = [("grad", {}), ("autograd", {"remat": sf.checkpoint_policies.nothing_saveable}),
            ("grad", {"grad_reduce": "sum", "reshard_after_forward": False}),
            ("accumulate", {})]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
        self.head = nn.Linear(3, 2)
        self.register_buffer("shift", torch.full((2,), 0.5))

    def forward(self, x):
        return self.head(self.blocks(x)) + self.shift


def _fm() -> sf.FunctionalModel:
    torch.manual_seed(0)
    return sf.functional(_Net())


def _params(fm: sf.FunctionalModel, rank: int) -> dict[str, torch.Tensor]:
    """The init, the ignored leaves differing per rank (as experts do)."""
    full = fm.init(1)
    return {k: v + 0.1 * (rank + 1) if k in IGNORED else v for k, v in full.items()}


def _x(rank: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(10 + rank))


def _loss(model, leaves, x):
    return model.apply(leaves, x).square().mean()


def _grads(model, shards, x, how: str):
    """The gradients of the trainable leaves: torch.func.grad, autograd or accumulate."""
    train, rest = model.split_trainable(shards)

    def loss(t, batch=x):
        return _loss(model, model.merge(t, rest), batch)

    if how == "grad":
        return torch.func.grad(loss)(train)
    if how == "autograd":
        live = {k: v.clone().requires_grad_() for k, v in train.items()}
        loss(live).backward()
        return {k: v.grad for k, v in live.items()}
    return model.accumulate_grads(loss, 2)(train, x)[0]


def _on_rank():
    """Per variant this rank's gathered gradients; its shards; the names any unit gathers."""
    import torch.distributed as dist

    rank, mesh, fm = dist.get_rank(), sf.Mesh({"dp": 2}), _fm()
    out = []
    for how, options in VARIANTS:
        model = sf.shard_params(fm, mesh, "dp", units=["blocks"], ignored_params=IGNORED,
                                **options)
        shards = model.shard(_params(fm, rank))
        out.append(model.gather(_grads(model, shards, _x(rank), how)))
    gathered = {n for u in (*model._units, model._root) for f in u.gather for n in f.names}
    return out, shards, gathered, dict(model.specs)


def test_ignored_leaves_keep_their_rank_gradient(worlds):
    """Other leaves: the mean (sum) over ranks of the unsharded gradients; ignored leaves:
    this rank's own gradient (so a missing or extra reduction of either fails)."""
    fm = _fm()
    refs = [_grads(fm, _params(fm, r), _x(r), "grad") for r in range(2)]
    assert not torch.allclose(refs[0]["head.bias"], refs[1]["head.bias"])
    for rank, (results, shards, gathered, specs) in enumerate(worlds(2).run(_on_rank)):
        assert not gathered & set(IGNORED) and "blocks.2.weight" in gathered
        for name in IGNORED:
            assert torch.equal(shards[name], _params(fm, rank)[name])  # whole, its own
            assert specs[name].spec == sf.P()
        for (_, options), grads in zip(VARIANTS, results, strict=True):
            scale = 1.0 if options.get("grad_reduce") == "sum" else 0.5
            for name, grad in grads.items():
                want = refs[rank][name] if name in IGNORED else \
                    scale * (refs[0][name] + refs[1][name])
                torch.testing.assert_close(grad, want, msg=f"{name} {options}")


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
        self.b.weight = self.a.weight
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        return self.b(self.a(x))


def test_misuse_is_refused_by_name():
    """Names that are no parameter, a tied alias, a buffer or one string are refused;
    a predicate picks parameters only."""
    fm, mesh = sf.functional(_Tied()), sf.Mesh({"dp": 1})
    cases = [(["a.wieght"], ValueError, r"'a.wieght' is not a parameter.*did you mean"),
             (["b.weight"], ValueError, r"'b.weight' is tied to 'a.weight'"),
             (["count"], ValueError, r"'count' is a buffer"),
             ("a.weight", TypeError, "collection of parameter names or a predicate")]
    for ignored, error, match in cases:
        with pytest.raises(error, match=match):
            sf.shard_params(fm, mesh, "dp", ignored_params=ignored)
    model = sf.shard_params(fm, mesh, "dp", ignored_params=lambda n, leaf: leaf.shape[0] == 2)
    assert model.ignored_params == {"a.weight", "a.bias", "b.bias"}
    assert model.train().ignored_params == model.ignored_params
