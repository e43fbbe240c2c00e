"""Receives posted ahead and message buffers kept from step to step.

With declared (or inferred) shapes each rank posts every receive of the step
when the step starts (none from inside an action), and a pipeline model keeps its activation and
gradient buffers for the next step, as torch's stages keep their receive
buffers. Neither may change a number: steps stay equal to the unsplit model,
no returned gradient shares memory with a kept buffer (the next step would
overwrite it), and a step that fails with receives posted ahead leaves every
rank able to run the next one.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.transforms.pipeline import pipeline_stages
from shardfn.transforms.pipeline._p2p import Declared, Messenger
from tests.transforms.pipeline._pipeline_models import batch, mlp_units, mse, reference
from tests.transforms.pipeline.test_pipeline_errors import _Failing


def _declared(rows: int, m: int, width: int = 8) -> sf.ShapeDtype:
    return sf.ShapeDtype(torch.Size([rows // m, width]), torch.float32)


def _repeated_steps(p: int, schedule: str, virtual: int, seeds: list[int], shapes):
    n_units = 2 * p * virtual + 1
    pp = pipeline_stages(mlp_units(n_units), sf.Mesh({"pp": p}),
                         balance=[2] * (p * virtual - 1) + [3], schedule=schedule,
                         microbatches=4, loss_fn=mse, virtual=virtual, shapes=shapes)
    params = pp.init(0)
    found, kept = [], []
    for seed in seeds:
        loss, grads = pp.value_and_grad(params, *batch(8, seed=seed))
        found.append((loss, grads))
        kept.append(sorted(b.buffer.data_ptr() for b in pp.message_buffers.buffers.values()))
    return found, kept


@pytest.mark.parametrize("p, schedule, virtual, shapes", [
    (2, "1f1b", 1, "declared"), (2, "interleaved", 2, None), (4, "gpipe", 1, "declared"),
    (2, "zb-h1", 1, None)])
def test_kept_buffers_are_reused_and_every_step_is_exact(worlds, p, schedule, virtual, shapes):
    seeds = [1, 2, 3, 4]
    declared = _declared(8, 4) if shapes == "declared" else None
    results = worlds(p).run(_repeated_steps, p, schedule, virtual, seeds, declared)
    n_units = 2 * p * virtual + 1
    for found, kept in results:
        for seed, (loss, grads) in zip(seeds, found, strict=True):
            _, ref_loss, ref_grads, _ = reference(mlp_units(n_units), 0, *batch(8, seed=seed))
            assert_close(loss, ref_loss)
            assert_close(grads, {n: ref_grads[n] for n in grads})
        # inferred shapes: the first step exchanges headers, kept buffers start at the second
        start = 0 if shapes == "declared" else 1
        assert kept[start], "no message buffer was kept"
        assert all(k == kept[start] for k in kept[start:]), "the buffers were not reused"


class _AddParam(nn.Module):
    """``x + p`` with ``p`` of the micro-batch's shape: ``p``'s gradient *is* the output
    gradient received from the next stage, which autograd may keep as ``p.grad``."""

    def __init__(self, rows: int, width: int):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(rows, width))

    def forward(self, x):
        return x + self.p


def _aliasing_steps():
    units = [nn.Linear(4, 8), _AddParam(8, 8), nn.Linear(8, 3)]
    pp = pipeline_stages(units, sf.Mesh({"pp": 2}), balance=[2, 1], schedule="1f1b",
                         microbatches=1, loss_fn=mse, shapes=_declared(8, 1))
    params = pp.init(0)
    first = pp.value_and_grad(params, *batch(8, seed=1))[1]
    snapshot = {n: g.clone() for n, g in first.items()}
    pp.value_and_grad(params, *batch(8, seed=2))  # would overwrite a kept buffer's alias
    kept = {b.buffer.untyped_storage().data_ptr() for b in pp.message_buffers.buffers.values()}
    shared = [n for n, g in first.items() if g.untyped_storage().data_ptr() in kept]
    return first, snapshot, shared


def test_a_gradient_aliasing_a_kept_buffer_is_copied_out(worlds):
    units = [nn.Linear(4, 8), _AddParam(8, 8), nn.Linear(8, 3)]
    ref_grads = reference(units, 0, *batch(8, seed=1))[2]
    for first, snapshot, shared in worlds(2).run(_aliasing_steps):
        assert shared == []
        assert_close(first, snapshot)  # the next step left the returned gradients alone
        assert_close(first, {n: ref_grads[n] for n in first})


def _fail_in_the_second_step(schedule: str):
    units = [nn.Linear(4, 8), nn.Tanh(), _Failing(when=5), nn.Linear(8, 3)]
    pp = pipeline_stages(units, sf.Mesh({"pp": 2}), balance=[2, 2], schedule=schedule,
                         microbatches=4, loss_fn=mse, shapes=_declared(8, 4))
    params = pp.init(0)
    pp.value_and_grad(params, *batch(8, seed=1))  # calls 0-3 pass
    start = time.perf_counter()
    try:  # call 5 (counting from 0): micro-batch 1 of step 2
        pp.value_and_grad(params, *batch(8, seed=2))
        failed = None
    except Exception as error:  # noqa: BLE001 - the test looks at which error each rank got
        failed = (type(error).__name__, str(error))
    seconds = time.perf_counter() - start
    return failed, seconds, pp.value_and_grad(params, *batch(8, seed=3))[0]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_failure_with_receives_posted_ahead_stops_every_rank_then_recovers(worlds, schedule):
    results = worlds(2).run(_fail_in_the_second_step, schedule)
    (name0, text0), _, _ = results[0]
    (name1, text1), _, _ = results[1]
    assert name1 == "RuntimeError" and "exploded on purpose" in text1
    assert name0 == "PeerFailed" and "exploded on purpose" in text0
    expected = reference([nn.Linear(4, 8), nn.Tanh(), nn.Identity(), nn.Linear(8, 3)], 0,
                         *batch(8, seed=3))[1]
    for _, seconds, loss in results:
        assert seconds < 20
        assert_close(loss, expected)


def _messenger_prepost():
    mesh = sf.Mesh({"pp": 2})
    pp = pipeline_stages(mlp_units(3), mesh, balance=[2, 1], schedule="gpipe",
                         microbatches=1, loss_fn=mse)
    ax = pp.plan.ax
    declared = Declared((2, 3), torch.float32)
    known = {("act", 0, 0): declared, ("act", 0, 1): declared}
    messenger = Messenger(ax, {("act", 0, 0): 0, ("act", 0, 1): 1, ("act", 0, 2): 2}.__getitem__,
                          known.get)
    value = torch.arange(6.0).reshape(2, 3)
    if ax.index == 0:
        messenger.send(("act", 0, 0), 1, value)
        messenger.send(("act", 0, 1), 1, value + 1)
        messenger.send(("act", 0, 2), 1, value + 2)  # not declared: header, then payload
        messenger.finish()
        return None
    posted = [messenger.prepost(("act", 0, 1), 0), messenger.prepost(("act", 0, 1), 0),
              messenger.prepost(("act", 0, 2), 0)]
    got = [messenger.recv(("act", 0, k), 0) for k in range(3)]
    return posted, got, len(messenger.posted)


def test_messenger_prepost_receives_the_same_values(worlds):
    posted, got, left = worlds(2).run(_messenger_prepost)[1]
    assert posted == [True, False, False]  # once; never for an undeclared message
    value = torch.arange(6.0).reshape(2, 3)
    assert_close(got, [value, value + 1, value + 2])
    assert left == 0



def _declared_steps(p: int):
    pp = pipeline_stages(mlp_units(2 * p + 1), sf.Mesh({"pp": p}), balance=[2] * (p - 1) + [3],
                         schedule="1f1b", microbatches=4, loss_fn=mse, shapes=_declared(8, 4))
    params = pp.init(0)
    found = []
    for seed in (1, 2, 3):
        loss, grads, report = pp.value_and_grad(params, *batch(8, seed=seed), report=True)
        found.append((loss, grads, report.header_first))
    out = [pp.apply(params, batch(8, seed=1)[0]) for _ in range(2)]
    return found, out


@pytest.mark.parametrize("p", [2, 4])
def test_declared_shapes_declare_the_loss_from_the_second_step(worlds, p):
    """With ``shapes=`` the loss (and ``apply``'s output) is the only message the first
    step exchanges header first; from the second step on it is declared too."""
    for rank, (found, out) in enumerate(worlds(p).run(_declared_steps, p)):
        counts = [count for _, _, count in found]
        assert counts[0] == (p - 1 if rank == p - 1 else 1), (rank, counts)
        assert counts[1:] == [0, 0], (rank, counts)
        for seed, (loss, grads, _) in zip((1, 2, 3), found, strict=True):
            _, ref_loss, ref_grads, ref_out = reference(mlp_units(2 * p + 1), 0,
                                                        *batch(8, seed=seed))
            assert_close(loss, ref_loss)
            assert_close(grads, {n: ref_grads[n] for n in grads})
        ref_out = reference(mlp_units(2 * p + 1), 0, *batch(8, seed=1))[3]
        assert_close(out, [ref_out, ref_out])


def _disagreeing_declarations():
    pp = pipeline_stages(mlp_units(3), sf.Mesh({"pp": 2}), balance=[2, 1], schedule="gpipe",
                         microbatches=1, loss_fn=mse)
    ax = pp.plan.ax
    mine = Declared((2, 3) if ax.index == 0 else (3, 2), torch.float32)  # same bytes
    messenger = Messenger(ax, {("act", 0, 0): 0}.__getitem__, {("act", 0, 0): mine}.get)
    if ax.index == 0:
        messenger.send(("act", 0, 0), 1, torch.arange(6.0).reshape(2, 3))
        messenger.finish()
        return None
    try:
        messenger.recv(("act", 0, 0), 0)
    except RuntimeError as error:
        return str(error), (("act", 0, 0), 0) in messenger.received
    return "no error"


def test_ranks_whose_declarations_disagree_get_an_error_not_a_value(worlds):
    text, taken = worlds(2).run(_disagreeing_declarations)[1]
    assert "disagree" in text and "(2, 3)" in text and "(3, 2)" in text, text
    assert taken  # settling after the error does not wait for the message again


def _posted_before_the_first_action(schedule: str, virtual: int):
    import shardfn.transforms.pipeline.runtime as runtime
    from shardfn.transforms.pipeline.messages import message_lists

    p = 2
    pp = pipeline_stages(mlp_units(2 * p * virtual + 1), sf.Mesh({"pp": p}),
                         balance=[2] * (p * virtual - 1) + [3], schedule=schedule,
                         microbatches=4, loss_fn=mse, virtual=virtual, shapes=_declared(8, 4))
    params = pp.init(0)
    pp.value_and_grad(params, *batch(8, seed=1))  # the loss is declared from the 2nd step
    seen, original = [], runtime.run_action

    def run_action(step, progress, action):  # the driver runs each action through this
        if not seen:
            seen.append(set(step.messenger.posted))
        posts = len(step.messenger.posted) + len(step.messenger.received)
        original(step, progress, action)
        seen.append(len(step.messenger.posted) + len(step.messenger.received) - posts)

    runtime.run_action = run_action
    try:
        loss, grads = pp.value_and_grad(params, *batch(8, seed=2))
    finally:
        runtime.run_action = original
    expected = set(message_lists(pp.plan.schedule, pp.plan.ax.index)[1])
    return seen[0], expected, seen[1:], loss, grads


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("interleaved", 2)])
def test_every_declared_receive_is_posted_when_the_step_starts(worlds, schedule, virtual):
    """No receive is posted from inside an action (a post there can wait for the
    connection while this rank's last send moves): all are posted before the first."""
    n_units = 4 * virtual + 1
    for posted, expected, changes, loss, grads in worlds(2).run(
            _posted_before_the_first_action, schedule, virtual):
        assert posted == expected and expected
        # each action only takes posted receives: posted + received stays the same
        assert changes == [0] * len(changes), changes
        _, ref_loss, ref_grads, _ = reference(mlp_units(n_units), 0, *batch(8, seed=2))
        assert_close(loss, ref_loss)
        assert_close(grads, {n: ref_grads[n] for n in grads})
