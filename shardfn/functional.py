"""Turn an ``nn.Module`` into a pure pair ``(init, apply)`` over a flat dict of tensors.

``functional(module)`` keeps a *skeleton* of the module on the meta device (no
memory, never the user's tensors) and returns a :class:`FunctionalModel`:

* ``init(seed)`` builds the parameters and buffers as a flat dict
  ``name -> Tensor`` (names as in ``module.named_parameters()`` /
  ``named_buffers()``), each submodule under its own seed, so
  ``init_subset(seed, paths)`` gives exactly that slice of ``init(seed)``: a
  rank can build just its shard.
* ``apply(params, *args, **kwargs)`` runs the module's forward with ``params``
  swapped into the skeleton for the call, as ``torch.func.functional_call`` does
  (which it uses for a parametrized module); it is pure (buffers are passed as private
  copies, so a BatchNorm in training mode never changes the caller's tensors)
  and works under ``torch.func.grad`` / ``vjp`` / ``vmap`` and plain autograd.

How each leaf is initialised (an ``init_fns`` entry, else the owner's
``reset_parameters()``, else a copy of the user's value) is described in
:mod:`shardfn._functional_init`.

Tied weights (one tensor registered under two names) are one leaf under the
first name; ``tied`` maps each alias to it and ``apply`` keeps them tied, so
gradients through both uses add up in the one leaf.

Example:
    >>> import torch
    >>> from shardfn.functional import functional
    >>> model = functional(torch.nn.Linear(3, 2))
    >>> params = model.init(0)
    >>> sorted(params)
    ['bias', 'weight']
    >>> model.apply(params, torch.ones(4, 3)).shape
    torch.Size([4, 2])
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardfn._functional_hf import without_input_grad_hooks, without_kv_cache
from shardfn._functional_init import InitFn, InitPlan, derive_seed, init_subset, plan_init
from shardfn._functional_layout import LeafTree, ShapeDtype
from shardfn._functional_leaves import check_params, describe_unknown, vmap_buffer_error
from shardfn._functional_leaves import refuse_differentiated_state as refuse_state
from shardfn._functional_swap import Slot, call_swapped, plan_slots
from shardfn._torch_internals import TransformType, in_transform

__all__ = ["FunctionalModel", "InitFn", "ShapeDtype", "derive_seed", "functional"]

Params = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class FunctionalModel(LeafTree):
    """A module as pure functions of a flat ``name -> Tensor`` dict; made by :func:`functional`.

    Attributes:
        module: the skeleton (meta device) that ``apply`` calls with the leaves swapped
            in for the call; it holds no real tensor outside a call.
        names: every leaf name, parameters first, then buffers.
        param_names / buffer_names: the two kinds of leaves.
        frozen_names: parameters with ``requires_grad=False``.
        trainable_names: the other parameters (what ``split_trainable`` returns first).
        tied: alias name -> the name of the leaf it shares (``{"head.weight": "emb.weight"}``).
        owners: leaf name -> path of the submodule that registers it.
        module_paths: every submodule path (``""`` is the root), for ``init_subset``.

    The tree members of the model protocol (:mod:`shardfn.model`) that an unsharded
    model has trivially (``functional`` is itself, ``mesh`` None, ``specs`` every leaf
    ``Layout(P(), shape)``, ``shard``/``gather`` the identity) and ``params_from``,
    ``param_shapes``, ``abstract`` come from its base :class:`~._functional_layout.LeafTree`.
    """

    module: nn.Module
    names: tuple[str, ...]
    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    frozen_names: tuple[str, ...]
    trainable_names: tuple[str, ...]
    tied: Mapping[str, str]
    owners: Mapping[str, str]
    module_paths: tuple[str, ...]
    _plan: InitPlan

    # ---------------------------------------------------------------- init

    def init(self, seed: int, device: torch.device | str | None = None) -> Params:
        """Build all parameters and buffers, deterministically from ``seed``.

        The caller's RNG state is left untouched and the user's module is not
        read except for leaves no ``reset_parameters`` covers (see the module
        docstring). Values depend on the device type, as torch's RNG does.

        Args:
            seed: any int; the same seed gives identical tensors in every call
                and every process.
            device: where to create the tensors; default ``torch.get_default_device()``.

        Returns:
            ``name -> Tensor`` (plain tensors, ``requires_grad=False``) in ``names`` order.

        Example:
            >>> model = functional(torch.nn.Linear(3, 2))
            >>> torch.equal(model.init(0)["weight"], model.init(0)["weight"])
            True
        """
        return self.init_subset(seed, self.module_paths, device=device)

    def init_subset(
        self,
        seed: int,
        module_paths: Sequence[str],
        device: torch.device | str | None = None,
        *,
        recurse: bool = False,
    ) -> Params:
        """Build only the leaves registered by the given submodules: that slice of ``init``.

        Args:
            seed: as for :meth:`init`.
            module_paths: submodule paths (``""`` is the root), see ``module_paths``.
            device: as for :meth:`init`.
            recurse: also include the leaves of all descendants of each path.

        Returns:
            ``name -> Tensor`` for the leaves owned by those submodules, in ``names`` order.

        Example:
            >>> net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
            >>> model = functional(net)
            >>> sorted(model.init_subset(0, ["1"]))
            ['1.bias', '1.weight']
        """
        return init_subset(self._plan, self.module, seed, module_paths, device, recurse=recurse)

    # ---------------------------------------------------------------- apply

    def apply(
        self, params: Mapping[str, torch.Tensor], *args: Any, mutable: bool = False, **kwargs: Any
    ) -> Any:
        """Run the module's forward with ``params``; pure and torch.func-compatible.

        Buffers are given to the forward as private copies, so in-place
        updates (BatchNorm running stats in training mode) never reach the
        caller's tensors; ``mutable=True`` returns them. Buffers are state: differentiate
        ``split_trainable(params)[0]`` only (docs/functional.md, "Buffers are state").

        Args:
            params: ``name -> Tensor`` with exactly the names in ``names``
                (aliases of tied weights are not passed).
            *args, **kwargs: passed to ``module.forward``.
            mutable: also return the buffers as the forward left them.

        Returns:
            Whatever ``forward`` returns; with ``mutable=True`` the pair
            ``(output, new_buffers)``: ``new_buffers`` maps every name in
            ``buffer_names`` (integer ones such as ``num_batches_tracked``
            included) to its value after the forward, so ``{**params, **new_buffers}``
            is the next step's tree. Under ``torch.func.grad`` return them as the
            auxiliary output (``has_aux=True``).

        Raises:
            ValueError: missing/unexpected names or a leaf of the wrong shape; a buffer
                or frozen parameter being differentiated (``torch.func.grad`` over the
                whole tree, or ``requires_grad=True`` under autograd), named.
            TypeError: ``params`` is not a mapping or holds a non-tensor, or
                ``mutable`` is not a bool.
            RuntimeError: under ``torch.func.vmap``, the forward updates an
                unbatched buffer in place (BatchNorm in training mode).

        Example:
            >>> model = functional(torch.nn.Linear(3, 2))
            >>> params = model.init(0)
            >>> trainable, rest = model.split_trainable(params)
            >>> loss = lambda t, x: model.apply(model.merge(t, rest), x).sum()
            >>> torch.func.grad(loss)(trainable, torch.ones(3))["bias"]
            tensor([1., 1.])
            >>> bn = functional(torch.nn.BatchNorm1d(2))
            >>> _, new = bn.apply(bn.init(0), torch.tensor([[0., 1.], [2., 3.]]), mutable=True)
            >>> new["running_mean"], new["num_batches_tracked"]
            (tensor([0.1000, 0.2000]), tensor(1))
        """
        if not isinstance(mutable, bool):
            raise TypeError(f"apply: mutable must be True or False, got {mutable!r}")
        call_params = self._call_params(params)
        out = self._forward(call_params, args, kwargs)
        if not mutable:
            return out
        return out, {name: call_params[name] for name in self.buffer_names}

    def apply_with_buffers(
        self, params: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any
    ) -> tuple[Any, Params]:
        """Alias of ``apply(params, *args, mutable=True, **kwargs)``: ``(output, new_buffers)``.

        Example:
            >>> model = functional(torch.nn.BatchNorm1d(2))
            >>> params = model.init(0)
            >>> _, buffers = model.apply_with_buffers(params, torch.tensor([[0., 1.], [2., 3.]]))
            >>> buffers["running_mean"]
            tensor([0.1000, 0.2000])
        """
        return self.apply(params, *args, mutable=True, **kwargs)

    @property
    def _slots(self) -> tuple[Slot, ...] | None:
        """Where each leaf goes in the skeleton (:func:`~._functional_swap.plan_slots`),
        worked out on the first ``apply``; None: ``apply`` uses ``functional_call``.
        (Not ``functools.cached_property``: on Python 3.11 it takes an RLock, which
        ``torch.compile`` cannot trace.)"""
        if "_planned_slots" not in self.__dict__:
            self.__dict__["_planned_slots"] = plan_slots(self.module, self.tied,
                                                         set(self._plan.leaves))
        return self.__dict__["_planned_slots"]

    def _forward(self, call_params: Params, args: tuple, kwargs: dict) -> Any:
        try:
            if self._slots is None:
                return torch.func.functional_call(
                    self.module, call_params, args, kwargs, tie_weights=True, strict=True
                )
            return call_swapped(self.module, self._slots, call_params, args, kwargs)
        except RuntimeError as error:
            text = str(error).lower()
            if not (in_transform(TransformType.Vmap) and ("in place" in text or "inplace" in text)):
                raise
            raise vmap_buffer_error(type(self.module).__name__, self.buffer_names, error) from error

    def _call_params(self, params: Mapping[str, torch.Tensor]) -> Params:
        self.check(params)
        refuse_state(params, self.buffer_names, self.frozen_names, "FunctionalModel.apply")
        call_params = dict(params)
        for name in self.buffer_names:
            call_params[name] = call_params[name].clone()
        return call_params

    def check(self, params: Mapping[str, torch.Tensor], *, shapes: bool = True) -> None:
        """Check that ``params`` has exactly this model's leaf names and shapes.

        Args:
            params: a ``name -> Tensor`` mapping.
            shapes: also check the full shapes; ``False`` for a tree of local
                shards (``sf.shard(params, specs, mesh)``), whose shapes differ.

        Raises:
            TypeError: not a mapping, or a value that is not a tensor (named).
            ValueError: missing or unexpected names (all listed; a tied alias
                is named with its owner), or a wrong shape (leaf and both shapes).

        Example:
            >>> model = functional(torch.nn.Linear(3, 2))
            >>> model.check({"weight": torch.zeros(2, 3), "bias": torch.zeros(2)})
        """
        check_params(params, self._plan.leaves, self.tied, type(self.module).__name__, shapes)

    # ---------------------------------------------------------------- helpers

    def split_trainable(self, params: Mapping[str, torch.Tensor]) -> tuple[Params, Params]:
        """Split ``params`` into ``(trainable, rest)``: trainable parameters vs buffers+frozen.

        Only the names are checked (every leaf, none unknown), not the shapes, so
        a tree of local shards (``sf.shard(params, specs, mesh)``) splits too.
        Buffers (integer ones such as ``num_batches_tracked`` included) and
        frozen parameters go to ``rest``; ``trainable`` holds only floating
        leaves, so nothing integer reaches a gradient transform or an optimizer.

        Args:
            params: a ``name -> Tensor`` dict with every leaf name (full or sharded).

        Returns:
            ``(trainable, rest)``; differentiate only ``trainable``.

        Raises:
            ValueError / TypeError: as :meth:`check` for names and non-tensors.

        Example:
            >>> model = functional(torch.nn.BatchNorm1d(2))
            >>> trainable, rest = model.split_trainable(model.init(0))
            >>> sorted(trainable), sorted(rest)
            (['bias', 'weight'], ['num_batches_tracked', 'running_mean', 'running_var'])
        """
        self.check(params, shapes=False)
        trainable_set = set(self.trainable_names)
        trainable = {n: params[n] for n in self.names if n in trainable_set}
        rest = {n: params[n] for n in self.names if n not in trainable_set}
        return trainable, rest

    def merge(
        self, trainable: Mapping[str, torch.Tensor], rest: Mapping[str, torch.Tensor]
    ) -> Params:
        """Inverse of :meth:`split_trainable`: one dict in ``names`` order.

        Names only are checked (the parts may be local shards of any shape):
        none in both parts and none the model does not have. A subset of the
        leaves is allowed (e.g. one pipeline stage's); :meth:`apply` checks
        that every leaf is there.

        Args:
            trainable, rest: disjoint ``name -> Tensor`` dicts.

        Returns:
            The merged dict, in ``names`` order.

        Raises:
            ValueError: a name in both parts, or a name that is not a leaf of the model.

        Example:
            >>> model = functional(torch.nn.Linear(3, 2))
            >>> params = model.init(0)
            >>> model.merge(*model.split_trainable(params)).keys() == params.keys()
            True
        """
        overlap = sorted(set(trainable) & set(rest))
        if overlap:
            raise ValueError(f"merge: names present in both trainable and rest: {overlap}")
        both = {**rest, **trainable}
        unknown = [name for name in both if name not in self._plan.leaves]
        if unknown:
            described = [describe_unknown(name, self.tied, self.names) for name in unknown]
            raise ValueError(
                f"merge: not leaves of {type(self.module).__name__}: {', '.join(described)}"
            )
        return {name: both[name] for name in self.names if name in both}

    def train(self, mode: bool = True) -> FunctionalModel:
        """A copy of this model whose skeleton is in training (or eval) mode; ``self`` is unchanged.

        Example:
            >>> functional(torch.nn.Dropout()).eval().module.training
            False
        """
        skeleton = copy.deepcopy(self.module)
        skeleton.train(mode)
        return dataclasses.replace(self, module=skeleton)

    def eval(self) -> FunctionalModel:
        """Same as ``train(False)``."""
        return self.train(False)

    def __repr__(self) -> str:
        numel = sum(leaf.shape.numel() for leaf in self._plan.leaves.values() if not leaf.is_buffer)
        return (
            f"FunctionalModel({type(self.module).__name__}, {len(self.param_names)} params "
            f"({numel} elements), {len(self.buffer_names)} buffers, {len(self.tied)} tied, "
            f"training={self.module.training})"
        )


def functional(
    module: nn.Module, *, init_fns: Mapping[str, InitFn] | None = None
) -> FunctionalModel:
    """Turn ``module`` into a :class:`FunctionalModel` with pure ``init`` and ``apply``.

    The module is not modified and may live on the meta device (a model built
    under ``with torch.device("meta")``); only a meta-device skeleton is kept. A Hugging
    Face model initialises as its ``_init_weights`` does and computes without a KV cache
    unless ``apply(..., use_cache=True)``, and without the input-grad hooks of
    ``enable_input_require_grads()`` (:mod:`shardfn._functional_hf`).

    Args:
        module: any ``nn.Module`` (lazy modules must be materialised first).
        init_fns: ``name or fnmatch pattern -> fn(shape, dtype, device, generator)``
            for leaves ``reset_parameters`` does not set (or to override it). An
            exact name wins over patterns; among patterns the first match wins.
            ``generator`` is seeded from ``(seed, leaf name)``. Every key must
            match some leaf.

    Returns:
        The functional model.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or an ``init_fns`` value is not callable.
        ValueError: uninitialised lazy parameters, or an ``init_fns`` key that matches no leaf.

    Example:
        >>> class Masked(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.empty(3))
        ...     def forward(self, x):
        ...         return x * self.w
        >>> zeros = lambda shape, dtype, device, generator: torch.zeros(shape, dtype=dtype)
        >>> with torch.device("meta"):
        ...     big = Masked()
        >>> functional(big, init_fns={"w": zeros}).init(0)["w"]
        tensor([0., 0., 0.])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"functional() expects a torch.nn.Module, got {type(module).__name__}")
    skeleton, init_plan = plan_init(module, init_fns or {})
    without_kv_cache(skeleton)  # a Hugging Face model: no KV cache filled in place
    without_input_grad_hooks(skeleton)  # nor requires_grad_ hooks torch.func refuses
    leaves = init_plan.leaves
    param_names = tuple(n for n, leaf in leaves.items() if not leaf.is_buffer)
    return FunctionalModel(
        module=skeleton,
        names=tuple(leaves),
        param_names=param_names,
        buffer_names=tuple(n for n, leaf in leaves.items() if leaf.is_buffer),
        frozen_names=tuple(n for n in param_names if not leaves[n].trainable),
        trainable_names=tuple(n for n in param_names if leaves[n].trainable),
        tied=init_plan.tied,
        owners={n: leaf.owner for n, leaf in leaves.items()},
        module_paths=tuple(init_plan.owned),
        _plan=init_plan,
    )

