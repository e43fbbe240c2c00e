"""Recording and replay of a function's ops: the machinery under `remat` and `shard_params`.

A rematerialised function runs twice: once in forward, where some op outputs
are kept, and once more in backward, where the kept outputs stand in for their
ops and everything else is recomputed. Two dispatch modes do that:

* :class:`Recorder` (forward) runs every op. For each op it can replay (see
  below) it asks the *policy* whether to keep the output; kept outputs become
  :class:`Saved` values, keyed by ``(op, how many times that op ran before)``.
  It also keeps a copy of every argument before the first in-place write to it
  (``mutated``), so that the recomputation can start from the same values.
* :class:`Replayer` (backward) counts ops the same way: an op whose key was
  saved returns the saved output instead of running, after a check that its
  input shapes and dtypes (its *signature*) are the forward's, so a
  recomputation that takes another path raises instead of replaying wrong
  values; every other op runs again.

Never saved: view, in-place and ``out=`` ops, ops whose output shares an input's
storage, random ops (so the RNG stream of the recomputation matches the
forward's), ops that update running statistics without declaring it, and
outputs changed in place later in the forward. Ops in ``uncounted`` (autocast's
casts, :data:`CASTS`, some of which its weight cache serves without running an
op) are neither counted nor saved, so both runs match every other op by count.

The policy interface: ``policy(op, name) -> bool | Offload``, where ``op`` is the
aten op and ``name`` is ``None`` or the tag given with ``sf.checkpoint_name``
(:func:`tag`); ``True`` keeps the output, ``False`` recomputes it and
``Offload(device)`` keeps it on ``device`` until the replay brings it back.

Hooks for other users of the modes: :meth:`Recorder.check_closure` runs before
every op (remat refuses a closed-over tensor that requires grad; a subclass may
accept it), and :func:`rng_state` / :func:`replay_rng` capture and restore the
RNG state a recomputation must start from.

Example:
    >>> recorder = Recorder(checkpoint_policies.dots_saveable, [x])
    >>> with torch.no_grad(), recorder:
    ...     y = fn(x)
    >>> with Replayer(recorder.finish()):
    ...     y_again = fn(x)  # the matmuls are not run again
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shardfn._torch_internals import (
    TorchDispatchMode,
    torch_tree_flatten,
    torch_tree_leaves,
    torch_tree_unflatten,
    unwrap_functorch,
)
from shardfn.transforms._tp_rng import StreamsState, replay_streams, set_streams, streams_state

__all__ = [
    "CASTS",
    "UNDECLARED_WRITES",
    "Offload",
    "Policy",
    "Recorder",
    "Replayer",
    "RngState",
    "Saved",
    "base_tensor",
    "replay_rng",
    "rng_state",
    "set_rng",
    "signature",
    "storage_ptr",
    "tag",
]

aten = torch.ops.aten
#: autocast's casts (some come from its weight cache): never counted nor saved under autocast
CASTS = frozenset({aten._to_copy.default})
#: ops that update arguments in place without saying so in their schema: argument positions
UNDECLARED_WRITES = {
    aten.native_batch_norm.default: (3, 4),  # running_mean, running_var (training=True)
    aten.cudnn_batch_norm.default: (3, 4),
    aten.miopen_batch_norm.default: (3, 4),
}


class Offload(NamedTuple):
    """Policy answer: save the value on ``device`` (CPU, pinned when CUDA) and bring it back."""

    device: str = "cpu"


Policy = Callable[[Any, "str | None"], "bool | Offload"]
"""``policy(op, name) -> bool | Offload``: which op outputs a :class:`Recorder` keeps."""

#: the recorders running now, innermost last (what :func:`tag` tells)
_ACTIVE: contextvars.ContextVar[tuple[Recorder, ...]] = contextvars.ContextVar(
    "shardfn_active_recorders", default=())

base_tensor = unwrap_functorch
"""``base_tensor(t)``: the plain tensor under every torch.func (grad / vmap) wrapper of ``t``."""


def storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (``-1`` for a tensor without one, e.g. a wrapper)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1


def signature(args, kwargs) -> tuple:
    """``((shape, dtype), ...)`` of an op's tensor inputs: what a replay checks."""
    return tuple((tuple(t.shape), t.dtype) for t in torch_tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor))


