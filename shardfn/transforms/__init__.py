"""Composable transforms: each file is one transform you can read top to bottom."""

from shardfn.transforms._fsdp_ep import FsdpEpLayout, FsdpEpModel
from shardfn.transforms._fsdp_tp import FsdpTpLayout, FsdpTpModel
from shardfn.transforms._pp_ep import expert_stage
from shardfn.transforms._tp_ep import TpEpModel
from shardfn.transforms.accumulate import accumulate_grads, split_batch
from shardfn.transforms.data_parallel import DataParallel, data_parallel
from shardfn.transforms.experts import ExpertParallelModel, expert_parallel
from shardfn.transforms.loss_scale import (
    LossScaler,
    ScaleState,
    all_finite,
    dynamic_loss_scale,
    skip_nonfinite,
    static_loss_scale,
)
from shardfn.transforms.precision import Precision, cast_floating, with_precision
from shardfn.transforms.shard_opt_state import ShardedOptimizer, ShardedOptState, shard_opt_state
from shardfn.transforms.shard_params import OffloadPolicy, ShardedModel, shard_params
from shardfn.transforms.sync_batch_norm import SyncBatchNorm, sync_batch_norm
from shardfn.transforms.tensor_split import (
    Colwise,
    FusedLayout,
    PrepareInput,
    PrepareInputOutput,
    PrepareOutput,
    Replicate,
    Rowwise,
    SequenceParallel,
    SplitRNG,
    TensorSplitModel,
    Vocab,
    tensor_split,
)
from shardfn.transforms.vocab_parallel import vocab_parallel_cross_entropy

__all__ = [
    "Colwise",
    "DataParallel",
    "ExpertParallelModel",
    "FsdpEpLayout",
    "FsdpEpModel",
    "FsdpTpLayout",
    "FsdpTpModel",
    "FusedLayout",
    "LossScaler",
    "OffloadPolicy",
    "Precision",
    "PrepareInput",
    "PrepareInputOutput",
    "PrepareOutput",
    "Replicate",
    "Rowwise",
    "SequenceParallel",
    "ScaleState",
    "ShardedOptState",
    "ShardedModel",
    "ShardedOptimizer",
    "SplitRNG",
    "SyncBatchNorm",
    "TensorSplitModel",
    "TpEpModel",
    "Vocab",
    "accumulate_grads",
    "all_finite",
    "cast_floating",
    "data_parallel",
    "expert_parallel",
    "expert_stage",
    "dynamic_loss_scale",
    "shard_opt_state",
    "shard_params",
    "skip_nonfinite",
    "split_batch",
    "static_loss_scale",
    "sync_batch_norm",
    "tensor_split",
    "vocab_parallel_cross_entropy",
    "with_precision",
]
