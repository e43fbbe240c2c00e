"""A rank SIGKILLed mid-epoch, a new world resumed from the last checkpoint: bit-identical.

A ZeRO-3 run (``sf.shard_params`` on ``{"dp": 2}``, AdamW) reads shuffled batches from
``sf.data.loader`` and saves ``{params, opt, data, step}`` with ``sf.checkpoint`` every
``EVERY`` steps. Rank 1 kills itself (SIGKILL) one step after the checkpoint of step 3,
in the middle of the first epoch. A new world (the local world respawns after the death)
resumes from ``sf.checkpoint.latest``, with parameters initialised from another seed so
that only the checkpoint carries the run, and trains into the next epoch. Its final
parameters equal, bit for bit, those of a run that never stopped, and every rank reads
the same remaining samples. The same holds with ``num_workers=2`` (workers started by the
loader's default context), and a resume on one data rank with the same global batch
reads the concatenated blocks and ends equal to round-off.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from shardfn.checkpoint import latest
from shardfn.testing import RankError

SAMPLES, GLOBAL_BATCH, TOTAL, EVERY, KILL_AT = 20, 4, 8, 3, 4  # 5 batches an epoch


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, 4, generator=g),
                         torch.randn(SAMPLES, 1, generator=g), torch.arange(SAMPLES))


def _run(axes, save_to=None, load_from=None, kill_at=None, num_workers=0):
    """ZeRO-3 training up to step ``TOTAL`` (from the newest checkpoint in ``load_from``),
    saving every ``EVERY`` steps to ``save_to``; rank 1 SIGKILLs itself after step
    ``kill_at``. Returns the gathered parameters, the sample ids read at each step, the
    loader's state and its workers' start method."""
    import signal

    import torch.distributed as dist

    import shardfn as sf
    import shardfn.checkpoint as ck
    from shardfn import data as sfd

    mesh = sf.Mesh(axes)
    model = sf.shard_params(sf.functional(nn.Sequential(nn.Linear(4, 8), nn.Tanh(),
                                                        nn.Linear(8, 1))), mesh, "dp")
    data = sfd.loader(_dataset(), mesh, global_batch=GLOBAL_BATCH, seed=7,
                      num_workers=num_workers)
    opt = sf.optim.adamw(1e-2, weight_decay=0.1)
    params = model.init(0 if load_from is None else 99)  # a resume must not rely on init
    layouts = {"params": model, "opt": opt}
    state = {"params": params, "opt": opt.init(params), "data": data.state, "step": 0}
    if load_from is not None:
        state = ck.load(ck.latest(load_from), state, mesh, layouts)
        data.load_state(state["data"])
    params, opt_state, step = state["params"], state["opt"], state["step"]

    def loss(p, x, y):
        return ((model.apply(p, x) - y) ** 2).mean()

    read = []
    while step < TOTAL:
        for x, y, ids in data:
            grads = torch.func.grad(loss)(params, x, y)  # the mean over the data ranks
            updates, opt_state = opt.update(grads, opt_state, params)
            params = sf.optim.apply_updates(params, updates)
            step += 1
            read.append(ids.tolist())
            if save_to is not None and step % EVERY == 0:
                ck.save(save_to, {"params": params, "opt": opt_state, "data": data.state,
                                  "step": step}, mesh, layouts, step=step)
            if step == kill_at and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == TOTAL:
                break
    context = data.dataloader.multiprocessing_context
    return (sf.gather(params, model.specs, mesh), read, data.state,
            context.get_start_method() if context is not None else None)


def _kill_and_resume(worlds, directory, num_workers):
    """The straight run, the killed one and the resumed one on 2 ranks; checks the
    checkpoint left and returns (straight, resumed) results."""
    straight = worlds(2).run(_run, {"dp": 2})
    with pytest.raises(RankError, match="rank 1 is dead"):
        worlds(2).run(_run, {"dp": 2}, directory, kill_at=KILL_AT, num_workers=num_workers)
    assert os.path.basename(latest(directory)) == f"step_{EVERY:06d}"  # mid-epoch
    resumed = worlds(2).run(_run, {"dp": 2}, load_from=directory, num_workers=num_workers)
    for (want, want_read, want_state, _), (got, got_read, got_state, context) in \
            zip(straight, resumed, strict=True):
        assert got_read == want_read[EVERY:]  # the same remaining samples, into epoch 1
        assert got_state == want_state == (7, 1, 12, SAMPLES, True)
        assert context == ("fork" if num_workers else None)
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            assert torch.equal(got[name], value), name  # bit for bit
    return straight, resumed


def test_rank_killed_mid_epoch_resumes_bit_identical(worlds, tmp_path):
    _kill_and_resume(worlds, str(tmp_path / "ckpt"), num_workers=0)


def test_rank_killed_mid_epoch_resumes_with_workers_and_on_one_data_rank(worlds, tmp_path):
    directory = str(tmp_path / "ckpt")
    straight, _ = _kill_and_resume(worlds, directory, num_workers=2)
    # one data rank, the same global batch of 4: one process reads both ranks' blocks
    ((params, read, state, context),) = worlds(1).run(_run, {"dp": 1}, load_from=directory,
                                                      num_workers=2)
    assert context == "fork"
    assert read == [a + b for a, b in zip(straight[0][1], straight[1][1], strict=True)][EVERY:]
    assert state == straight[0][2]
    torch.testing.assert_close(params, straight[0][0])  # a mean of 4, not of 2 means of 2


def test_workers_fork_only_in_a_spawned_process(worlds):
    from shardfn.data.loader import worker_context

    assert worker_context() is None  # the test process: its own default start method
    assert worlds(1).run(worker_context) == ["fork"]  # a local-world rank (spawned)
