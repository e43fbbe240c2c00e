"""The pipeline step's records and the model's caches (issue #23, point 4).

A step is a frozen ``StepInputs``, one mutable ``Progress`` and its actions as
functions of both; a graph kept from F lives in ``progress.kept`` until its last
backward piece, and nothing is left there when the step ends. A ``PipelineModel``
is frozen: its caches (inferred shapes, message buffers, call guard) are kept
outside it, one record per model object, and die with it.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref

import pytest
from torch.testing import assert_close

import shardfn as sf
from shardfn.transforms.pipeline import pipeline_stages
from shardfn.transforms.pipeline._buffers import MessageBuffers
from shardfn.transforms.pipeline.caches import _CACHES, caches_of
from shardfn.transforms.pipeline.guard import CallGuard
from shardfn.transforms.pipeline.shapes import ShapeCache
from tests.transforms.pipeline._pipeline_models import batch, mlp_units, mse, reference


def _model():
    return pipeline_stages(mlp_units(5), sf.Mesh({"pp": 1}), balance=[5], schedule="gpipe",
                           microbatches=2, loss_fn=mse)


def test_the_caches_are_kept_outside_the_frozen_model():
    pp = _model()
    cached = (ShapeCache, MessageBuffers, CallGuard)
    assert not [f.name for f in dataclasses.fields(pp) if isinstance(getattr(pp, f.name), cached)]
    assert pp.shape_cache is pp.shape_cache is caches_of(pp).shapes
    assert pp.message_buffers is caches_of(pp).buffers and pp.call_guard is caches_of(pp).guard
    for other in (pp.eval(), copy.copy(pp), dataclasses.replace(pp)):  # each its own
        assert other.shape_cache is not pp.shape_cache
        assert other.call_guard is not pp.call_guard
    with pytest.raises(dataclasses.FrozenInstanceError):
        pp.shape_cache = ShapeCache()
    held, ref = len(_CACHES), weakref.ref(pp)
    del pp
    gc.collect()
    assert ref() is None and len(_CACHES) < held  # the registry does not keep the model


def _step_with_records(schedule: str):
    import shardfn.transforms.pipeline.runtime as runtime

    pp = pipeline_stages(mlp_units(5), sf.Mesh({"pp": 2}), balance=[2, 3], schedule=schedule,
                         microbatches=4, loss_fn=mse)
    found, progresses, original = [], [], runtime.run_action

    def run_action(step, progress, action):
        original(step, progress, action)
        kept = progress.kept.get((action.stage, action.microbatch))
        try:
            step.plan = None
            frozen = False
        except AttributeError:
            frozen = True
        found.append((action.kind, kept is not None and kept.x is not None,
                      kept is not None and kept.out is not None, frozen))
        progresses.append(progress)

    runtime.run_action = run_action
    try:
        loss, grads = pp.value_and_grad(pp.init(0), *batch(8, seed=1))
    finally:
        runtime.run_action = original
    progress = progresses[-1]
    assert all(p is progress for p in progresses)  # one progress object for the whole step
    return found, dict(progress.kept), dict(progress.local), loss, grads


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_every_kept_graph_lives_from_its_forward_to_its_last_backward_piece(worlds, schedule):
    _, ref_loss, ref_grads, _ = reference(mlp_units(5), 0, *batch(8, seed=1))
    for found, kept, local, loss, grads in worlds(2).run(_step_with_records, schedule):
        assert all(frozen for *_, frozen in found)
        for kind, has_input, has_output, _ in found:
            if kind == "F":  # the whole graph: its input and its output
                assert has_input and has_output
            else:  # B dropped the input (W needs only the rest); W dropped all
                assert not has_input
                assert not has_output or (kind == "B" and schedule == "zb-h1")
        assert ("W" in {k for k, *_ in found}) == (schedule == "zb-h1")
        assert kept == {} and local == {}  # nothing kept once the step ended
        assert_close(loss, ref_loss)
        assert_close(grads, {n: ref_grads[n] for n in grads})
