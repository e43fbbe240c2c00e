"""Pipeline timelines: recording, Chrome trace, PNG, measured bubble (synthetic and simulated)."""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardfn.transforms.pipeline.report import Event
from shardfn.transforms.pipeline.schedules import make_schedule
from shardfn.transforms.pipeline.simulate import simulate
from shardfn.transforms.pipeline.timeline import (
    Timeline,
    TimelineEvent,
    from_actions,
    from_simulation,
    gather_events,
    measured_bubble,
    plot,
    to_chrome_trace,
)


def test_record_span_and_order():
    tl = Timeline()
    tl.record(1, "B", 1, 0, 2.0, 3.0)
    tl.record(0, "F", 0, 0, 0.0, 1.0)
    tl.record(1, "recv", 1, 0, 1.0, 1.5, peer=0)
    with tl.span(0, "W", 0, 2):
        pass
    events = tl.events
    assert [e.kind for e in events[:3]] == ["F", "recv", "B"]
    assert events[1].peer == 0 and events[3].kind == "W" and events[3].end >= events[3].start
    with pytest.raises(RuntimeError), tl.span(0, "F", 0, 5):
        raise RuntimeError("stage failed")
    assert tl.events[-1].microbatch == 5  # recorded although the body raised
    tl.clear()
    assert tl.events == ()


def test_disabled_records_nothing_and_bad_events_are_refused():
    off = Timeline(enabled=False)
    off.record(0, "F", 0, 0, 0.0, 1.0)
    off.record(0, "nonsense", 0, 0, 1.0, 0.0)  # not even checked: disabled costs nothing
    with off.span(0, "F", 0, 0):
        pass
    assert off.events == ()
    on = Timeline()
    with pytest.raises(ValueError, match="kind must be one of.*got 'X' \\(rank 2, stage 3"):
        on.record(2, "X", 3, 1, 0.0, 1.0)
    with pytest.raises(ValueError, match="B of stage 1, microbatch 4 on rank 0 ends"):
        on.record(0, "B", 1, 4, 2.0, 1.0)


def test_thread_safe():
    tl = Timeline()

    def work(rank):
        for i in range(500):
            tl.record(rank, "F", rank, i, float(i), i + 0.5)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tl.events) == 2000
    assert {(e.rank, e.microbatch) for e in tl.events} == {(r, i) for r in range(4)
                                                           for i in range(500)}


def test_measured_bubble_on_synthetic_events():
    ev = [TimelineEvent(0, "F", 0, 0, 10.0, 11.0), TimelineEvent(0, "B", 0, 0, 13.0, 15.0),
          TimelineEvent(1, "F", 1, 0, 11.0, 12.0), TimelineEvent(1, "B", 1, 0, 12.0, 13.0),
          TimelineEvent(1, "recv", 1, 0, 10.0, 11.0), TimelineEvent(0, "recv", 0, 0, 11.0, 13.0)]
    # span 10..15 = 5 s x 2 ranks; busy 3 + 2 = 5 s; waits are idle
    assert measured_bubble(ev) == pytest.approx(0.5)
    assert measured_bubble(ev, n_ranks=3) == pytest.approx(1 - 5 / 15)
    # overlapping spans on one rank count once
    assert measured_bubble(ev + [TimelineEvent(0, "F", 0, 1, 10.5, 11.0)]) == pytest.approx(0.5)
    assert measured_bubble([TimelineEvent(0, "F", 0, 0, 1.0, 2.0)]) == 0.0
    with pytest.raises(ValueError, match="no compute"):
        measured_bubble([TimelineEvent(0, "recv", 0, 0, 0.0, 1.0)])


@settings(max_examples=8, deadline=None)
@given(name=st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1"]), p=st.integers(1, 4),
       m=st.integers(1, 8), t_b=st.sampled_from([1.0, 2.0, 3.0]))
