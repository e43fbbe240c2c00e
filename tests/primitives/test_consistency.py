"""Check mode: ranks that disagree raise ConsistencyError on every rank, agreeing ranks pass.

The checks are called directly (as the collectives and transforms call them) on
the local world: matching calls, then one rank with another dtype, shape, op,
permutation, tree or an extra call, values that differ (a per-rank seed), and
the same inside ``torch.func.grad``'s backward, ``vmap`` and plain autograd.
Each rank function turns check mode on with a short timeout and restores the
setting after, and renumbers the checks (``reset``) so that a failing case does
not offset the next one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardfn.primitives import consistency

TIMEOUT_S = 2.0


# ---------------------------------------------------------------- helpers (run on each rank)


def _checked(body, *args, check_timeout: float = TIMEOUT_S, enable: bool = True):
    """Run ``body(rank, ax, *args)`` in check mode; ``("ok", value)`` or ``("error", message)``."""
    import torch.distributed as dist

    import shardfn as sf
    from shardfn.primitives import consistency as c
    from shardfn.primitives._comm import resolve

    was_on, was_timeout = c.enabled(), c.check_timeout()
    c.reset()
    c.check_consistency(enable, timeout=check_timeout)
    try:
        mesh = sf.Mesh({"x": dist.get_world_size()})
        ax = resolve("x", mesh)
        return ("ok", body(dist.get_rank(), ax, *args))
    except c.ConsistencyError as error:
        return ("error", str(error))
    finally:
        c.check_consistency(was_on, timeout=was_timeout)
        c.reset()


def _errors(results: list) -> list[str]:
    """Every rank's message; fails unless every rank raised ConsistencyError."""
    assert all(kind == "error" for kind, _ in results), results
    return [message for _, message in results]


def _same_error_everywhere(results: list, *needles: str) -> str:
    messages = _errors(results)
    assert len(set(messages)) == 1, messages  # every rank raises the same message
    for needle in needles:
        assert needle in messages[0], messages[0]
    return messages[0]


# ---------------------------------------------------------------- check_call


def _matching_calls(rank, ax):
    x = torch.ones(4, 3)
    consistency.check_call("psum", ax, x)
    consistency.check_call("all_gather", ax, {"a": x, "b": [x[0], 2]}, dim=0)
    consistency.check_call("ppermute", ax, x, perm=((0, 1), (1, 0)))
    consistency.check_call("shard_params.apply", ax, ((x,), {"train": True}))
    consistency.check_call("barrier", ax)
    # call sites may differ between ranks: they are shown, not compared
    if rank == 0:
        consistency.check_call("psum", ax, x)
    else:
        consistency.check_call("psum", ax, x)
    return "done"


@pytest.mark.parametrize("n", [2, 3])
def test_matching_calls_pass(worlds, n):
    assert worlds(n).run(_checked, _matching_calls) == [("ok", "done")] * n


def _dtype_mismatch(rank, ax):
    consistency.check_call("psum", ax, torch.ones(4, 3))  # one good call first: #1
    x = torch.ones(4, 3, dtype=torch.int32 if rank == ax.size - 1 else torch.float32)
    consistency.check_call("psum", ax, x)
    return "no error"


@pytest.mark.parametrize("n", [2, 3])
def test_dtype_mismatch_raises_on_every_rank(worlds, n):
    message = _same_error_everywhere(
        worlds(n).run(_checked, _dtype_mismatch),
        "ranks of axis 'x'", "disagree at collective #2",
        "rank 0: psum(float32[4, 3]) at ", f"rank {n - 1}: psum(int32[4, 3]) at ",
        "test_consistency.py:", "in _dtype_mismatch",
        "in the tensor (float32[4, 3] vs int32[4, 3])",
    )
    assert message.count("\n  rank ") == n  # one line per rank


def _shape_mismatch(rank, ax):
    consistency.check_call("all_gather", ax, torch.ones(rank + 2, 3), dim=0)


def test_shape_mismatch(worlds):
    _same_error_everywhere(worlds(2).run(_checked, _shape_mismatch),
                           "rank 0: all_gather(float32[2, 3], dim=0)",
                           "rank 1: all_gather(float32[3, 3], dim=0)")


def _op_mismatch(rank, ax):
    consistency.check_call("psum" if rank == 0 else "all_gather", ax, torch.ones(2))


