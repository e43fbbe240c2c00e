"""Each private torch name in ``shardfn/_torch_internals.py`` still does what shardfn relies on.

One test per internal (or per small family), each checking the behaviour the
package uses, not just that the name exists: after a torch upgrade, the failing
tests name exactly which internal changed. Run with
``SHARDFN_ALLOW_UNTESTED_TORCH=1`` on a torch outside ``TESTED_TORCH``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from shardfn import _torch_internals as ti

# --- the version check -------------------------------------------------------------------


def test_this_torch_is_a_tested_release():
    assert ".".join(torch.__version__.split("+")[0].split(".")[:2]) in ti.TESTED_TORCH


def test_version_check_raises_on_an_untested_torch(monkeypatch):
    monkeypatch.delenv("SHARDFN_ALLOW_UNTESTED_TORCH", raising=False)
    tested = ti.TESTED_TORCH[0]
    ti._check_version(f"{tested}.0+cpu")  # local build tags and patch releases are fine
    ti._check_version(f"{tested}.1")
    with pytest.raises(ImportError, match=r"not 9\.1\.0.*SHARDFN_ALLOW_UNTESTED_TORCH=1"):
        ti._check_version("9.1.0")
    monkeypatch.setenv("SHARDFN_ALLOW_UNTESTED_TORCH", "0")  # "0" does not allow
    with pytest.raises(ImportError, match="not 9.1.0"):
        ti._check_version("9.1.0")


def test_version_check_warns_when_untested_torch_is_allowed(monkeypatch):
    monkeypatch.setenv("SHARDFN_ALLOW_UNTESTED_TORCH", "1")
    with pytest.warns(RuntimeWarning, match=r"not 9\.1\.0.*proceeding"):
        ti._check_version("9.1.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ti._check_version(f"{ti.TESTED_TORCH[0]}.0")  # a tested release never warns


def test_importing_shardfn_on_an_untested_torch_fails_with_the_reason():
    import os
    import subprocess
    import sys

    code = "import torch; torch.__version__ = '9.1.0'; import shardfn"
    env = {k: v for k, v in os.environ.items() if k != "SHARDFN_ALLOW_UNTESTED_TORCH"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode != 0
    assert "ImportError: shardfn is tested with torch" in run.stderr and "9.1.0" in run.stderr
    env["SHARDFN_ALLOW_UNTESTED_TORCH"] = "1"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0 and "RuntimeWarning" in run.stderr, run.stderr


def test_a_missing_internal_fails_at_import_naming_it():
    with pytest.raises(ImportError, match=r"relies on torch\.utils\._pytree\.no_such_name"):
        ti._private("torch.utils._pytree", "no_such_name")
    with pytest.raises(ImportError, match=r"relies on torch\._no_such_module\.x"):
        ti._private("torch._no_such_module", "x")
    with pytest.raises(ImportError, match=r"relies on torch\.ops\.inductor\.no_such_op"):
        ti._ops("inductor", "resize_storage_bytes_", "no_such_op")
    assert ti._ops("inductor", "resize_storage_bytes_") is torch.ops.inductor


# --- functional collectives, the default store, process groups (2 ranks) ------------------


class _SumGradAcrossRanks(torch.autograd.Function):
    """Identity forward; the backward all-reduces the gradient (as shardfn's backward does)."""

    @staticmethod
    def forward(x, group_name):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group_name = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        ops = ti.c10d_functional
        return ops.wait_tensor(ops.all_reduce(grad.contiguous(), "sum", ctx.group_name)), None


def _functional_collectives():
    import torch.distributed as dist

    ops, rank, size = ti.c10d_functional, dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    x = torch.arange(4.0) + 10 * rank  # rank 0: [0, 1, 2, 3]; rank 1: [10, 11, 12, 13]

    def loss(y):
        return (_SumGradAcrossRanks.apply(y, group) * (rank + 1)).sum()

    grad = torch.func.grad(loss)(torch.ones(3))  # sum over ranks of (rank + 1)
    out = {
        "grad": grad,
        "all_reduce": ops.wait_tensor(ops.all_reduce(x, "sum", group)),
        "all_gather": ops.wait_tensor(ops.all_gather_into_tensor(x, size, group)),
        "reduce_scatter": ops.wait_tensor(ops.reduce_scatter_tensor(x, "sum", size, group)),
        "all_to_all": ops.wait_tensor(ops.all_to_all_single(x, [2, 2], [2, 2], group)),
        "broadcast": ops.wait_tensor(ops.broadcast(x.clone(), 1, group)),
    }
    return {k: v.tolist() for k, v in out.items()}


def test_functional_collectives_work_in_a_backward_under_grad(worlds):
    """The functional ops (and ``wait_tensor``) give the right values, also when called in
    an ``autograd.Function``'s backward under ``torch.func.grad``."""
    r0, r1 = worlds(2).run(_functional_collectives)
    assert r0["grad"] == r1["grad"] == [3.0, 3.0, 3.0]
    assert r0["all_reduce"] == r1["all_reduce"] == [10.0, 12.0, 14.0, 16.0]
    assert r0["all_gather"] == r1["all_gather"] == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]
    assert (r0["reduce_scatter"], r1["reduce_scatter"]) == ([10.0, 12.0], [14.0, 16.0])
    assert (r0["all_to_all"], r1["all_to_all"]) == ([0.0, 1.0, 10.0, 11.0],
                                                    [2.0, 3.0, 12.0, 13.0])
    assert r0["broadcast"] == r1["broadcast"] == [10.0, 11.0, 12.0, 13.0]


