"""Every private PyTorch name shardfn relies on, in one place, behind a version check.

shardfn needs a few things torch does not offer publicly: the functional
collective ops (the only ones that run inside an ``autograd.Function``'s
backward under ``torch.func``), functorch's wrapper and interpreter-stack
queries, the dispatch-mode base class, torch's own pytree (to walk the
arguments a dispatch mode sees), FSDP's storage resize op, and the default
process group's store. Each is bound here once; the rest of the package
imports it from this module (``tests/test_architecture.py`` fails on a private
name anywhere else), and ``tests/test_torch_internals.py`` checks that each
still behaves as shardfn relies on, so a torch upgrade shows exactly what
broke.

On a torch release outside :data:`TESTED_TORCH` the import raises, naming the
release; ``SHARDFN_ALLOW_UNTESTED_TORCH=1`` proceeds with a warning (the
per-internal tests then say what still holds). On any release, an internal
that torch does not have fails the import with an ``ImportError`` naming it.

Example:
    >>> from shardfn import _torch_internals as ti
    >>> ti.unwrap_functorch(torch.ones(2)).shape
    torch.Size([2])
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Any, NamedTuple

import torch

__all__ = [
    "BatchNormBase",
    "TESTED_TORCH",
    "assert_async",
    "TorchDispatchMode",
    "DisableFuncTorch",
    "TransformType",
    "c10d_functional",
    "constant_result",
    "default_store",
    "get_interpreter_stack",
    "get_unwrapped",
    "group_sequence_number",
    "in_transform",
    "InOrderCommPass",
    "is_differentiated",
    "is_functorch_wrapped",
    "process_groups",
    "resize_storage_bytes_",
    "temporarily_clear_interpreter_stack",
    "torch_tree_flatten",
    "torch_tree_leaves",
    "torch_tree_unflatten",
    "unsafe_overlap_passes",
    "unwrap_functorch",
]

TESTED_TORCH: tuple[str, ...] = ("2.13",)


def _check_version(version: str) -> None:
    """Raise unless ``version``'s release (``"2.13"`` of ``"2.13.0+cpu"``) is in TESTED_TORCH.

    Args:
        version: a torch version string.

    Raises:
        ImportError: for an untested release, naming it and what to do; with
            ``SHARDFN_ALLOW_UNTESTED_TORCH`` set (not ``0``) it warns instead.
    """
    release = ".".join(version.split("+")[0].split(".")[:2])
    if release in TESTED_TORCH:
        return
    message = (f"shardfn is tested with torch {', '.join(TESTED_TORCH)}, not {version}: it relies "
               "on private torch internals (shardfn/_torch_internals.py) that may have changed")
    if os.environ.get("SHARDFN_ALLOW_UNTESTED_TORCH", "") not in ("", "0"):
        warnings.warn(message + "; proceeding because SHARDFN_ALLOW_UNTESTED_TORCH is set",
                      RuntimeWarning, stacklevel=3)
        return
    raise ImportError(message + ". Install a tested torch (pip install torch==2.13.0) or set "
                      "SHARDFN_ALLOW_UNTESTED_TORCH=1 and run tests/test_torch_internals.py.")


_check_version(torch.__version__)


def _private(module: str, name: str) -> Any:
    """``module.name``, or an ImportError naming it when this torch does not have it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(_missing(f"{module}.{name}", error)) from error


def _ops(namespace: str, *names: str) -> Any:
    """``torch.ops.<namespace>``, after checking that it has each op in ``names``."""
    ops = getattr(torch.ops, namespace)
    for name in names:
        try:
            getattr(ops, name)
        except (AttributeError, RuntimeError) as error:
            raise ImportError(_missing(f"torch.ops.{namespace}.{name}", error)) from error
    return ops


def _missing(what: str, error: Exception) -> str:
    return (f"shardfn relies on {what}, which torch {torch.__version__} does not have "
            f"({error}); tests/test_torch_internals.py says what each internal must do")


# ---- collectives -------------------------------------------------------------------------
#: ``torch.ops._c10d_functional``: all_reduce, all_gather_into_tensor, reduce_scatter_tensor,
#: all_to_all_single, broadcast, wait_tensor (work inside autograd.Function backward under
#: torch.func, where plain ``torch.distributed`` calls fail).
c10d_functional = _ops("_c10d_functional", "all_reduce", "all_gather_into_tensor",
                       "reduce_scatter_tensor", "all_to_all_single", "broadcast", "wait_tensor")