def test_different_op(worlds):
    _same_error_everywhere(worlds(2).run(_checked, _op_mismatch), "differs from rank 0 in the op",
                           "rank 0: psum(float32[2])", "rank 1: all_gather(float32[2])")


def _perm_mismatch(rank, ax):
    perm = ((0, 1), (1, 2), (2, 0)) if rank != 1 else ((0, 2), (2, 1), (1, 0))
    consistency.check_call("ppermute", ax, torch.ones(2), perm=perm)


def test_different_perm(worlds):
    message = _same_error_everywhere(worlds(3).run(_checked, _perm_mismatch),
                                     "rank 1 differs from rank 0 in argument perm=",
                                     "rank 1: ppermute(float32[2], perm=((0, 2), (2, 1), (1, 0)))")
    assert "rank 2: ppermute(float32[2], perm=((0, 1), (1, 2), (2, 0)))" in message


def _tree_mismatch(rank, ax):
    tree = {"a": torch.ones(2), "b": torch.ones(3)} if rank == 0 else {"a": torch.ones(2)}
    consistency.check_call("psum", ax, tree)


def test_tree_structure_mismatch(worlds):
    _same_error_everywhere(worlds(2).run(_checked, _tree_mismatch), "in the tree structure",
                           "rank 0: psum({a: float32[2], b: float32[3]})",
                           "rank 1: psum({a: float32[2]})")


def _extra_call_then_other(rank, ax):
    x = torch.ones(2)
    consistency.check_call("psum", ax, x)
    if rank == 1:
        consistency.check_call("psum", ax, x)  # the extra call
    consistency.check_call("all_gather", ax, x, dim=0)


def test_extra_call_is_caught_at_the_next_check(worlds):
    _same_error_everywhere(worlds(2).run(_checked, _extra_call_then_other),
                           "disagree at collective #2", "rank 0: all_gather(float32[2], dim=0)",
                           "rank 1: psum(float32[2])")


def _extra_call_at_the_end(rank, ax):
    x = torch.ones(2)
    consistency.check_call("psum", ax, x)
    if rank == 1:
        consistency.check_call("psum", ax, torch.ones(5))  # nobody else comes
    return "finished"


def test_extra_call_times_out_naming_the_missing_rank(worlds):
    results = worlds(2).run(_checked, _extra_call_at_the_end, check_timeout=0.5)
    assert results[0] == ("ok", "finished")
    kind, message = results[1]
    assert kind == "error"
    assert "timed out after 0.5 s at collective #2" in message
    assert "rank 0 never reached collective #2 (psum over 'x' at " in message
    assert "its last checked call was #1: psum(float32[2]) at " in message
    assert "rank 1 arrived: psum(float32[5])" in message
    assert "in _extra_call_at_the_end" in message


def _one_rank_skips(rank, ax):
    consistency.check_call("psum", ax, torch.ones(2))
    if rank != 2:  # rank 2 skips the all_gather (e.g. it raised before it)
        consistency.check_call("all_gather", ax, torch.ones(2), dim=0)
    return "finished"


def test_skipped_call_on_three_ranks_names_the_missing_one(worlds):
    results = worlds(3).run(_checked, _one_rank_skips, check_timeout=0.5)
    assert results[2] == ("ok", "finished")
    for kind, message in results[:2]:
        assert kind == "error"
        assert "rank 2 never reached collective #2 (all_gather over 'x' at " in message
        assert "its last checked call was #1: psum(float32[2])" in message
        for r in (0, 1):  # the other may have timed out first: it then says so
            assert re.search(rf"rank {r} arrived(, then gave up waiting)?: all_gather\("
                             r"float32\[2\], dim=0\)", message), message


def _late_rank_after_timeout(rank, ax):
    """Rank 0 times out at #1 (it takes the call back); the next calls still pair up."""
    import time

    x = torch.ones(2)
    if rank == 0:
        try:
            consistency.check_call("psum", ax, x)
        except consistency.ConsistencyError:
            pass
        consistency.check_consistency(True, timeout=5.0)
        consistency.check_call("all_gather", ax, x, dim=0)
    else:
        time.sleep(1.0)
        consistency.check_call("all_gather", ax, x, dim=0)
    return "paired"


def test_a_timed_out_call_is_taken_back(worlds):
    results = worlds(2).run(_checked, _late_rank_after_timeout, check_timeout=0.3)
    assert results == [("ok", "paired")] * 2


