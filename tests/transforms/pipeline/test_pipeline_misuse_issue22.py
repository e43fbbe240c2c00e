"""Issue 22: pipeline misuse is refused, never a wrong number; profiling leaves the model alone.

* two threads calling ``value_and_grad`` on one model at once: both calls raise on every
  rank (their messages would mix, and the ranks may pair the calls differently);
* pp ranks given batches of different sizes: every rank raises, naming each rank's sizes,
  with check mode on and off;
* a stage output that does not require grad arrives as a plain tensor (an in-place op on
  it works, as in the unsplit model);
* ``balance="time"`` leaves BatchNorm statistics and the random stream as they were;
* a missing or wrong ``balance`` names ``balance='params'`` and ``'time'``.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import shardfn as sf
from shardfn.transforms.pipeline import pipeline_stages
from shardfn.transforms.pipeline.guard import CallGuard, ConcurrentCallError
from tests.transforms.pipeline._pipeline_models import batch, mlp_units, mse, reference

#: released by each rank's test thread once the second call was refused (see _Gated)
GATE = threading.Event()


class _Gated(nn.Module):
    """Waits for :data:`GATE` in forward: holds a step open while a second thread calls."""

    def forward(self, x):
        if not GATE.wait(timeout=30):
            raise RuntimeError("gate never opened")
        return x


def _healthy_loss():
    pp = pipeline_stages(mlp_units(4), sf.Mesh({"pp": 2}), balance=[2, 2], schedule="1f1b",
                         microbatches=2, loss_fn=mse)
    return pp.value_and_grad(pp.init(0), *batch(4))[0]


def _two_threads():
    GATE.clear()
    units = [nn.Linear(4, 8), _Gated(), _Gated(), nn.Linear(8, 3)]
    pp = pipeline_stages(units, sf.Mesh({"pp": 2}), balance=[2, 2], schedule="1f1b",
                         microbatches=2, loss_fn=mse)
    params, found = pp.init(0), {}

    def call(name, rows):
        try:
            found[name] = pp.value_and_grad(params, *batch(rows, seed=rows))[0]
        except Exception as error:  # noqa: BLE001 - the test looks at each thread's error
            found[name] = error

    first = threading.Thread(target=call, args=("first", 4))
    first.start()
    while not pp.call_guard._lock.locked():  # the first call is inside its step
        first.join(0.001)
    call("second", 6)  # at once: refused
    GATE.set()
    first.join(60)
    return {k: (type(v).__name__, str(v)) for k, v in found.items()}


def test_two_threads_on_one_model_are_refused_on_every_rank(worlds):
    for found in worlds(2).run(_two_threads):
        assert found["second"][0] == "ConcurrentCallError", found
        assert "another thread is running value_and_grad" in found["second"][1]
        assert found["first"][0] == "ConcurrentCallError", found  # its result is not trusted
        assert "not trusted" in found["first"][1]
    for loss in worlds(2).run(_healthy_loss):  # nothing was left unmatched
        assert_close(loss, reference(mlp_units(4), 0, *batch(4))[1])


def test_calls_one_after_another_from_two_threads_are_fine():
    guard = CallGuard()

    def use():
        with guard.hold("apply"):
            pass

    worker = threading.Thread(target=use)
    worker.start()
    worker.join()
    with guard.hold("value_and_grad"):
        pass
    with pytest.raises(ConcurrentCallError, match="not trusted"), guard.hold("x"):
        with pytest.raises(ConcurrentCallError, match="running x"), guard.hold("y"):
            pass


def _uneven_batches(check: bool):
    before = sf.check_consistency()
    sf.check_consistency(check)
    try:
        pp = pipeline_stages(mlp_units(4), sf.Mesh({"pp": 2}), balance=[2, 2],
                             schedule="1f1b", microbatches=2, loss_fn=mse)
        rows = 8 if pp.rank == 0 else 6
        try:
            pp.value_and_grad(pp.init(0), *batch(rows))
        except ValueError as error:
            return type(error).__name__, str(error)
        return None
    finally:
        sf.check_consistency(before)


@pytest.mark.parametrize("check", [True, False])
def test_batches_of_different_sizes_raise_on_every_rank(worlds, check):
    for found in worlds(2).run(_uneven_batches, check):
        assert found is not None, "a loss came back from different batches"
        assert "pp rank 0: inputs 8 rows, targets 8 rows" in found[1], found
        assert "pp rank 1: inputs 6 rows, targets 6 rows" in found[1], found
    for loss in worlds(2).run(_healthy_loss):
        assert_close(loss, reference(mlp_units(4), 0, *batch(4))[1])


class _Constant(nn.Module):
    """An output that does not depend on the parameters (no grad), like a position table."""

    def forward(self, x):
        return torch.ones(x.shape[0], 8) * 0.5


class _AddInPlace(nn.Module):
    def forward(self, x):
        return x.add_(1.0)


def _in_place_units():
    return [nn.Linear(4, 8), _Constant(), _AddInPlace(), nn.Linear(8, 3)]


def _in_place_step():
    pp = pipeline_stages(_in_place_units(), sf.Mesh({"pp": 2}), balance=[2, 2],
                         schedule="1f1b", microbatches=2, loss_fn=mse)
    loss, grads = pp.value_and_grad(pp.init(0), *batch(4))
    return loss, grads


def test_a_no_grad_activation_arrives_without_grad(worlds):
    """Old code: stage 1 got a leaf requiring grad and ``add_`` raised."""
    _, want_loss, want_grads, _ = reference(_in_place_units(), 0, *batch(4))
    for loss, grads in worlds(2).run(_in_place_step):
        assert_close(loss, want_loss)
        for name, grad in grads.items():
            assert_close(grad, want_grads[name])


def test_a_no_grad_activation_handed_over_on_one_rank():
    """Consecutive stages on one rank (virtual stages) hand over locally: same rule."""
    pp = pipeline_stages(_in_place_units(), sf.Mesh({"pp": 1}), balance=[2, 2], virtual=2,
                         schedule="interleaved", microbatches=2, loss_fn=mse)
    loss, grads = pp.value_and_grad(pp.init(0), *batch(4))
    _, want_loss, want_grads, _ = reference(_in_place_units(), 0, *batch(4))
    assert_close(loss, want_loss)
    assert_close(grads, {n: want_grads[n] for n in grads})


def test_balance_time_changes_nothing():
    units = [nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3)]
    before = {n: t.clone() for n, t in nn.Sequential(*units).state_dict().items()}
    sample = torch.randn(5, 4)
    kept, rng = sample.clone(), torch.get_rng_state()
    pp = pipeline_stages(units, sf.Mesh({"pp": 1}), balance="time", sample=sample,
                         microbatches=1, loss_fn=mse)
    assert sum(pp.balance) == 4
    after = nn.Sequential(*units).state_dict()
    for name, value in before.items():
        assert torch.equal(after[name], value), name  # running stats, num_batches_tracked
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(sample, kept)


def test_balance_time_with_a_wrong_sample_names_the_unit():
    with pytest.raises(ValueError, match=r"unit 0 \(Linear\) failed .* sample= must be"):
        pipeline_stages(mlp_units(4), sf.Mesh({"pp": 1}), balance="time",
                        sample=torch.randn(2, 5), microbatches=1, loss_fn=mse)


@pytest.mark.parametrize("balance, kind", [
    (None, TypeError), ([2, 2], ValueError), ([2, 2.0, 1], TypeError), ([5, 0], ValueError)])
def test_a_missing_or_wrong_balance_names_params_and_time(balance, kind):
    options = {} if balance is None else {"balance": balance}
    with pytest.raises(kind, match="balance='params'.*balance='time'"):
        pipeline_stages(mlp_units(5), sf.Mesh({"pp": 1}), virtual=2, microbatches=2,
                        loss_fn=mse, schedule="interleaved", **options)


#: forwards of _Slow on this process (a module global: sf.functional copies the module)
SLOW_CALLS = [0]


class _Slow(nn.Module):
    """Counts its calls; 0.4 s each (stage 0's forwards, while the last stage fails)."""

    def forward(self, x):
        import time

        SLOW_CALLS[0] += 1
        time.sleep(0.4)
        return x


class _Explodes(nn.Module):
    def forward(self, x):
        raise RuntimeError("exploded on purpose")


def _failing_last_stage():
    SLOW_CALLS[0] = 0
    units = [nn.Linear(4, 8), _Slow(), _Explodes(), nn.Linear(8, 3)]
    pp = pipeline_stages(units, sf.Mesh({"pp": 2}), balance=[2, 2], schedule="gpipe",
                         microbatches=8, loss_fn=mse)
    try:
        pp.value_and_grad(pp.init(0), *batch(8))
    except Exception as error:  # noqa: BLE001 - the test looks at every rank's error
        return type(error).__name__, str(error), SLOW_CALLS[0]
    return None


def test_a_failing_stage_stops_the_others_early(worlds):
    """GPipe: stage 0 runs all 8 forwards before its first receive; the last stage fails on
    micro-batch 0. Old code: stage 0 ran all 8 forwards (3.2 s) before it heard."""
    first, second = worlds(2).run(_failing_last_stage)
    assert second[0] == "RuntimeError" and "exploded on purpose" in second[1]
    assert first[0] == "PeerFailed" and "exploded on purpose" in first[1], first
    assert first[2] < 8, f"stage 0 ran {first[2]} of 8 forwards after the failure"
    for loss in worlds(2).run(_healthy_loss):
        assert_close(loss, reference(mlp_units(4), 0, *batch(4))[1])


def _same_sizes_other_values():
    pp = pipeline_stages(mlp_units(4), sf.Mesh({"pp": 2}), balance=[2, 2], schedule="1f1b",
                         microbatches=2, loss_fn=mse)
    try:
        pp.value_and_grad(pp.init(0), *batch(4, seed=7 + pp.rank))
    except ValueError as error:
        return type(error).__name__, str(error)
    return None


def test_check_mode_compares_the_batch_values(worlds):
    """Same sizes, other values (a per-rank data loader): check mode (on in the local world)
    refuses it on every rank; the size comparison alone cannot see it."""
    for found in worlds(2).run(_same_sizes_other_values):
        assert found is not None and found[0] == "ConsistencyError", found
        assert "pipeline value_and_grad batch" in found[1], found
