"""``assert_sharded_matches``: a sharded training step equals its unsharded reference.

The user describes both sides as a :class:`Trainer`: an initial state (a dict
such as ``{"params": ..., "opt_state": ...}``), a step ``(state, batch) ->
(state, record)`` whose record holds metrics such as ``{"loss": ..., "grads":
...}``, and, for the sharded side, a ``gather`` that turns a rank's state and
record into full tensors (``sf.gather`` with ``model.specs``, an optimizer's
``gather_state``, ...; :func:`gather_with` builds it from spec trees).

The sharded side is made on every rank of a local world by ``sharded(mesh)``;
the reference by ``reference()`` in the test process. Each step gets the same
global batch; each rank's share is cut by ``split`` (by default dim 0 over the
mesh's ``"dp"`` axis, or the whole batch when there is none). The kit compares
the initial state and, after every step, the keys of ``compare`` with
``torch.testing.assert_close``, leaf by leaf, rank by rank; see
:mod:`shardfn.testing._compare` for the failure message and its hints.

Example:
    >>> def sharded(mesh):
    ...     dp = sf.data_parallel(mesh, "dp")
    ...     return loss_trainer(params, loss_fn, reduce_grads=dp.reduce_grads)
    >>> assert_sharded_matches(sharded, lambda: loss_trainer(params, loss_fn),
    ...                        mesh={"dp": 2}, inputs=[batch0, batch1])
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from shardfn import pytree
from shardfn.testing import worlds as _worlds
from shardfn.testing._compare import Tolerance, compare_runs

__all__ = ["COMPARE", "Trainer", "assert_sharded_matches", "gather_with", "loss_trainer",
           "split_over", "state_specs"]

COMPARE = ("loss", "outputs", "grads", "params", "opt_state")
State = Mapping[str, Any]
Step = Callable[[State, Any], tuple[State, Mapping[str, Any]]]


class Trainer(NamedTuple):
    """One side of a comparison.

    Attributes:
        state: the initial state, a dict of named trees (e.g. ``params``, ``opt_state``).
        step: ``(state, batch) -> (new_state, record)``; the record a dict of named trees
            (e.g. ``loss``, ``outputs``, ``grads``). On the sharded side, values that are
            the same on every rank (the loss) must be reduced already (``sf.pmean``).
        gather: ``(state | record) -> full`` on the sharded side: the same dict with full
            tensors (collectives allowed; called on every rank). None: values are full.
    """

    state: State
    step: Step
    gather: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None


def loss_trainer(params: Any, loss_fn: Callable, *, opt: Any = None,
                 reduce_grads: Callable | None = None, reduce_loss: Callable | None = None,
                 gather: Callable | None = None, with_outputs: bool = False) -> Trainer:
    """A :class:`Trainer` for the common step: gradient, optional reduction, optional update.

    Args:
        params: the initial parameters (this rank's shards on the sharded side).
        loss_fn: ``loss_fn(params, batch) -> loss`` (``-> (loss, outputs)`` with
            ``with_outputs``).
        opt: a pure optimizer (``init``/``update``, e.g. ``sf.optim.adamw`` or a
            ``sf.shard_opt_state`` of one); None: parameters stay as they are.
        reduce_grads: applied to the gradient tree (e.g. ``dp.reduce_grads``).
        reduce_loss: applied to the loss (e.g. ``lambda l: sf.pmean(l, "dp")``).
        gather: as :attr:`Trainer.gather`.
        with_outputs: ``loss_fn`` also returns outputs, recorded as ``"outputs"``.

    Returns:
        A trainer with state ``{"params"[, "opt_state"]}`` and records
        ``{"loss", "grads"[, "outputs"]}``.

    Example:
        >>> reference = loss_trainer(params, loss_fn, opt=sf.optim.adam(1e-2))
    """
    value_and_grad = torch.func.grad_and_value(loss_fn, has_aux=with_outputs)
    state = {"params": params}
    if opt is not None:
        state["opt_state"] = opt.init(params)

    def step(state: State, batch: Any) -> tuple[State, dict[str, Any]]:
        grads, value = value_and_grad(state["params"], batch)
        loss, outputs = value if with_outputs else (value, None)
        if reduce_grads is not None:
            grads = reduce_grads(grads)
        if reduce_loss is not None:
            loss = reduce_loss(loss)
        record = {"loss": loss, "grads": grads}
        if with_outputs:
            record["outputs"] = outputs
        if opt is None:
            return state, record
        from shardfn.optim import apply_updates

        updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        return {"params": apply_updates(state["params"], updates), "opt_state": opt_state}, record

    return Trainer(state, step, gather)


class GatherWith(NamedTuple):
    """:func:`gather_with`'s gather: ``sf.gather`` of the keys of ``specs``, the others kept
    (the kit refuses a compared key it keeps that holds a gradient shard)."""

    specs: Mapping[str, Any]
    mesh: Any = None

    def __call__(self, values: dict[str, Any]) -> dict[str, Any]:
        from shardfn.spec import gather

        for key in [key for key in values if key in self.specs]:
            _check_marks(key, values[key], self.specs[key], "sf.testing.gather_with")
        return {key: gather(value, self.specs[key], self.mesh) if key in self.specs else value
                for key, value in values.items()}


def gather_with(specs: Mapping[str, Any], mesh: Any = None) -> GatherWith:
    """A :attr:`Trainer.gather` that applies ``sf.gather`` to the keys of ``specs``.

    Args:
        specs: ``key -> spec tree`` (``Layout`` leaves such as ``model.specs`` cut the
            padding off), e.g. ``{"params": model.specs, "grads": model.specs}``.
        mesh: the mesh (default: the current one).

    Returns:
        ``fn(values) -> values`` with those keys gathered and the others as they are.
        ``fn`` raises ``ValueError`` naming the leaf and the axis for a gradient shard
        (``shard_params``' gradients, see :mod:`shardfn.primitives.reduced`) whose spec
        does not name the axis it is sharded over.

    Example:
        >>> gather = gather_with({"params": tp.specs, "grads": tp.specs}, mesh)
    """
    return GatherWith(specs, mesh)


def _check_marks(key: str, value: Any, spec_tree: Any, what: str) -> None:
    """Refuse a leaf of ``value`` that is a shard over an axis its spec (a prefix tree;
    None: replicated, taken as it is) does not name: it would be compared as the whole
    tensor. Free while no tensor is marked (:mod:`shardfn.primitives.reduced`)."""
    import optree

    from shardfn.primitives import reduced
    from shardfn.spec import Layout, LeafLayout, P, spec_axes

    paths, leaves, _ = optree.tree_flatten_with_path(value, none_is_leaf=True,
                                                     namespace=pytree.NAMESPACE)
    if not any(reduced.marks_of(leaves)):
        return
    kinds = (P, Layout, LeafLayout)
    spec_leaves = pytree.broadcast_prefix(spec_tree, value, lambda x: isinstance(x, kinds))
    axes = [spec_axes(s) if isinstance(s, kinds) else () for s in spec_leaves]
    reduced.check_layouts(what, leaves, axes,
                          lambda: [f"{key}[{pytree.path_name(p)!r}]" for p in paths],
                          f"Gather it with the layout of the model that made it: gather="
                          f"sf.testing.gather_with({{{key!r}: model.specs, ...}}, mesh).")


def state_specs(opt_state: Any, param_specs: Mapping[str, Any]) -> Any:
    """A spec tree for an optimizer state: ``param_specs`` for every subtree shaped like the
    parameters (Adam's ``mu``/``nu``, a momentum), replicated (None) for the rest (counts).

    Args:
        opt_state: the optimizer state (a NamedTuple, tuple, list or dict of trees).
        param_specs: ``name -> spec`` of the parameters (e.g. ``model.specs``).

    Returns:
        A spec tree, a prefix of ``opt_state``, for ``sf.gather`` / :func:`gather_with`.

    Example:
        >>> gather_with({"opt_state": state_specs(opt.init(shards), model.specs)}, mesh)
    """
    if isinstance(opt_state, Mapping):
        if set(opt_state) == set(param_specs):
            return dict(param_specs)
        return {k: state_specs(v, param_specs) for k, v in opt_state.items()}
    if isinstance(opt_state, tuple) and hasattr(opt_state, "_fields"):
        return type(opt_state)(*(state_specs(v, param_specs) for v in opt_state))
    if isinstance(opt_state, (tuple, list)):
        return type(opt_state)(state_specs(v, param_specs) for v in opt_state)
    return None


def split_over(axis: str | tuple[str, ...] | None) -> Callable[[Any, Any], Any]:
    """A ``split`` giving each rank its equal share of dim 0 along ``axis`` (None: all of it).

    ``axis`` may be a tuple of mesh axes (their product, row-major).

    Raises (when called):
        ValueError: naming the batch leaf whose dim 0 does not divide by the axis size.
    """
    def split(batch: Any, mesh: Any) -> Any:
        if axis is None or mesh.size(axis) == 1:
            return batch
        n, index = mesh.size(axis), mesh.index(axis)
        names, leaves, treedef = pytree.tree_flatten_with_path(batch)
        out = []
        for name, leaf in zip(names, leaves, strict=True):
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.shape[0] % n:
                shape = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf)
                raise ValueError(f"assert_sharded_matches: batch leaf {name!r} ({shape}) "
                                 f"cannot be split into {n} equal parts along dim 0 over "
                                 f"mesh axis {axis!r}; pass split= or a divisible batch")
            out.append(leaf.chunk(n)[index])
        return pytree.tree_unflatten(treedef, out)

    return split


def _detached(tree: Any) -> Any:
    """CPU copies of the tensors; other leaves that may not pickle (a mesh) become their type."""
    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu", copy=True)
        return x if isinstance(x, (bool, int, float, complex, str, type(None))) else (
            f"<{type(x).__name__}>")

    return pytree.tree_map(leaf, tree)


def _run_trainer(trainer: Trainer, batches: Sequence[Any], split: Callable | None,
                 mesh: Any, compared: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Records (init, then one per step) of ``trainer`` on ``batches``, gathered and detached.

    A gradient shard under a ``compared`` key that the gather keeps as it is (no gather,
    or a :func:`gather_with` without that key) is refused, naming it: it would be compared
    as the whole tensor. A gather of the user's own is not looked into."""
    gather = trainer.gather or (lambda values: values)
    kept = (() if trainer.gather is not None and not isinstance(trainer.gather, GatherWith)
            else [key for key in compared if trainer.gather is None
                  or key not in trainer.gather.specs])

    def full(values: dict[str, Any]) -> dict[str, Any]:
        for key in [key for key in kept if key in values]:
            _check_marks(key, values[key], None, "sf.testing (a leaf compared as it is, not "
                                                 "gathered)")
        return _detached(dict(gather(values)))

    state = trainer.state
    records = [full(dict(state))]
    for batch in batches:
        local = split(batch, mesh) if split is not None else batch
        state, record = trainer.step(state, local)
        records.append(full({**state, **record}))
    return records


def _on_rank(make: Callable, mesh_shape: dict[str, int], batches: Sequence[Any],
             split: Any, compared: Sequence[str] = ()) -> list[dict[str, Any]]:
    """What every rank runs: build the mesh and the sharded trainer, run the steps."""
    from shardfn.mesh import Mesh

    mesh = Mesh(mesh_shape)
    if split == "default":
        split = split_over("dp" if "dp" in mesh_shape else None)
    elif isinstance(split, (str, tuple)) or split is None:
        split = split_over(split)
    with mesh:  # collectives in the user's step find the mesh without mesh=
        trainer = make(mesh)
        if not isinstance(trainer, Trainer):
            raise TypeError(f"assert_sharded_matches: sharded(mesh) must return a "
                            f"sf.testing.Trainer, got {type(trainer).__name__}")
        return _run_trainer(trainer, batches, split, mesh, compared)


def _mesh_shape(mesh: Mapping[str, int] | None, n_ranks: int | None) -> dict[str, int]:
    if mesh is None:
        if n_ranks is None:
            raise ValueError("assert_sharded_matches: pass mesh={'dp': n, ...} or n_ranks=n")
        return {"dp": n_ranks}
    shape = dict(mesh)
    if n_ranks is not None and math.prod(shape.values()) != n_ranks:
        raise ValueError(f"assert_sharded_matches: mesh {shape} has "
                         f"{math.prod(shape.values())} ranks, not n_ranks={n_ranks}")
    return shape


def assert_sharded_matches(sharded: Callable[[Any], Trainer],
                           reference: Callable[[], Trainer] | Trainer, *,
                           mesh: Mapping[str, int] | None = None, n_ranks: int | None = None,
                           inputs: Sequence[Any] | Callable[[int], Any] = (),
                           steps: int | None = None, split: Any = "default",
                           world: Any = None, rtol: float | None = None,
                           atol: float | None = None,
                           compare: Sequence[str] | None = None) -> list[list[dict[str, Any]]]:
    """Run ``sharded`` on a local world and ``reference`` here; assert they agree leaf by leaf.

    Args:
        sharded: ``sharded(mesh) -> Trainer``, called on every rank (shipped by cloudpickle);
            it and its steps run inside ``with mesh:``.
        reference: ``reference() -> Trainer`` (or a Trainer), run in this process.
        mesh: the mesh shape ``{axis: size}``; or ``n_ranks`` for ``{"dp": n_ranks}``.
        inputs: the global batch of every step: a sequence, or ``inputs(step)``.
        steps: how many steps (default: ``len(inputs)``; needed with a callable).
        split: ``split(batch, mesh) -> this rank's batch``, an axis name or tuple of names
            (dim 0 of every leaf split over it), None (every rank gets the whole batch), or
            the default: split over ``"dp"`` when the mesh has that axis, else the whole
            batch.
        world: a ``LocalWorld``, a ``worlds(n)``-style function, or None (the session's
            shared worlds, those of the pytest plugin's ``local_world`` fixture).
        rtol, atol: tolerances (both or neither; default: assert_close's for the dtype).
        compare: the record keys to compare, in this order; a key the reference has and
            the sharded side lacks fails. Default :data:`COMPARE` (loss, outputs, grads,
            params, opt_state), each compared where both sides report it.

    Returns:
        Every rank's records (init, then one per step), for further checks.

    Raises:
        AssertionError: naming the first differing leaf, the record ("init" / "step s"),
            the rank, the max abs/rel error, and a hint for a typical bug.
        ValueError: for a bad mesh, batch split or compare key; naming the leaf, for a
            compared gradient shard (``shard_params``' gradients, see
            :mod:`shardfn.primitives.reduced`) that no ``gather`` gathers, or that
            :func:`gather_with` gathers with a spec not naming its axis.

    Example:
        >>> assert_sharded_matches(make_sharded, make_reference, n_ranks=2,
        ...                        inputs=[batch], compare=("loss", "grads"))
    """
    shape = _mesh_shape(mesh, n_ranks)
    if (rtol is None) != (atol is None):
        raise ValueError("assert_sharded_matches: pass both rtol and atol, or neither")
    strict = compare is not None
    compare = COMPARE if compare is None else compare
    bad = [key for key in compare if not isinstance(key, str)]
    if bad or isinstance(compare, str):
        raise ValueError(f"assert_sharded_matches: compare takes a sequence of key names, "
                         f"got {compare!r}")
    if callable(inputs):
        if steps is None:
            raise ValueError("assert_sharded_matches: inputs(step) needs steps=")
        batches = [inputs(s) for s in range(steps)]
    else:
        batches = list(inputs)[:steps] if steps is not None else list(inputs)
        if steps is not None and len(batches) < steps:
            raise ValueError(f"assert_sharded_matches: steps={steps} but only {len(batches)} "
                             "inputs were given")
    ref = reference() if callable(reference) and not isinstance(reference, Trainer) else reference
    expected = _run_trainer(ref, batches, None, None)
    n = math.prod(shape.values())
    on_rank = functools.partial(_on_rank, sharded)  # a RankError's headline names `sharded`
    on_rank.__qualname__ = getattr(sharded, "__qualname__", type(sharded).__qualname__)
    per_rank = _worlds.resolve(world, n).run(on_rank, shape, batches, split, tuple(compare))
    compared = [key for key in compare if any(key in record for record in expected)]
    if not compared:
        raise ValueError(f"assert_sharded_matches: the reference reports none of {compare} "
                         f"(it reports {sorted(set().union(*expected))}); nothing to compare")
    compare_runs(expected, per_rank, keys=tuple(compare), tolerance=Tolerance(rtol, atol),
                 mesh_shape=shape, strict=strict)
    return per_rank