def default_store() -> Any:
    """The default process group's key-value store (``distributed_c10d._get_default_store``)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def process_groups() -> list:
    """Every process group this process created (``distributed_c10d._world.pg_map``)."""
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)


def group_sequence_number(group: Any) -> int:
    """Collectives issued on ``group`` so far (``ProcessGroup._get_sequence_number_for_group``)."""
    return group._get_sequence_number_for_group()


# ---- functorch ---------------------------------------------------------------------------
is_functorch_wrapped = _private("torch._C._functorch", "is_functorch_wrapped_tensor")
get_unwrapped = _private("torch._C._functorch", "get_unwrapped")
get_interpreter_stack = _private("torch._C._functorch", "get_interpreter_stack")
TransformType = _private("torch._C._functorch", "TransformType")
#: context manager: ops run on plain tensors, not re-wrapped by an active grad/vmap level
DisableFuncTorch = _private("torch._C", "_DisableFuncTorch")
temporarily_clear_interpreter_stack = _private("torch._functorch.pyfunctorch",
                                               "temporarily_clear_interpreter_stack")


def unwrap_functorch(x: torch.Tensor) -> torch.Tensor:
    """The plain tensor under every functorch wrapper (grad and vmap levels)."""
    while is_functorch_wrapped(x):
        x = get_unwrapped(x)
    return x


_is_gradtracking = _private("torch._C._functorch", "is_gradtrackingtensor")


def is_differentiated(x: torch.Tensor) -> bool:
    """Whether ``x`` is being differentiated: it requires grad under autograd, or some
    ``torch.func`` grad level (``grad``, ``vjp``, ``jacrev``) tracks it, at any depth
    of nesting and under any vmap level. A tensor a grad level merely wraps (an
    argument outside ``argnums``) is not; forward-mode (``jvp``) tangents are not.

    Example:
        >>> is_differentiated(torch.ones(2)), is_differentiated(torch.ones(2, requires_grad=True))
        (False, True)
    """
    if x.requires_grad:
        return True
    while is_functorch_wrapped(x):
        if _is_gradtracking(x) and x.requires_grad:
            return True
        x = get_unwrapped(x)
    return x.requires_grad


def in_transform(kind: Any) -> bool:
    """Whether a functorch transform of ``kind`` (a :data:`TransformType`) is active."""
    return any(i.key() == kind for i in get_interpreter_stack() or ())


# ---- dispatch and pytrees ----------------------------------------------------------------
TorchDispatchMode = _private("torch.utils._python_dispatch", "TorchDispatchMode")
torch_tree_flatten = _private("torch.utils._pytree", "tree_flatten")
torch_tree_leaves = _private("torch.utils._pytree", "tree_leaves")
torch_tree_unflatten = _private("torch.utils._pytree", "tree_unflatten")

# ---- storage -----------------------------------------------------------------------------
#: FSDP's in-place storage resize as an op (``resize_storage_bytes_(t, nbytes)``), visible to
#: dispatch modes; the public alternative is ``t.untyped_storage().resize_(nbytes)``.
resize_storage_bytes_ = _ops("inductor", "resize_storage_bytes_").resize_storage_bytes_

# ---- modules -----------------------------------------------------------------------------
#: the common base of ``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm`` (torch.nn's private
#: ``_BatchNorm``): ``sf.sync_batch_norm``'s layer subclasses it, as those layers do.
BatchNormBase = _private("torch.nn.modules.batchnorm", "_BatchNorm")

# ---- asserts -----------------------------------------------------------------------------
#: ``assert_async(cond, message)``: fail a one-element bool tensor ``cond`` on its device
#: without a host sync (a CUDA device-side assert; on the CPU it raises at once).
assert_async = _private("torch", "_assert_async")

# ---- torch.compile -----------------------------------------------------------------------
#: what ``torch.compiler.assume_constant_result`` sets on a function (dynamo then calls it at
#: trace time and keeps its result as a constant); torch's decorator imports ``torch._dynamo``
#: (about a second) to set it, which every process importing shardfn would pay.
_CONSTANT_MARK = "_dynamo_marked_constant"


def constant_result(fn: Any) -> Any:
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo``.

    Example:
        >>> @constant_result
        ... def warn_once() -> bool: ...
    """
    setattr(fn, _CONSTANT_MARK, True)
    return fn


class InOrderCommPass(NamedTuple):
    """Inductor's compute/communication reordering pass ``name`` (a function of
    ``torch._inductor.comms``), run with the collectives kept in the graph's order.

    torch 2.13 lets these passes swap two collectives by default
    (``config_comms.*_unsafe_collectives_reorder``, "must be used with runtime
    estimations aligned across ranks"); a rank's graph differs from the others' (its own
    pieces and blocks), so the estimates and then the collectives' order can differ from
    rank to rank: gloo aborts on mismatched sizes, equal sizes would mix the data. This
    runs the pass with both switches off. A NamedTuple so inductor's cache can pickle it.

    Example:
        >>> passes = [InOrderCommPass("sink_waits_iterative")]
        >>> options = {"reorder_for_compute_comm_overlap": True,
        ...            "reorder_for_compute_comm_overlap_passes": passes}
    """

    name: str

    def __call__(self, snodes: list) -> list:
        from torch._inductor import comms, config_comms  # only when inductor schedules

        with config_comms.patch(reorder_iterative_unsafe_collectives_reorder=False,
                                sink_waits_iterative_unsafe_collectives_reorder=False):
            return getattr(comms, self.name)(snodes)


_UNSAFE_SWITCH = {"reorder_communication_preserving_peak_memory":
                  "reorder_iterative_unsafe_collectives_reorder",
                  "sink_waits_iterative": "sink_waits_iterative_unsafe_collectives_reorder"}


def unsafe_overlap_passes() -> list[str]:
    """The overlap passes set in inductor's global config that may swap two collectives.

    Reads ``torch._inductor.config`` only if it is imported already (no inductor import):
    with ``reorder_for_compute_comm_overlap`` on, each of
    ``reorder_for_compute_comm_overlap_passes`` named ``reorder_communication_preserving_
    peak_memory`` or ``sink_waits_iterative`` (a string or torch's function) whose
    ``config_comms.*_unsafe_collectives_reorder`` switch is on. :class:`InOrderCommPass`
    entries are safe. Options given to ``torch.compile(options=...)`` are not seen here.

    Returns:
        Their names, in order (empty: nothing unsafe configured).

    Example:
        >>> unsafe_overlap_passes()
        []
    """
    import sys

    config = sys.modules.get("torch._inductor.config")
    comms = sys.modules.get("torch._inductor.config_comms")
    if config is None or comms is None or not config.reorder_for_compute_comm_overlap:
        return []
    out = []
    for p in config.reorder_for_compute_comm_overlap_passes:
        if isinstance(p, InOrderCommPass):
            continue
        name = p if isinstance(p, str) else getattr(p, "__name__", "")
        if name in _UNSAFE_SWITCH and getattr(comms, _UNSAFE_SWITCH[name]):
            out.append(name)
    return out
