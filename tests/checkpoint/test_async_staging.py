"""Async saves reuse their staging buffers, and every checkpoint holds its own values.

Two async saves in a row, the second started before the first is waited for,
with the state changed in place after each: the second copies into the same
CPU buffers as the first (no allocation), only once the first has finished,
so each checkpoint loads the values at its own call. New shapes get new
buffers; ``release_staging`` frees them.
"""

from __future__ import annotations

import torch

import shardfn.checkpoint as ck
from shardfn.checkpoint import _staging


def _state(v: float):
    return {"w": torch.full((64, 8), v), "opt": {"m": torch.full((9,), -v)}, "step": int(v)}


def test_second_async_save_reuses_buffers_and_keeps_each_value(tmp_path):
    import time

    ck.release_staging()
    state = _state(1.0)
    calls = []

    def slow_first_write(event, **info):  # the first save is still writing its buffers
        if event == "write_file" and not calls:
            calls.append(info["name"])
            time.sleep(0.3)

    with ck._hooks.installed(slow_first_write):
        _two_saves(tmp_path, state)
    assert calls == ["__0_0.distcp"]


def _two_saves(tmp_path, state):
    first = ck.save(str(tmp_path / "one"), state, async_=True)
    pointers = [b.data_ptr() for b in _staging._KEPT[0][1]]
    state["w"].add_(1.0)  # the step goes on, in place: now _state(2.0)
    state["opt"]["m"].sub_(1.0)
    state["step"] = 2
    second = ck.save(str(tmp_path / "two"), state, async_=True)  # the first still pending
    assert [b.data_ptr() for b in _staging._KEPT[0][1]] == pointers  # the same buffers
    for x in (state["w"], state["opt"]["m"]):
        x.mul_(10.0)
    assert second.wait() == str(tmp_path / "two") and first.done()
    torch.testing.assert_close(ck.load(first.path, _state(0.0)), _state(1.0))
    torch.testing.assert_close(ck.load(second.path, _state(0.0)), _state(2.0))


def test_new_shapes_get_new_buffers_and_release_frees_them(tmp_path):
    ck.release_staging()
    ck.save(str(tmp_path / "a"), _state(1.0), async_=True).wait()
    kept = _staging._KEPT[0][1]
    other = {"w": torch.ones(3, 3)}
    ck.save(str(tmp_path / "b"), other, async_=True).wait()
    assert len(_staging._KEPT) == 1 and _staging._KEPT[0][1][0].shape == (3, 3)
    assert all(k.shape != (3, 3) for k in kept)
    torch.testing.assert_close(ck.load(str(tmp_path / "b"), {"w": torch.zeros(3, 3)}), other)
    ck.release_staging()
    assert _staging._KEPT == []
