"""``check_model``: the conformance suite of the model protocol (:mod:`shardfn.model`).

Every model kind (``sf.functional``, ``shard_params``, HSDP, ``tensor_split``, FSDP x TP,
``pipeline_stages``, ``with_precision``, ``remat``, and a transform of your own) must
pass it. It runs on each rank (inside ``LocalWorld.run`` or a ``torchrun`` process, or
in a single process for unsharded kinds) and compares every member with the unsharded
reference, ``model.functional`` unless another is given:

* the members exist, ``names`` / ``param_names`` / ``buffer_names`` / ``trainable_names``
  / ``frozen_names`` are this rank's slices of the reference's, ``specs`` covers
  ``names``;
* ``init(seed)`` is ``shard(reference.init(seed))`` bitwise, and ``gather`` of it is the
  reference's leaves bitwise (``sf.gather(tree, specs, mesh)`` agrees);
  ``shard(gather(x)) == x``;
* ``split_trainable`` / ``merge`` round-trip, and ``shard`` / ``gather`` of the
  trainable subset;
* ``params_from(module)`` of a module holding the reference's values is ``init``;
* ``apply`` (and with ``mutable=True`` its buffers), ``eval().apply`` and the gathered
  gradients of ``loss_fn(apply(...), targets)`` equal the reference's (a model with
  its own ``value_and_grad(params, inputs, targets)``, the pipeline, is asked for
  its gradients that way: build it with the same ``loss_fn``).

Example:
    >>> def on_rank():
    ...     mesh = sf.Mesh({"dp": dist.get_world_size()})
    ...     model = sf.shard_params(sf.functional(net), mesh, "dp")
    ...     return sf.testing.check_model(model, (x,), loss_fn=mse, targets=y)
    >>> world.run(on_rank)   # raises, naming the member and the leaf, on a mismatch
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from shardfn import pytree
from shardfn.model import missing_members
from shardfn.spec import gather as spec_gather

__all__ = ["Conformance", "check_model", "module_holding"]

Params = dict[str, torch.Tensor]


class Conformance(NamedTuple):
    """What :func:`check_model` checked on this rank.

    Attributes:
        kind: the model's type name.
        names: this rank's leaves.
        checked: the checks run, in order (``"apply"``, ``"grads"``, ...).
    """

    kind: str
    names: tuple[str, ...]
    checked: tuple[str, ...]


class _Tol(NamedTuple):
    rtol: float | None
    atol: float | None


def _fail(model: Any, member: str, message: str) -> None:
    raise AssertionError(f"{type(model).__name__}.{member}: {message}")


def _same_tree(model: Any, member: str, actual: Mapping[str, Any],
               expected: Mapping[str, Any], tol: _Tol | None, names: Sequence[str] | None = None
               ) -> None:
    """``actual[n]`` equals ``expected[n]`` for ``names`` (default: expected's); bitwise
    without ``tol``."""
    if not isinstance(actual, Mapping):
        _fail(model, member, f"returned a {type(actual).__name__}, not a dict name -> Tensor")
    names = list(expected) if names is None else list(names)
    missing = [n for n in names if n not in actual]
    if missing:
        _fail(model, member, f"missing leaves {missing}")
    for name in names:
        a, e = actual[name], expected[name]
        if not isinstance(a, torch.Tensor):
            _fail(model, member, f"leaf {name!r} is a {type(a).__name__}, not a Tensor")
        if a.shape != e.shape or a.dtype != e.dtype:
            _fail(model, member, f"leaf {name!r} is {tuple(a.shape)} {a.dtype}, expected "
                                 f"{tuple(e.shape)} {e.dtype}")
        if tol is None:
            if not torch.equal(a.detach(), e.detach()):
                _fail(model, member, f"leaf {name!r} differs from the reference (bitwise "
                                     f"check; max |diff| {(a - e).abs().max().item():.3g})")
        else:
            try:
                torch.testing.assert_close(a.detach(), e.detach(), rtol=tol.rtol,
                                           atol=tol.atol)
            except AssertionError as error:
                _fail(model, member, f"leaf {name!r} differs from the reference: {error}")


def _plain(out: Any) -> Any:
    """A Hugging Face ``ModelOutput`` (an ordered dict that also indexes by position) as a
    plain dict of its set fields, so its tensors are compared; anything else unchanged."""
    if isinstance(out, Mapping) and callable(getattr(out, "to_tuple", None)):
        return {key: _plain(value) for key, value in out.items()}
    return out


def _same_output(model: Any, member: str, actual: Any, expected: Any, tol: _Tol) -> None:
    a_leaves, a_def = pytree.tree_flatten(_plain(actual))
    e_leaves, e_def = pytree.tree_flatten(_plain(expected))
    if a_def != e_def:
        _fail(model, member, f"output structure {a_def} differs from the reference's {e_def}")
    _same_tree(model, member, {str(i): x for i, x in enumerate(a_leaves)},
               {str(i): x for i, x in enumerate(e_leaves)}, tol)


def module_holding(functional: Any, full: Mapping[str, torch.Tensor]) -> nn.Module:
    """A materialised copy of ``functional.module`` whose leaves hold ``full``'s values.

    Args:
        functional: a :class:`~shardfn.functional.FunctionalModel`.
        full: ``name -> Tensor`` for every leaf (tied aliases may be left out).

    Returns:
        A new module on ``full``'s device (``params_from`` of it is ``full``).

    Example:
        >>> module = module_holding(fm, fm.init(0))
    """
    device = next(iter(full.values())).device if full else torch.device("cpu")
    module = copy.deepcopy(functional.module).to_empty(device=device)
    found = dict(module.named_parameters(remove_duplicate=False))
    found.update(module.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for name, value in full.items():
            found[name].copy_(value)
    return module


def _names(model: Any, reference: Any) -> None:
    names = tuple(model.names)
    order = [n for n in reference.names if n in set(names)]
    if list(names) != order or len(set(names)) != len(names):
        _fail(model, "names", f"{names} is not a slice of the reference's leaves "
                              f"{reference.names} in their order")
    for member in ("param_names", "buffer_names", "trainable_names", "frozen_names"):
        want = tuple(n for n in getattr(reference, member) if n in set(names))
        if tuple(getattr(model, member)) != want:
            _fail(model, member, f"{tuple(getattr(model, member))}, expected this rank's "
                                 f"slice of the reference's: {want}")
    if set(model.specs) != set(names):
        _fail(model, "specs", f"covers {sorted(model.specs)}, expected the leaves {names}")


def _loss_and_grads(model: Any, params: Params, args: tuple, kwargs: dict,
                    loss_fn: Callable, targets: Any) -> tuple[torch.Tensor, Params]:
    """The loss and the gradients of this rank's trainable leaves."""
    if hasattr(model, "value_and_grad"):  # a model that runs its own backward (pipeline)
        loss, grads = model.value_and_grad(params, *args, targets, **kwargs)
        return loss, grads
    trainable, rest = model.split_trainable(params)

    def loss_of(t):
        return loss_fn(model.apply(model.merge(t, rest), *args, **kwargs), targets)

    grads, loss = torch.func.grad_and_value(loss_of)(trainable)
    return loss, grads


def check_model(model: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                *, seed: int = 0, reference: Any = None,
                loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, targets: Any = None,
                mutable: bool = True, rtol: float | None = None, atol: float | None = None
                ) -> Conformance:
    """Check that ``model`` implements the model protocol and computes its reference.

    Call it on every rank with the same arguments (the checks run collectives).

    Args:
        model: the model under test.
        args, kwargs: the inputs of one ``apply`` (the same on every rank).
        seed: the ``init`` seed.
        reference: the unsharded model it must compute (default ``model.functional``;
            give ``sf.with_precision(fm, p)`` for a precision-wrapped model).
        loss_fn: ``(output, targets) -> scalar``; with it the gathered gradients of the
            trainable leaves are compared too.
        targets: the second argument of ``loss_fn``.
        mutable: also check ``apply(..., mutable=True)``'s buffers (False for a kind that
            refuses it, such as the pipeline's inference ``apply``).
        rtol, atol: tolerances of the computed values (outputs, buffers, gradients);
            leaves (init, shard, gather, params_from) are compared bitwise.

    Returns:
        A :class:`Conformance` record of the checks that ran.

    Raises:
        AssertionError: naming the member, and the leaf, that does not conform.

    Example:
        >>> check_model(sf.functional(nn.Linear(3, 2)), (torch.randn(4, 3),))
        Conformance(kind='FunctionalModel', ...)
    """
    kwargs = dict(kwargs or {})
    args = tuple(args)
    missing = missing_members(model)
    if missing:
        _fail(model, "protocol", f"lacks the members {missing} (see shardfn.model.MEMBERS)")
    reference = model.functional if reference is None else reference
    functional = model.functional
    if (rtol is None) != (atol is None):  # one given: the other at torch's float32 default
        rtol, atol = (1.3e-6 if rtol is None else rtol), (1e-5 if atol is None else atol)
    tol = _Tol(rtol, atol)
    checked = ["members"]
    _names(model, functional)
    checked.append("names")

    full = functional.init(seed)
    local = model.init(seed)
    _same_tree(model, "init", local, model.shard(full), None, model.names)
    if set(local) != set(model.names):
        _fail(model, "init", f"returned leaves {sorted(local)}, expected {model.names}")
    gathered = model.gather(local)
    _same_tree(model, "gather", gathered, full, None, [n for n in functional.names
                                                       if n in gathered or n in local])
    by_specs = spec_gather(dict(local), dict(model.specs), model.mesh) \
        if model.mesh is not None else dict(local)
    _same_tree(model, "specs (sf.gather with them)", by_specs, full, None, list(local))
    _same_tree(model, "shard(gather(x))", model.shard(gathered), local, None, model.names)
    checked += ["init", "shard", "gather", "specs"]

    trainable, rest = model.split_trainable(local)
    if sorted(trainable) != sorted(model.trainable_names):
        _fail(model, "split_trainable", f"trainable part {sorted(trainable)}, expected "
                                        f"{sorted(model.trainable_names)}")
    _same_tree(model, "merge", model.merge(trainable, rest), local, None, model.names)
    full_trainable = {n: full[n] for n in functional.trainable_names}
    _same_tree(model, "shard (the trainable subset)", model.shard(full_trainable), trainable,
               None)
    _same_tree(model, "gather (the trainable subset)", model.gather(trainable), full, None,
               list(trainable))
    checked += ["split_trainable", "merge", "subsets"]

    from_module = model.params_from(module_holding(functional, full))
    _same_tree(model, "params_from", from_module, local, None, model.names)
    checked.append("params_from")

    expected = reference.apply(full, *args, **kwargs)
    _same_output(model, "apply", model.apply(local, *args, **kwargs), expected, tol)
    checked.append("apply")
    if mutable:
        out, buffers = model.apply(local, *args, mutable=True, **kwargs)
        ref_out, ref_buffers = reference.apply(full, *args, mutable=True, **kwargs)
        _same_output(model, "apply(mutable=True)", out, ref_out, tol)
        _same_tree(model, "apply(mutable=True) buffers", model.gather(buffers),
                   ref_buffers, tol, [n for n in model.buffer_names])
        checked.append("mutable")
    evaluated = model.eval()
    if type(evaluated) is not type(model):
        _fail(model, "eval", f"returned a {type(evaluated).__name__}")
    _same_output(model, "eval().apply", evaluated.apply(local, *args, **kwargs),
                 reference.eval().apply(full, *args, **kwargs), tol)
    _same_output(model, "apply after eval() (self unchanged)",
                 model.apply(local, *args, **kwargs), expected, tol)
    checked.append("train/eval")

    if loss_fn is not None:
        loss, grads = _loss_and_grads(model, local, args, kwargs, loss_fn, targets)
        ref_trainable, ref_rest = reference.split_trainable(full)
        ref_grads, ref_loss = torch.func.grad_and_value(
            lambda t: loss_fn(reference.apply(reference.merge(t, ref_rest), *args, **kwargs),
                              targets))(ref_trainable)
        _same_output(model, "loss", loss, ref_loss, tol)
        full_grads = model.gather(grads)
        lost = [n for n in grads if n not in full_grads]
        if lost:
            _fail(model, "gather (gradients)", f"dropped the leaves {lost}")
        _same_tree(model, "gradients (gathered)", full_grads, ref_grads, tol,
                   [n for n in functional.trainable_names if n in full_grads])
        checked.append("grads")
    return Conformance(type(model).__name__, tuple(model.names), tuple(checked))
