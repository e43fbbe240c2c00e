"""Weights from and to Hugging Face: ``save_pretrained`` directories, for every model kind.

* :func:`load_pretrained` reads a directory that ``transformers``' ``save_pretrained``
  wrote (``model.safetensors``, or ``model.safetensors.index.json`` and its shards)
  into this rank's leaves of any model kind (``sf.functional``, ``shard_params``,
  ``tensor_split``, FSDP x TP, ``pipeline_stages``, and their wrappers), cast to the
  leaves' dtype. Each rank reads only its leaves; for row and column splits
  (``shard_params``, plain ``tensor_split`` styles, FSDP x TP) only the rows of its
  shards (``safe_open(...).get_slice``), else the full tensor, which the model's own
  ``shard`` cuts. No communication.
* :func:`save_pretrained` writes any layout back as such a directory: one group of
  leaves at a time (at most ``max_shard_size`` bytes) is gathered with the model's own
  ``gather`` and written by one rank, with the index, ``config.json`` and
  ``generation_config.json``; ``from_pretrained`` loads it with no missing or unexpected
  key. Persistent entries only (like ``state_dict()``); a tied weight once, under the
  name ``transformers`` keeps.

Names are the model's leaf names (for a Hugging Face module: its ``state_dict`` keys);
a file of the whole model loads into its base model and back (the
``base_model_prefix``, as ``from_pretrained`` does).

Example:
    >>> model = sf.shard_params(sf.functional(llama), mesh, "dp")
    >>> params = sf.checkpoint.load_pretrained("llama-dir", model)
    >>> sf.checkpoint.save_pretrained("out-dir", model, params)   # every rank calls it
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from shardfn._functional_hf import user_config
from shardfn.checkpoint import _hf_files as hf_files
from shardfn.checkpoint._agree import Outcome, agree
from shardfn.checkpoint._dcp import checkpoint_group
from shardfn.checkpoint.errors import CheckpointMismatchError
from shardfn.checkpoint.export import _built, non_persistent_buffers
from shardfn.spec import Layout, LeafLayout, P
from shardfn.transforms import FsdpTpLayout, FsdpTpModel, ShardedModel, TensorSplitModel

__all__ = ["load_pretrained", "save_pretrained"]

Params = dict[str, torch.Tensor]


# ---------------------------------------------------------------- names


def _renames(fmodel) -> list[Callable[[str], str | None]]:
    """Leaf name -> stored key: as is; with the base model prefix added; removed."""
    prefix = getattr(fmodel.module, "base_model_prefix", "") or ""
    same: list[Callable[[str], str | None]] = [lambda n: n]
    if not prefix:
        return same
    cut = len(prefix) + 1
    return same + [lambda n: f"{prefix}.{n}",
                   lambda n: n[cut:] if n.startswith(prefix + ".") else None]


def _stored_keys(fmodel, stored: set[str]) -> tuple[dict[str, str], set[str]]:
    """``(leaf -> stored key, the stored keys that are tied aliases or non-persistent
    buffers)``: a tied leaf may be stored under any of its names."""
    rename = max(_renames(fmodel), key=lambda r: sum(r(n) in stored for n in fmodel.names))
    aliases: dict[str, list[str]] = {}
    for alias, kept in fmodel.tied.items():
        aliases.setdefault(kept, []).append(alias)
    keys = {}
    for name in fmodel.names:
        for candidate in (name, *aliases.get(name, ())):
            if rename(candidate) in stored:
                keys[name] = rename(candidate)
                break
    known = {rename(n) for n in [*fmodel.tied, *non_persistent_buffers(fmodel)]}
    return keys, known


def _save_names(fmodel) -> dict[str, str]:
    """Leaf -> the key to write: a tied leaf under the name ``transformers`` keeps (the
    source of its ``_tied_weights_keys``), which ``from_pretrained`` ties the other to."""
    hf_tied = getattr(fmodel.module, "_tied_weights_keys", None)
    out = {name: name for name in fmodel.names}
    if isinstance(hf_tied, Mapping):
        for alias, kept in fmodel.tied.items():
            if hf_tied.get(kept) == alias:
                out[kept] = alias
    return out


# ---------------------------------------------------------------- load


def _windows(layout: Any, shape: tuple[int, ...], mesh) -> list[hf_files.Window] | None:
    """Per dim ``(first row, rows, local rows)`` of this rank's shard under ``layout``
    (a split of a split composes: FSDP x TP), as ``sf.shard`` cuts and pads; None: no
    row window describes it (a fused ``[q|k|v]``)."""
    windows = [(0, d, d) for d in shape]
    for step in (layout.tp, layout.dp) if isinstance(layout, FsdpTpLayout) else (layout,):
        if isinstance(step, LeafLayout):
            return None
        spec = step.spec if isinstance(step, Layout) else (step or P())
        for dim, part in enumerate(spec):
            if part is None:
                continue
            start, count, length = windows[dim]
            n, i = mesh.size(part), mesh.index(part)
            block = -(-length // n)
            first = min(i * block, length)
            windows[dim] = (start + min(first, count), max(0, min(first + block, count) - first),
                            block)
    return windows


def _reads_rows(model) -> bool:
    """Whether ``model.shard`` is ``sf.shard`` with ``model.specs`` (no placement of its
    own, such as an offload's pinned storage), so a rank may read its rows only."""
    inner = model.sharded if isinstance(model, FsdpTpModel) else model
    return isinstance(model, (ShardedModel, TensorSplitModel, FsdpTpModel)) and \
        getattr(inner, "offload", None) is None


def _target(leaf_dtype: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and leaf_dtype.is_floating_point else leaf_dtype


def load_pretrained(path: str | os.PathLike, model, *, dtype: torch.dtype | None = None,
                    strict: bool = True, device: torch.device | str | None = None) -> Params:
    """This rank's leaves of ``model`` from a ``save_pretrained`` directory.

    Args:
        path: the directory (``model.safetensors``, or ``model.safetensors.index.json``
            and the shards it names).
        model: any model kind (``sf.functional(module)`` and every transform of it);
            a pipeline gets the leaves of this rank's stages only.
        dtype: the floating leaves' dtype (a bfloat16 file into float32 parameters);
            None: each leaf's own dtype (``model.functional.param_shapes()``). Integer
            leaves keep theirs.
        strict: refuse leaves the files lack and keys of the files the model does not
            have; False: a missing leaf is left out of the result (merge it with
            ``model.init(seed)``) and unknown keys are skipped. A shape that differs is
            refused either way.
        device: where the leaves go (None: the mesh's device, CPU without a mesh; an
            offloading ``shard_params`` keeps them where its ``shard`` puts them).

    Returns:
        ``name -> this rank's leaf`` in ``model.names`` order, as ``model.shard`` of the
        stored values gives. Non-persistent buffers the files lack (Llama's rotary
        ``inv_freq``) are built as ``model.init`` builds them. Tied weights are one leaf
        (a missing ``lm_head.weight`` of a tied model is expected).

    Raises:
        CheckpointMismatchError: (a ``ValueError``) naming every missing and unexpected
            key and every shape that differs (stored and expected).
        CorruptCheckpointError: a file the index names is missing or not safetensors.
        FileNotFoundError: ``path`` holds neither file.

    Example:
        >>> model = sf.tensor_split(sf.functional(llama), mesh, "tp", plan)
        >>> params = sf.checkpoint.load_pretrained("llama-dir", model, dtype=torch.float32)
        >>> opt_state = opt.init(params)            # weights only: a fresh optimizer
    """
    fmodel = model.functional
    optional = non_persistent_buffers(model)
    shapes = fmodel.param_shapes()
    mesh = model.mesh
    if device is None:
        device = mesh.device if mesh is not None else torch.device("cpu")
    with hf_files.WeightFiles(path) as files:
        keys, known = _stored_keys(fmodel, set(files.where))
        missing = [n for n in fmodel.names if n not in keys and n not in optional]
        unexpected = sorted(set(files.where) - set(keys.values()) - known)
        wrong = [f"{keys[n]!r}: stored {files.shape(keys[n])}, the model's "
                 f"{tuple(shapes[n].shape)}" for n in fmodel.names
                 if n in keys and files.shape(keys[n]) != tuple(shapes[n].shape)]
        if wrong or (strict and (missing or unexpected)):
            raise CheckpointMismatchError(
                f"load_pretrained({str(path)!r}) into {type(fmodel.module).__name__}: "
                + "; ".join(part for part in (
                    f"missing keys {missing}" if strict and missing else "",
                    f"unexpected keys {unexpected}" if strict and unexpected else "",
                    f"shapes differ: {', '.join(wrong)}" if wrong else "") if part)
                + ("" if wrong else " (strict=False loads the keys both have)"))
        specs = model.specs if _reads_rows(model) else None  # (a property: built once)
        out: Params = {}
        for name in model.names:
            if name not in keys:
                continue
            target = _target(shapes[name].dtype, dtype)
            windows = None if specs is None else \
                _windows(specs[name], tuple(shapes[name].shape), mesh)
            if windows is not None:
                out[name] = files.read(keys[name], windows).to(device, target)
            else:  # the full tensor, cut by the model itself
                full = files.read(keys[name]).to(device, target)
                out.update(model.shard({name: full}))
    build = [n for n in model.names if n not in keys and n in optional]
    if build:
        out.update(model.shard({n: v.to(device) for n, v in _built(model, build).items()}))
    return {name: out[name] for name in model.names if name in out}


# ---------------------------------------------------------------- save


def _write_configs(path: Path, fmodel, config, dtypes: set[torch.dtype]) -> None:
    """``config.json`` (its ``architectures`` and ``dtype`` those of the files) and, when
    the module has one, ``generation_config.json``."""
    module = fmodel.module
    config = config if config is not None else user_config(module)
    if config is not None and hasattr(config, "save_pretrained"):
        config = copy.deepcopy(config)
        if hasattr(module, "config_class"):  # a transformers PreTrainedModel
            config.architectures = [type(module).__name__]
        if len(dtypes) == 1:
            config.dtype = next(iter(dtypes))
        config.save_pretrained(str(path))
    generation = getattr(module, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(str(path))


def save_pretrained(path: str | os.PathLike, model, params: Mapping[str, torch.Tensor], *,
                    config=None, max_shard_size: int | str = "5GB",
                    dtype: torch.dtype | None = None) -> str:
    """Write this model's leaves as a ``save_pretrained`` directory (every rank calls it).

    Leaves are gathered a file's worth at a time (``model.gather`` of at most
    ``max_shard_size`` bytes; a pipeline gathers its whole tree over pp first) and the
    first rank of the mesh writes each file atomically (temporary name, fsync, rename),
    then the index and the configs; weight files of an earlier save in ``path`` are
    removed. A failure on the writing rank is raised on every rank
    (``CheckpointError`` naming it). An unsharded model (no mesh) writes from the
    calling process.

    Args:
        path: the directory (made if missing).
        model: any model kind; ``params`` its leaves on this rank (``model.names``).
        params: ``name -> this rank's leaf``.
        config: the ``transformers`` config to write as ``config.json`` (default: the
            module's own ``config``; none: no config written).
        max_shard_size: bytes per file, an int or ``"5GB"``/``"500MB"``/``"2GiB"``; more
            than one file adds ``model.safetensors.index.json``.
        dtype: the floating leaves' dtype in the files (None: as they are);
            ``config.json``'s ``dtype`` says the one written.

    Returns:
        ``path``.

    Raises:
        ValueError: naming the leaves ``params`` lacks or that the model does not have.
        CheckpointError: writing failed (on every rank).

    Example:
        >>> sf.checkpoint.save_pretrained("out-dir", model, params, max_shard_size="2GB")
        >>> llama = AutoModelForCausalLM.from_pretrained("out-dir")
    """
    fmodel, mesh, path = model.functional, model.mesh, Path(path)
    max_bytes = hf_files.parse_size(max_shard_size)
    dropped = non_persistent_buffers(model)
    missing = [n for n in model.names if n not in params and n not in dropped]
    unknown = [n for n in params if n not in model.names]
    if missing or unknown:
        raise ValueError(f"save_pretrained: params must hold this rank's leaves of the model "
                         f"(model.names): missing {missing}, not leaves {unknown}")
    kept = [n for n in model.names if n not in dropped]
    if hasattr(model, "stage_models"):  # a pipeline: each rank holds its stages' leaves
        whole = model.gather({n: params[n] for n in kept})  # every pp rank: the full tree
        kept, gather = [n for n in fmodel.names if n in whole and n not in dropped], None
    else:
        whole = None
        gather = model.gather
    numels = {name: shape.shape.numel() for name, shape in fmodel.param_shapes().items()}
    sizes = [(name, numels[name] * _target((params if whole is None else whole)[name].dtype,
                                           dtype).itemsize) for name in kept]
    groups = hf_files.plan_files(sizes, max_bytes)
    names = hf_files.file_names(len(groups))
    stored = _save_names(fmodel)
    writer = mesh is None or mesh.rank == mesh.ranks[0]
    outcome, weight_map, dtypes = Outcome(), {}, set()
    if writer:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            outcome.error = err
    for file_name, group in zip(names, groups, strict=True):
        full = {n: whole[n] for n in group} if gather is None else \
            gather({n: params[n] for n in group})
        if not writer or outcome.error is not None:
            continue
        try:
            tensors = {}
            for n in group:
                value = full[n].detach()
                target = _target(value.dtype, dtype)
                tensors[stored[n]] = value.to("cpu", target, copy=True).contiguous()
                if value.is_floating_point():
                    dtypes.add(target)
                weight_map[stored[n]] = file_name
            hf_files.write_file(path / file_name, tensors)
        except Exception as err:  # noqa: BLE001 - raised on every rank below
            outcome.error = err
        del full
    if writer and outcome.error is None:
        try:
            if len(names) > 1:
                metadata = {"total_size": sum(size for _, size in sizes),
                            "total_parameters": sum(numels[n] for n in kept)}
                hf_files.write_json(path / hf_files.INDEX, {
                    "metadata": metadata, "weight_map": dict(sorted(weight_map.items()))})
            hf_files.remove_stale(path, [*names, *([hf_files.INDEX] if len(names) > 1 else [])])
            _write_configs(path, fmodel, config, dtypes)
        except Exception as err:  # noqa: BLE001 - raised on every rank below
            outcome.error = err
    agree(None if mesh is None else checkpoint_group(), outcome, f"save_pretrained({path})")
    return str(path)
