"""Export to and import from plain PyTorch: ``state_dict`` files and ``torch.optim`` states.

* :func:`export_state_dict` writes full parameters (``sf.gather(params,
  model.specs, mesh)``) as a ``module.state_dict()``-compatible file,
  safetensors or ``torch.save``, that plain PyTorch loads into the original
  ``nn.Module`` with ``strict=True`` (``module=`` adds the names of tied weights,
  which a functional model lists once; ``module=`` or ``model=`` leaves out the
  non-persistent buffers, which ``state_dict()`` leaves out: Llama's rotary
  ``inv_freq``, BERT's ``position_ids``). Written atomically (temporary name,
  fsync, rename).
* :func:`import_state_dict` reads such a file (or a ``state_dict``) into a
  sharded run: this rank's shards for a ``ShardedModel`` / ``TensorSplitModel``;
  non-persistent buffers the file lacks are built as the model's ``init`` builds them.
* :func:`optimizer_to_torch` / :func:`optimizer_from_torch` convert a full
  (unsharded) Adam/AdamW/SGD state (``AdamState`` / ``SgdState``; for
  ``shard_opt_state`` use ``opt.gather_state`` / ``opt.shard_state``) to and
  from a ``torch.optim`` optimizer's ``state_dict``, so a run moves between
  shardfn and torch. Hyper-parameters are the optimizers' own: build both with
  the same ones.

Example:
    >>> full = sf.gather(params, model.specs, mesh)
    >>> if mesh.rank == 0:
    ...     sf.checkpoint.export_state_dict("model.safetensors", full, module=module)
    >>> module.load_state_dict(safetensors.torch.load_file("model.safetensors"))
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from shardfn.functional import FunctionalModel
from shardfn.mesh import Mesh
from shardfn.optim.adam import AdamState
from shardfn.optim.sgd import SgdState
from shardfn.spec import shard

__all__ = ["export_state_dict", "import_state_dict", "non_persistent_buffers",
           "optimizer_from_torch", "optimizer_to_torch"]


def _unsharded(model) -> FunctionalModel | None:
    """The unsharded functional model under a model's wrappers (None: none found)."""
    queue, seen = [model], set()
    while queue:
        obj = queue.pop(0)
        if isinstance(obj, FunctionalModel):
            return obj
        if obj is None or id(obj) in seen or isinstance(obj, nn.Module) or len(seen) > 64:
            continue
        seen.add(id(obj))
        queue += [getattr(obj, a, None) for a in ("functional", "fmodel", "tp", "inner",
                                                  "model", "base")]
    return None


def non_persistent_buffers(source) -> set[str]:
    """The names of the non-persistent buffers (those ``state_dict()`` leaves out).

    Args:
        source: an ``nn.Module``, or a shardfn model (a ``FunctionalModel`` or any
            transform of one: its skeleton says which buffers are persistent).

    Returns:
        Their dotted names (empty: none, or ``source`` is neither).

    Example:
        >>> sorted(non_persistent_buffers(sf.functional(llama)))
        ['model.rotary_emb.inv_freq']
    """
    if not isinstance(source, nn.Module):
        fmodel = _unsharded(source)
        source = getattr(fmodel if fmodel is not None else source, "module", None)
        if not isinstance(source, nn.Module):
            return set()
    out = set()
    for path, sub in source.named_modules(remove_duplicate=False):
        for name in getattr(sub, "_non_persistent_buffers_set", ()):
            out.add(f"{path}.{name}" if path else name)
    return out


def _aliases(full: Mapping[str, torch.Tensor], module: nn.Module | None) -> dict[str, str]:
    """``{state_dict name missing from full: the name in full it is tied to}``."""
    if module is None:
        return {}
    sd = module.state_dict(keep_vars=True)
    by_tensor = {id(v): k for k, v in sd.items() if k in full}
    out = {}
    for k, v in sd.items():
        if k not in full:
            if id(v) not in by_tensor:
                raise ValueError(f"export_state_dict: the module's {k!r} is not in the "
                                 "parameters given (nor tied to one of them)")
            out[k] = by_tensor[id(v)]
    return out


