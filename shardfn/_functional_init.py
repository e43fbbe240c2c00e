"""How :func:`shardfn.functional` initialises a module's leaves: ``init`` and ``init_subset``.

Every submodule is initialised under its own seed, derived from ``(seed, module
path)`` by a stable hash (:func:`derive_seed`), by materialising *only the
leaves it registers itself* on a private copy and calling its
``reset_parameters()``; so any subset of submodules gives exactly that slice of
the whole initialisation.

How each leaf is initialised, first rule that applies wins:

1. ``init_fns[name]`` (exact name, else the first ``fnmatch`` pattern that
   matches), called as ``fn(shape, dtype, device, generator)`` with a
   ``torch.Generator`` seeded from ``(seed, name)`` (``None`` on ``meta``).
2. the owning submodule's ``reset_parameters()`` (or, if it has none,
   ``_reset_parameters()``, as ``nn.MultiheadAttention`` has), if it writes
   the leaf. Only the owner's write counts: a parent that re-initialises a
   child's leaf (``MultiheadAttention`` zeroing ``out_proj.bias``) is ignored,
   so values never depend on which other submodules were initialised. Inside a
   Hugging Face ``PreTrainedModel``, its ``_init_weights`` then runs on the owner
   and its ancestors, as ``post_init`` does (:mod:`shardfn._functional_hf`:
   embeddings ``normal(0, config.initializer_range)``, GPT-2's scaled ``c_proj``).
3. a copy of the user's module's current value (parameters created with
   ``torch.randn`` in ``__init__``, constant buffers such as a mask). If that
   value is on the meta device, ``init`` raises and names the leaf.

Example:
    >>> derive_seed(0, "blocks.0") == derive_seed(0, "blocks.0")
    True
"""

from __future__ import annotations

import copy
import fnmatch
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from shardfn._functional_hf import inside_pretrained, run_init_weights
from shardfn._functional_leaves import Leaf, find_leaves, meta_skeleton, reject_lazy, suggest

__all__ = [
    "InitFn",
    "InitPlan",
    "derive_seed",
    "init_subset",
    "plan_init",
]

InitFn = Callable[[torch.Size, torch.dtype, torch.device, "torch.Generator | None"], torch.Tensor]
"""``fn(shape, dtype, device, generator) -> Tensor`` initialising one leaf."""

Params = dict[str, torch.Tensor]


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


class InitPlan(NamedTuple):
    """What ``init`` needs to know of a module, found once by :func:`plan_init`."""

    leaves: Mapping[str, Leaf]  # name -> leaf, parameters first, in ``names`` order
    owned: Mapping[str, tuple[str, ...]]  # every submodule path -> the leaves it registers
    tied: Mapping[str, str]  # alias -> the name of the leaf it shares
    init_fns: Mapping[str, InitFn]  # leaf name -> its init_fns entry
    sources: Mapping[str, torch.Tensor]  # leaf name -> the user's value (no reset sets it)


def plan_init(module: nn.Module, init_fns: Mapping[str, InitFn]) -> tuple[nn.Module, InitPlan]:
    """The meta-device skeleton of ``module`` and the :class:`InitPlan` of its leaves.

    Raises:
        ValueError: uninitialised lazy parameters, or an ``init_fns`` key that matches no leaf.
        TypeError: an ``init_fns`` value is not callable, or the module cannot be copied.
    """
    reject_lazy(module)
    skeleton = meta_skeleton(module)
    leaves, tied, _, owned = find_leaves(skeleton)
    resolved = _resolve_init_fns(init_fns, leaves, tied)
    sources = _uninitialised_sources(module, skeleton, leaves, owned, resolved)
    return skeleton, InitPlan(leaves, {p: tuple(ns) for p, ns in owned.items()}, tied, resolved,
                              sources)


def init_subset(
    plan: InitPlan,
    skeleton: nn.Module,
    seed: int,
    module_paths: Sequence[str],
    device: torch.device | str | None,
    *,
    recurse: bool,
) -> Params:
    """``FunctionalModel.init_subset``: the leaves the submodules at ``module_paths`` register.

    Returns:
        ``name -> Tensor`` in ``plan.leaves`` order; the caller's RNG state is untouched.
    """
    every_path = tuple(plan.owned)
    seed = _check_seed(seed)
    if isinstance(module_paths, str):
        raise TypeError(
            f"module_paths must be a sequence of paths, got the string {module_paths!r}; "
            f"write [{module_paths!r}]"
        )
    chosen = set()
    for path in module_paths:
        if path not in plan.owned:
            raise ValueError(
                f"init_subset: no submodule at path {path!r}{suggest(path, every_path)}"
            )
        chosen.add(path)
        if recurse:
            prefix = path + "." if path else ""
            chosen.update(p for p in every_path if p.startswith(prefix))
    device = _resolve_device(device)
    values: Params = {}
    with _forked_rng(device), torch.inference_mode(False), torch.no_grad():
        for path in every_path:
            if path in chosen and plan.owned[path]:
                leaves = [plan.leaves[name] for name in plan.owned[path]]
                values.update(_init_owned(skeleton, path, leaves, plan.init_fns,
                                         plan.sources, seed, device))
    return {name: values[name] for name in plan.leaves if name in values}


