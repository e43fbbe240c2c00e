"""Under a pipeline each pp rank loads only what its stages read, and the step is unchanged.

* ``sf.data.loader(..., reads=sf.data.stage_reads(pp))`` on {"pp": 2}, {"pp": 2, "dp": 2},
  an interleaved pp=2 with 4 stages and {"pp": 4} (two middle ranks): the rank of stage 0
  gets the inputs only, the rank of the last stage the targets only, a middle rank
  nothing and never indexes the dataset (``__getitem__`` counted); every sample of a
  step is read exactly once by each reading rank; the loader's position is the same on
  every rank; and the pipelined steps on those batches give the one-process gradients on
  the global batches.
* The pipeline refuses None where a rank reads the data (naming the rank and its stage)
  on every rank, still catches batches that disagree among the ranks that pass them
  (shapes of the inputs, rows of inputs against targets), and re-infers shapes when the
  batch changes on a rank that passes None (its cache key is agreed, not its own).
* One process: the ``fields=`` forms and their errors; one rank holding every stage
  reads both sides.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close
from torch.utils.data import Dataset

from tests.transforms.pipeline._pipeline_models import batch, mlp_units, mse, reference

#: (mesh, data axes, schedule, virtual, units): one case per way a rank can read
CASES = {
    "pp2": ({"pp": 2}, (), "1f1b", 1, 4),
    "pp2xdp2": ({"pp": 2, "dp": 2}, ("dp",), "gpipe", 1, 4),
    "interleaved": ({"pp": 2}, (), "interleaved", 2, 8),
    "pp4": ({"pp": 4}, (), "1f1b", 1, 8),
}


class Counted(Dataset):
    """Dict samples ``{"x", "y", "id"}`` that count the ``__getitem__`` calls in this process."""

    def __init__(self, n: int):
        gen = torch.Generator().manual_seed(n)
        self.x, self.y = torch.randn(n, 4, generator=gen), torch.randn(n, 3, generator=gen)
        self.calls: list[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.calls.append(int(i))
        return {"x": self.x[i], "y": self.y[i], "id": i}


def _run(axes, data_axes, schedule, virtual, n_units, steps=2):
    """``steps`` SGD steps on reads= batches; per rank: what it read, its dataset calls,
    its loader state and the full gradients of each step."""
    import shardfn as sf

    mesh = sf.Mesh(axes)
    stages = axes["pp"] * virtual
    pp = sf.pipeline_stages(mlp_units(n_units), mesh, "pp", balance=[n_units // stages] * stages,
                            schedule=schedule, virtual=virtual,
                            microbatches=2, loss_fn=mse,
                            dp_axis="dp" if data_axes else None)
    dataset = Counted(20)
    data = sf.data.loader(dataset, mesh, data_axes=data_axes, global_batch=8, seed=3,
                          reads=sf.data.stage_reads(pp), fields=("x", "y"))
    params, seen, grads_by_step = pp.init(0), [], []
    for _, (inputs, targets) in zip(range(steps), data, strict=False):
        seen.append((inputs is not None, targets is not None))
        loss, grads = pp.value_and_grad(params, inputs, targets)
        grads_by_step.append(pp.gather(grads))
        params = {k: v - 0.1 * grads[k] if k in grads else v for k, v in params.items()}
    return tuple(pp.reads), seen, dataset.calls, tuple(data.state), grads_by_step


def _one_process(n_units, steps=2):
    """The unsplit model's gradients on the loader's global batches, one process."""
    import shardfn as sf

    full = sf.functional(nn.Sequential(*mlp_units(n_units)))
    params, found = full.init(0), []
    data = sf.data.loader(Counted(20), global_batch=8, seed=3)
    for _, sample in zip(range(steps), data, strict=False):
        grads = torch.func.grad(lambda p, s=sample: mse(full.apply(p, s["x"]), s["y"]))(params)
        found.append(grads)
        params = {k: v - 0.1 * grads[k] for k, v in params.items()}
    return found


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_stage_reads_its_side_and_the_step_equals_one_process(worlds, case):
    axes, data_axes, schedule, virtual, n_units = CASES[case]
    size = axes["pp"] * axes.get("dp", 1)
    found = worlds(size).run(_run, axes, data_axes, schedule, virtual, n_units)
    want = _one_process(n_units)
    wrong = _one_process(n_units, steps=1)[0]
    local = 8 // axes.get("dp", 1)
    for rank, (reads, seen, calls, state, grads_by_step) in enumerate(found):
        pp_index = rank // axes.get("dp", 1)  # pp is the first axis
        last = axes["pp"] - 1 if virtual == 1 else 1  # interleaved: stage 3 on pp rank 1
        assert reads == (pp_index == 0, pp_index == last), (rank, reads)
        assert seen == [reads] * 2, (rank, seen)
        assert len(calls) == (local * 2 if any(reads) else 0), (rank, calls)
        assert len(set(calls)) == len(calls)  # each sample of a step read once
        assert state == found[0][3]  # the same position on every rank
        for got, reference_grads in zip(grads_by_step, want, strict=True):
            assert_close(got, reference_grads)
        assert any(not torch.allclose(grads_by_step[1][k], wrong[k]) for k in wrong)


def _refusals():
    """What each rank raised for each wrong call, then a right call whose batch changes."""
    import shardfn as sf

    pp = sf.pipeline_stages(mlp_units(4), sf.Mesh({"pp": 2}), "pp", balance=[2, 2],
                            schedule="1f1b", microbatches=2, loss_fn=mse)
    params, first = pp.init(0), pp.rank == 0
    x, y = batch(8)

    def error(inputs, targets):
        try:
            pp.value_and_grad(params, inputs, targets)
        except ValueError as raised:
            return str(raised)
        return None

    found = {
        "no inputs on stage 0": error(None, None if first else y),
        "no targets on the last": error(x if first else None, y if first else None),
        "inputs of other shapes": error(x if first else torch.randn(8, 5), y),
        "rows differ across sides": error(x if first else None, None if first else y[:6]),
    }
    losses = []
    for rows in (8, 7, 8):  # a rank given None sees the new shapes through the agreement
        x, y = batch(rows)
        losses.append(pp.value_and_grad(params, x if first else None,
                                        None if first else y)[0])
    return found, losses


def test_none_where_a_rank_reads_and_disagreeing_readers_are_refused_on_every_rank(worlds):
    results = worlds(2).run(_refusals)
    for found, losses in results:
        assert found["no inputs on stage 0"] is not None
        assert "pp rank 0 holds stage 0, which reads the inputs, but was given inputs=None" \
            in found["no inputs on stage 0"]
        assert "pp rank 1 holds stage 1, the last, which reads the targets, but was given " \
               "targets=None" in found["no targets on the last"]
        assert "inputs of other shapes or dtypes (pp ranks [0] vs pp ranks [1])" in \
            found["inputs of other shapes"]
        assert "pp rank 0: inputs 8 rows, targets no targets" in \
            found["rows differ across sides"]
        assert "pp rank 1: inputs no inputs, targets 6 rows" in found["rows differ across sides"]
        for rows, loss in zip((8, 7, 8), losses, strict=True):
            assert_close(loss, reference(mlp_units(4), 0, *batch(rows))[1])


class Pairs(Dataset):
    def __init__(self, n: int, kind: str):
        self.n, self.kind, self.calls = n, kind, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.calls += 1
        x, y = torch.full((2,), float(i)), torch.tensor(-i)
        return {"pair": (x, y), "triple": (x, y, i), "dict": {"x": x, "m": x, "y": y}}[self.kind]


def test_fields_pick_each_side_and_refuse_what_they_cannot():
    import shardfn as sf
    from shardfn.data import StageReads

    for kind, fields in [("pair", None), ("triple", (0, 1)), ("dict", (("x", "m"), "y")),
                         ("dict", lambda s: (s["x"], s["y"]))]:
        data = sf.data.loader(Pairs(6, kind), global_batch=3, shuffle=False,
                              reads=StageReads(False, True), fields=fields)
        inputs, targets = next(iter(data))
        assert inputs is None and torch.equal(targets, torch.tensor([0, -1, -2])), kind
        data = sf.data.loader(Pairs(6, kind), global_batch=3, shuffle=False,
                              reads=StageReads(True, False), fields=fields)
        inputs, targets = next(iter(data))
        x = inputs["x"] if isinstance(inputs, dict) else inputs
        assert targets is None and torch.equal(x[:, 0], torch.tensor([0.0, 1, 2])), kind
    nothing = Pairs(6, "pair")
    data = sf.data.loader(nothing, global_batch=3, reads=StageReads(False, False),
                          last_batch="pad")
    assert [tuple(b.data) for b in data] == [(None, None)] * 2 and nothing.calls == 0
    assert data.state == sf.data.loader(Pairs(6, "pair"), global_batch=3).state._replace(
        epoch=1)
    with pytest.raises(TypeError, match="a tuple of 3, not an \\(inputs, targets\\) pair"):
        next(iter(sf.data.loader(Pairs(6, "triple"), global_batch=3,
                                 reads=StageReads(True, True))))
    with pytest.raises(KeyError, match="no field 'z'"):
        next(iter(sf.data.loader(Pairs(6, "dict"), global_batch=3,
                                 reads=StageReads(True, True), fields=("x", "z"))))
    with pytest.raises(TypeError, match="fields= says how samples split"):
        sf.data.loader(Pairs(6, "pair"), global_batch=3, fields=(0, 1))
    with pytest.raises(TypeError, match="a key must be an int"):
        sf.data.loader(Pairs(6, "pair"), global_batch=3, reads=StageReads(True, True),
                       fields=(0.5, 1))
    with pytest.raises(TypeError, match="takes a pipeline model"):
        sf.data.stage_reads(nn.Linear(2, 2))


def test_one_rank_holding_every_stage_reads_both_sides():
    """pp=1 (interleaved, 2 stages on one rank): the rank reads both sides, and None for
    either is refused naming it, before anything runs."""
    import shardfn as sf

    pp = sf.pipeline_stages(mlp_units(8), sf.Mesh({"pp": 1}), "pp", balance=[4, 4],
                            virtual=2, schedule="interleaved", microbatches=2, loss_fn=mse)
    assert sf.data.stage_reads(pp) == (True, True)
    x, y = batch(4)
    with pytest.raises(ValueError, match="pp rank 0 holds stage 0, which reads the inputs"):
        pp.value_and_grad(pp.init(0), None, y)
    with pytest.raises(ValueError, match="pp rank 0 holds stage 1, the last, but was given "
                                         "neither inputs nor targets"):
        pp.value_and_grad(pp.init(0), None, None)
    with pytest.raises(ValueError, match="pp rank 0 holds stage 0, which reads the inputs"):
        pp.apply(pp.init(0), None)
    assert_close(pp.value_and_grad(pp.init(0), x, y)[0],
                 reference(mlp_units(8), 0, x, y)[1])
