"""DCP's global save plan and metadata, from every rank's local plan, made on each rank.

DCP's own global step (``DefaultSavePlanner.create_global_plan``) dedups write
items that several ranks plan (replicated chunks), builds the metadata and
validates the chunks; it runs on one rank between two collectives, and takes
tens of milliseconds for a few hundred items. shardfn sends the local plans in
its staging agreement, so every rank makes the same global plan itself:
:func:`global_plans` keeps each item that several ranks plan with the one that
has the fewest bytes so far (ties: the lowest rank; the plans are the same on
every rank, so the choice is too) and checks every tensor's chunks (inside the
tensor, not overlapping); rank 0 then builds the metadata (:func:`metadata_of`).

Example:
    >>> plans = global_plans([p for _, _, p in payloads])   # same on every rank
    >>> metadata = metadata_of(plans)                        # rank 0
"""

from __future__ import annotations

import dataclasses
import math

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

__all__ = ["global_plans", "metadata_of"]


def _index(item: WriteItem) -> tuple:
    offset = item.index.offset
    return item.index.fqn, None if offset is None else tuple(offset)


def _nbytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def global_plans(plans: list[SavePlan]) -> list[SavePlan]:
    """Every rank's plan with each item that several ranks plan kept by one of them.

    Raises:
        ValueError: naming a tensor whose chunks leave it or overlap.
    """
    holders: dict[tuple, tuple[WriteItem, list[int]]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            holders.setdefault(_index(item), (item, []))[1].append(rank)
    planned = [0] * len(plans)
    keeper: dict[tuple, int] = {}
    for key, (item, ranks) in holders.items():
        if len(ranks) == 1:
            keeper[key] = ranks[0]
            planned[ranks[0]] += _nbytes(item)
    for key, (item, ranks) in holders.items():
        if len(ranks) > 1:
            keeper[key] = min(ranks, key=lambda r: (planned[r], r))
            planned[keeper[key]] += _nbytes(item)
    _check_chunks([item for item, _ in holders.values()])
    return [dataclasses.replace(plan, items=[i for i in plan.items if keeper[_index(i)] == r])
            for r, plan in enumerate(plans)]


def _check_chunks(items: list[WriteItem]) -> None:
    boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            continue
        data = item.tensor_data
        lo, sizes = tuple(data.chunk.offsets), tuple(data.chunk.sizes)
        if len(lo) != len(data.size) or any(o < 0 or o + s > n for o, s, n in
                                            zip(lo, sizes, data.size, strict=True)):
            raise ValueError(f"checkpoint save: a chunk of {item.index.fqn!r} (offsets {lo}, "
                             f"sizes {sizes}) leaves its tensor of shape {tuple(data.size)}")
        for other_lo, other_sizes in boxes.setdefault(item.index.fqn, []):
            if all(a < b + t and b < a + s for a, s, b, t in
                   zip(lo, sizes, other_lo, other_sizes, strict=True)) and all(sizes) \
                    and all(other_sizes):
                raise ValueError(f"checkpoint save: chunks of {item.index.fqn!r} overlap: "
                                 f"{lo}+{sizes} and {other_lo}+{other_sizes}")
        boxes[item.index.fqn].append((lo, sizes))


def metadata_of(plans: list[SavePlan]) -> Metadata:
    """DCP's metadata of the global ``plans`` (what ``create_default_global_save_plan``
    builds: each tensor's size, properties and chunks; each object's entry)."""
    md: dict = {}
    for plan in plans:
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                md[item.index.fqn] = BytesStorageMetadata()
                continue
            data = item.tensor_data
            md.setdefault(item.index.fqn, TensorStorageMetadata(
                properties=data.properties, size=data.size, chunks=[])).chunks.append(data.chunk)
    return Metadata(state_dict_metadata=md)
