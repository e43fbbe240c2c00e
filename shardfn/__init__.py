"""shardfn: functional, JAX-style sharding for PyTorch over torch.func.

Example:
    >>> import shardfn as sf
    >>> mesh = sf.Mesh({"dp": 1})
    >>> sf.P("dp", None)
    P('dp', None)
"""

from shardfn import data, distributed, log, memory, models, optim, pytree
from shardfn._functional_grad import grad_and_value
from shardfn.functional import FunctionalModel, ShapeDtype, functional
from shardfn.mesh import Mesh, get_mesh, set_mesh
from shardfn.model import Model
from shardfn.overlap import overlap_options
from shardfn.primitives import (
    CommStats,
    all_gather,
    all_to_all,
    all_to_all_v,
    axis_index,
    axis_size,
    broadcast,
    comm_stats,
    pmean,
    pmean_invariant,
    ppermute,
    psum,
    psum_invariant,
    psum_scatter,
    pvary,
    reset_comm_stats,
)
from shardfn.primitives.consistency import ConsistencyError, check_consistency
from shardfn.primitives.declared import check_replicated
from shardfn.spec import Layout, P, gather, layout_of, local_shape, shard, spec_axes
from shardfn.transforms import (
    Colwise,
    DataParallel,
    ExpertParallelModel,
    FsdpEpLayout,
    FsdpEpModel,
    FsdpTpLayout,
    FsdpTpModel,
    FusedLayout,
    LossScaler,
    OffloadPolicy,
    Precision,
    Replicate,
    Rowwise,
    ScaleState,
    SequenceParallel,
    ShardedModel,
    ShardedOptimizer,
    ShardedOptState,
    SplitRNG,
    TensorSplitModel,
    TpEpModel,
    Vocab,
    accumulate_grads,
    all_finite,
    data_parallel,
    dynamic_loss_scale,
    expert_parallel,
    expert_stage,
    shard_opt_state,
    shard_params,
    skip_nonfinite,
    split_batch,
    static_loss_scale,
    sync_batch_norm,
    tensor_split,
    vocab_parallel_cross_entropy,
    with_precision,
)
from shardfn.transforms.pipeline import (
    ModelUnits,
    PipelineModel,
    Schedule,
    StepReport,
    hf_units,
    pipeline_split,
    pipeline_stages,
    schedule_from_actions,
    schedule_from_csv,
)
from shardfn.transforms.remat import Offload, checkpoint_name, checkpoint_policies, remat
from shardfn.transforms.tensor_split import (
    FusedColumnsLayout,
    PrepareInput,
    PrepareInputOutput,
    PrepareOutput,
    hf_tp_plan,
)
from shardfn.transforms.vocab_parallel import vocab_parallel_causal_lm_loss

__version__ = "0.1.0"

__all__ = [
    "ModelUnits",
    "Schedule",
    "hf_units",
    "schedule_from_actions",
    "schedule_from_csv",
    "checkpoint",
    "data",
    "Colwise",
    "PipelineModel",
    "StepReport",
    "pipeline_stages",
    "pipeline_split",
    "CommStats",
    "ConsistencyError",
    "DataParallel",
    "ExpertParallelModel",
    "FsdpEpLayout",
    "FsdpEpModel",
    "FsdpTpLayout",
    "FsdpTpModel",
    "FunctionalModel",
    "FusedColumnsLayout",
    "FusedLayout",
    "ScaleState",
    "ShapeDtype",
    "ShardedOptState",
    "ShardedModel",
    "ShardedOptimizer",
    "Layout",
    "LossScaler",
    "Precision",
    "PrepareInput",
    "PrepareInputOutput",
    "PrepareOutput",
    "Mesh",
    "Model",
    "Replicate",
    "Rowwise",
    "SequenceParallel",
    "SplitRNG",
    "TensorSplitModel",
    "TpEpModel",
    "Vocab",
    "Offload",
    "OffloadPolicy",
    "P",
    "accumulate_grads",
    "all_finite",
    "all_gather",
    "all_to_all",
    "all_to_all_v",
    "axis_index",
    "axis_size",
    "broadcast",
    "check_consistency",
    "check_replicated",
    "checkpoint_name",
    "checkpoint_policies",
    "comm_stats",
    "data_parallel",
    "expert_parallel",
    "expert_stage",
    "distributed",
    "dynamic_loss_scale",
    "functional",
    "gather",
    "hf_tp_plan",
    "get_mesh",
    "grad_and_value",
    "layout_of",
    "log",
    "local_shape",
    "memory",
    "models",
    "optim",
    "overlap_options",
    "pmean",
    "pmean_invariant",
    "ppermute",
    "psum",
    "psum_invariant",
    "psum_scatter",
    "pvary",
    "pytree",
    "remat",
    "reset_comm_stats",
    "set_mesh",
    "shard",
    "shard_opt_state",
    "shard_params",
    "skip_nonfinite",
    "split_batch",
    "static_loss_scale",
    "sync_batch_norm",
    "tensor_split",
    "vocab_parallel_causal_lm_loss",
    "vocab_parallel_cross_entropy",
    "with_precision",
    "spec_axes",
    "testing",
]


def __getattr__(name):
    # shardfn.testing spawns processes and pulls in cloudpickle; shardfn.checkpoint pulls in
    # torch.distributed.checkpoint and DTensor (seconds per process): import them on first use.
    if name in ("testing", "checkpoint"):
        import importlib

        return importlib.import_module(f"shardfn.{name}")
    raise AttributeError(f"module 'shardfn' has no attribute {name!r}")
