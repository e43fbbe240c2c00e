"""Pure optimizers in optax's style: ``init(params) -> state``, ``update(...) -> (updates, state)``.

The update rules follow torch.optim's arithmetic op for op (SGD, Adam, AdamW),
run over the flat leaf list with ``torch._foreach_add_``-style kernels, and never mutate
their inputs unless asked to (``donating(opt)``, ``apply_updates(..., donate=True)``:
the inputs are dead after the call and are overwritten in place). States are
NamedTuples of tensors, so they save, shard and gather like parameters. See docs/optim.md.

Example:
    >>> import shardfn as sf
    >>> opt = sf.optim.chain(sf.optim.clip_by_global_norm(1.0), sf.optim.adamw(1e-3))
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
    >>> params = sf.optim.apply_updates(params, updates)
"""

from shardfn.optim import schedules
from shardfn.optim._compose import needs_full_leaves
from shardfn.optim.adam import AdamState, adam, adamw
from shardfn.optim.base import (
    EmptyState,
    GradientTransformation,
    ScalarOrSchedule,
    ScaleByScheduleState,
    Schedule,
    apply_updates,
    chain,
    donating,
    identity,
    scale,
    scale_by_schedule,
    set_to_zero,
)
from shardfn.optim.clipping import clip_by_global_norm, clip_grads, global_norm, sharded_over
from shardfn.optim.donation import Donation, donated
from shardfn.optim.inject import InjectHyperparamsState, inject_hyperparams, set_hyperparams
from shardfn.optim.masking import MaskedState, MultiTransformState, masked, multi_transform
from shardfn.optim.schedules import (
    constant,
    cosine_decay,
    join,
    linear_schedule,
    linear_warmup,
    warmup_cosine_decay,
)
from shardfn.optim.sgd import SgdState, sgd

__all__ = [
    "AdamState",
    "EmptyState",
    "GradientTransformation",
    "InjectHyperparamsState",
    "MaskedState",
    "MultiTransformState",
    "ScalarOrSchedule",
    "Donation",
    "ScaleByScheduleState",
    "Schedule",
    "SgdState",
    "adam",
    "adamw",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "clip_grads",
    "constant",
    "cosine_decay",
    "donated",
    "donating",
    "global_norm",
    "identity",
    "inject_hyperparams",
    "join",
    "linear_schedule",
    "linear_warmup",
    "masked",
    "multi_transform",
    "needs_full_leaves",
    "scale",
    "scale_by_schedule",
    "schedules",
    "set_hyperparams",
    "set_to_zero",
    "sgd",
    "sharded_over",
    "warmup_cosine_decay",
]
