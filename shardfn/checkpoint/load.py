"""``sf.checkpoint.load``: a checkpoint into the layout of ``like``, on any mesh or world size.

``like`` is the state as the new run lays it out (e.g. ``model.init(0)`` and
``opt.init(params)`` on the new mesh); ``layouts`` says how, as for ``save``.
Every rank reads the stored chunks that overlap its own shards (DCP's
resharding), so a checkpoint of ZeRO-3 on 4 ranks loads into 2 ranks, into
ZeRO-1 or into one process. Before any data is read the checkpoint must be
complete (its commit marker), its files must have their sizes, its metadata
file its checksum, and ``like`` must fit it: one error lists every missing,
unexpected and mis-shaped leaf (``subtree=``, ``unexpected="ignore"``,
``missing="keep"`` and ``cast=True`` lift one refusal each, where meant). A
compressed checkpoint (``save(..., compression=)``) is detected from its
metadata. Each data file is read once: its checksum is
checked on the bytes read (by the rank that reads most of it; a file no rank
reads is checked by one rank), and a mismatch fails the load, naming the file.
Two rank agreements in all: after planning (locally: no DCP collective), and
after reading.

Example:
    >>> like = {"params": model.init(0), "opt": opt.init(model.init(0)), "step": 0}
    >>> state = sf.checkpoint.load(sf.checkpoint.latest("ckpt"), like,
    ...                            layouts={"params": model, "opt": opt})
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import torch

from shardfn import pytree
from shardfn.checkpoint import _commit
from shardfn.checkpoint._agree import agree, local
from shardfn.checkpoint._dcp import _Target, checkpoint_group
from shardfn.checkpoint._layout import Entry, resolve
from shardfn.checkpoint._read import VerifyingReader, assign_files, file_bytes, read, read_plan
from shardfn.checkpoint.errors import CheckpointMismatchError
from shardfn.checkpoint.save import _mesh, _world, wait_pending
from shardfn.mesh import Mesh

__all__ = ["load", "mismatches", "missing_keys"]

_RANK_KEY = re.compile(r"^(.*)@rank\d+$")


def _resolve_path(path: str | os.PathLike) -> str:
    """``path`` itself, or the newest complete checkpoint in a directory of ``step_*``."""
    p = Path(path)
    if not (p / _commit.MARKER).exists() and p.is_dir() and not (p / ".metadata").exists():
        newest = _commit.latest(p)
        if newest is not None:
            return newest
    return str(path)


def missing_keys(entries: list[Entry], metadata) -> set[str]:
    """The keys of ``entries`` (``like``'s saved leaves) that the checkpoint does not hold."""
    stored = metadata.state_dict_metadata
    return {e.key for e in entries if e.key is not None and e.key not in stored}


def mismatches(entries: list[Entry], leaves: list, metadata,
               elsewhere: tuple[set[str], set[str]] = (set(), set()), *,
               missing: str = "error", unexpected: str = "error", cast: bool = False,
               within: str | None = None) -> list[str]:
    """Every way ``like`` (its entries and leaves) does not fit the checkpoint's metadata.

    Args:
        elsewhere: the keys and leaf names the other ranks load (a key another rank loads,
            a pipeline stage's leaf, is not unexpected here).
        missing, unexpected, cast: as for :func:`load` (what is allowed).
        within: only the stored keys under this dotted path can be unexpected (a subtree
            load).

    Returns:
        One line per kind of mismatch (empty: ``like`` fits).
    """
    stored = metadata.state_dict_metadata
    wanted = {e.key: (e, x) for e, x in zip(entries, leaves, strict=True) if e.key is not None}
    names = {e.name for e in entries} | elsewhere[1]
    absent = sorted(k for k in wanted if k not in stored) if missing == "error" else []
    extra = [] if unexpected == "ignore" else sorted(
        k for k in stored if k not in wanted and k not in elsewhere[0] and not (
            _RANK_KEY.match(k) and _RANK_KEY.match(k).group(1) in names) and (
            within is None or k == within or k.startswith(within + ".")))
    wrong = []
    for key, (entry, x) in sorted(wanted.items()):
        md = stored.get(key)
        if md is None:
            continue
        is_tensor = hasattr(md, "size") and hasattr(md, "chunks")
        if is_tensor != entry.tensor:
            wrong.append(f"{entry.name!r}: the checkpoint holds "
                         f"{'a tensor' if is_tensor else 'an object'}, like has "
                         f"{'a tensor' if entry.tensor else type(x).__name__}")
        elif is_tensor and tuple(md.size) != tuple(entry.shape):
            wrong.append(f"{entry.name!r}: shape {tuple(md.size)} in the checkpoint, "
                         f"{tuple(entry.shape)} in like")
        elif is_tensor and md.properties.dtype != x.dtype and not (
                cast and torch.can_cast(md.properties.dtype, x.dtype)):
            wrong.append(f"{entry.name!r}: dtype {md.properties.dtype} in the checkpoint, "
                         f"{x.dtype} in like " + (
                             "(cast=True casts only where torch.can_cast allows: not "
                             "floating into integer, not into bool)" if cast else
                             "(cast=True casts on load)"))
    out = []
    if absent:
        out.append(f"missing (in like, not in the checkpoint): {absent} "
                   "(missing='keep' keeps like's values)")
    if extra:
        out.append(f"unexpected (in the checkpoint, not in like): {extra} "
                   "(unexpected='ignore' loads the rest; subtree= loads one subtree)")
    if wrong:
        out.append("shape/type: " + "; ".join(wrong))
    return out


def load(path: str | os.PathLike, like, mesh: Mesh | None = None, layouts=None, *,
         verify: bool = True, subtree: str | None = None, missing: str = "error",
         unexpected: str = "error", cast: bool = False):
    """Load the checkpoint at ``path`` into the structure and layout of ``like``.

    Args:
        path: a checkpoint, or a directory of ``step_*`` checkpoints (its newest complete
            one is loaded).
        like: the state tree as this run lays it out: local shards of the right shapes
            and dtypes (their values are not used, except where ``layouts`` says
            :class:`~shardfn.checkpoint.Skip` or ``missing="keep"`` keeps them), and
            any objects.
        mesh: the mesh the layouts refer to (default: the current mesh, if any).
        layouts: layout sources as for :func:`~shardfn.checkpoint.save`, for this run.
        verify: check every file's size and checksum (on the bytes read).
        subtree: the dotted path of the checkpoint's subtree that ``like`` (and
            ``layouts``) mirror, e.g. ``"params"``: only it is read, and only its leaves
            count as unexpected. (An optimizer's state needs its parameters beside it:
            load ``{"params": ..., "opt": ...}`` with ``unexpected="ignore"`` instead.)
        missing: ``"error"`` (default) refuses leaves of ``like`` that the checkpoint
            lacks, naming them; ``"keep"`` returns ``like``'s own values there (a new
            head, a new optimizer buffer).
        unexpected: ``"error"`` (default) refuses leaves of the checkpoint that ``like``
            lacks, naming them; ``"ignore"`` loads the leaves ``like`` has.
        cast: ``False`` (default) refuses a stored dtype that differs from ``like``'s,
            naming the leaf and both dtypes; ``True`` casts each stored tensor to
            ``like``'s dtype where ``torch.can_cast`` allows it (bfloat16 into float32
            and back, integer into floating; not floating into integer).

    Returns:
        A new tree like ``like``: new tensors (``like``'s dtype, device and
        ``requires_grad``; padding zero) and the stored objects.

    Raises:
        IncompleteCheckpointError: the checkpoint has no commit marker.
        CorruptCheckpointError: a file is missing, truncated or corrupted (names it).
        CheckpointMismatchError: ``like`` does not fit; lists every mismatch.

    Example:
        >>> state = sf.checkpoint.load("ckpt/step_000100", like, layouts={"params": model})
        >>> params = sf.checkpoint.load("ckpt/step_000100", model.init(1), mesh, model,
        ...                             subtree="params")   # weights only
    """
    if missing not in ("error", "keep") or unexpected not in ("error", "ignore"):
        raise ValueError(f"load: missing={missing!r} (use 'error' or 'keep'), "
                         f"unexpected={unexpected!r} (use 'error' or 'ignore')")
    options = {"missing": missing, "unexpected": unexpected, "cast": cast, "within": None}
    if subtree is None:
        return _load(path, like, mesh, layouts, verify, options)
    labels = _subtree_labels(subtree)
    nested_like, nested_layouts = like, layouts
    for label in reversed(labels):
        nested_like = {label: nested_like}
        nested_layouts = None if nested_layouts is None else {label: nested_layouts}
    state = _load(path, nested_like, mesh, nested_layouts, verify,
                  {**options, "within": subtree})
    for label in labels:
        state = state[label]
    return state


def _subtree_labels(subtree: str) -> list[str]:
    labels = subtree.split(".") if isinstance(subtree, str) else []
    if not labels or not all(labels):
        raise ValueError(f"load: subtree={subtree!r} is not a dotted path of the state tree "
                         "(e.g. 'params' or 'opt.mu')")
    return labels


def _load(path, like, mesh: Mesh | None, layouts, verify: bool, options: dict):
    """:func:`load` with its options (``within``: the subtree's dotted path, or None)."""
    wait_pending()
    the_mesh = _mesh(mesh)  # before any collective: a mesh over part of the world raises here
    path = _resolve_path(path)
    group = checkpoint_group()
    rank, world = _world(group)
    leaves, treedef = pytree.tree_flatten(like)
    with local() as outcome:  # everything local: the manifest, the metadata, the read plan
        manifest = _commit.read_manifest(path)
        if verify:
            _commit.check_sizes(path, manifest, sorted(manifest["files"]))
        reader = VerifyingReader(str(path), manifest if verify else None)
        metadata = reader.read_metadata()
        entries = resolve(like, layouts, the_mesh, rank)
        _check_per_rank(entries, manifest, rank, world)
        kept = missing_keys(entries, metadata) if options["missing"] == "keep" else set()
        targets = {e.key: _Target(e, None) for e in entries
                   if e.key is not None and e.key not in kept}
        planner = plan = None
        if not mismatches(entries, leaves, metadata, (set(metadata.state_dict_metadata),
                                                      {e.name for e in entries}), **options):
            planner, plan = read_plan(targets, reader, rank)
        outcome.payload = ({e.key for e in entries if e.key is not None},
                           {e.name for e in entries},
                           {} if plan is None else file_bytes(plan, reader))
    everyone = agree(group, outcome, f"checkpoint load of {str(path)!r} (layouts)")
    with local() as outcome:
        elsewhere = (set().union(*(k for k, _, _ in everyone)),
                     set().union(*(n for _, n, _ in everyone)))
        problems = mismatches(entries, leaves, metadata, elsewhere, **options)
        if problems:
            raise CheckpointMismatchError(f"checkpoint {str(path)!r} does not fit like: "
                                          + " | ".join(problems))
        fresh = []
        for entry, x in zip(entries, leaves, strict=True):
            if entry.key is None or entry.key in kept:  # Skip, or missing="keep"
                fresh.append(x)
            elif entry.tensor:
                covered = sum(math.prod(c.sizes) for c in entry.chunks) == x.numel()
                local_tensor = (torch.empty if covered else torch.zeros)(
                    x.shape, dtype=x.dtype, device=x.device)  # zeros: the padding
                fresh.append(local_tensor)
                targets[entry.key].views = {c.offsets: c.view(local_tensor)
                                            for c in entry.chunks}
            else:
                fresh.append(None)
        data_files = sorted(n for n in manifest["files"] if n != ".metadata")
        reader.assign(*assign_files(data_files, [f for _, _, f in everyone], rank))
        read(planner, plan, reader)
        for i, (entry, x) in enumerate(zip(entries, leaves, strict=True)):
            if entry.key is None or entry.key in kept:
                continue
            if not entry.tensor:
                fresh[i] = targets[entry.key].value
            elif x.requires_grad:  # autograd-style parameters
                fresh[i].requires_grad_(True)
    agree(group, outcome, f"checkpoint load of {str(path)!r} (reading)")
    return pytree.tree_unflatten(treedef, fresh)


def _check_per_rank(entries: list[Entry], manifest, rank: int, world: int) -> None:
    """PerRank leaves (one value per rank) load only into as many ranks as saved them."""
    per_rank = sorted(e.name for e in entries if e.key is not None and
                      e.key.endswith(f"@rank{rank}"))
    saved_world = manifest.get("world_size")
    if per_rank and saved_world is not None and saved_world != world:
        raise ValueError(f"checkpoint load: {per_rank} are PerRank leaves (one value per "
                         f"rank), saved by {saved_world} ranks; this run has {world}, so "
                         "they cannot be matched to ranks. Load them as Skip() (keep "
                         "like's value) or save them replicated")