def _gave_up_and_left(rank, ax):
    """Rank 0 times out at #1 and makes no other call; rank 1 comes late: it must not pair
    with the call rank 0 gave up on. Rank 1 starts only once rank 0 has given up (a key in
    the store), so a loaded machine cannot make the two calls meet in time."""
    import uuid

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    key = [uuid.uuid4().hex]
    dist.broadcast_object_list(key, src=0)  # one key per run: the world persists
    store = distributed_c10d._get_default_store()
    if rank == 1:
        store.wait([f"late/{key[0]}"])
    try:
        consistency.check_call("psum", ax, torch.ones(2))
    except consistency.ConsistencyError as error:
        return str(error)
    finally:
        if rank == 0:
            store.set(f"late/{key[0]}", "gave up")
    return "paired with a call taken back"


def test_a_late_rank_does_not_pair_with_a_call_taken_back(worlds):
    results = worlds(2).run(_checked, _gave_up_and_left, check_timeout=0.3)
    assert "rank 1 never reached collective #1" in results[0][1]
    assert "rank 0 arrived, then gave up waiting: psum(float32[2])" in results[1][1]


def _one_axis_of_two(rank, ax):
    import shardfn as sf
    from shardfn.primitives._comm import resolve

    mesh = sf.Mesh({"a": 2, "b": 2})
    # groups {0,1} and {2,3} over "b" are numbered apart; rank 3 disagrees only with rank 2
    b = resolve("b", mesh)
    consistency.check_call("psum", b, torch.ones(2, dtype=torch.int64 if rank == 3 else None))
    return "b ok"


def test_groups_are_checked_apart(worlds):
    results = worlds(4).run(_checked, _one_axis_of_two)
    assert results[:2] == [("ok", "b ok")] * 2
    messages = _errors(results[2:])
    assert messages[0] == messages[1]
    assert "axis 'b' (ranks [2, 3])" in messages[0] and "rank 3: psum(int64[2])" in messages[0]


def _objects_and_big_trees(rank, ax):
    from torch.distributed import distributed_c10d

    class Config:  # default repr "<...Config object at 0x...>": the address differs per rank
        pass

    tree = {f"w{i}": torch.ones(2, i % 3) for i in range(500)}
    consistency.check_call("shard_params.apply", ax, ((tree, Config()), {"fn": _checked}))
    store = distributed_c10d._get_default_store()
    posted = store.get(f"sfcheck/{consistency._EPOCH[0]}/0,1/0/{rank}")
    return len(posted)


def test_object_addresses_are_not_compared_and_big_trees_post_little(worlds):
    results = worlds(2).run(_checked, _objects_and_big_trees)
    assert [kind for kind, _ in results] == ["ok", "ok"], results
    assert all(size < 1000 for _, size in results), results  # a digest, not 500 leaves


def _big_tree_mismatch(rank, ax):
    tree = {f"w{i}": torch.ones(2, 3) for i in range(50)}
    if rank == 1:
        tree["w37"] = torch.ones(2, 4)
    consistency.check_call("pmean", ax, tree)


def test_big_tree_mismatch_names_the_leaf(worlds):
    _same_error_everywhere(worlds(2).run(_checked, _big_tree_mismatch),
                           "in leaf 'w37' (float32[2, 3] vs float32[2, 4])", "... 46 more")


# ---------------------------------------------------------------- under torch.func and autograd


def _checked_identity():
    class CheckedIdentity(torch.autograd.Function):
        """Identity whose forward and backward each run a check (as a collective does)."""

        generate_vmap_rule = True

        @staticmethod
        def forward(x, ax, backward_tag):
            consistency.check_call("f.forward", ax, x)
            return x.clone()

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.ax, ctx.backward_tag = inputs[1], inputs[2]

        @staticmethod
        def backward(ctx, grad):
            consistency.check_call("f.backward", ctx.ax, grad, tag=ctx.backward_tag)
            return grad * 2, None, None

    return CheckedIdentity


def _under_transforms(rank, ax, bad_backward):
    fn = _checked_identity()
    tag = rank if bad_backward else 0
    x = torch.arange(3.0)
    g_func = torch.func.grad(lambda x: fn.apply(x, ax, tag).sum())(x)
    _, vjp = torch.func.vjp(lambda x: fn.apply(x, ax, tag), x)
    (g_vjp,) = vjp(torch.ones(3))
    leaf = x.clone().requires_grad_()
    fn.apply(leaf, ax, tag).sum().backward()
    batched = torch.func.vmap(lambda row: fn.apply(row, ax, tag))(torch.ones(5, 3))
    return [g_func.tolist(), g_vjp.tolist(), leaf.grad.tolist(), tuple(batched.shape)]


