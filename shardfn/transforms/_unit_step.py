"""One `shard_params` ``apply()`` call: its forward and backward (``Step``), and the two
``autograd.Function`` s it runs through (``RootFn``, ``UnitFn``).

See :mod:`shardfn.transforms.shard_params` for how a step runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

from shardfn import pytree
from shardfn.primitives import _comm, autocast_state, stats
from shardfn.primitives.flat import all_reduce_async
from shardfn.primitives.reduce_scaling import divide_factors
from shardfn.transforms._unit_exchange import TagCounter, UnitGather, UnitReduce, no_functorch
from shardfn.transforms._unit_plan import ACTIVE, Unit
from shardfn.transforms._units import Accumulator, NoReduce, UnitRecorder, UnitReplayer
from shardfn.transforms.remat import _base

if TYPE_CHECKING:
    from shardfn.transforms.shard_params import ShardedModel

__all__ = ["Reduce", "RootFn", "Step", "TreeSpec", "UnitFn"]

_ops = torch.ops._c10d_functional

Params = dict[str, torch.Tensor]


# ================================================================ collectives of a unit


class Reduce:
    """The reduction of one unit's gradients: reduce-scatters issued now, finished by wait().

    Takes ownership of ``grads`` (full gradients of the unit's owned trainable leaves).
    Only the leaves in ``wanted`` (None: all) are reduced: a leaf left out of the
    differentiation costs no communication. They are reduced in the reduce dtype; the
    shard gradients come back in the master dtype, on the storage device. With HSDP the
    shards are then summed over the replica axis.

    In fp16/bf16 the gradients are divided by ``pre`` before the sum and by ``post``
    after it (``divide_factors`` over every data-parallel rank, as FSDP2 does), so a
    mean that fits the dtype does not overflow on the way; ``grad_reduce="sum"``
    multiplies ``pre`` back instead (in the master dtype).
    """

    def __init__(self, model: ShardedModel, unit: Unit, grads: dict[str, torch.Tensor],
                 tag: int, wanted: frozenset[str] | None = None):
        self.model, self.unit = model, unit
        if wanted is not None:
            grads = {n: g for n, g in grads.items() if n in wanted}
        self.flats = unit.scatter_for(wanted)
        count = model._all_ax.size
        self.factors = [divide_factors(count, flat.dtype) for flat in self.flats]
        self.replicated = {n: grads.pop(n).detach() for n in unit.replicated if n in grads}
        self.exchange = UnitReduce(unit, grads, model._ax, tag, self.flats,
                                   [pre for pre, _ in self.factors])

    def _finish(self, chunk: torch.Tensor, pre: float, post: float) -> None:
        """Scale a reduced chunk (a fresh tensor of ours, in the master dtype) in place."""
        with no_functorch():
            if self.model.grad_reduce == "mean":
                if post != 1.0:
                    chunk.div_(post)
            elif pre != 1.0:
                chunk.mul_(pre)

    def wait(self) -> Params:
        """This rank's shard gradients (``name -> tensor`` of the local shard shape)."""
        model, unit = self.model, self.unit
        chunks = self.exchange.wait()
        rep = model._replicate_ax
        if rep is not None and rep.size > 1 and chunks:
            with stats.collective_scope(rep.describe(f"psum of unit {unit.label}")):
                chunks = [_ops.wait_tensor(h) for h in [all_reduce_async(c, rep) for c in chunks]]
        place, out = model._place, {}
        for flat, chunk, (pre, post) in zip(self.flats, chunks, self.factors, strict=True):
            chunk = chunk.to(flat.master)  # a fresh tensor of ours: scaled in place
            self._finish(chunk, pre, post)
            for name, local, offset in zip(flat.names, flat.local_shapes, flat.offsets,
                                           strict=True):
                out[name] = place.to_storage(chunk[offset:offset + math.prod(local)].view(local))
        for name, grad in self.replicated.items():
            master = model._masters[name]
            dtype = place.comm_reduce_dtype(master)
            pre, post = divide_factors(model._all_ax.size, dtype)
            reduced = _comm.psum((grad / pre if pre != 1.0 else grad).to(dtype), model._all_ax)
            reduced = reduced.to(master)
            scaled = (reduced / post if post != 1.0 else reduced) if model.grad_reduce == "mean" \
                else (reduced * pre if pre != 1.0 else reduced)
            out[name] = place.to_storage(scaled)
        return out


# ================================================================ one apply() call


class TreeSpec(NamedTuple):
    """A pytree with its tensor leaves taken out (they travel through autograd.Functions)."""

    treedef: Any
    is_tensor: tuple[bool, ...]
    constants: tuple[Any, ...]  # the non-tensor leaves

    @staticmethod
    def of(tree: Any) -> tuple[TreeSpec, list[torch.Tensor]]:
        leaves, treedef = pytree.tree_flatten(tree)
        is_tensor = tuple(isinstance(x, torch.Tensor) for x in leaves)
        constants = tuple(x for x, t in zip(leaves, is_tensor, strict=True) if not t)
        return TreeSpec(treedef, is_tensor, constants), [x for x in leaves if
                                                           isinstance(x, torch.Tensor)]

    def build(self, tensors: Sequence[torch.Tensor]) -> Any:
        tensors, constants = iter(tensors), iter(self.constants)
        leaves = [next(tensors) if t else next(constants) for t in self.is_tensor]
        return pytree.tree_unflatten(self.treedef, leaves)


@dataclasses.dataclass
class _Saved:
    """What one unit call in forward leaves for backward."""

    outputs: list[torch.Tensor]  # its output tensors, replayed by the root's recompute
    versions: list[int]  # their version counters, to catch in-place changes
    spec: TreeSpec
    rng_before: Any
    rng_after: Any
    replay: dict | None = None  # the remat policy's saved op outputs inside the unit
    vjp_fn: Callable | None = None  # activations kept (remat=None): the unit's vjp
    gather: UnitGather | None = None  # its full parameters (storage released until backward)
    buffers: Params | None = None  # its buffers as the call found them (for a recompute)


class Step:
    """The state of one ``apply`` call, shared by its forward and its backward."""

    def __init__(self, model: ShardedModel, arg_spec: TreeSpec,
                 arg_tensors: Sequence[torch.Tensor], keep: bool, record: bool,
                 mutable: bool = False):
        self.model = model
        self.arg_spec = arg_spec
        # per tensor argument: may a gradient be asked for it (the root's graph is
        # recorded in forward, before backward says which inputs need one)
        self.arg_wants = [is_float(t) and (t.requires_grad or is_wrapped(t))
                          for t in arg_tensors]
        self.keep = keep  # keep full params for backward (reshard_after_forward=False)
        self.record = record  # a backward may follow: save unit outputs for replay
        self.shards: Params = {}  # plain local shards and buffers (as RootFn.forward got them)
        self.local: Params = {}  # replicated leaves and buffers on the compute device, cast
        self.root_plain: Params = {}  # the root's full parameters, plain
        self.root_values: Params = {}  # the root's full parameters in the recompute (primals)
        self.overrides: Params = {}  # unit shards as primals of the root's recompute
        self.mode = "forward"
        self.order: list[int] = []  # unit index of each call, in forward order
        self.saved: list[_Saved] = []
        self.replay_at = 0
        self.prefetched: dict[tuple[str, int], UnitGather] = {}
        self.tags = TagCounter()  # message tags of this call's exchanges
        self.reducing: dict[int, Reduce] = {}  # position -> its deferred gradient reduction
        self.finished: set[int] = set()  # positions whose deferred reduction nobody will wait
        self.kept: dict[int, Params] = {}  # unit index (-1: root) -> full params
        self.kept_uses: dict[int, int] = {}
        self.out_spec: TreeSpec | None = None
        self.rng_root: Any = None
        self.accumulator = Accumulator.current(model._token)  # reduce_once: add, don't reduce
        self.root_mode: UnitRecorder | UnitReplayer | None = None  # the root's remat mode
        self.root_replay: dict | None = None  # what the root's recorder saved
        self.root_vjp: Callable | None = None  # activations kept: the root's vjp from forward
        self.root_gather: UnitGather | None = None  # its parameters, released until backward
        self.done = False  # backward ran
        self.later_at: dict[int, tuple[str, ...]] = {}  # position -> the later_names it took
        # buffers as the forward updates them (name -> private copy, made on first use), and
        # whether apply returns them (mutable=True: extra outputs of RootFn after the model's)
        self.buffers: Params = {}
        self.mutable = mutable
        self.n_outputs = 0  # the model's own output tensors (before the buffers)
        # leaves whose gradient the backward reduces (None: every trainable one)
        self.wanted: frozenset[str] | None = None
        # a recompute in backward runs under the forward's autocast state
        self.autocast = autocast_state.capture() if record and not model._save else None

    def gather(self, unit: Unit) -> UnitGather:
        return UnitGather(unit, self.shards, self.model._ax, self.model._place, self.tags())

    def reduce(self, unit: Unit, grads: dict[str, torch.Tensor]) -> Reduce | NoReduce:
        """Start reducing ``unit``'s full gradients (or add them to the accumulator); only
        those of the leaves a gradient is wanted for."""
        if self.accumulator is not None:
            if self.wanted is not None:
                grads = {n: g for n, g in grads.items() if n in self.wanted}
            self.accumulator.add(unit.index, grads, self.model._masters)
            return NoReduce()
        return Reduce(self.model, unit, grads, self.tags(), self.wanted)

    def replay_autocast(self) -> contextlib.AbstractContextManager:
        """The forward's autocast state, for a recompute (as ``torch.utils.checkpoint``)."""
        return self.autocast.replay() if self.autocast is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def unit_scope(self) -> Iterator[None]:
        """Hide a unit's ops from the root's remat recorder / replayer."""
        if self.root_mode is None:
            yield
        else:
            with self.root_mode.pause():
                yield

    # ---- gathering, with prefetch ----------------------------------------------------------
    def gathered(self, unit: Unit, phase: str,
                 position: int) -> tuple[Params, UnitGather | None]:
        """Full parameters of ``unit`` for its call at ``position``, and their gather (None
        when kept from forward); prefetch the next ones."""
        if unit.index in self.kept:
            return self.kept[unit.index], None
        pending = self.prefetched.pop((phase, position), None)
        if pending is None or pending.unit is not unit:
            if pending is not None:
                pending.wait()  # a wrong guess: complete it and drop it
            pending = self.start_gather(unit, phase, position)
        full = pending.wait()
        self.prefetch(phase, position)
        if self.keep and phase == "forward":
            self.kept[unit.index] = full
        return full, pending

    def start_gather(self, unit: Unit, phase: str, position: int) -> UnitGather:
        """Issue the gather for a call: in backward, into the storage its forward kept."""
        if phase == "backward" and self.saved[position].gather is not None:
            return self.saved[position].gather.start(self.shards, self.tags())
        return self.gather(unit)

    def prefetch(self, phase: str, position: int) -> None:
        model = self.model
        if phase == "forward":
            guess = model._order_hint or list(range(len(model._units)))
            ahead = [(q, guess[q]) for q in range(position + 1, position + 1 + model.prefetch)
                     if q < len(guess)]
        else:
            ahead = [(q, self.order[q]) for q in range(position - 1, position - 1 - model.prefetch,
                                                        -1) if q >= 0]
        for q, index in ahead:
            if (phase, q) not in self.prefetched and index not in self.kept:
                self.prefetched[(phase, q)] = self.start_gather(model._units[index], phase, q)

    def drop_prefetched(self) -> None:
        for pending in self.prefetched.values():
            pending.wait()
        self.prefetched.clear()

    def params_for(self, unit: Unit, full: Params, override: Mapping = (),
                   buffers: Params | None = None) -> Params:
        """What ``functional_call`` on the unit's module gets, by the module's own names.

        Buffers come from ``buffers`` (default: the step's, as the forward has updated
        them so far), private copies the forward may update in place.
        """
        params = {}
        buffers = self.buffers if buffers is None else buffers
        for name, rel in unit.rel:
            if name in override:
                params[rel] = override[name]
            elif name in full:
                params[rel] = full[name]
            elif name in self.model._buffer_set:
                if name not in buffers:  # first use: a private copy
                    buffers[name] = self.local[name].clone()
                params[rel] = buffers[name]
            elif name in unit.external:
                params[rel] = self.root_plain[name]
            else:  # a replicated (0-dim) parameter
                params[rel] = self.local[name]
        return params

    # ---- forward ---------------------------------------------------------------------------
    def forward_root(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        model = self.model
        root, names, place = model._root, model.names, model._place
        self.shards = dict(zip(names, tensors[:len(names)], strict=True))
        local = [n for u in (*model._units, root) for n in u.replicated] + [
            n for n in names if n in model._buffer_set]
        self.local = {n: place.cast(place.to_compute(self.shards[n])) for n in local}
        args, kwargs = self.arg_spec.build(tensors[len(names):])
        pending = self.gather(root)
        self.prefetch("forward", -1)
        full = pending.wait()
        if self.keep:
            self.kept[-1] = full
        self.root_plain = {**full, **{n: self.local[n] for n in root.replicated}}
        self.rng_root = _rng_state()
        saving = self.record and model._save
        try:
            if saving:
                out = self.forward_root_saving(args, kwargs)
            else:
                params = self.params_for(root, self.root_plain)
                if self.record and model._policy is not None:
                    self.root_mode = UnitRecorder(model._policy, params)
                with _active(self), self.root_mode or contextlib.nullcontext():
                    out = _call(root, params, args, kwargs)
                del params
        finally:
            self.drop_prefetched()
        if saving and not self.keep:  # the root's vjp holds its parameters: free the storage
            pending.release()
            self.root_gather = pending
        if self.root_mode is not None:
            self.root_replay, self.root_mode = self.root_mode.finish(), None
        del pending, full
        self.model._order_hint[:] = self.order
        self.root_plain = {}
        self.out_spec, outputs = TreeSpec.of(out)
        self.n_outputs = len(outputs)
        inputs = {id(t) for t in tensors}
        outputs = [x.clone() if id(x) in inputs else x for x in outputs]
        if self.mutable:
            outputs += self.new_buffers()
        self.buffers = {}
        return tuple(outputs)

    def new_buffers(self) -> list[torch.Tensor]:
        """Every buffer (in the model's order) as the forward left it, in the form the
        caller gave it (its dtype and device): private tensors."""
        model, out = self.model, []
        for name in model.functional.buffer_names:
            given = self.shards[name]
            value = self.buffers.get(name)
            if value is None:  # no unit used it: unchanged
                value = given.detach().clone()
            else:
                value = model._place.to_storage(value).to(given.dtype)
            out.append(value)
        return out

    def forward_root_saving(self, args: tuple, kwargs: dict) -> Any:
        """Run the root recording its autograd graph (kept for backward: no recompute).

        Each unit call computes first (on plain inputs, recording its own graph), then
        its output enters the root's graph through ``UnitFn`` as in a replay.
        """
        model, root = self.model, self.model._root
        spec, tensors = TreeSpec.of((args, kwargs))
        with torch.enable_grad():
            root_train = {n: self.root_plain[n].detach().requires_grad_() for n in root.grad_inputs}
            unit_train = {n: self.shards[n].detach().requires_grad_()
                          for n in model._unit_trainable}
            tensors = [t.detach().requires_grad_() if self.arg_wants[i] else t
                       for i, t in enumerate(tensors)]
            self.mode, self.replay_at, self.overrides = "forward+replay", 0, unit_train
            self.root_values = {**self.root_plain, **root_train}
            try:
                with _active(self):
                    out = _call(root, self.params_for(root, self.root_values),
                                *spec.build(tensors))
            finally:
                self.mode = "forward"
                self.root_values, self.overrides = {}, {}
        self.check_guesses()
        wanted = {i: tensors[i] for i, w in enumerate(self.arg_wants) if w}
        self.root_vjp = _recorded_vjp(out, (root_train, unit_train, wanted))
        return _detached(out)

    def call_unit(self, index: int, args: tuple, kwargs: dict) -> Any:
        unit = self.model._units[index]
        with self.unit_scope():
            if self.mode == "replay":
                return self.replay_unit(unit, args, kwargs)
            if self.mode == "forward+replay":  # compute on plain inputs, then join the graph
                spec, tensors = TreeSpec.of((args, kwargs))
                self.forward_unit(unit, *spec.build(_plain(tensors)))
                return self.replay_unit(unit, args, kwargs)
            return self.forward_unit(unit, args, kwargs)

    def forward_unit(self, unit: Unit, args: tuple, kwargs: dict) -> Any:
        position = len(self.order)
        self.order.append(unit.index)
        rng_before = _rng_state()
        # a recompute in backward starts from the buffers this call found (its own updates
        # to them are thrown away: the forward's count once)
        buffers_before = ({n: self.buffers[n].clone() if n in self.buffers else self.local[n]
                           for n in unit.buffers} if self.record and not self.model._save
                          else None)
        full, gather = self.gathered(unit, "forward", position)
        vjp_fn, recorder = None, None
        if self.record and self.model._save:
            out, vjp_fn = self.forward_saving(unit, full, args, kwargs)
            if not self.keep:  # autograd holds the parameters: free their storage instead
                gather.release()
            else:
                gather = None
        else:
            gather = None
            params = self.params_for(unit, full)
            if self.record and self.model._policy is not None:
                recorder = UnitRecorder(self.model._policy, params)
            with recorder or contextlib.nullcontext():
                out = _call(unit, params, args, kwargs)
            del params
        del full
        if self.keep:
            self.kept_uses[unit.index] = self.kept_uses.get(unit.index, 0) + 1
        if self.record:
            spec, tensors = TreeSpec.of(out)
            self.saved.append(_Saved(tensors, [t._version for t in tensors], spec, rng_before,
                                     _rng_state(), recorder.finish() if recorder else None,
                                     vjp_fn, gather, buffers_before))
        return out

    def forward_saving(self, unit: Unit, full: Params, args: tuple,
                       kwargs: dict) -> tuple[Any, Callable]:
        """Run a unit recording its autograd graph (w.r.t. its trainable leaves and floating
        inputs): its output, and the vjp its backward calls (no recompute)."""
        values = {**self.local, **self.root_plain, **full}
        spec, tensors = TreeSpec.of((args, kwargs))
        with torch.enable_grad():
            train = {n: values[n].detach().requires_grad_() for n in unit.grad_inputs}
            tensors = [t.detach().requires_grad_() if is_float(t) else t for t in tensors]
            out = _call(unit, self.params_for(unit, full, train), *spec.build(tensors))
        floats = {i: t for i, t in enumerate(tensors) if is_float(t)}
        return _detached(out), _recorded_vjp(out, (train, floats))

    def replay_unit(self, unit: Unit, args: tuple, kwargs: dict) -> Any:
        position = self.replay_at
        self.replay_at += 1
        if position >= len(self.order) or self.order[position] != unit.index:
            raise RuntimeError(
                f"shard_params: when recomputed for backward, the root forward made call "
                f"{position} to unit {unit.label}, but in forward the unit calls were "
                f"{[self.model.units[i] for i in self.order]}; the root forward must be "
                f"deterministic"
            )
        saved = self.saved[position]
        if any(t._version != v for t, v in zip(saved.outputs, saved.versions, strict=True)):
            raise RuntimeError(
                f"shard_params: an output of unit {unit.label} was modified in place after the "
                f"unit returned it; backward replays that output, so update it out of place "
                f"(x = x + y rather than x += y)"
            )
        values = {**self.root_values, **self.overrides}
        arg_spec, arg_tensors = TreeSpec.of((args, kwargs))
        self.later_at[position] = later = self.later_names(position)
        inputs = [values[name] for name in unit.grad_inputs + later]
        outputs = UnitFn.apply(self, position, arg_spec, *inputs, *arg_tensors)
        saved.outputs = []  # the replayed outputs now own the storage
        _set_rng_state(saved.rng_after)
        return saved.spec.build(outputs)

    def later_names(self, position: int) -> tuple[str, ...]:
        """Shards of the next call's unit: their gradient comes out of this call's backward.

        The reduce-scatter a unit call issues in its backward is waited in the backward of
        the call before it (which runs next), so it overlaps with that call's backward.
        """
        if self.mode == "forward+replay":  # the next call has not happened yet: guess it
            guess = self.model._order_hint or list(range(len(self.model._units)))
            following = guess[position + 1] if position + 1 < len(guess) else None
        else:
            following = self.order[position + 1] if position + 1 < len(self.order) else None
        return () if following is None else self.model._units[following].owned_grads

    def check_guesses(self) -> None:
        """After a forward that guessed each call's successor: a call whose predecessor
        guessed wrong waits for its own reduction (nobody else would return it)."""
        for position in range(len(self.order) - 1):
            actual = self.model._units[self.order[position + 1]].owned_grads
            if self.later_at.get(position) != actual:
                self.finished.add(position + 1)

    # ---- backward --------------------------------------------------------------------------
    def backward_root(self, arg_tensors, grads, outputs_float, needs_grad) -> tuple:
        model, root = self.model, self.model._root
        if self.mode == "replay" or self.done:
            raise RuntimeError("shard_params: backward through one apply() call can run only "
                               "once (it frees what it saved); call model.apply again")
        self.done = True
        trainable = [n for n, need in zip(model.names, needs_grad, strict=False)
                     if need and n in model._trainable_set]
        if len(trainable) < len(model._trainable_set):  # some leaves want no gradient
            self.wanted = frozenset(trainable)
        if self.root_vjp is not None:
            return self.backward_root_saved(arg_tensors, grads, outputs_float, needs_grad)
        full = self.kept.pop(-1, None)
        if full is None:
            pending = self.gather(root)
            self.prefetch("backward", len(self.order))
            full = pending.wait()
        self.root_plain = {**full, **{n: self.local[n] for n in root.replicated}}
        root_train = {n: self.root_plain[n] for n in root.grad_inputs}
        unit_train = {n: self.shards[n] for n in model._unit_trainable}
        n_leaves = len(model.names)
        float_args = {i: t for i, t in enumerate(arg_tensors)
                      if t.is_floating_point() and needs_grad[n_leaves + i]}
        cotangents = tuple(g for g, f in zip(grads, outputs_float, strict=True) if f)

        def recompute(root_train, unit_train, float_args):
            args, kwargs = self.arg_spec.build([float_args.get(i, t)
                                                for i, t in enumerate(arg_tensors)])
            self.mode, self.replay_at, self.overrides = "replay", 0, unit_train
            self.root_values = {**self.root_plain, **root_train}
            if self.root_replay is not None:
                self.root_mode = UnitReplayer(self.root_replay)
            try:  # from the buffers as the forward found them (its updates count once)
                with (_active(self), _forked_rng(self.rng_root), self.replay_autocast(),
                      self.root_mode or contextlib.nullcontext()):
                    out = _call(root, self.params_for(root, self.root_values, buffers={}),
                                args, kwargs)
            finally:
                self.root_mode = None
            return _float_outputs(out, outputs_float)

        _, vjp_fn = torch.func.vjp(recompute, root_train, unit_train, float_args)
        g_root, g_units, g_args = vjp_fn(cotangents)
        del vjp_fn, full, root_train
        return self.finish_backward(g_root, g_units, g_args, len(arg_tensors))

    def backward_root_saved(self, arg_tensors, grads, outputs_float, needs_grad) -> tuple:
        """Backward of a forward that kept its vjp: refill the root's parameters, run it."""
        kept = self.kept.pop(-1, None)
        if kept is None:
            self.root_gather.start(self.shards, self.tags())
            self.prefetch("backward", len(self.order))
            self.root_gather.wait()
        cotangents = tuple(g for g, f in zip(grads, outputs_float, strict=True) if f)
        g_root, g_units, g_args = self.root_vjp(cotangents)
        self.root_vjp = None
        if self.root_gather is not None:
            self.root_gather.release()
            self.root_gather = None
        n_leaves = len(self.model.names)
        g_args = {i: g for i, g in g_args.items() if needs_grad[n_leaves + i]}
        return self.finish_backward(g_root, g_units, g_args, len(arg_tensors))

    def finish_backward(self, g_root, g_units, g_args, n_args: int) -> tuple:
        """Reduce the root's gradients, collect the units' and return the leaves' grads."""
        model, root = self.model, self.model._root
        self.drop_prefetched()
        self.root_values, self.overrides, self.root_plain, self.saved = {}, {}, {}, []
        self.root_replay = None
        g_units = dict(g_units)
        root_reduce = self.reduce(root, dict(g_root))
        for pending in self.reducing.values():  # the first call's, and any left unclaimed
            for name, grad in pending.wait().items():
                g_units[name] = g_units[name] + grad
        self.reducing.clear()
        reduced = root_reduce.wait()
        trainable = model._trainable_set if self.wanted is None else self.wanted
        leaf_grads = [(reduced[n] if n in reduced else g_units.get(n)) if n in trainable else None
                      for n in model.names]
        return (*leaf_grads, *[g_args.get(i) for i in range(n_args)])

    def backward_unit(self, position: int, arg_spec: TreeSpec, arg_tensors, grads,
                      outputs_float, needs_grad) -> tuple:
        unit = self.model._units[self.order[position]]
        full, _ = self.gathered(unit, "backward", position)
        if unit.index in self.kept:
            self.kept_uses[unit.index] -= 1
            if not self.kept_uses[unit.index]:
                del self.kept[unit.index]
        later = self.later_at[position]
        n_inputs = len(unit.grad_inputs) + len(later)
        cotangents = tuple(g for g, f in zip(grads, outputs_float, strict=True) if f)
        saved = self.saved[position]
        if saved.vjp_fn is not None:  # activations kept: the forward's vjp, on refilled params
            g_train, g_args = saved.vjp_fn(cotangents)
            g_train = dict(g_train)
            saved.vjp_fn = None
            if saved.gather is not None:
                saved.gather.release()
                saved.gather = None
        else:
            g_train, g_args = self.recompute_vjp(unit, saved, full, arg_spec, arg_tensors,
                                                 cotangents, outputs_float,
                                                 needs_grad[n_inputs:])
        full = None
        external = {n: g_train.pop(n).detach() for n in unit.external if n in g_train}
        # the next call's reduction, issued in its backward (which ran just before this one)
        # and in flight during this one's: finished before this one's starts, so at most
        # one reduction is in flight
        later_grads: Params = {}
        if later:
            pending = self.reducing.pop(position + 1, None)
            if pending is not None:
                later_grads = pending.wait()
            else:  # its backward has not run (a branch): it must finish its own
                self.finished.add(position + 1)
        reduce = self.reduce(unit, g_train)
        if position in self.finished:
            own = reduce.wait()
        else:  # the call before this one (or the root) waits for it and returns the grads
            self.reducing[position] = reduce
            own = {}
        grad_inputs = [external[n] if n in external else own.get(n) for n in unit.grad_inputs]
        return (*grad_inputs, *[later_grads.get(n) for n in later],
                *[g_args.get(i) if needs_grad[n_inputs + i] else None
                  for i in range(len(arg_tensors))])

    def recompute_vjp(self, unit: Unit, saved: _Saved, full: Params, arg_spec: TreeSpec,
                      arg_tensors, cotangents, outputs_float, needs_grad) -> tuple[dict, dict]:
        """Recompute a unit call under ``torch.func.vjp`` (replaying what its policy
        recorded, with the forward's RNG state) and apply it to ``cotangents``."""
        values = {**self.local, **self.root_plain, **full}
        train = {n: values[n] for n in unit.grad_inputs}
        float_args = {i: t for i, t in enumerate(arg_tensors)
                      if t.is_floating_point() and needs_grad[i]}

        def recompute(train, float_args):
            args, kwargs = arg_spec.build([float_args.get(i, t) for i, t in enumerate(arg_tensors)])
            replayer = UnitReplayer(saved.replay) if saved.replay is not None else None
            buffers = {n: t.clone() for n, t in (saved.buffers or {}).items()}
            with (_forked_rng(saved.rng_before), self.replay_autocast(),
                  replayer or contextlib.nullcontext()):
                out = _call(unit, self.params_for(unit, full, train, buffers), args, kwargs)
            return _float_outputs(out, outputs_float)

        _, vjp_fn = torch.func.vjp(recompute, train, float_args)
        saved.replay = saved.buffers = None  # the recompute has what it needs
        g_train, g_args = vjp_fn(cotangents)
        return dict(g_train), g_args


class RootFn(torch.autograd.Function):
    """The whole apply(): inputs are every leaf and every tensor argument."""

    @staticmethod
    def forward(step: Step, *tensors: torch.Tensor):
        return step.forward_root(tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        step = ctx.step = inputs[0]
        ctx.save_for_backward(*inputs[1 + len(step.model.names):])
        n = ctx.n_outputs = step.n_outputs  # then the new buffers (mutable=True)
        ctx.outputs_float = [is_float(o) for o in output[:n]]
        ctx.mark_non_differentiable(*[o for o in output[:n] if not is_float(o)], *output[n:])

    @staticmethod
    def backward(ctx, *grads):
        saved, grads = _plain(ctx.saved_tensors), _plain(grads[:ctx.n_outputs])
        return None, *ctx.step.backward_root(saved, grads, ctx.outputs_float,
                                              ctx.needs_input_grad[1:])


class UnitFn(torch.autograd.Function):
    """One unit call inside the root's recompute: forward replays, backward does the work."""

    @staticmethod
    def forward(step: Step, position: int, arg_spec: TreeSpec, *tensors: torch.Tensor):
        return tuple(t.detach() for t in step.saved[position].outputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        step, position, arg_spec = inputs[:3]
        unit = step.model._units[step.order[position]]
        n_inputs = len(unit.grad_inputs) + len(step.later_at[position])
        ctx.step, ctx.position, ctx.arg_spec = step, position, arg_spec
        ctx.save_for_backward(*inputs[3 + n_inputs:])
        ctx.outputs_float = [is_float(o) for o in output]
        ctx.mark_non_differentiable(*[o for o in output if not is_float(o)])

    @staticmethod
    def backward(ctx, *grads):
        saved, grads = _plain(ctx.saved_tensors), _plain(grads)
        return None, None, None, *ctx.step.backward_unit(
            ctx.position, ctx.arg_spec, saved, grads, ctx.outputs_float, ctx.needs_input_grad[3:])


# ================================================================ small helpers


def _call(unit: Unit, params: Params, args: tuple, kwargs: dict) -> Any:
    return torch.func.functional_call(unit.module, params, args, kwargs, tie_weights=True,
                                      strict=True)


def _plain(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Strip functorch wrappers (saved tensors of a finished vjp level would trip its asserts)."""
    return [None if t is None else _base(t).detach() for t in tensors]


is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def is_float(x: torch.Tensor) -> bool:
    return x.is_floating_point() or x.is_complex()


def _float_outputs(out: Any, outputs_float: Sequence[bool]) -> tuple[torch.Tensor, ...]:
    tensors = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    return tuple(x for x, f in zip(tensors, outputs_float, strict=True) if f)


@contextlib.contextmanager
def _active(step: Step) -> Iterator[None]:
    ACTIVE.append(step)
    try:
        yield
    finally:
        ACTIVE.remove(step)


def _detached(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)


def _recorded_vjp(out: Any, groups: tuple[Mapping, ...]) -> Callable:
    """The vjp of a recorded autograd graph from the floating tensors of ``out`` to the
    tensors of ``groups`` (mappings key -> leaf requiring grad).

    Returns ``fn(cotangents) -> tuple of {key: grad}`` (one per group, zeros where
    unused), like ``torch.func.vjp`` of the same computation. It runs plain autograd
    with functorch disabled, so it may be called inside a ``torch.func`` transform's
    backward; it frees the graph.
    """
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and is_float(o)]
    inputs = [t for group in groups for t in group.values()]

    def vjp_fn(cotangents: Sequence[torch.Tensor]) -> tuple[dict, ...]:
        pairs = [(o, g) for o, g in zip(outs, cotangents, strict=True) if o.requires_grad]
        grads: Sequence[torch.Tensor | None] = [None] * len(inputs)
        if pairs and inputs:
            # functorch off, and its interpreter stack hidden: an autograd.Function whose
            # backward calls another Function's apply (the collectives') then runs as plain
            # autograd instead of functorch's custom_function_call
            with no_functorch(), temporarily_clear_interpreter_stack():
                grads = torch.autograd.grad([o for o, _ in pairs], inputs,
                                            [g for _, g in pairs], allow_unused=True)
        it = iter(torch.zeros(x.shape, dtype=x.dtype, device=x.device) if g is None else g
                  for g, x in zip(grads, inputs, strict=True))
        return tuple({key: next(it) for key in group} for group in groups)

    return vjp_fn


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


@contextlib.contextmanager
def _forked_rng(state: tuple) -> Iterator[None]:
    """Run a block from the RNG ``state`` (as in forward), then restore the caller's."""
    before = _rng_state()
    _set_rng_state(state)
    try:
        yield
    finally:
        _set_rng_state(before)