def _store_and_groups():
    import torch.distributed as dist

    store = ti.default_store()
    if dist.get_rank() == 0:
        store.set("test_torch_internals/key", "from rank 0")
    dist.barrier()
    value = store.get("test_torch_internals/key").decode()
    groups = ti.process_groups()
    before = ti.group_sequence_number(dist.group.WORLD)
    dist.all_reduce(torch.ones(1))
    after = ti.group_sequence_number(dist.group.WORLD)
    dist.barrier()
    if dist.get_rank() == 0:
        store.delete_key("test_torch_internals/key")
    return value, isinstance(store, dist.Store), dist.group.WORLD in groups, after - before


def test_default_store_process_groups_and_sequence_numbers(worlds):
    """Both ranks read a key one of them set in the default store; the default group is
    among the process groups; one collective advances its sequence number by one."""
    assert worlds(2).run(_store_and_groups) == [("from rank 0", True, True, 1)] * 2


# --- functorch ----------------------------------------------------------------------------


def test_functorch_wrappers_under_grad_and_vmap():
    seen = {}

    def under_grad(x):
        seen["grad"] = (ti.is_functorch_wrapped(x), ti.get_unwrapped(x),
                        ti.unwrap_functorch(x))
        return x.sum()

    def under_vmap(x):
        seen["vmap"] = (ti.is_functorch_wrapped(x), ti.unwrap_functorch(x))
        return x * 2

    x = torch.arange(6.0).reshape(2, 3)
    torch.func.grad(under_grad)(x)
    wrapped, one_level, plain = seen["grad"]
    assert wrapped and not ti.is_functorch_wrapped(one_level) and not ti.is_functorch_wrapped(plain)
    assert torch.equal(plain, x) and torch.equal(one_level, x)
    torch.func.vmap(under_vmap)(x)
    wrapped, plain = seen["vmap"]
    assert wrapped and not ti.is_functorch_wrapped(plain)
    assert torch.equal(plain, x)  # the unwrapped tensor has the batch dimension back
    torch.func.grad(lambda y: torch.func.vmap(under_vmap)(y).sum())(x)  # two levels
    assert not ti.is_functorch_wrapped(seen["vmap"][1]) and torch.equal(seen["vmap"][1], x)
    assert not ti.is_functorch_wrapped(x) and ti.unwrap_functorch(x) is x


def test_is_differentiated_under_grad_levels():
    """A grad level's argument in argnums is differentiated, one outside is not (it is
    wrapped all the same); an outer level counts; jvp tangents do not; autograd does."""
    seen = []

    def f(a, b):
        seen.append((ti.is_differentiated(a), ti.is_differentiated(b)))
        return (a * b).sum()

    a, b = torch.ones(2), torch.ones(2)
    torch.func.grad(f)(a, b)
    torch.func.grad(lambda a, b: torch.func.grad(f)(a, b).sum(), argnums=1)(a, b)
    torch.func.jvp(f, (a, b), (a, b))
    assert seen == [(True, False), (True, True), (False, False)]
    assert ti.is_differentiated(a.requires_grad_()) and not ti.is_differentiated(b)