def test_checks_in_forward_and_backward_under_torch_func(worlds):
    results = worlds(2).run(_checked, _under_transforms, False)
    assert results == [("ok", [[2.0] * 3, [2.0] * 3, [2.0] * 3, (5, 3)])] * 2


def test_mismatch_in_backward_under_grad_raises_on_every_rank(worlds):
    _same_error_everywhere(worlds(2).run(_checked, _under_transforms, True),
                           "disagree at collective #2", "argument tag= (0 vs 1)",
                           "rank 0: f.backward(float32[3], tag=0) at ",
                           "rank 1: f.backward(float32[3], tag=1) at ",
                           "in backward")  # user code: the Function's own backward


def _vmap_per_example_shapes(rank, ax):
    def body(row):
        consistency.check_call("psum", ax, row)
        return row * 2

    # the batch size may differ (it is not what the collective sees); the per-example shape not
    torch.func.vmap(body)(torch.ones(rank + 2, 3))
    torch.func.vmap(body)(torch.ones(4, 3 + rank))


def test_vmap_compares_per_example_shapes(worlds):
    _same_error_everywhere(worlds(2).run(_checked, _vmap_per_example_shapes),
                           "disagree at collective #2", "rank 0: psum(float32[3])",
                           "rank 1: psum(float32[4])")


# ---------------------------------------------------------------- check_replicated


def _replicated(rank, ax, seeds):
    torch.manual_seed(seeds[rank])
    params = {"fc": {"w": torch.randn(3, 2), "b": torch.zeros(3)}, "scale": torch.tensor(1.0),
              "step": 3}
    params["fc"]["w"].requires_grad_()
    consistency.check_replicated("shard_params.init params", ax, params)
    return "same"


def test_replicated_values_pass(worlds):
    assert worlds(3).run(_checked, _replicated, [7, 7, 7]) == [("ok", "same")] * 3


def test_different_seeds_raise_on_every_rank(worlds):
    message = _same_error_everywhere(
        worlds(3).run(_checked, _replicated, [7, 7, 8]),
        "shard_params.init params must be the same on every rank of axis 'x'",
        "1 of 4 leaves differ, the first is 'fc.w'", "same seed",
        "rank 2: shard_params.init params at ", "in _replicated")
    assert "ranks [0, 1] hold value" in message and "ranks [2] hold value" in message


def _replicated_under_grad(rank, ax):
    def loss(w):
        consistency.check_replicated("weights", ax, {"w": w})
        return (w * (rank + 1)).sum()

    return torch.func.grad(loss)(torch.ones(2) * (1 + (rank == 1) * 1e-7)).tolist()


def test_replicated_sees_through_functorch_wrappers(worlds):
    # 1 + 1e-7 rounds to the next float32 above 1: one ulp apart is caught
    _same_error_everywhere(worlds(2).run(_checked, _replicated_under_grad),
                           "weights must be the same", "the first is 'w'")


def _replicated_structure_differs(rank, ax):
    consistency.check_replicated("opt state", ax, [torch.zeros(2)] * (rank + 1))


def test_replicated_with_another_tree_reports_the_tree(worlds):
    _same_error_everywhere(worlds(2).run(_checked, _replicated_structure_differs),
                           "disagree at check #1", "in the tree structure")


# ---------------------------------------------------------------- off mode, costs, threads, env


def _off_mode(rank, ax):
    from torch.distributed import distributed_c10d

    consistency.check_call("psum" if rank else "all_gather", ax, torch.ones(rank + 1))
    torch.manual_seed(rank)
    consistency.check_replicated("params", ax, torch.randn(3))
    store = distributed_c10d._get_default_store()
    return [k for k in ("0", "1") if store.check([f"sfcheck/{consistency._EPOCH[0]}/0,1/0/{k}"])]


def test_off_mode_does_nothing(worlds):
    assert worlds(2).run(_checked, _off_mode, enable=False) == [("ok", [])] * 2


