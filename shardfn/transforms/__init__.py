"""Composable transforms: each file is one transform you can read top to bottom."""

from shardfn.transforms.accumulate import accumulate_grads, split_batch
from shardfn.transforms.data_parallel import DataParallel, data_parallel
from shardfn.transforms.shard_opt_state import ShardedOptimizer, ShardedOptState, shard_opt_state

__all__ = [
    "DataParallel",
    "ShardedOptState",
    "ShardedOptimizer",
    "accumulate_grads",
    "data_parallel",
    "shard_opt_state",
    "split_batch",
]