def tag(x: Any, name: str, *, leaves: Callable[[Any], Iterable] = torch_tree_leaves) -> None:
    """Tell every active :class:`Recorder` that the tensors in ``x`` are named ``name``.

    ``leaves`` flattens ``x`` (called only while a recorder is active).
    """
    recorders = _ACTIVE.get()
    if recorders:
        for leaf in leaves(x):
            if isinstance(leaf, torch.Tensor):
                for recorder in recorders:
                    recorder.tag(base_tensor(leaf), name)


def _replayable(func, args, kwargs, outs: list) -> bool:
    schema = func._schema
    if func is aten._unsafe_view.default or torch.Tag.nondeterministic_seeded in func.tags:
        return False
    if func in UNDECLARED_WRITES:  # replaying it would skip its update of running stats
        return False
    if any(a.alias_info is not None for a in schema.arguments):
        return False  # views, in-place and out= ops
    if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
        return False
    inputs = {storage_ptr(t) for t in torch_tree_flatten((args, kwargs))[0]
              if isinstance(t, torch.Tensor)}
    return not any(storage_ptr(o) in inputs for o in outs)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and a.stride() == b.stride()
                      and a.storage_offset() == b.storage_offset() and a.dtype == b.dtype)


def _to_device(t: torch.Tensor, device: str) -> torch.Tensor:
    target = torch.device(device)
    if t.device == target:
        return t
    pin = target.type == "cpu" and t.device.type == "cuda"
    out = torch.empty(t.shape, dtype=t.dtype, device=target, pin_memory=pin)
    return out.copy_(t, non_blocking=pin)


class Saved:
    """One saved op output (a tensor or a tuple of tensors), maybe offloaded."""

    def __init__(self, signature: tuple, out: Any, decision: bool | Offload):
        self.signature, self.decision = signature, decision
        self.leaves, self.spec = torch_tree_flatten(out)
        self.versions = [t._version for t in self.leaves]
        self.devices = [t.device for t in self.leaves]

    def unchanged(self) -> bool:
        """Whether no in-place op has changed the value since it was recorded."""
        return all(t._version == v for t, v in zip(self.leaves, self.versions, strict=True))

    def finish(self) -> bool:
        """Keep the value if the forward did not mutate it; move offloaded values."""
        if not self.unchanged():
            return False
        if isinstance(self.decision, Offload):
            self.leaves = [_to_device(t, self.decision.device) for t in self.leaves]
            self.versions = [t._version for t in self.leaves]
        return True

    def load(self, *, fresh: bool = False) -> Any:
        """The value, back on the devices it was recorded on; ``fresh``: as new tensor
        objects (aliases), for a replay under plain autograd, which records its history
        on what an op returns (the recorded tensor may be a forward output the caller
        holds, with its own history). Under torch.func the transform's wrappers take it."""
        leaves = [(t.detach() if fresh else t) if t.device == d else t.to(d, non_blocking=True)
                  for t, d in zip(self.leaves, self.devices, strict=True)]
        return torch_tree_unflatten(leaves, self.spec)