def _old_keys_deleted(rank, ax):
    from torch.distributed import distributed_c10d

    for _ in range(5):
        consistency.check_call("psum", ax, torch.ones(2))
    store = distributed_c10d._get_default_store()
    prefix = f"sfcheck/{consistency._EPOCH[0]}/0,1"
    return [store.check([f"{prefix}/{seq}/{rank}"]) for seq in range(5)]


def test_each_rank_deletes_its_old_keys(worlds):
    # call 4's key stays until call 5 is read by this rank; the others are gone
    assert worlds(2).run(_checked, _old_keys_deleted) == [("ok", [False] * 4 + [True])] * 2


def _no_comm_stats(rank, ax):
    import shardfn as sf

    sf.reset_comm_stats()
    consistency.check_call("psum", ax, torch.ones(100))
    consistency.check_replicated("params", ax, torch.ones(100))
    return sf.comm_stats().total_calls, sf.comm_stats().total_bytes


def test_checks_are_not_counted_as_communication(worlds):
    assert worlds(2).run(_checked, _no_comm_stats) == [("ok", (0, 0))] * 2


def _suspended_thread(rank, ax):
    with consistency.suspended():
        consistency.check_call("psum" if rank else "all_gather", ax, torch.ones(2))
    consistency.check_call("psum", ax, torch.ones(2))  # still call #1 for both
    return consistency._SEQ[ax.ranks]


def test_suspended_skips_checks_on_this_thread(worlds):
    assert worlds(2).run(_checked, _suspended_thread) == [("ok", 1)] * 2


def _helper_thread(rank, ax):
    import threading

    errors = []

    def helper():
        try:  # a shardfn helper thread: skipped, though the ranks disagree
            consistency.check_call("psum" if rank else "all_gather", ax, torch.ones(2))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(repr(error))

    thread = threading.Thread(target=helper, name="shardfn-test-helper")
    thread.start()
    thread.join()
    return errors, consistency._SEQ.get(ax.ranks, 0)


def test_shardfn_helper_threads_do_not_check(worlds):
    assert worlds(2).run(_checked, _helper_thread) == [("ok", ([], 0))] * 2


def test_one_rank_axis_and_no_process_group_are_free(worlds):
    from shardfn.primitives._comm import Axis

    was = consistency.enabled()
    consistency.check_consistency(True)
    try:  # no process group in the test process: nothing to compare with
        consistency.check_call("psum", Axis(("x",), 1, 0, None, (0,)), torch.ones(2))
        consistency.check_call("psum", Axis(("x",), 2, 0, None, (0, 1)), torch.ones(2))
    finally:
        consistency.check_consistency(was)


@pytest.mark.parametrize(("env", "expected"), [
    ({}, (None, 60.0)),
    ({"SHARDFN_CHECK": "1"}, (True, 60.0)),
    ({"SHARDFN_CHECK": " On "}, (True, 60.0)),
    ({"SHARDFN_CHECK": "0", "SHARDFN_CHECK_TIMEOUT": "2.5"}, (False, 2.5)),
    ({"SHARDFN_CHECK": "", "SHARDFN_CHECK_TIMEOUT": ""}, (False, 60.0)),
])
def test_env_parsing(env, expected):
    assert consistency._parse_env(env) == expected


@pytest.mark.parametrize("env", [{"SHARDFN_CHECK": "maybe"}, {"SHARDFN_CHECK_TIMEOUT": "0"},
                                 {"SHARDFN_CHECK_TIMEOUT": "-1"}, {"SHARDFN_CHECK_TIMEOUT": "x"},
                                 {"SHARDFN_CHECK_TIMEOUT": "inf"}])
def test_bad_env_values_are_refused(env):
    with pytest.raises(ValueError, match="SHARDFN_CHECK"):
        consistency._parse_env(env)


def test_env_variable_turns_check_mode_on_at_import():
    code = ("from shardfn.primitives import consistency as c; "
            "print(c.enabled(), c.check_timeout(), c.env_setting())")
    env = {**os.environ, "SHARDFN_CHECK": "yes", "SHARDFN_CHECK_TIMEOUT": "7"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__)))))
    assert out.stdout.split() == ["True", "7.0", "True"]


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="True, False or None"):
        consistency.check_consistency(1)
    for bad in (0, -1.0, float("inf"), "5", True):
        with pytest.raises(ValueError, match="positive number of seconds"):
            consistency.check_consistency(timeout=bad)


