"""Training on sf.data.loader batches equals one process on the global batches, and resumes.

* A data-parallel step (``sf.data_parallel`` over the data axes, ``accumulate_grads``
  over the micro-batches, a padded last batch weighted by its real samples) on every
  mesh of the property test gives the parameters of one process trained on the global
  batches of ``loader(dataset)``.
* pp x dp: ``pipeline_stages(dp_axis="dp")`` on loader batches (every pp rank passes
  the same batch; the pipeline checks it) gives the one-process gradients.
* A run stopped mid-epoch and resumed from ``sf.checkpoint`` (the loader's state saved
  with the parameters) reads the same remaining samples: bit-identical parameters on 2
  data ranks, and the same order on 1 data rank with DataLoader workers.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import TensorDataset

MESHES = [
    ({"dp": 1}, ("dp",)), ({"dp": 2}, ("dp",)), ({"dp": 3}, ("dp",)),
    ({"dp": 2, "tp": 2}, ("dp",)), ({"replica": 2, "dp": 2}, ("replica", "dp")),
    ({"replica": 2, "dp": 1, "tp": 2}, ("replica", "dp")), ({"pp": 2, "dp": 2}, ("dp",)),
]


def _dataset(num_samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(num_samples)
    return TensorDataset(torch.randn(num_samples, 4, generator=g),
                         torch.randn(num_samples, 1, generator=g), torch.arange(num_samples))


def _units() -> list[nn.Module]:
    return [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)]


def _loss(model, params, batch, weight, accumulation):
    """The mean squared error over this rank's real samples. With padding and a
    ``weight`` (the rank's real samples), the sum over a micro-batch's real samples over
    the whole local batch's count, so that averaging the micro-batches, then
    ``reduce_grads(weight=)``, gives the mean over the global batch's real samples; with
    padding and no weight (the reference), that mean computed directly."""
    from shardfn.data import Padded

    (x, y, _), mask = (batch.data, batch.mask) if isinstance(batch, Padded) else (batch, None)
    per_sample = ((model.apply(params, x) - y) ** 2)[:, 0]
    if mask is None:
        return per_sample.mean()
    if weight is None:  # the one-process reference: the real samples' mean, no weights
        return per_sample[mask].mean()
    return (per_sample * mask).sum() * accumulation / max(weight, 1)


def _train(axes, data_axes, num_samples, global_batch, accumulation, seed, last_batch, steps):
    """``steps`` AdamW steps on loader batches; one process when ``axes`` is None."""
    import shardfn as sf
    from shardfn import data as sfd

    mesh = sf.Mesh(axes) if axes else None
    model = sf.functional(nn.Sequential(*_units()))
    data = sfd.loader(_dataset(num_samples), mesh, data_axes=data_axes,
                      global_batch=global_batch, accumulation=accumulation, seed=seed,
                      last_batch=last_batch)
    dp = sf.data_parallel(mesh, data_axes) if mesh else None
    opt = sf.optim.adamw(1e-2)
    params = model.init(0)
    state = opt.init(params)
    grad_fn = sf.accumulate_grads(torch.func.grad(
        lambda p, b, w: _loss(model, p, b, w, accumulation)), accumulation)
    done = 0
    while done < steps:
        for batch in data:
            weight = batch.weight if last_batch == "pad" and mesh is not None else None
            grads = grad_fn(params, batch, weight)
            if dp is not None:
                grads = dp.reduce_grads(grads, weight=weight)
            updates, state = opt.update(grads, state, params)
            params = sf.optim.apply_updates(params, updates)
            done += 1
            if done == steps:
                break
    return params


@settings(max_examples=8, deadline=None)
@given(mesh=st.sampled_from(MESHES), num_samples=st.integers(6, 30),
       microbatch=st.integers(1, 2), accumulation=st.integers(1, 2), seed=st.integers(0, 99),
       last_batch=st.sampled_from(["drop", "pad"]))
def test_sharded_step_on_loader_batches_equals_one_process(worlds, mesh, num_samples,
                                                           microbatch, accumulation, seed,
                                                           last_batch):
    axes, data_axes = mesh
    size = data_ranks = 1
    for name, n in axes.items():
        size *= n
        data_ranks *= n if name in data_axes else 1
    global_batch = microbatch * accumulation * data_ranks
    num_samples = max(num_samples, global_batch + 1)
    per_epoch = num_samples // global_batch if last_batch == "drop" else \
        -(-num_samples // global_batch)
    steps = per_epoch + 1  # the padded last batch and into the next epoch
    results = worlds(size).run(_train, axes, data_axes, num_samples, global_batch,
                               accumulation, seed, last_batch, steps)
    reference = _train(None, (), num_samples, global_batch, 1, seed, last_batch, steps)
    wrong = _train(None, (), num_samples, global_batch, 1, seed + 1, last_batch, steps)
    assert any(not torch.allclose(wrong[k], reference[k]) for k in reference)  # it can fail
    for params in results:
        torch.testing.assert_close(params, reference)


def _pipeline(steps):
    import shardfn as sf
    from shardfn import data as sfd

    mesh = sf.Mesh({"pp": 2, "dp": 2})
    pp = sf.pipeline_stages(_units(), mesh, "pp", balance=[2, 1], schedule="gpipe",
                            microbatches=2, loss_fn=lambda out, y: ((out - y) ** 2).mean(),
                            dp_axis="dp")
    data = sfd.loader(_dataset(20), mesh, data_axes="dp", global_batch=8, accumulation=2,
                      seed=1)
    params, grads_by_step = pp.init(0), []
    for _step, (x, y, _) in zip(range(steps), data, strict=False):
        loss, grads = pp.value_and_grad(params, x, y)  # stage 0 reads x, the last y
        grads_by_step.append(pp.gather(grads))
        params = {k: v - 0.1 * grads[k] if k in grads else v for k, v in params.items()}
    return grads_by_step


def test_pipeline_on_loader_batches_equals_one_process(worlds):
    import shardfn as sf
    from shardfn import data as sfd

    full = sf.pipeline_split(_units(), balance=[2, 1]).full
    params, reference = full.init(0), []
    mse = lambda p, x, y: ((full.apply(p, x) - y) ** 2).mean()  # noqa: E731
    for _step, (x, y, _) in zip(range(2), sfd.loader(_dataset(20), global_batch=8, seed=1),
                                strict=False):
        grads = torch.func.grad(mse)(params, x, y)
        reference.append(grads)
        params = {k: v - 0.1 * grads[k] for k, v in params.items()}
    for rank_grads in worlds(4).run(_pipeline, 2):
        for got, want in zip(rank_grads, reference, strict=True):
            torch.testing.assert_close(got, want)


def _resumable(axes, accumulation, steps, load_from, save_to, num_workers=0):
    """``steps`` steps from the newest checkpoint in ``load_from`` (if any), saving the
    parameters, optimizer and loader state to ``save_to`` at the end; returns the
    parameters, the sample ids this rank read at each step and the loader's state."""
    import shardfn as sf
    from shardfn import data as sfd

    mesh = sf.Mesh(axes)
    model = sf.functional(nn.Sequential(*_units()))
    data = sfd.loader(_dataset(20), mesh, global_batch=4, accumulation=accumulation, seed=7,
                      num_workers=num_workers,
                      multiprocessing_context="fork" if num_workers else None)
    dp, opt = sf.data_parallel(mesh, "dp"), sf.optim.adamw(1e-2)
    params = model.init(0)
    state = {"params": params, "opt": opt.init(params), "data": data.state}
    if load_from is not None:
        state = sf.checkpoint.load(sf.checkpoint.latest(load_from), state, mesh)
        data.load_state(state["data"])
    params, opt_state = state["params"], state["opt"]
    grad_fn = sf.accumulate_grads(torch.func.grad(
        lambda p, b: _loss(model, p, b, None, accumulation)), accumulation)
    read = []
    while len(read) < steps:
        for batch in data:
            read.append(batch[2].tolist())
            grads = dp.reduce_grads(grad_fn(params, batch))
            updates, opt_state = opt.update(grads, opt_state, params)
            params = sf.optim.apply_updates(params, updates)
            if len(read) == steps:
                break
    if save_to is not None:
        sf.checkpoint.save(save_to, {"params": params, "opt": opt_state, "data": data.state},
                           mesh, step=len(read))
    return params, read, data.state


def test_resume_mid_epoch_continues_the_order_on_2_and_on_1_data_ranks(worlds, tmp_path):
    total, stop = 8, 3  # 5 batches of 4 per epoch: stop mid-epoch, end in the next one
    straight = worlds(2).run(_resumable, {"dp": 2}, 1, total, None, None)
    first = worlds(2).run(_resumable, {"dp": 2}, 1, stop, None, str(tmp_path))
    again = worlds(2).run(_resumable, {"dp": 2}, 1, total - stop, str(tmp_path), None)
    assert first[0][2] == (7, 0, 12, 20, True)  # (seed, epoch, offset, samples, shuffle)
    for rank in range(2):
        assert first[rank][1] + again[rank][1] == straight[rank][1]
        assert again[rank][2] == straight[rank][2] == (7, 1, 12, 20, True)
        for name, value in straight[rank][0].items():
            assert torch.equal(again[rank][0][name], value), name  # bit for bit
    # one data rank, the same global batch (two micro-batches of 2), with workers
    ((params, read, state),) = worlds(1).run(_resumable, {"dp": 1}, 2, total - stop,
                                             str(tmp_path), None, num_workers=2)
    assert read == [a + b for a, b in zip(straight[0][1], straight[1][1], strict=True)][stop:]
    assert state == straight[0][2]
    torch.testing.assert_close(params, straight[0][0])  # the mean of 2 ranks' means: round-off
