"""The flat collectives of traced ZeRO code (``shardfn.primitives._comm_traced``).

On a gloo group they run as one ``all_to_all_single`` each (gloo's reduce-scatter is an
all-reduce of the whole tensor); they must give what ``_comm.psum_scatter`` /
``_comm.all_gather`` give, bit for bit on 2 ranks, for any block size (0 included),
and refuse a tensor they cannot split with the axis in the message.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st


def _on_rank(blocks: list[int]) -> dict:
    import shardfn as sf
    from shardfn.primitives import _comm, _comm_traced

    mesh = sf.Mesh({"dp": 2})
    ax = _comm.resolve("dp", mesh)
    out = {"pairwise": _comm_traced._pairwise(ax.group_name, "cpu"), "same": [], "want": []}
    for k in blocks:
        xs = [torch.randn(2 * k, generator=torch.Generator().manual_seed(10 * k + r))
              for r in range(2)]
        x = xs[ax.index]
        mine = _comm_traced.psum_scatter_flat(x, ax)
        full = _comm_traced.all_gather_flat(mine, ax)
        out["same"].append(torch.equal(mine, _comm.psum_scatter(x, ax, 0))
                           and torch.equal(full, _comm.all_gather(mine, ax, 0)))
        block = slice(ax.index * k, (ax.index + 1) * k)
        out["want"].append(torch.equal(mine, xs[0][block] + xs[1][block]))
    # every block's collectives in flight at once (how the traced ZeRO steps issue them):
    # each result is still its own
    issued = [_comm_traced.psum_scatter_flat_start(x.repeat(2) if k else x, ax)
              for k, x in zip(blocks, [torch.full((2 * k,), float(k + ax.index))
                                       for k in blocks], strict=True)]
    gathers = [_comm_traced.all_gather_flat_start(torch.full((k,), float(ax.index)), ax)
               for k in blocks]
    out["in_flight"] = [
        torch.equal(_comm_traced.wait_flat(p), torch.full((2 * k if k else 0,), 2.0 * k + 1))
        and torch.equal(_comm_traced.wait_flat(g), torch.arange(2.0).repeat_interleave(k))
        for k, p, g in zip(blocks, issued, gathers, strict=True)]
    try:
        _comm_traced.psum_scatter_flat(torch.zeros(3), ax)
        out["refused"] = None
    except ValueError as error:
        out["refused"] = str(error)
    return out


@settings(max_examples=4, deadline=None)
@given(blocks=st.lists(st.integers(0, 300), min_size=1, max_size=4))
def test_flat_collectives_equal_the_functional_ones_bitwise(worlds, blocks):
    for got in worlds(2).run(_on_rank, blocks):
        assert got["pairwise"], "the local world is gloo: the all-to-all path must run"
        assert all(got["same"]) and all(got["want"]) and all(got["in_flight"]), got
        assert got["refused"] and "'dp'" in got["refused"] and "(3,)" in got["refused"]


def test_one_rank_needs_no_group():
    from shardfn.primitives import _comm, _comm_traced

    ax = _comm.Axis(("dp",), 1, 0, None, (0,))
    x = torch.arange(4.0)
    assert torch.equal(_comm_traced.psum_scatter_flat(x, ax), x)
    assert torch.equal(_comm_traced.all_gather_flat(x, ax), x)