def test_simulated_timeline_gives_the_simulated_bubble(name, p, m, t_b):
    v = 2 if name == "interleaved" and m % max(1, m // p) == 0 else 1
    schedule = make_schedule(name, p, m, v)
    result = simulate(schedule, t_f=1.0, t_b=t_b)
    events = from_simulation(schedule, result)
    assert measured_bubble(events) == pytest.approx(result.bubble, abs=1e-12)
    # shifting the clock (another process's origin) changes nothing
    shifted = [e._replace(start=e.start + 1e4, end=e.end + 1e4) for e in events]
    assert measured_bubble(shifted) == pytest.approx(result.bubble, abs=1e-9)


def test_gpipe_simulated_bubble_is_the_formula_through_the_timeline():
    for p, m in ((2, 4), (4, 8)):
        schedule = make_schedule("gpipe", p, m)
        events = from_simulation(schedule, simulate(schedule, t_f=1.0, t_b=2.0))
        assert measured_bubble(events) == pytest.approx((p - 1) / (m + p - 1))


def test_from_actions_splits_the_receive_wait():
    events = from_actions(1, [Event("F", 1, 0, 0.0, 3.0, 1.0),
                              Event("B", 1, 0, 3.0, 4.0, 0.0)], offset=100.0)
    assert events == [TimelineEvent(1, "recv", 1, 0, 100.0, 101.0),
                      TimelineEvent(1, "F", 1, 0, 101.0, 103.0),
                      TimelineEvent(1, "B", 1, 0, 103.0, 104.0)]
    assert measured_bubble(events) == 0.0


def test_chrome_trace(tmp_path):
    schedule = make_schedule("1f1b", 2, 3)
    events = from_simulation(schedule, simulate(schedule))
    events.append(TimelineEvent(1, "recv", 1, 0, 0.0, 1.0, peer=0))
    path = tmp_path / "trace.json"
    trace = to_chrome_trace(events, path)
    assert json.loads(path.read_text()) == trace
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(events)
    assert {e["pid"] for e in spans} == {0, 1}
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"]
             if e["name"] == "process_name"}
    assert names == {(0, "pp rank 0"), (1, "pp rank 1")}
    b = next(e for e in spans if e["pid"] == 1 and e["name"] == "B2")
    # rank 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7] F2 [7,8] (F(0, 2) ends at 7) B2 [8,10]
    assert b["ts"] == pytest.approx(8e6) and b["dur"] == pytest.approx(2e6)
    wait = next(e for e in spans if e["tid"] == 1)
    assert wait["cat"] == "recv wait" and wait["args"]["peer"] == 0
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in spans)


def test_plot_writes_a_png_with_one_row_per_rank(tmp_path):
    matplotlib_image = pytest.importorskip("matplotlib.image")
    schedule = make_schedule("zb-h1", 4, 6)
    events = from_simulation(schedule, simulate(schedule, 1.0, 2.0, 1.0))
    events.append(TimelineEvent(3, "recv", 3, 0, 0.0, 3.0, peer=2))
    path = plot(events, tmp_path / "timeline.png")
    image = matplotlib_image.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 500
    small = plot(events[:3], tmp_path / "small.png", title="three events", n_ranks=4)
    assert small.stat().st_size > 1000


def test_gather_events_single_process_sorts():
    events = [TimelineEvent(1, "F", 1, 0, 2.0, 3.0), TimelineEvent(0, "F", 0, 0, 1.0, 2.0)]
    assert [e.rank for e in gather_events(events)] == [0, 1]


def test_gather_events_over_two_ranks(worlds):
    def on_rank():
        import torch.distributed as dist

        from shardfn.transforms.pipeline.timeline import TimelineEvent, gather_events

        r = dist.get_rank()
        return gather_events([TimelineEvent(r, "F", r, 0, float(r), r + 1.0)])

    results = worlds(2).run(on_rank)
    assert results[0] == results[1] == [TimelineEvent(0, "F", 0, 0, 0.0, 1.0),
                                        TimelineEvent(1, "F", 1, 0, 1.0, 2.0)]


def test_a_real_pipeline_step_through_the_timeline(worlds):
    """The runtime's StepReport -> from_actions -> gather_events: every action of every rank
    once, compute spans inside the step, a bubble in [0, 1), and the Chrome trace and PNG."""

    def on_rank():
        import torch
        import torch.distributed as dist
        from torch import nn

        import shardfn as sf
        from shardfn.transforms.pipeline import pipeline_stages
        from shardfn.transforms.pipeline.timeline import from_actions, gather_events

        torch.manual_seed(0)
        units = [nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4)]
        pp = pipeline_stages(units, sf.Mesh({"pp": 2}), "pp", balance=[2, 2],
                             schedule="zb-h1", microbatches=4,
                             loss_fn=lambda out, t: ((out - t) ** 2).mean())
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        _, _, report = pp.value_and_grad(pp.init(0), x, y, report=True)
        events = from_actions(dist.get_rank(), report.events, offset=report.start)
        return gather_events(events), report.start

    (events, start0), (events1, start1) = worlds(2).run(on_rank)
    assert events == events1
    schedule = make_schedule("zb-h1", 2, 4)
    for rank in (0, 1):
        ran = [(e.kind, e.stage, e.microbatch) for e in events
               if e.rank == rank and e.kind in "FBW"]
        assert ran == [tuple(a) for a in schedule.actions[rank]]  # in the schedule's order
    assert all(e.start >= min(start0, start1) for e in events)
    assert 0.0 <= measured_bubble(events) < 1.0
    trace = to_chrome_trace(events)
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