def test_tcp_store_wait_path():
    """A TCPStore (what torchrun gives) is waited on, not polled; a wait that times out
    leaves the client in step with the server."""
    import threading
    import time

    import torch.distributed as dist

    for _ in range(5):
        store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
        peer = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False)  # another rank
        assert not consistency._polls_files(dist.PrefixStore("default_pg", store))
        threading.Timer(0.05, peer.set, ("k1", "v")).start()
        t0 = time.monotonic()
        assert consistency._wait_keys(store, ["k1"], 5.0)  # set later by another client
        assert consistency._wait_keys(store, ["k0", "k1"], 0.1) is False  # k0 never comes
        assert time.monotonic() - t0 < 3.0
        peer.set("k0", "late")
        assert peer.get("k0") == b"late"  # a set has no reply: this one makes sure it landed
        assert [store.check(["k0"]), store.check(["nope"]), store.get("k0")] == [
            True, False, b"late"]
        assert consistency._wait_keys(store, ["k0", "k1"], 5.0)


_TORCHRUN_LIKE = """
import json, sys, torch, torch.distributed as dist
import shardfn as sf
from shardfn.primitives import consistency as c
from shardfn.primitives._comm import resolve
dist.init_process_group("gloo")  # env://: a TCPStore, as under torchrun
ax = resolve("x", sf.Mesh({"x": dist.get_world_size()}))
c.check_consistency(True, timeout=5.0)
c.check_call("psum", ax, torch.ones(3))
try:
    c.check_call("psum", ax, torch.ones(3 + dist.get_rank()))
    out = "no error"
except c.ConsistencyError as error:
    out = str(error)
store = c._default_store()
while isinstance(store, dist.PrefixStore):
    store = store.underlying_store
print(json.dumps([type(store).__name__, out]))
dist.destroy_process_group()
"""