class Recorder(TorchDispatchMode):
    """Forward: runs every op, keeps the outputs the policy saves (see the module docstring).

    Args:
        policy: ``policy(op, name) -> bool | Offload``.
        inputs: the function's tensor arguments (a closure check and ``mutated`` use them).
        uncounted: ops neither counted nor saved (:data:`CASTS` under autocast).

    After the block, :meth:`finish` returns the saved values for a :class:`Replayer`
    and ``mutated`` maps an input's index to a copy of its value before the first
    in-place write to it.
    """

    def __init__(self, policy: Policy, inputs: list[torch.Tensor], *,
                 uncounted: frozenset = frozenset()):
        super().__init__()
        self.policy = policy
        self.uncounted = uncounted
        self.counts: Counter = Counter()
        self.saved: dict[tuple, Saved] = {}
        self.producers = WeakIdKeyDictionary()  # op output -> (key, signature, weak outputs)
        self.inputs = list(inputs)
        self.input_storages = {storage_ptr(base_tensor(t)) for t in inputs}
        self.mutated: dict[int, torch.Tensor] = {}

    def __enter__(self):
        _ACTIVE.set((*_ACTIVE.get(), self))
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.set(tuple(r for r in _ACTIVE.get() if r is not self))
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.check_closure(func, args, kwargs)
        self._note_input_writes(func, args, kwargs)
        self._forget_written(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in self.uncounted:
            return out
        key = (func, self.counts[func])
        self.counts[func] += 1
        outs, spec = torch_tree_flatten(out)
        if not _replayable(func, args, kwargs, outs):
            return out
        op_signature = signature(args, kwargs)
        record = (key, op_signature, [weakref.ref(o) for o in outs], spec)
        for o in outs:
            self.producers[o] = record
        decision = self.policy(func, None)
        if decision:
            self.saved[key] = Saved(op_signature, out, decision)
        return out

    def check_closure(self, func, args, kwargs) -> None:
        """Refuse an op input that requires grad and is not (a cast of) an argument.

        Override it to accept such inputs (shard_params' units read their
        parameters from the module skeleton they are swapped into, not through their
        arguments).
        """
        for t in torch_tree_flatten((args, kwargs))[0]:
            if (isinstance(t, torch.Tensor) and t.requires_grad
                    and storage_ptr(t) not in self.input_storages
                    and not self._cast_of_input(t)):
                raise ValueError(
                    f"remat: the function reads a tensor of shape {tuple(t.shape)} that requires "
                    f"grad but is not one of its arguments (a closure?) in {func}; pass it as an "
                    "argument so that it gets a gradient")

    def _cast_of_input(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is autocast's cached cast of an argument (``ToCopy`` of that leaf).

        Autocast keeps one cast per leaf that requires grad and hands it out
        without running an op, so the forward sees a tensor that requires grad
        and lives in no argument's storage. It is still a function of an
        argument: the recomputation casts that argument again. A view of such a
        cast (``F.linear``'s ``weight.t()``) counts too: it reads the same cast.
        """
        if t._base is not None:
            t = t._base
        fn = t.grad_fn
        if fn is None or type(fn).__name__ != "ToCopyBackward0":
            return False
        sources = [f for f, _ in fn.next_functions if f is not None]
        return (len(sources) == 1 and hasattr(sources[0], "variable")
                and storage_ptr(sources[0].variable) in self.input_storages)

    def _forget_written(self, func, args, kwargs) -> None:
        """Drop a saved output that ``func`` writes in place: its replay would hand back the
        written value. Declared writes bump the version ``Saved.finish`` checks; BatchNorm's
        running statistics (:data:`UNDECLARED_WRITES`) do not, so this catches them."""
        undeclared = UNDECLARED_WRITES.get(func)
        if undeclared is None or not self.saved:
            return
        for position in undeclared:
            t = args[position] if position < len(args) else None
            if not isinstance(t, torch.Tensor):
                continue
            record = self.producers.get(t)
            if record is None and t._base is not None:
                record = self.producers.get(t._base)
            if record is not None:
                self.saved.pop(record[0], None)

    def _note_input_writes(self, func, args, kwargs) -> None:
        if not self.input_storages:
            return
        undeclared = UNDECLARED_WRITES.get(func, ())
        for position, argument in enumerate(func._schema.arguments):
            declared = argument.alias_info is not None and argument.alias_info.is_write
            if not declared and position not in undeclared:
                continue
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            for t in value if isinstance(value, list | tuple) else (value,):
                if isinstance(t, torch.Tensor) and storage_ptr(t) in self.input_storages:
                    self._keep_before_write(t, func)

    def _keep_before_write(self, written: torch.Tensor, func) -> None:
        ptr = storage_ptr(written)
        sharing = [i for i, t in enumerate(self.inputs) if storage_ptr(base_tensor(t)) == ptr]
        exact = [i for i in sharing if _same_view(base_tensor(self.inputs[i]), written)]
        for index in exact or sharing:  # (a view of an input: every input on that storage)
            if index in self.mutated:
                continue
            t = self.inputs[index]
            if t.requires_grad:
                raise ValueError(
                    f"remat: the function updates in place ({func}) its argument of shape "
                    f"{tuple(t.shape)} that requires grad; autograd cannot follow that "
                    "through a remat. Update a copy (x = x + ...) or pass a tensor that "
                    "does not require grad (a buffer)")
            self.mutated[index] = t.detach().clone()

    def tag(self, tensor: torch.Tensor, name: str) -> None:
        """``checkpoint_name``: the policy decides again, with ``name``, for ``tensor``'s op."""
        record = self.producers.get(tensor)
        if record is None and tensor._base is not None:
            record = self.producers.get(tensor._base)
        if record is None:
            return  # an input, or made by a view/in-place op of one: nothing to replay
        key, op_signature, weak_outs, spec = record
        decision = self.policy(key[0], name)
        outs = [ref() for ref in weak_outs]
        if decision and all(o is not None for o in outs):
            self.saved[key] = Saved(op_signature, torch_tree_unflatten(outs, spec), decision)
        else:
            self.saved.pop(key, None)

    def finish(self) -> dict[tuple, Saved]:
        """The saved values still valid at the end of the forward, for a :class:`Replayer`."""
        return {key: s for key, s in self.saved.items() if s.finish()}


class Replayer(TorchDispatchMode):
    """Recompute: saved ops return their saved outputs, every other op runs.

    Args:
        saved: what :meth:`Recorder.finish` returned.
        uncounted: the recorder's ``uncounted``.
        fresh: return saved values as new tensor objects (:meth:`Saved.load`); needed
            when the recomputation runs under plain autograd, not ``torch.func``.
    """

    def __init__(self, saved: dict[tuple, Saved], *, uncounted: frozenset = frozenset(),
                 fresh: bool = False):
        super().__init__()
        self.saved = saved
        self.uncounted = uncounted
        self.fresh = fresh
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.uncounted:
            return func(*args, **kwargs)
        key = (func, self.counts[func])
        self.counts[func] += 1
        saved = self.saved.get(key)
        if saved is None or not saved.unchanged():  # e.g. an output the caller changed in place
            return func(*args, **kwargs)
        op_signature = signature(args, kwargs)
        if op_signature != saved.signature:
            raise RuntimeError(
                f"remat: the recomputation of {func} (call {key[1]}) got inputs "
                f"{op_signature}, the forward had {saved.signature}; the function must run the "
                "same ops in both (no data-dependent Python control flow), or use "
                "policy=nothing_saveable")
        return saved.load(fresh=self.fresh)


# ----------------------------------------------------------------------------- RNG state
class RngState(NamedTuple):
    """The CPU generator's state, each given CUDA device's (index -> state), and the
    tensor-parallel per-rank dropout streams of the ``TensorSplitModel.apply`` call it
    was taken in (None outside one; :mod:`._tp_rng`)."""

    cpu: torch.Tensor
    cuda: dict[int, torch.Tensor]
    split: StreamsState | None = None


def rng_state(tensors=()) -> RngState:
    """The RNG state now: CPU, and CUDA for ``tensors``' devices (else the current one).

    Example:
        >>> state = rng_state([x])
        >>> with replay_rng(state):
        ...     same = torch.rand(3)  # the values drawn after ``state`` was taken
    """
    cuda = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = {t.device.index for t in tensors if t.device.type == "cuda"}
        for index in devices or {torch.cuda.current_device()}:
            cuda[index] = torch.cuda.get_rng_state(index)
    return RngState(torch.get_rng_state(), cuda, streams_state())


@contextlib.contextmanager
def replay_rng(state: RngState) -> Iterator[None]:
    """Run a block from ``state``; the RNG state before the block is restored after it."""
    with torch.random.fork_rng(devices=list(state.cuda)), replay_streams(state.split):
        _set_generators(state)
        yield


def _set_generators(state: RngState) -> None:
    torch.set_rng_state(state.cpu)
    for index, cuda_state in state.cuda.items():
        torch.cuda.set_rng_state(cuda_state, index)


def set_rng(state: RngState) -> None:
    """Set the RNG state to ``state`` for good: the generators, and the current
    ``TensorSplitModel.apply`` call's per-rank streams (as a unit call left them in
    forward, when its replay is skipped)."""
    _set_generators(state)
    set_streams(state.split)