def export_state_dict(path: str | os.PathLike, full_params: Mapping[str, torch.Tensor],
                      format: str = "safetensors", *, module: nn.Module | None = None,
                      model=None) -> str:
    """Write full parameters as a ``module.state_dict()``-compatible file (call on one rank).

    Like ``module.state_dict()`` it holds the parameters and the persistent buffers:
    the non-persistent buffers that ``full_params`` holds (Llama's rotary ``inv_freq``,
    BERT's ``position_ids``) are left out when ``module`` or ``model`` says which they
    are, so ``module.load_state_dict(..., strict=True)`` takes the file.

    Args:
        path: the file to write.
        full_params: ``name -> full tensor`` (e.g. ``sf.gather(params, model.specs, mesh)``).
        format: ``"safetensors"`` or ``"torch"`` (``torch.save``).
        module: the original module: adds the state_dict names of tied weights and
            leaves out its non-persistent buffers.
        model: the shardfn model ``full_params`` come from (any transform of
            ``sf.functional(module)``): leaves out the non-persistent buffers.

    Returns:
        The path written.

    Example:
        >>> sf.checkpoint.export_state_dict("m.pt", full, "torch", module=module)
    """
    if format not in ("safetensors", "torch"):
        raise ValueError(f"export_state_dict: format is 'safetensors' or 'torch', got "
                         f"{format!r}")
    dropped = non_persistent_buffers(module) | non_persistent_buffers(model)
    tensors = {k: v.detach().cpu().contiguous() for k, v in full_params.items()
               if k not in dropped}
    for alias, name in _aliases(tensors, module).items():
        tensors[alias] = tensors[name]
    tmp = Path(f"{path}.tmp-{os.getpid()}")
    if format == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.clone() for k, v in tensors.items()}, str(tmp))  # no shared storage
    else:
        torch.save(tensors, tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return str(path)


def _read(source) -> dict[str, torch.Tensor]:
    if isinstance(source, Mapping):
        return dict(source)
    text = str(source)
    if text.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(text)
    try:
        from safetensors.torch import load_file

        return load_file(text)
    except Exception:  # noqa: BLE001 - not safetensors: a torch.save file
        return torch.load(text, map_location="cpu", weights_only=True)


def import_state_dict(source, model=None, mesh: Mesh | None = None) -> dict[str, torch.Tensor]:
    """Read a plain ``state_dict`` (a dict, a safetensors or ``torch.save`` file).

    Args:
        source: the dict or the file's path.
        model: a sharded model (``ShardedModel``, ``TensorSplitModel``): return this
            rank's shards of its parameters (names the model does not have, such as a
            tied weight's second name, are dropped); None: the full dict. Its
            non-persistent buffers, which ``module.state_dict()`` leaves out, are taken
            from ``source`` when it has them, else built as the model's ``init`` builds
            them (from the module's own values or initialisation; no random draw).
        mesh: for a model that is neither (a ``.specs`` of Layouts): the mesh.

    Returns:
        ``name -> tensor``: full, or this rank's shards.

    Raises:
        ValueError: naming the parameters and persistent buffers the model has and the
            state_dict lacks.

    Example:
        >>> params = sf.checkpoint.import_state_dict("m.safetensors", model)
    """
    full = _read(source)
    if model is None:
        return full
    names = tuple(getattr(model, "names", None) or model.specs)
    optional = non_persistent_buffers(model)
    missing = [n for n in names if n not in full and n not in optional]
    if missing:
        raise ValueError(f"import_state_dict: the state_dict lacks {missing}")
    full = {**_built(model, [n for n in names if n not in full]), **full}
    full = {n: full[n] for n in names}
    if hasattr(model, "shard_params_tree"):
        return model.shard_params_tree(full)
    if hasattr(model, "shard"):
        return model.shard(full)
    if isinstance(model, FunctionalModel) and not hasattr(model, "specs"):
        return full  # unsharded
    return shard(full, model.specs, mesh)


def _built(model, names: list[str]) -> dict[str, torch.Tensor]:
    """The full values of the non-persistent buffers ``names`` as the unsharded model's
    ``init`` builds them (only their owners' leaves are built)."""
    if not names:
        return {}
    fmodel = _unsharded(model)
    if fmodel is None:
        raise ValueError(f"import_state_dict: the state_dict lacks the non-persistent "
                         f"buffers {names}, and {type(model).__name__} has no functional "
                         "model to build them from: add them to the state_dict")
    built = fmodel.init_subset(0, sorted({fmodel.owners[n] for n in names}))
    return {n: built[n] for n in names}


def _order(torch_opt: torch.optim.Optimizer, names: Sequence[str]) -> list[str]:
    count = sum(len(g["params"]) for g in torch_opt.param_groups)
    if len(names) != count:
        raise ValueError(f"optimizer interop: {len(names)} names for the torch optimizer's "
                         f"{count} parameters (give them in param_groups order, e.g. "
                         "[n for n, _ in module.named_parameters()])")
    return list(names)


def optimizer_to_torch(state, torch_opt: torch.optim.Optimizer, names: Sequence[str]) -> None:
    """Load a full shardfn Adam/AdamW (``AdamState``) or SGD (``SgdState``) state into
    ``torch_opt`` (built over the module's parameters, ``names`` in its order).

    Example:
        >>> sf.checkpoint.optimizer_to_torch(full_state, torch.optim.AdamW(module.parameters()),
        ...                                  [n for n, _ in module.named_parameters()])
    """
    names = _order(torch_opt, names)
    sd = torch_opt.state_dict()
    count = int(state.count)
    per_param = {}
    for i, name in enumerate(names):
        if count == 0:
            continue
        if isinstance(state, AdamState):
            per_param[i] = {"step": torch.tensor(float(count)),
                            "exp_avg": state.mu[name].detach().clone(),
                            "exp_avg_sq": state.nu[name].detach().clone()}
        elif isinstance(state, SgdState):
            buf = None if state.momentum is None else state.momentum[name].detach().clone()
            per_param[i] = {"momentum_buffer": buf}
        else:
            raise TypeError(f"optimizer_to_torch: converts AdamState (adam/adamw) and SgdState "
                            f"(sgd), got {type(state).__name__}")
    sd["state"] = per_param
    torch_opt.load_state_dict(sd)


def optimizer_from_torch(torch_opt: torch.optim.Optimizer, names: Sequence[str], like, *,
                         step: int | None = None):
    """A full shardfn state like ``like`` (an ``AdamState`` or ``SgdState`` from
    ``opt.init(full_params)``) holding ``torch_opt``'s state.

    ``torch.optim.SGD`` keeps no step count: the count becomes ``step`` (give it when a
    schedule depends on it), else 1 when it has momentum buffers (0 without).

    Example:
        >>> state = sf.checkpoint.optimizer_from_torch(torch_opt, names, opt.init(full))
    """
    names = _order(torch_opt, names)
    torch_state = torch_opt.state_dict()["state"]
    steps = {int(v["step"]) for v in torch_state.values() if "step" in v}
    if isinstance(like, AdamState):
        if len(steps) > 1:
            raise ValueError(f"optimizer_from_torch: parameters are at different steps {steps}; "
                             "shardfn's Adam keeps one count")
        mu, nu = dict(like.mu), dict(like.nu)
        for i, name in enumerate(names):
            if i in torch_state:
                mu[name] = torch_state[i]["exp_avg"].clone()
                nu[name] = torch_state[i]["exp_avg_sq"].clone()
        count = steps.pop() if steps else 0
        return AdamState(torch.tensor(count, dtype=torch.int64), mu, nu)
    if isinstance(like, SgdState):
        momentum = None if like.momentum is None else dict(like.momentum)
        for i, name in enumerate(names):
            buf = torch_state.get(i, {}).get("momentum_buffer")
            if momentum is not None and buf is not None:
                momentum[name] = buf.clone()
        has_buffers = any(v.get("momentum_buffer") is not None for v in torch_state.values())
        count = step if step is not None else int(has_buffers)
        return SgdState(torch.tensor(count, dtype=torch.int64), momentum)
    raise TypeError(f"optimizer_from_torch: converts into AdamState (adam/adamw) or SgdState "
                    f"(sgd), got {type(like).__name__}")