def test_tcp_store_world_like_torchrun(tmp_path):
    """Two processes joined over env:// (TCPStore, the store NCCL jobs have): same checks."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", _TORCHRUN_LIKE], env=env, cwd=root,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert [store for store, _ in outs] == ["TCPStore", "TCPStore"]
    assert outs[0][1] == outs[1][1]
    assert "disagree at collective #2" in outs[0][1]
    assert "rank 1: psum(float32[4])" in outs[0][1]


def _real_psum_mismatch(rank, ax):
    import shardfn as sf

    mesh = sf.Mesh({"x": 2})
    x = torch.ones(4, 3, dtype=torch.int32 if rank else torch.float32)
    out = sf.psum(x, "x", mesh=mesh)  # unchecked: 1065353216 (f32 1.0's bits read as int32)
    return out.tolist()


def test_the_issue_case_psum_f32_vs_i32(worlds):
    """The issue's case through the real collective: the message points at the user's line."""
    message = _same_error_everywhere(worlds(2).run(_checked, _real_psum_mismatch),
                                     "rank 0: psum(float32[4, 3]) at ",
                                     "rank 1: psum(int32[4, 3]) at ")
    assert "test_consistency.py:" in message and "in _real_psum_mismatch" in message


def _real_psum_backward_site(rank, ax):
    import shardfn as sf

    mesh = sf.Mesh({"x": 2})

    def loss(x):
        return (sf.psum(x, "x", mesh=mesh) * (1.0 + rank)).sum()

    return torch.func.grad(loss)(torch.ones(3)).tolist()  # psum's backward is checked too


def test_real_psum_under_grad_passes(worlds):
    assert worlds(2).run(_checked, _real_psum_backward_site) == [("ok", [3.0] * 3)] * 2


# ---------------------------------------------------------------- property: raises iff ranks differ

_DTYPES = [torch.float32, torch.int32, torch.float16, torch.bool]


@st.composite
def _rank_calls(draw):
    """Per rank: (op, {name: (shape, dtype)}, static); often equal, sometimes one rank changed."""
    n = draw(st.sampled_from([2, 3]))
    leaf = st.tuples(st.lists(st.integers(0, 3), max_size=3).map(tuple), st.sampled_from(_DTYPES))
    base = (draw(st.sampled_from(["psum", "all_gather"])),
            draw(st.dictionaries(st.sampled_from(["a", "b", "c"]), leaf, min_size=1, max_size=3)),
            {"dim": draw(st.integers(0, 2))})
    calls = [base] * n
    if draw(st.booleans()):
        odd = draw(st.integers(0, n - 1))
        op, tree, static = base
        what = draw(st.sampled_from(["op", "leaf", "add", "static"]))
        if what == "op":
            op = "psum_scatter"
        elif what == "leaf":
            name = draw(st.sampled_from(sorted(tree)))
            tree = {**tree, name: draw(leaf)}
        elif what == "add":
            tree = {**tree, "z": draw(leaf)}
        else:
            static = {"dim": static["dim"] + 1}
        calls = calls[:odd] + [(op, tree, static)] + calls[odd + 1:]
    return n, calls


def _drawn_call(rank, ax, calls):
    op, spec, static = calls[rank]
    tree = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in spec.items()}
    consistency.check_call(op, ax, tree, **static)
    return "passed"


@settings(max_examples=12)
@given(_rank_calls())
def test_check_raises_exactly_when_ranks_differ(worlds, case):
    n, calls = case
    results = worlds(n).run(_checked, _drawn_call, calls)
    differ = any(call != calls[0] for call in calls)
    if not differ:
        assert results == [("ok", "passed")] * n
        return
    message = _same_error_everywhere(results, "disagree at collective #1")
    for rank, (op, _, _) in enumerate(calls):
        assert f"rank {rank}: {op}(" in message


def test_leaf_hash_covers_layouts_and_dtypes():
    """Equal values hash equal whatever the layout; any other value, dtype or shape differs."""
    h = consistency._leaf_hash
    dense = torch.arange(6.0).reshape(2, 3)
    assert h(dense) == h(dense.t().contiguous().t()) == h(dense.to_sparse())
    assert h(dense) != h(dense.to(torch.float64)) and h(dense) != h(dense.reshape(3, 2))
    assert h(dense) != h(dense + 1e-6)
    z = torch.ones(3, dtype=torch.complex64) * (1 + 2j)
    assert h(z.conj()) == h(z.conj().resolve_conj()) != h(z)
    assert h(torch.zeros(2)) != h(-torch.zeros(2))  # bitwise
    for leaf in (torch.tensor(True), torch.zeros(0, 3), torch.ones(2, dtype=torch.bfloat16),
                 torch.empty(2, device="meta"), 3, "s"):
        assert len(h(leaf)) == 16


def _sites_in_forward_and_backward(rank, ax):
    import os

    import shardfn as sf

    mesh = sf.Mesh({"x": 2})
    # a backward whose code lives in the shardfn package (as shardfn's own Functions do)
    code = compile("def library_backward(ax, g):\n    check_call('lib.backward', ax, g)\n",
                   os.path.join(os.path.dirname(sf.__file__), "_pretend_library.py"), "exec")
    namespace = {"check_call": consistency.check_call}
    exec(code, namespace)

    class Library(torch.autograd.Function):
        @staticmethod
        def forward(x, ax):
            return x.clone()

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.ax = inputs[1]

        @staticmethod
        def backward(ctx, g):
            namespace["library_backward"](ctx.ax, g)
            return g, None

    Library.backward.__code__ = Library.backward.__code__.replace(
        co_filename=os.path.join(os.path.dirname(sf.__file__), "_pretend_library.py"))
    seen = []
    exchange = consistency._exchange

    def spy(ax, fp, label):
        seen.append((fp["op"], fp["site"]))
        return exchange(ax, fp, label)

    consistency._exchange = spy
    try:
        def loss(x):
            return Library.apply(sf.psum(x, "x", mesh=mesh), ax).sum()  # FORWARD SITE

        torch.func.grad(loss)(torch.ones(3))  # BACKWARD SITE
    finally:
        consistency._exchange = exchange
    return seen


def test_sites_skip_shardfn_and_torch_frames(worlds):
    """The forward's site is the user's psum line; a check in a backward run by library code
    names the line that called grad."""
    import inspect

    lines, first = inspect.getsourcelines(_sites_in_forward_and_backward)
    forward = first + next(i for i, text in enumerate(lines) if "FORWARD SITE" in text)
    backward = first + next(i for i, text in enumerate(lines) if "BACKWARD SITE" in text)
    (kind, seen), _ = worlds(2).run(_checked, _sites_in_forward_and_backward)
    assert kind == "ok", seen
    assert [op for op, _ in seen] == ["psum", "lib.backward"], seen
    assert seen[0][1].endswith(f"test_consistency.py:{forward} in loss"), seen
    assert seen[1][1].endswith(
        f"test_consistency.py:{backward} in _sites_in_forward_and_backward"), seen
