"""Pipeline schedules: every schedule validates, bubbles equal their formulas, 1F1B's memory.

All single-process: the schedules are data and ``simulate`` runs them on a clock.
"""

from __future__ import annotations

import pickle
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardfn.transforms.pipeline.kinds import ActionKind, MessageKind, Status
from shardfn.transforms.pipeline.messages import message_lists
from shardfn.transforms.pipeline.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    ScheduleName,
    interleaved_round,
    make_schedule,
)
from shardfn.transforms.pipeline.simulate import simulate, theoretical_bubble, validate

NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def _all_schedules():
    """Every (name, p, m, v) the brief asks for: p 1..4, m 1..12, v 1..3 where allowed."""
    for name in NAMES:
        for p in range(1, 5):
            for m in range(1, 13):
                for v in (1, 2, 3):
                    if v > 1 and not SCHEDULES[name][1]:
                        continue
                    if name == "interleaved" and v > 1 and m % max(1, m // p):
                        continue
                    yield name, p, m, v


def _show(schedule: Schedule, rank: int) -> list[str]:
    return [f"{a.kind}{a.stage}.{a.microbatch}" for a in schedule.actions[rank]]


def test_every_schedule_validates_and_holds_every_action_once():
    count = 0
    for name, p, m, v in _all_schedules():
        schedule = make_schedule(name, p, m, v)
        validate(schedule)
        kinds = "FBW" if schedule.split_backward else "FB"
        flat = [a for actions in schedule.actions for a in actions]
        assert len(flat) == len(set(flat)) == len(kinds) * p * v * m, (name, p, m, v)
        assert schedule.n_stages == p * v and schedule.n_microbatches == m
        count += 1
    assert count == 366  # 144 gpipe, 48 each for 1f1b and zb-h1, 126 interleaved


def test_known_orders():
    assert _show(make_schedule("1f1b", 4, 6), 0) == \
        "F0.0 F0.1 F0.2 F0.3 B0.0 F0.4 B0.1 F0.5 B0.2 B0.3 B0.4 B0.5".split()
    assert _show(make_schedule("1f1b", 4, 6), 3) == \
        "F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F3.3 B3.3 F3.4 B3.4 F3.5 B3.5".split()
    # Megatron / torch's interleaved order: (v - 1) * p + 2 (p - 1 - r) warm-up forwards
    assert _show(make_schedule("interleaved", 2, 4, 2), 0) == \
        "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3".split()
    # ZB-H1: the last rank defers p - 1 weight gradients, the first none
    zb = make_schedule("zb-h1", 4, 6)
    assert _show(zb, 0)[:7] == "F0.0 F0.1 F0.2 F0.3 B0.0 W0.0 F0.4".split()
    assert _show(zb, 3)[:10] == "F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F3.3 B3.3 W3.0 F3.4".split()
    assert make_schedule("interleaved_1f1b", 2, 4, 2).actions == \
        make_schedule("interleaved", 2, 4, 2).actions
    assert make_schedule("interleaved", 3, 5).actions == make_schedule("1f1b", 3, 5).actions


@settings(max_examples=8, deadline=None)
@given(p=st.integers(1, 4), m=st.integers(1, 12), t_f=st.sampled_from([0.5, 1.0, 2.0]),
       ratio=st.sampled_from([1.0, 2.0, 3.0]))
def test_gpipe_and_1f1b_bubble_is_the_formula(p, m, t_f, ratio):
    """(p - 1) / (m + p - 1) for t_b = t_f and t_b = 2 t_f (any ratio: the formula has none)."""
    for name in ("gpipe", "1f1b"):
        result = simulate(make_schedule(name, p, m), t_f=t_f, t_b=ratio * t_f)
        assert result.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert result.makespan == pytest.approx((m + p - 1) * t_f * (1 + ratio))
        assert result.busy == pytest.approx([m * t_f * (1 + ratio)] * p)


@settings(max_examples=8, deadline=None)
@given(p=st.integers(2, 4), v=st.integers(2, 3), rounds=st.integers(1, 3),
       extra=st.integers(0, 3), ratio=st.sampled_from([1.0, 2.0]))
def test_interleaved_bubble(p, v, rounds, extra, ratio):
    """What is checked: for every m >= p the schedule accepts (m % p == 0 and the
    generalised rounds), the simulated bubble is exactly (p - 1) / (v m + p - 1), below
    1F1B's (p - 1) / (m + p - 1)."""
    m = rounds * p + extra
    if m % max(1, m // p):
        with pytest.raises(ValueError, match="rounds"):
            make_schedule("interleaved", p, m, v)
        return
    result = simulate(make_schedule("interleaved", p, m, v), t_f=1.0, t_b=ratio)
    assert result.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert result.bubble < simulate(make_schedule("1f1b", p, m), 1.0, ratio).bubble


def test_interleaved_with_fewer_microbatches_than_ranks_runs_no_worse_than_1f1b():
    """m < p is one round (torch's generalisation): it runs, never worse than 1F1B, but
    above the m >= p formula."""
    for p in (2, 3, 4):
        for m in range(1, p):
            inter = simulate(make_schedule("interleaved", p, m, 2)).bubble
            assert inter <= simulate(make_schedule("1f1b", p, m)).bubble + 1e-12
            assert inter > theoretical_bubble("interleaved", p, m, 2)  # the formula needs m >= p


@settings(max_examples=8, deadline=None)
@given(p=st.integers(2, 4), m=st.integers(1, 12),
       times=st.sampled_from([(1.0, 2.0, None), (1.0, 2.0, 0.5), (1.0, 3.0, 1.0),
                              (2.0, 2.0, 1.0)]))
def test_zb_h1_bubble_is_lower_than_1f1b_and_the_formula(p, m, times):
    t_f, t_b, t_w = times
    zb = simulate(make_schedule("zb-h1", p, m), t_f, t_b, t_w)
    one = simulate(make_schedule("1f1b", p, m), t_f, t_b)
    assert zb.bubble < one.bubble
    assert zb.makespan < one.makespan
    if m >= p:
        assert zb.bubble == pytest.approx(theoretical_bubble("zb-h1", p, m, 1, t_f, t_b, t_w))
    # activations held (until W) peak at p, as 1F1B's first rank
    assert max(zb.peak_held) == max(one.peak_in_flight) == min(p, m)


def test_zb_h1_unit_times_bubble_is_a_third_of_1f1b():
    """Qi et al.'s claim with T_F = T_B = T_W: 1F1B idles 3 (p - 1), ZB-H1 (p - 1)."""
    p, m = 4, 8
    zb = simulate(make_schedule("zb-h1", p, m), 1.0, 2.0, 1.0)
    one = simulate(make_schedule("1f1b", p, m), 1.0, 2.0)
    assert one.makespan - 3 * m == 3 * (p - 1)
    assert zb.makespan - 3 * m == p - 1


@settings(max_examples=8, deadline=None)
@given(p=st.integers(1, 4), m=st.integers(1, 12))
def test_memory_1f1b_at_most_p_minus_rank_gpipe_m(p, m):
    one = simulate(make_schedule("1f1b", p, m))
    assert one.peak_in_flight == tuple(min(p - r, m) for r in range(p))
    assert max(one.peak_in_flight) <= p
    assert simulate(make_schedule("gpipe", p, m)).peak_in_flight == (m,) * p
    zb = simulate(make_schedule("zb-h1", p, m))
    assert zb.peak_in_flight == one.peak_in_flight  # B frees as in 1F1B; W may hold longer
    assert all(h <= min(p, m) for h in zb.peak_held)


def test_peak_in_flight_of_interleaved_is_bounded_like_megatron():
    for p, m, v in ((2, 4, 2), (4, 8, 2), (4, 12, 3)):
        peak = simulate(make_schedule("interleaved", p, m, v)).peak_in_flight
        warmups = [(v - 1) * p + 2 * (p - 1 - r) + 1 for r in range(p)]
        assert all(x <= w for x, w in zip(peak, warmups, strict=True)), (peak, warmups)
        assert max(peak) < v * m  # not GPipe's everything


def test_simulate_times():
    result = simulate(make_schedule("gpipe", 2, 2), t_f=1.0, t_b=2.0)
    assert result.starts[0] == (0.0, 1.0, 5.0, 7.0) and result.ends[0] == (1.0, 2.0, 7.0, 9.0)
    assert result.starts[1] == (1.0, 2.0, 3.0, 5.0)
    assert result.makespan == 9.0 and result.bubble == pytest.approx(1 - 12 / 18)
    with_comm = simulate(make_schedule("gpipe", 2, 2), t_f=1.0, t_b=2.0, t_comm=0.5)
    assert with_comm.makespan == 10.0
    assert simulate(make_schedule("1f1b", 1, 3)).bubble == 0.0


def _broken(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    all_actions = list(schedule.actions)
    all_actions[rank] = tuple(actions)
    return schedule._replace(actions=tuple(all_actions))


def test_validate_rejects_broken_schedules():
    good = make_schedule("1f1b", 2, 3)
    r0 = list(good.actions[0])
    cases = {
        "missing": r0[:-1],
        "twice": r0 + [r0[0]],
        "lives on rank 1": r0 + [Action("F", 1, 0)],
        "kind 'W'": r0 + [Action("W", 0, 0)],
        "out of range": r0 + [Action("F", 0, 9)],
    }
    for message, actions in cases.items():
        with pytest.raises(ValueError, match=message):
            validate(_broken(good, 0, actions))
    r1 = list(good.actions[1])  # the last stage: B(1, 0) needs its own F(1, 0)
    with pytest.raises(ValueError, match="rank 1 runs B.*before F\\(stage 1, microbatch 0\\)"):
        validate(_broken(good, 1, [r1[1], r1[0], *r1[2:]]))
    # rank 0 runs B(0, 0) before F(0, 1); rank 1 needs F(1, 1) (from F(0, 1)) before B(1, 0)
    gpipe = make_schedule("gpipe", 2, 2)
    swapped = _broken(gpipe, 0, [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1),
                                 Action("B", 0, 1)])
    with pytest.raises(ValueError, match="deadlocks.*rank 0 at B\\(stage 0, microbatch 0\\) "
                                         "waits for B\\(stage 1, microbatch 0\\); rank 1 at F"):
        validate(swapped)
    zb = make_schedule("zb-h1", 2, 2)
    w_first = [a for a in zb.actions[1] if a.kind == "W"] + \
        [a for a in zb.actions[1] if a.kind != "W"]
    with pytest.raises(ValueError, match="before B"):
        validate(_broken(zb, 1, w_first))
    with pytest.raises(ValueError, match="action lists"):
        validate(good._replace(actions=good.actions[:1]))


def test_make_schedule_errors():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'.*1f1b"):
        make_schedule("pipedream", 2, 4)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n_microbatches must be an int >= 1"):
            make_schedule("1f1b", 2, bad)
    with pytest.raises(ValueError, match="n_ranks must be"):
        make_schedule("gpipe", 0, 4)
    with pytest.raises(ValueError, match="n_virtual must be"):
        make_schedule("interleaved", 2, 4, 0)
    for name in ("1f1b", "zb-h1"):
        with pytest.raises(ValueError, match="one stage per rank; n_virtual=2"):
            make_schedule(name, 2, 4, 2)
    with pytest.raises(ValueError, match="m=7 is not a multiple of its 3 rounds.*valid m"):
        make_schedule("interleaved", 2, 7, 2)
    assert interleaved_round(4, 8) == 4 and interleaved_round(4, 10) == 5
    assert interleaved_round(4, 3) == 3


def test_simulate_errors_and_formula_names():
    with pytest.raises(ValueError, match="t_w"):
        simulate(make_schedule("zb-h1", 2, 2), t_b=2.0, t_w=2.0)
    with pytest.raises(ValueError, match="t_f and t_b must be > 0"):
        simulate(make_schedule("1f1b", 2, 2), t_f=0.0)
    with pytest.raises(ValueError, match="unknown schedule"):
        theoretical_bubble("pipedream", 2, 4)


def _torch_order(cls_name: str, p: int, m: int, v: int) -> list[list[str]] | None:
    """torch's order per rank for schedule class ``cls_name`` (its idle slots dropped),
    computed by its own per-rank method on a stand-in (no process group); None if torch
    lacks it."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    method = getattr(getattr(schedules, cls_name, None), "_calculate_single_rank_operations",
                     None)
    if method is None:
        return None
    rounds = max(1, m // p)
    holder = type("Stand", (), {"n_local_stages": v, "pp_group_size": p,
                                "microbatches_per_round": m // rounds, "_n_microbatches": m})
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B",
             "BACKWARD_WEIGHT": "W"}
    return [[f"{kinds[a.computation_type.name]}{a.stage_index}.{a.microbatch_index}"
             for a in method(holder(), r) if a is not None] for r in range(p)]


@pytest.mark.parametrize(("name", "cls_name", "v"), [
    ("interleaved", "ScheduleInterleaved1F1B", 2), ("interleaved", "ScheduleInterleaved1F1B", 3),
    ("zb-h1", "ScheduleInterleavedZeroBubble", 1)])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_order_is_torchs(name, cls_name, v, p):
    """Action for action, every rank's order is torch's (interleaved: ScheduleInterleaved1F1B;
    zb-h1: ScheduleInterleavedZeroBubble with one stage per rank, its ZB-H1 order), so a
    step-time gap between the two is not the order."""
    for m in range(1, 9):
        if name == "interleaved" and m % max(1, m // p):
            continue
        theirs = _torch_order(cls_name, p, m, v)
        if theirs is None:
            pytest.skip(f"torch's {cls_name} has no per-rank order method")
        ours = make_schedule(name, p, m, v)
        assert [_show(ours, r) for r in range(p)] == theirs, (p, m, v)


def test_kinds_are_enums_that_read_as_their_strings():
    """Schedules and message lists hold enum members; each one compares, hashes, prints
    and pickles as its string, so hand-written string schedules and keys still work."""
    assert set(get_args(ScheduleName)) == set(SCHEDULES)
    schedule = make_schedule("zb-h1", 2, 2)
    kinds = {a.kind for actions in schedule.actions for a in actions}
    assert kinds == set(ActionKind) and all(type(k) is ActionKind for k in kinds)
    owed, expected = message_lists(schedule, 0)
    assert all(type(key[0]) is MessageKind for key, _ in owed + expected)
    key = (MessageKind.ACT, 0, 1)
    assert {("act", 0, 1): 5}[key] == 5 and key == ("act", 0, 1)
    assert repr(key) == "('act', 0, 1)" and f"{ActionKind.W}{3}" == "W3"
    assert pickle.loads(pickle.dumps(key))[0] is MessageKind.ACT
    assert int(Status.ERROR) == 1 and MessageKind("grad") is MessageKind.GRAD
    hand_written = schedule._replace(actions=tuple(
        tuple(Action(str(a.kind.value), a.stage, a.microbatch) for a in actions)
        for actions in schedule.actions))
    assert simulate(hand_written) == simulate(schedule)
