"""Issue #24: interleaved zero bubble, ZB-V (a V-shaped placement) and schedules written as data.

Single-process checks (the schedules are data): every new schedule validates, is torch's
order action for action, and simulates a smaller bubble than interleaved 1F1B at the same
``p, v, m``; a written schedule is refused with the rank, the action and the reason. One
2-rank world run: the new schedules and a written 1F1B equal the unsplit model.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import shardfn as sf
from shardfn.transforms.pipeline import pipeline_stages
from shardfn.transforms.pipeline.kinds import LOSS_KEY, MessageKind
from shardfn.transforms.pipeline.messages import message_lists
from shardfn.transforms.pipeline.schedules import Action, Schedule, make_schedule
from shardfn.transforms.pipeline.simulate import simulate, theoretical_bubble, validate
from shardfn.transforms.pipeline.written import (
    resolve_schedule,
    schedule_from_actions,
    schedule_from_csv,
    schedule_to_csv,
)
from tests.transforms.pipeline._pipeline_models import batch, mlp_units, mse, reference


def _show(schedule: Schedule) -> list[list[str]]:
    return [[f"{a.kind}{a.stage}.{a.microbatch}" for a in row] for row in schedule.actions]


def _torch_orders(cls_name: str, p: int, m: int, v: int) -> list[list[str]]:
    """torch's per-rank order (idle slots dropped) from its own method on a stand-in."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    rounds = max(1, m // p)
    stand = type("Stand", (), {"n_local_stages": v, "pp_group_size": p, "_n_microbatches": m,
                               "microbatches_per_round": m // rounds, "num_stages": v * p})()
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    method = getattr(schedules, cls_name)._calculate_single_rank_operations
    return [[f"{kinds[a.computation_type.name]}{a.stage_index}.{a.microbatch_index}"
             for a in method(stand, r) if a is not None] for r in range(p)]


def test_new_schedules_validate_are_torchs_and_beat_interleaved():
    checked = 0
    for p in range(1, 5):
        for m in range(1, 13):
            cases = [("zbv", "ScheduleZBVZeroBubble", 2)]
            if m % max(1, m // p) == 0:  # the interleaved rounds
                cases += [("interleaved_zb", "ScheduleInterleavedZeroBubble", v) for v in (2, 3)]
            for name, cls_name, v in cases:
                ours = make_schedule(name, p, m, v)
                validate(ours)
                assert ours.split_backward and ours.n_stages == p * v
                assert _show(ours) == _torch_orders(cls_name, p, m, v), (name, p, m, v)
                if m >= p and m % p == 0:
                    theirs = simulate(make_schedule("interleaved", p, m, v)).bubble
                    assert simulate(ours).bubble <= theirs + 1e-12, (name, p, m, v)
                checked += 1
    assert checked == 48 + 2 * 39  # zbv everywhere; interleaved_zb where the rounds divide m
    # the numbers (t_f = 1, t_b = 2, t_w = 1): interleaved 1F1B vs the zero-bubble ones
    for p, m, interleaved, zero in ((2, 4, 1 / 9, 1 / 25), (4, 8, 3 / 19, 3 / 51)):
        assert simulate(make_schedule("interleaved", p, m, 2)).bubble == \
            pytest.approx(interleaved) == theoretical_bubble("interleaved", p, m, 2)
        for name in ("interleaved_zb", "zbv"):
            assert simulate(make_schedule(name, p, m, 2)).bubble == pytest.approx(zero), name
    # with v = 1 the interleaved zero bubble is ZB-H1, as interleaved 1F1B is 1F1B
    assert make_schedule("interleaved_zb", 3, 6).actions == make_schedule("zb-h1", 3, 6).actions
    with pytest.raises(ValueError, match="exactly 2 stages per rank.*virtual=2"):
        make_schedule("zbv", 2, 4)
    with pytest.raises(ValueError, match="schedule 'interleaved_zb' runs micro-batches in rounds"):
        make_schedule("interleaved_zb", 2, 7, 2)
    with pytest.raises(ValueError, match="no closed form.*simulate"):
        theoretical_bubble("zbv", 2, 4, 2)


def test_zbv_places_a_v_and_its_messages_follow():
    zbv = make_schedule("zbv", 2, 3, 2)
    assert zbv.placement == (0, 1, 1, 0) and [zbv.rank_of(s) for s in range(4)] == [0, 1, 1, 0]
    owed0, expected0 = message_lists(zbv, 0)  # rank 0 holds the first and the last stage
    owed1, expected1 = message_lists(zbv, 1)
    assert (LOSS_KEY, 1) in owed0 and (LOSS_KEY, 0) in expected1
    assert ((MessageKind.ACT, 0, 0), 1) in owed0 and ((MessageKind.ACT, 2, 0), 0) in owed1
    # stage 1 -> stage 2 is a hand-off on rank 1, never a message
    assert not any(key[:2] == (MessageKind.ACT, 1) for key, _ in owed1 + expected0)
    assert sorted(k for k, _ in owed0) == sorted(k for k, _ in expected1)  # all matched
    assert sorted(k for k, _ in owed1) == sorted(k for k, _ in expected0)
    looped = zbv._replace(placement=None)  # the same order on looped stages is refused
    with pytest.raises(ValueError, match="rank 0 runs F\\(stage 3, microbatch 0\\), which "
                                         "lives on rank 1"):
        validate(looped)
    with pytest.raises(ValueError, match="puts 3 stages on rank 0; every rank holds n_virtual=2"):
        validate(zbv._replace(placement=(0, 1, 0, 0)))


def _written_1f1b() -> list[list[str]]:
    return [["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],
            ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]]


def test_written_schedules_equal_builtin_and_bad_ones_are_refused():
    written = schedule_from_actions(_written_1f1b(), n_microbatches=4)
    assert written.actions == make_schedule("1f1b", 2, 4).actions
    assert (written.name, written.split_backward, written.placement) == ("custom", False, None)
    assert simulate(written) == simulate(make_schedule("1f1b", 2, 4))
    zbv = make_schedule("zbv", 2, 3, 2)  # a table round trip, torch's "I" read as B
    table = schedule_to_csv(zbv).replace("B", "I")
    again = schedule_from_csv(table, n_microbatches=3, virtual=2, placement="v", name="mine")
    assert again.actions == zbv.actions and again.placement == zbv.placement
    tuples = [[(a.kind.value, a.stage, a.microbatch) for a in row] for row in zbv.actions]
    assert schedule_from_actions(tuples, n_microbatches=3, virtual=2,
                                 placement=[0, 1, 1, 0]).actions == zbv.actions

    def refused(rows, match, **options):
        options = {"n_microbatches": 2, **options}
        with pytest.raises(ValueError, match=match):
            schedule_from_actions(rows, **options)

    # B before its F on the last stage's rank
    refused([["0F0", "0F1", "0B0", "0B1"], ["1B0", "1F0", "1F1", "1B1"]],
            r"rank 1 runs B\(stage 1, microbatch 0\) \(position 0\) before F\(stage 1, "
            r"microbatch 0\) \(position 1\), which it needs")
    # a missing W in a split-backward schedule
    refused([["0F0", "0F1", "0B0", "0W0", "0B1"], ["1F0", "1B0", "1W0", "1F1", "1B1", "1W1"]],
            r"rank 0 never runs W\(stage 0, microbatch 1\): .*every B needs its W")
    # a deadlock: rank 0 waits for B(1, 0), which rank 1 runs only after F(1, 1)
    refused([["0F0", "0B0", "0F1", "0B1"], ["1F1", "1F0", "1B0", "1B1"]],
            r"deadlocks .*rank 0 at B\(stage 0, microbatch 0\) waits for B\(stage 1, "
            r"microbatch 0\); rank 1 at F\(stage 1, microbatch 1\) waits for F\(stage 0, "
            r"microbatch 1\)")
    # micro-batch 2 is never run
    refused([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]],
            r"rank 0 never runs F\(stage 0, microbatch 2\): micro-batch 2 never runs stage 0",
            n_microbatches=3)
    refused([["0F0", "0X0"]], r"rank 0 action 1 is '0X0'")
    refused([["0F0"]], "placement='v' places 2 stages per rank", placement="v")
    with pytest.raises(ValueError, match="has n_virtual=1, but the pipeline has virtual= 2"):
        resolve_schedule(written, 2, 4, 2)
    with pytest.raises(ValueError, match="has n_microbatches=4, but the pipeline has "
                                         "microbatches= 8"):
        resolve_schedule(written, 2, 8, 1)


_CASES = {  # name -> (schedule, m, v, balance of 7 units)
    "interleaved_zb": ("interleaved_zb", 4, 2, [2, 1, 2, 2]),
    "zbv": ("zbv", 3, 2, [1, 2, 2, 2]),
    "1f1b": ("1f1b", 4, 1, [3, 4]),
    "written": ("written", 4, 1, [3, 4]),
}


def _on_rank():
    out = {}
    for key, (name, m, v, balance) in _CASES.items():
        schedule = schedule_from_actions(_written_1f1b(), n_microbatches=4) \
            if name == "written" else name
        torch.manual_seed(0)
        pp = pipeline_stages(mlp_units(7), sf.Mesh({"pp": 2}), "pp", balance=balance,
                             schedule=schedule, microbatches=m, loss_fn=mse, virtual=v)
        params = pp.init(5)
        x, y = batch(9)
        loss, grads, report = pp.value_and_grad(params, x, y, report=True)
        out[key] = {"loss": loss, "grads": grads, "names": pp.names, "layout": pp.layout,
                    "out": pp.apply(params, x), "full": pp.gather(params),
                    "kinds": sorted({e.kind for e in report.events}),
                    "events": [(e.kind, e.stage, e.microbatch) for e in report.events]}
    return out


def test_zero_bubble_and_written_schedules_equal_unsplit(worlds):
    torch.manual_seed(0)
    params, loss, grads, out = reference(mlp_units(7), 5, *batch(9))
    results = worlds(2).run(_on_rank)
    for rank, got in enumerate(results):
        for key, found in got.items():
            assert_close(found["loss"], loss, msg=f"{key} loss on rank {rank}")
            assert set(found["grads"]) == {n for n in found["names"] if n in grads}
            for name, grad in found["grads"].items():
                assert_close(grad, grads[name], msg=f"{key}: {name} on pp rank {rank}")
            assert_close(found["out"], out)
            assert_close(found["full"], params)
            split = key in ("interleaved_zb", "zbv")
            assert found["kinds"] == (["B", "F", "W"] if split else ["B", "F"]), key
        # the V: the first stage (unit 0) and the last (units 5, 6) on rank 0
        layout = got["zbv"]["layout"]
        assert (layout["0.weight"], layout["2.weight"], layout["6.weight"]) == (0, 1, 0)
        assert {got["interleaved_zb"]["layout"][n] for n in ("0.weight", "4.weight")} == {0}
        # the written 1F1B ran exactly the built-in's actions
        assert got["written"]["events"] == got["1f1b"]["events"]
        assert [tuple(a) for a in make_schedule("1f1b", 2, 4).actions[rank]] == \
            [tuple(Action(*e)) for e in got["written"]["events"]]
