"""Async save: staged to CPU memory before ``save`` returns; the step goes on meanwhile.

On 2 ranks (ZeRO-3 shards): the parameters are changed in place and collectives
run while the background thread writes; the checkpoint holds the values at the
call. A failure in the background (a test hook on one rank) is raised by
``wait()`` on every rank, and the previous checkpoint is untouched.
"""

from __future__ import annotations

import torch
from torch import nn

import shardfn as sf
import shardfn.checkpoint as ck


def _setup():
    mesh = sf.Mesh({"dp": 2})
    torch.manual_seed(0)
    model = sf.shard_params(sf.functional(nn.Sequential(nn.Linear(5, 9), nn.Linear(9, 3))),
                            mesh, "dp")
    return mesh, model


def _async_save(path: str, fail: bool):
    import torch.distributed as dist

    mesh, model = _setup()
    params = model.init(0)
    at_call = sf.gather(params, model.specs, mesh)

    def hook(event, **info):
        if fail and event == "before_commit" and dist.get_rank() == 0:
            raise OSError("injected: background failure")

    with ck._hooks.installed(hook):
        handle = ck.save(path, {"params": params}, mesh, {"params": model}, async_=True)
        assert isinstance(handle, ck.SaveHandle)
        for x in params.values():  # the step goes on: in place, with collectives
            x.add_(1.0)
        total = sf.psum(torch.ones(()), "dp", mesh=mesh)
        try:
            handle.wait()
        except ck.CheckpointError as err:
            return str(err)
    like = {"params": {k: torch.zeros_like(v) for k, v in params.items()}}
    out = ck.load(path, like, mesh, {"params": model})
    loaded = sf.gather(out["params"], model.specs, mesh)
    return int(total), all(torch.equal(loaded[k], at_call[k]) for k in at_call), \
        all(not torch.equal(loaded[k], sf.gather(params, model.specs, mesh)[k]) for k in at_call)


def test_async_save_holds_the_values_at_the_call(worlds, tmp_path):
    assert worlds(2).run(_async_save, str(tmp_path / "a"), False) == [(2, True, True)] * 2


def test_async_failure_is_raised_by_wait_on_every_rank(worlds, tmp_path):
    for error in worlds(2).run(_async_save, str(tmp_path / "b"), True):
        assert "rank 0" in error and "injected: background failure" in error, error
    assert ck.latest(str(tmp_path)) is None
    assert not (tmp_path / "b").exists()


def _async_bad_leaf(path: str):
    import torch.distributed as dist

    state = {"w": torch.ones(3), "seen": torch.tensor(dist.get_rank())}  # differs per rank
    handle = ck.save(path, state, async_=True)  # returns at once: checks run in the thread
    try:
        handle.wait()
    except ck.CheckpointError as err:
        return str(err)
    return "no error"


def test_async_errors_found_after_returning_reach_every_rank(worlds, tmp_path):
    for error in worlds(2).run(_async_bad_leaf, str(tmp_path / "c")):
        assert "'seen'" in error and "differ between ranks" in error, error
    assert not (tmp_path / "c").exists()
