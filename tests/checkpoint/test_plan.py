"""shardfn's global save plan: DCP's dedup and metadata, made on every rank.

Three ranks' local plans: a row-sharded tensor (one chunk each), a replicated
tensor and an object that every rank plans, a tensor only rank 2 holds. Each
item ends up in exactly one plan (the replicated ones spread by bytes, the same
choice from the same plans), the metadata equals DCP's own
``create_default_global_save_plan`` of those plans, and chunks that leave their
tensor or overlap are refused, naming the tensor.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from shardfn.checkpoint._plan import global_plans, metadata_of


def _tensor(key: str, offsets, sizes, size) -> WriteItem:
    return WriteItem(index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(
                         chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                         properties=TensorProperties(dtype=torch.float32),
                         size=torch.Size(size)))


def _plans() -> list[SavePlan]:
    plans = []
    for rank in range(3):
        items = [_tensor("w", (2 * rank, 0), (2, 4), (6, 4)),
                 _tensor("big", (0,), (100,), (100,)), _tensor("small", (0,), (3,), (3,)),
                 WriteItem(index=MetadataIndex("step"), type=WriteItemType.BYTE_IO)]
        if rank == 2:
            items.append(_tensor("only2", (0, 0), (5, 5), (5, 5)))
        plans.append(SavePlan(items))
    return plans


def test_each_item_once_and_dcps_metadata():
    plans = global_plans(_plans())
    keys = [(i.index.fqn, tuple(i.index.offset or ())) for p in plans for i in p.items]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 3 + 4  # w: 3; 4 others
    owners = {i.index.fqn: r for r, p in enumerate(plans) for i in p.items}
    assert owners["only2"] == 2
    assert owners["big"] in (0, 1) and owners["small"] != owners["big"]  # spread by bytes
    assert global_plans(_plans()) == plans  # the same plans give the same choice
    _, theirs = create_default_global_save_plan(plans, rewrite_index_hints=False)
    assert metadata_of(plans).state_dict_metadata == theirs.state_dict_metadata


def test_bad_chunks_are_refused_naming_the_tensor():
    plans = _plans()
    plans[1].items[0] = _tensor("w", (1, 0), (2, 4), (6, 4))  # overlaps rank 0's rows 0-1
    with pytest.raises(ValueError, match="chunks of 'w' overlap"):
        global_plans(plans)
    plans = _plans()
    plans[2].items[0] = _tensor("w", (5, 0), (2, 4), (6, 4))  # rows 5-6 of 6
    with pytest.raises(ValueError, match="chunk of 'w'.*leaves its tensor"):
        global_plans(plans)
