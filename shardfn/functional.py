"""Turn an ``nn.Module`` into a pure pair ``(init, apply)`` over a flat dict of tensors.

``functional(module)`` keeps a *skeleton* of the module on the meta device (no
memory, never the user's tensors) and returns a :class:`FunctionalModel`:

* ``init(seed)`` builds the parameters and buffers as a flat dict
  ``name -> Tensor`` (names as in ``module.named_parameters()`` /
  ``named_buffers()``). Every submodule is initialised under its own seed,
  derived from ``(seed, module path)`` by a stable hash, by materialising *only
  the leaves it registers itself* and calling its ``reset_parameters()``. So
  ``init_subset(seed, paths)`` on any set of submodules gives exactly the
  corresponding slice of ``init(seed)``: a rank can build just its shard.
* ``apply(params, *args, **kwargs)`` runs the module's forward with ``params``
  via ``torch.func.functional_call``; it is pure (buffers are passed as private
  copies, so a BatchNorm in training mode never changes the caller's tensors)
  and works under ``torch.func.grad`` / ``vjp`` / ``vmap`` and plain autograd.

How each leaf is initialised, first rule that applies wins:

1. ``init_fns[name]`` (exact name, else the first ``fnmatch`` pattern that
   matches), called as ``fn(shape, dtype, device, generator)`` with a
   ``torch.Generator`` seeded from ``(seed, name)`` (``None`` on ``meta``).
2. the owning submodule's ``reset_parameters()`` (or, if it has none,
   ``_reset_parameters()``, as ``nn.MultiheadAttention`` has), if it writes
   the leaf. Only the owner's write counts: a parent that re-initialises a
   child's leaf (``MultiheadAttention`` zeroing ``out_proj.bias``) is ignored,
   so values never depend on which other submodules were initialised.
3. a copy of the user's module's current value (parameters created with
   ``torch.randn`` in ``__init__``, constant buffers such as a mask). If that
   value is on the meta device, ``init`` raises and names the leaf.

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
import difflib
import fnmatch
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["FunctionalModel", "InitFn", "ShapeDtype", "derive_seed", "functional"]

InitFn = Callable[[torch.Size, torch.dtype, torch.device, "torch.Generator | None"], torch.Tensor]
"""``fn(shape, dtype, device, generator) -> Tensor`` initialising one leaf."""

Params = dict[str, torch.Tensor]


class ShapeDtype(NamedTuple):
    """Shape and dtype of one leaf, known without materialising it."""

    shape: torch.Size
    dtype: torch.dtype


class _Leaf(NamedTuple):
    name: str  # canonical dotted name ("blocks.0.weight")
    owner: str  # path of the submodule registering it ("blocks.0"; "" for the root)
    key: str  # attribute name inside the owner ("weight")
    is_buffer: bool
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool


def derive_seed(seed: int, path: str) -> int:
    """A 63-bit seed for ``path`` derived from ``seed`` by SHA-256 (stable across processes).

    Args:
        seed: the user's seed.
        path: a submodule path (``"blocks.0.attn"``) or any other label.

    Returns:
        A non-negative int below ``2**63``, the same in every process and run.

    Example:
        >>> derive_seed(0, "blocks.0") == derive_seed(0, "blocks.0") != derive_seed(1, "blocks.0")
        True
    """
    digest = hashlib.sha256(f"shardfn-init:{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class FunctionalModel:
    """A module as pure functions of a flat ``name -> Tensor`` dict; made by :func:`functional`.

    Attributes:
        module: the skeleton (meta device) that ``apply`` calls through
            ``functional_call``; it never holds real tensors.
        names: every leaf name, parameters first, then buffers.
        param_names / buffer_names: the two kinds of leaves.
        frozen_names: parameters with ``requires_grad=False``.
        trainable_names: the other parameters (what ``split_trainable`` returns first).
        tied: alias name -> the name of the leaf it shares (``{"head.weight": "emb.weight"}``).
        owners: leaf name -> path of the submodule that registers it.
        module_paths: every submodule path (``""`` is the root), for ``init_subset``.
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
    _leaves: Mapping[str, _Leaf]
    _owned: Mapping[str, tuple[str, ...]]
    _init_fns: Mapping[str, InitFn]
    _sources: Mapping[str, torch.Tensor]

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
        seed = _check_seed(seed)
        if isinstance(module_paths, str):
            raise TypeError(
                f"module_paths must be a sequence of paths, got the string {module_paths!r}; "
                f"write [{module_paths!r}]"
            )
        chosen = set()
        for path in module_paths:
            if path not in self._owned:
                raise ValueError(
                    f"init_subset: no submodule at path {path!r}{_suggest(path, self.module_paths)}"
                )
            chosen.add(path)
            if recurse:
                prefix = path + "." if path else ""
                chosen.update(p for p in self.module_paths if p.startswith(prefix))
        device = _resolve_device(device)
        values: Params = {}
        with _forked_rng(device), torch.inference_mode(False), torch.no_grad():
            for path in self.module_paths:
                if path in chosen and self._owned[path]:
                    values.update(self._init_module(path, seed, device))
        return {name: values[name] for name in self.names if name in values}

    def _init_module(self, path: str, seed: int, device: torch.device) -> Params:
        leaves = [self._leaves[name] for name in self._owned[path]]
        from_reset: Params = {}
        if any(leaf.name not in self._init_fns for leaf in leaves):
            submodule = self.module.get_submodule(path)
            if _reset_method(submodule) is not None:
                try:
                    from_reset = _run_reset(submodule, leaves, device, derive_seed(seed, path))
                except Exception as error:
                    raise RuntimeError(
                        f"reset_parameters() of {type(submodule).__name__} at "
                        f"{path or '<root>'!r} failed while initialising {self._owned[path]}: "
                        f"{error}"
                    ) from error
        values: Params = {}
        for leaf in leaves:
            if leaf.name in self._init_fns:
                value = _call_init_fn(self._init_fns[leaf.name], leaf, seed, device)
            elif leaf.name in from_reset:
                value = from_reset[leaf.name]
            elif leaf.name in self._sources:
                value = self._sources[leaf.name].detach().to(device=device, copy=True)
            elif 0 in leaf.shape:
                value = torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
            else:
                raise ValueError(
                    f"cannot initialise leaf {leaf.name!r} (shape {tuple(leaf.shape)}, "
                    f"{leaf.dtype}): {type(self.module.get_submodule(path)).__name__} at "
                    f"{path or '<root>'!r} has no reset_parameters() that sets it and the "
                    f"module it came from holds it on the meta device. Pass "
                    f"functional(module, init_fns={{{leaf.name!r}: fn}}) with "
                    f"fn(shape, dtype, device, generator) -> Tensor, or build the module "
                    f"off the meta device"
                )
            if value.shape != leaf.shape:
                raise ValueError(
                    f"initialising leaf {leaf.name!r} gave shape {tuple(value.shape)}, "
                    f"expected {tuple(leaf.shape)}"
                )
            values[leaf.name] = value.detach().to(dtype=leaf.dtype)
        return values

    # ---------------------------------------------------------------- apply

    def apply(
        self, params: Mapping[str, torch.Tensor], *args: Any, mutable: bool = False, **kwargs: Any
    ) -> Any:
        """Run the module's forward with ``params``; pure and torch.func-compatible.

        Buffers are given to the forward as private copies, so in-place
        updates (BatchNorm running stats in training mode) never reach the
        caller's tensors; ``mutable=True`` returns them.

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
            ValueError: missing/unexpected names or a leaf of the wrong shape.
            TypeError: ``params`` is not a mapping or holds a non-tensor, or
                ``mutable`` is not a bool.
            RuntimeError: under ``torch.func.vmap``, the forward updates an
                unbatched buffer in place (BatchNorm in training mode).

        Example:
            >>> model = functional(torch.nn.Linear(3, 2))
            >>> params = model.init(0)
            >>> grads = torch.func.grad(lambda p, x: model.apply(p, x).sum())(params, torch.ones(3))
            >>> grads["bias"]
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

    def _forward(self, call_params: Params, args: tuple, kwargs: dict) -> Any:
        try:
            return torch.func.functional_call(
                self.module, call_params, args, kwargs, tie_weights=True, strict=True
            )
        except RuntimeError as error:
            text = str(error).lower()
            if not (_under_vmap() and ("in place" in text or "inplace" in text)):
                raise
            raise RuntimeError(
                f"{type(self.module).__name__}.apply under torch.func.vmap: the forward updates "
                f"in place a tensor that vmap does not batch, typically a buffer (BatchNorm's "
                f"running statistics in training mode; buffers: {list(self.buffer_names)}), "
                f"which vmap cannot do, as for torch modules. Batch the buffers too (vmap over "
                f"the params tree, in_dims=0, as for an ensemble), or use model.eval() or "
                f"track_running_stats=False. torch said: {error}"
            ) from error

    def _call_params(self, params: Mapping[str, torch.Tensor]) -> Params:
        self.check(params)
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
        if not isinstance(params, Mapping):
            raise TypeError(
                f"params must be a mapping name -> Tensor (as returned by init), "
                f"got {type(params).__name__}"
            )
        if params.keys() != self._leaves.keys():
            missing = [name for name in self.names if name not in params]
            unexpected = [name for name in params if name not in self._leaves]
            parts = []
            if missing:
                parts.append(f"missing {missing}")
            if unexpected:
                described = [
                    f"{name!r} (tied to {self.tied[name]!r}; pass only that one)"
                    if name in self.tied
                    else repr(name)
                    for name in unexpected
                ]
                parts.append(f"unexpected [{', '.join(described)}]")
            raise ValueError(
                f"params do not match {type(self.module).__name__}: {'; '.join(parts)}"
            )
        for name, leaf in self._leaves.items():
            value = params[name]
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"params[{name!r}] must be a Tensor, got {type(value).__name__}")
            if shapes and value.shape != leaf.shape:
                raise ValueError(
                    f"params[{name!r}] has shape {tuple(value.shape)}, expected {tuple(leaf.shape)}"
                )

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
        unknown = [name for name in both if name not in self._leaves]
        if unknown:
            described = [
                f"{name!r} (tied to {self.tied[name]!r}; pass only that one)"
                if name in self.tied
                else f"{name!r}{_suggest(name, self.names)}"
                for name in unknown
            ]
            raise ValueError(
                f"merge: not leaves of {type(self.module).__name__}: {', '.join(described)}"
            )
        return {name: both[name] for name in self.names if name in both}

    def param_shapes(self) -> dict[str, ShapeDtype]:
        """``name -> ShapeDtype(shape, dtype)`` for every leaf, without materialising anything.

        Example:
            >>> functional(torch.nn.Linear(3, 2)).param_shapes()["weight"]
            ShapeDtype(shape=torch.Size([2, 3]), dtype=torch.float32)
        """
        return {name: ShapeDtype(leaf.shape, leaf.dtype) for name, leaf in self._leaves.items()}

    def abstract(self) -> Params:
        """``name -> meta Tensor``: the tree of ``init``'s result with shapes/dtypes but no data.

        Example:
            >>> functional(torch.nn.Linear(3, 2)).abstract()["bias"]
            tensor(..., device='meta', size=(2,))
        """
        return {
            name: torch.empty(leaf.shape, dtype=leaf.dtype, device="meta")
            for name, leaf in self._leaves.items()
        }

    def params_from(self, module: nn.Module) -> Params:
        """The current values of a materialised module of the same structure, as a params dict.

        Args:
            module: a module with the same leaf names (typically the original one).

        Returns:
            ``name -> Tensor`` (detached, sharing storage with ``module``).

        Example:
            >>> linear = torch.nn.Linear(3, 2)
            >>> functional(linear).params_from(linear)["weight"] is not None
            True
        """
        found = dict(module.named_parameters(remove_duplicate=False))
        found.update(module.named_buffers(remove_duplicate=False))
        params = {name: found[name].detach() for name in self.names if name in found}
        self.check(params)
        return params

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
        numel = sum(leaf.shape.numel() for leaf in self._leaves.values() if not leaf.is_buffer)
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
    under ``with torch.device("meta")``); only a meta-device skeleton is kept.

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
    _reject_lazy(module)
    skeleton = _meta_skeleton(module)

    leaves: dict[str, _Leaf] = {}
    kinds = ((False, skeleton.named_parameters()), (True, skeleton.named_buffers()))
    for is_buffer, named in kinds:
        for name, tensor in named:
            owner, _, key = name.rpartition(".")
            leaves[name] = _Leaf(
                name,
                owner,
                key,
                is_buffer,
                tensor.shape,
                tensor.dtype,
                bool(tensor.requires_grad) and not is_buffer,
            )
    canonical = {id(t): n for n, t in skeleton.named_parameters()}
    canonical.update({id(t): n for n, t in skeleton.named_buffers()})
    tied = {}
    for named in (
        skeleton.named_parameters(remove_duplicate=False),
        skeleton.named_buffers(remove_duplicate=False),
    ):
        for name, tensor in named:
            if canonical[id(tensor)] != name:
                tied[name] = canonical[id(tensor)]

    module_paths = tuple(path for path, _ in skeleton.named_modules())
    owned: dict[str, list[str]] = {path: [] for path in module_paths}
    for leaf in leaves.values():
        owned[leaf.owner].append(leaf.name)

    resolved_fns = _resolve_init_fns(init_fns or {}, leaves, tied)
    sources = _uninitialised_sources(module, skeleton, leaves, owned, resolved_fns)

    param_names = tuple(n for n, leaf in leaves.items() if not leaf.is_buffer)
    return FunctionalModel(
        module=skeleton,
        names=tuple(leaves),
        param_names=param_names,
        buffer_names=tuple(n for n, leaf in leaves.items() if leaf.is_buffer),
        frozen_names=tuple(
            n for n in param_names if not (leaves[n].requires_grad and _floating(leaves[n].dtype))
        ),
        trainable_names=tuple(
            n for n in param_names if leaves[n].requires_grad and _floating(leaves[n].dtype)
        ),
        tied=tied,
        owners={n: leaf.owner for n, leaf in leaves.items()},
        module_paths=module_paths,
        _leaves=leaves,
        _owned={p: tuple(ns) for p, ns in owned.items()},
        _init_fns=resolved_fns,
        _sources=sources,
    )


# -------------------------------------------------------------------- private helpers


def _meta_skeleton(module: nn.Module) -> nn.Module:
    """Deep copy of ``module`` whose parameters and buffers are on the meta device (ties kept)."""
    memo: dict[int, Any] = {}
    for param in module.parameters():
        memo[id(param)] = nn.Parameter(
            torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
        )
    for buffer in module.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    try:
        return copy.deepcopy(module, memo)
    except Exception as error:  # a module holding a lock, a process group, ...
        raise TypeError(
            f"functional() could not copy {type(module).__name__} into a meta-device skeleton "
            f"(copy.deepcopy failed: {error}); keep non-copyable objects out of the module"
        ) from error


def _floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _under_vmap() -> bool:
    stack = torch._C._functorch.get_interpreter_stack() or ()
    return any(i.key() == torch._C._functorch.TransformType.Vmap for i in stack)


def _reject_lazy(module: nn.Module) -> None:
    named = list(module.named_parameters()) + list(module.named_buffers())
    lazy = [name for name, tensor in named if nn.parameter.is_lazy(tensor)]
    if lazy:
        raise ValueError(
            f"functional(): {lazy} are uninitialised lazy parameters/buffers; run the module "
            f"once on an example input (or give explicit sizes) before calling functional()"
        )


def _reset_method(module: nn.Module) -> Callable[[], Any] | None:
    for attr in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, attr, None)
        if callable(method):
            return method
    return None


def _run_reset(
    submodule: nn.Module, leaves: Sequence[_Leaf], device: torch.device, seed: int
) -> Params:
    """Materialise ``leaves`` on a private copy of ``submodule``, reset it, return what it wrote.

    A leaf counts as written when the reset replaced it, changed it in place
    (version counter) or swapped its storage (``.data = ...``). The caller holds
    the forked RNG; this seeds it.
    """
    work = copy.deepcopy(submodule)  # meta: costs no tensor memory
    before: dict[str, tuple[torch.Tensor, int, int]] = {}
    for leaf in leaves:
        store = work._buffers if leaf.is_buffer else work._parameters
        fresh = torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
        if not leaf.is_buffer:
            fresh = nn.Parameter(fresh, requires_grad=leaf.requires_grad)
        store[leaf.key] = fresh
        before[leaf.name] = (fresh, fresh._version, _data_ptr(fresh))
    _seed_rng(device, seed)
    _reset_method(work)()
    written: Params = {}
    for leaf in leaves:
        store = work._buffers if leaf.is_buffer else work._parameters
        now = store.get(leaf.key)
        if now is None:
            continue
        fresh, version, pointer = before[leaf.name]
        if now is not fresh or now._version != version or _data_ptr(now) != pointer:
            written[leaf.name] = now.detach().to(device)
    return written


def _data_ptr(tensor: torch.Tensor) -> int:
    return 0 if tensor.device.type == "meta" else tensor.data_ptr()


def _call_init_fn(fn: InitFn, leaf: _Leaf, seed: int, device: torch.device) -> torch.Tensor:
    generator = None
    if device.type != "meta":
        generator = torch.Generator(device=device)
        generator.manual_seed(derive_seed(seed, "leaf:" + leaf.name))
    value = fn(leaf.shape, leaf.dtype, device, generator)
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"init_fns entry for {leaf.name!r} returned {type(value).__name__}, expected a Tensor"
        )
    return value.to(device=device)


def _resolve_init_fns(
    init_fns: Mapping[str, InitFn], leaves: Mapping[str, _Leaf], tied: Mapping[str, str]
) -> dict[str, InitFn]:
    if not isinstance(init_fns, Mapping):
        raise TypeError(f"init_fns must be a mapping name -> fn, got {type(init_fns).__name__}")
    for key, fn in init_fns.items():
        if not isinstance(key, str) or not callable(fn):
            raise TypeError(
                f"init_fns must map a leaf name (str) to fn(shape, dtype, device, generator); "
                f"got {key!r}: {type(fn).__name__}"
            )
    resolved: dict[str, InitFn] = {}
    used: set[str] = set()
    for name in leaves:
        if name in init_fns:
            resolved[name] = init_fns[name]
            used.add(name)
            continue
        for key, fn in init_fns.items():
            if key not in leaves and fnmatch.fnmatchcase(name, key):
                resolved[name] = fn
                used.add(key)
                break
    unused = [key for key in init_fns if key not in used]
    if unused:
        hints = [
            f"{key!r} (tied to {tied[key]!r}; use that name)"
            if key in tied
            else f"{key!r}{_suggest(key, leaves)}"
            for key in unused
        ]
        raise ValueError(f"init_fns keys match no leaf: {', '.join(hints)}")
    return resolved


def _uninitialised_sources(
    module: nn.Module,
    skeleton: nn.Module,
    leaves: Mapping[str, _Leaf],
    owned: Mapping[str, list[str]],
    init_fns: Mapping[str, InitFn],
) -> dict[str, torch.Tensor]:
    """The user's tensors for leaves that no ``reset_parameters`` sets (found by a meta dry run).

    Only references are kept (no copy); ``init`` copies them when it runs.
    """
    user = dict(module.named_parameters())
    user.update(module.named_buffers())
    sources: dict[str, torch.Tensor] = {}
    meta = torch.device("meta")
    for path, names in owned.items():
        todo = [leaves[n] for n in names if n not in init_fns]
        if not todo:
            continue
        covered: set[str] = set()
        submodule = skeleton.get_submodule(path)
        if _reset_method(submodule) is not None:
            try:
                with _forked_rng(meta), torch.inference_mode(False), torch.no_grad():
                    covered = set(_run_reset(submodule, todo, meta, 0))
            except Exception:  # reset needs real data: fall back to keeping the values
                covered = set()
        for leaf in todo:
            value = user[leaf.name]
            if leaf.name not in covered and value.device.type != "meta":
                sources[leaf.name] = value.detach()
    return sources


def _forked_rng(device: torch.device):
    """Fork the CPU RNG (and ``device``'s accelerator RNG) for the duration of a block."""
    if device.type in ("cpu", "meta"):
        return torch.random.fork_rng(devices=[])
    index = device.index
    if index is None:
        index = torch.get_device_module(device.type).current_device()
    return torch.random.fork_rng(devices=[index], device_type=device.type)


def _seed_rng(device: torch.device, seed: int) -> None:
    torch.random.default_generator.manual_seed(seed)
    if device.type not in ("cpu", "meta"):
        device_module = torch.get_device_module(device.type)
        with device_module.device(device):
            device_module.manual_seed(seed)


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.get_default_device()
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"invalid device {device!r}: {error}") from error


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    return seed


def _suggest(name: str, candidates: Iterator[str] | Sequence[str] | Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=3)
    return f"; did you mean {close}?" if close else ""