def _init_owned(
    module: nn.Module,
    path: str,
    leaves: Sequence[Leaf],
    init_fns: Mapping[str, InitFn],
    sources: Mapping[str, torch.Tensor],
    seed: int,
    device: torch.device,
) -> Params:
    """Initialise the ``leaves`` that the submodule at ``path`` of ``module`` registers.

    The rules of the module docstring, in order; the caller holds the forked RNG.

    Returns:
        ``name -> Tensor`` (detached, in each leaf's dtype) for every one of ``leaves``.
    """
    from_reset: Params = {}
    if any(leaf.name not in init_fns for leaf in leaves):
        submodule = module.get_submodule(path)
        if _has_initialiser(module, path):
            try:
                from_reset = _run_reset(module, path, leaves, device, derive_seed(seed, path))
            except Exception as error:
                what = "reset_parameters()" + (" or Hugging Face's _init_weights"
                                               if inside_pretrained(module, path) else "")
                raise RuntimeError(
                    f"{what} of {type(submodule).__name__} at {path or '<root>'!r} failed "
                    f"while initialising {tuple(leaf.name for leaf in leaves)}: {error}"
                ) from error
    values: Params = {}
    for leaf in leaves:
        if leaf.name in init_fns:
            value = _call_init_fn(init_fns[leaf.name], leaf, seed, device)
        elif leaf.name in from_reset:
            value = from_reset[leaf.name]
        elif leaf.name in sources:
            value = sources[leaf.name].detach().to(device=device, copy=True)
        elif 0 in leaf.shape:
            value = torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
        else:
            raise ValueError(
                f"cannot initialise leaf {leaf.name!r} (shape {tuple(leaf.shape)}, "
                f"{leaf.dtype}): {type(module.get_submodule(path)).__name__} at "
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


def _reset_method(module: nn.Module) -> Callable[[], Any] | None:
    for attr in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, attr, None)
        if callable(method):
            return method
    return None


def _has_initialiser(skeleton: nn.Module, path: str) -> bool:
    return (_reset_method(skeleton.get_submodule(path)) is not None
            or inside_pretrained(skeleton, path))


def _run_reset(
    skeleton: nn.Module, path: str, leaves: Sequence[Leaf], device: torch.device, seed: int
) -> Params:
    """Materialise ``leaves`` on a private copy of the submodule at ``path``, reset it (then
    Hugging Face's ``_init_weights``, inside a ``PreTrainedModel``), return what was written.

    A leaf counts as written when the reset replaced it, changed it in place
    (version counter) or swapped its storage (``.data = ...``). The caller holds
    the forked RNG; this seeds it.
    """
    work = copy.deepcopy(skeleton.get_submodule(path))  # meta: costs no tensor memory
    before: dict[str, tuple[torch.Tensor, int, int]] = {}
    for leaf in leaves:
        store = work._buffers if leaf.is_buffer else work._parameters
        fresh = torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
        if not leaf.is_buffer:
            fresh = nn.Parameter(fresh, requires_grad=leaf.requires_grad)
        store[leaf.key] = fresh
        before[leaf.name] = (fresh, fresh._version, _data_ptr(fresh))
    _seed_rng(device, seed)
    reset = _reset_method(work)
    if reset is not None:
        reset()
    run_init_weights(skeleton, path, work)
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


def _call_init_fn(fn: InitFn, leaf: Leaf, seed: int, device: torch.device) -> torch.Tensor:
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
    init_fns: Mapping[str, InitFn], leaves: Mapping[str, Leaf], tied: Mapping[str, str]
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
            else f"{key!r}{suggest(key, leaves)}"
            for key in unused
        ]
        raise ValueError(f"init_fns keys match no leaf: {', '.join(hints)}")
    return resolved


def _uninitialised_sources(
    module: nn.Module,
    skeleton: nn.Module,
    leaves: Mapping[str, Leaf],
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
        if _has_initialiser(skeleton, path):
            try:
                with _forked_rng(meta), torch.inference_mode(False), torch.no_grad():
                    covered = set(_run_reset(skeleton, path, todo, meta, 0))
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