def test_interpreter_stack_and_transform_types():
    seen = {}

    def record(name):
        stack = ti.get_interpreter_stack() or ()
        seen[name] = ([i.key() for i in stack], ti.in_transform(ti.TransformType.Vmap),
                      ti.in_transform(ti.TransformType.Grad))

    def inner(x):
        record("grad(vmap)")
        return x.sin()

    torch.func.vmap(lambda x: (record("vmap"), x)[1])(torch.ones(2, 3))
    torch.func.grad(lambda x: (record("grad"), x.sum())[1])(torch.ones(3))
    torch.func.grad(lambda x: torch.func.vmap(inner)(x).sum())(torch.ones(2, 3))
    torch.func.jvp(lambda x: (record("jvp"), x)[1], (torch.ones(2),), (torch.ones(2),))
    record("outside")
    kinds = ti.TransformType
    assert seen["vmap"] == ([kinds.Vmap], True, False)
    assert seen["grad"] == ([kinds.Grad], False, True)
    assert seen["grad(vmap)"] == ([kinds.Grad, kinds.Vmap], True, True)  # innermost last
    assert seen["jvp"][0] == [kinds.Jvp]
    assert seen["outside"] == ([], False, False)


def test_disable_functorch_gives_plain_results_inside_grad():
    seen = {}

    def f(x):
        plain = ti.unwrap_functorch(x)
        with ti.DisableFuncTorch():
            seen["out"] = plain * 2 + 1
        return x.sum()

    torch.func.grad(f)(torch.arange(3.0))
    assert not ti.is_functorch_wrapped(seen["out"])
    assert seen["out"].tolist() == [1.0, 3.0, 5.0]


def test_temporarily_clear_interpreter_stack():
    seen = {}

    def f(x):
        with ti.temporarily_clear_interpreter_stack():
            seen["inside"] = (list(ti.get_interpreter_stack() or ()),
                              ti.in_transform(ti.TransformType.Grad))
        seen["after"] = ti.in_transform(ti.TransformType.Grad)
        return x.sum()

    torch.func.grad(f)(torch.ones(2))
    assert seen == {"inside": ([], False), "after": True}


# --- dispatch mode, torch pytree, storage resize ------------------------------------------


class _Ops(ti.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_dispatch_mode_sees_aten_ops():
    with _Ops() as mode:
        out = torch.ones(2) * 3 + 1
    assert torch.ops.aten.mul.Tensor in mode.ops and torch.ops.aten.add.Tensor in mode.ops
    assert out.tolist() == [4.0, 4.0]


def test_torch_pytree_round_trip():
    a, b = torch.ones(2), torch.zeros(3)
    tree = {"w": [a, (1, b)], "s": "text", "n": None}
    leaves, spec = ti.torch_tree_flatten(tree)
    assert ti.torch_tree_leaves(tree) == leaves
    assert sum(isinstance(x, torch.Tensor) for x in leaves) == 2
    rebuilt = ti.torch_tree_unflatten(leaves, spec)
    assert rebuilt["w"][0] is a and rebuilt["w"][1][1] is b
    assert rebuilt["w"][1][0] == 1 and rebuilt["s"] == "text" and rebuilt["n"] is None


def test_resize_storage_bytes_frees_and_refills_and_is_an_op():
    t = torch.arange(4.0)
    nbytes = t.untyped_storage().nbytes()
    with _Ops() as mode:
        ti.resize_storage_bytes_(t, 0)
    assert t.untyped_storage().nbytes() == 0  # freed: the tensor keeps its shape
    assert t.shape == (4,)
    assert ti.resize_storage_bytes_.default in mode.ops  # memory.py counts frees by this op
    ti.resize_storage_bytes_(t, nbytes)
    assert t.untyped_storage().nbytes() == nbytes
    t.copy_(torch.tensor([5.0, 6.0, 7.0, 8.0]))  # refilled storage is usable again
    assert t.tolist() == [5.0, 6.0, 7.0, 8.0]


# --- modules ------------------------------------------------------------------------------


def test_batch_norm_base_is_the_base_of_torch_batch_norms():
    for layer in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm):
        assert issubclass(layer, ti.BatchNormBase)

    class Plain(ti.BatchNormBase):
        def _check_input_dim(self, input):  # the one method a subclass supplies
            pass

    torch.manual_seed(0)
    x = torch.randn(8, 3)
    ours, theirs = Plain(3), nn.BatchNorm1d(3)
    torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours.running_mean, theirs.running_mean)


def test_assert_async_passes_a_true_condition_and_raises_on_a_false_one_on_the_cpu():
    ti.assert_async(torch.tensor(True), "fine")
    with pytest.raises(RuntimeError):  # on the CPU it fails at once (CUDA: a device assert)
        ti.assert_async(torch.tensor(False), "out of range")


def test_constant_result_marks_a_function_as_torch_compiler_does():
    """``ti.constant_result`` sets what ``torch.compiler.assume_constant_result`` sets (without
    importing dynamo; tests/compile's warn-once tests run it under ``fullgraph=True``)."""

    def ours():
        return 3

    def theirs():
        return 3

    assert ti.constant_result(ours) is ours
    torch.compiler.assume_constant_result(theirs)
    marks = {k for k in vars(theirs)}
    assert marks and marks == {k for k in vars(ours)}


def test_in_order_comm_pass_runs_torch_pass_with_collectives_in_order():
    """It calls inductor's pass of that name with both unsafe-reorder switches off (and
    restores them), and pickles (inductor's cache keys hold the options)."""
    import pickle
    from unittest import mock

    from torch._inductor import comms, config_comms

    seen = []

    def fake(snodes):
        seen.append((config_comms.reorder_iterative_unsafe_collectives_reorder,
                     config_comms.sink_waits_iterative_unsafe_collectives_reorder))
        return snodes[::-1]

    before = (config_comms.reorder_iterative_unsafe_collectives_reorder,
              config_comms.sink_waits_iterative_unsafe_collectives_reorder)
    with mock.patch.object(comms, "sink_waits_iterative", fake):
        assert ti.InOrderCommPass("sink_waits_iterative")([1, 2, 3]) == [3, 2, 1]
    assert seen == [(False, False)]
    assert (config_comms.reorder_iterative_unsafe_collectives_reorder,
            config_comms.sink_waits_iterative_unsafe_collectives_reorder) == before
    assert pickle.loads(pickle.dumps(ti.InOrderCommPass("x"))) == ti.InOrderCommPass("x")
    for name in ("reorder_communication_preserving_peak_memory", "sink_waits_iterative"):
        assert callable(getattr(comms, name))  # the names overlap_options uses exist


def test_unsafe_overlap_passes_reads_inductors_global_config():
    import torch._inductor.config as config
    from torch._inductor import comms, config_comms

    assert ti.unsafe_overlap_passes() == []  # the default: no overlap passes
    passes = ["sink_waits_iterative", comms.reorder_communication_preserving_peak_memory,
              ti.InOrderCommPass("sink_waits_iterative"), "raise_comms"]
    with config.patch(reorder_for_compute_comm_overlap=True,
                      reorder_for_compute_comm_overlap_passes=passes):
        assert ti.unsafe_overlap_passes() == ["sink_waits_iterative",
                                              "reorder_communication_preserving_peak_memory"]
        with config_comms.patch(sink_waits_iterative_unsafe_collectives_reorder=False):
            assert ti.unsafe_overlap_passes() == [
                "reorder_communication_preserving_peak_memory"]
    with config.patch(reorder_for_compute_comm_overlap=False,
                      reorder_for_compute_comm_overlap_passes=passes):
        assert ti.unsafe_overlap_passes() == []


def test_every_internal_has_a_test_here():
    """A name added to ``_torch_internals.__all__`` gets a behaviour test in this file."""
    import inspect
    import sys

    source = inspect.getsource(sys.modules[__name__]).split("def test_every_internal")[0]
    untested = [n for n in ti.__all__ if f"ti.{n}" not in source]
    assert not untested, f"internals without a test in {__file__}: {untested}"
    assert all(hasattr(ti, n) for n in ti.__all__)
