"""`shard_params`: ZeRO-3 / FSDP full parameter sharding over a mesh axis (and HSDP).

Every parameter is split on dim 0 over ``axis`` (zero-padded to whole rows,
exactly ``sf.shard(full, model.specs, mesh)``), so a rank holds ``1/N`` of the
model and its shards form an ordinary tree: any ``sf.optim`` optimizer runs on
it directly and its state is ``1/N`` too. 0-dim parameters and buffers are
replicated (``P()``).

The model is cut into *units* (submodules chosen by ``units=``; what lies
outside every unit is the *root unit*). ``apply`` is one ``autograd.Function``
(``RootFn``). Its forward gathers the root's parameters and runs the root's
forward, recording a plain autograd graph; each unit call inside it all-gathers
that unit's shards (point-to-point, straight into the unit's full parameters:
``exchange.py``), runs the unit recording its own graph, *releases* the
storage of the full parameters (the graph keeps their aliases) and enters the
root's graph through a second ``autograd.Function`` (``UnitFn``). The backward
runs the root's graph: each ``UnitFn.backward`` refills its unit's parameter
storage (all-gathers again into the same place), runs the unit's recorded
backward and reduce-scatters the parameter gradient; finally the root's own
gradient is reduce-scattered. Nothing is recomputed, and only the outer
Function meets ``torch.func``, so the same code runs under ``torch.func.grad`` /
``grad_and_value`` / ``vjp`` and plain ``loss.backward()``.

With a ``remat=`` policy forward runs without a graph instead (recording what the
policy saves) and backward recomputes: the root's forward under
``torch.func.vjp`` with each unit call *replaying* its forward output, and each
unit under ``torch.func.vjp`` with its forward's RNG state, replaying the saved
values (``remat=nothing_saveable``: ZeRO-3 with activation checkpointing at unit
boundaries).

Overlap: while a unit computes, the all-gathers of the next ``prefetch`` units
are in flight (forward: in the order recorded by the previous call, at first
the registration order, where a wrong guess wastes a gather but never gives a
wrong result; backward: the reverse of this call's forward order). A unit's
reduce-scatter is waited only in the backward of the unit before it, which
returns that gradient (it takes the later unit's shards as extra inputs); the
root waits for the first unit's and for any left unclaimed.

Gradients (``grad_reduce``): ``"mean"`` (default, DDP/FSDP semantics) divides
the reduce-scatter by the number of data-parallel ranks, so a per-rank loss on
the rank's micro-batch gives the gradient of the global mean loss. ``"sum"``
is JAX's transpose rule (all_gather -> psum_scatter). With ``replicate_axis``
(HSDP) the shard gradients are also summed over that axis (the mean divides by
both sizes). In fp16/bf16 the gradients are divided before the sum and after it
(FSDP2's ``divide_factors``), so a mean that fits the dtype does not overflow.
"mean" is the mean of the per-rank gradients: the full-batch mean only for equal
per-rank batches (check mode compares the batch shapes; ``"sum"`` with a loss
divided by the global count weights unequal batches exactly). Only the leaves a
gradient is asked for are reduced. Frozen parameters and buffers get no gradient
(None; zeros under ``torch.func``).

Dtypes and buffers: ``apply`` computes in the dtypes of the shards given (float64
shards of a float32 module compute in float64) unless ``precision`` says otherwise.
``apply(..., mutable=True)`` also returns every buffer as the forward left it
(BatchNorm statistics of this rank's batch: buffers are per rank); a recompute does
not update them again, and recomputes run under the forward's autocast state.

Parameters tied across units belong to the root unit: they
are gathered once with it, passed to the units as full tensors, and their
gradient (the sum over all uses) is reduce-scattered once.

Cost per step with N ranks on ``axis`` and Psi = parameter bytes padded to
whole rows (a dim-0 size d becomes ``N * ceil(d / N)``): communication
``3 Psi (N-1)/N`` per rank (all-gather in forward, again in backward,
reduce-scatter), ``2 Psi (N-1)/N`` with ``reshard_after_forward=False`` (the
forward's full parameters are kept for backward, like ZeRO-2). Frozen
parameters are gathered but not reduce-scattered. Memory: ``Psi / N`` of
shards, plus up to ``prefetch + 1`` units' full parameters (and the root's),
plus during backward the current unit's full gradient and one reduction in flight
(the previous unit's), plus the activations (all of them by default;
with ``remat=nothing_saveable`` those at unit boundaries and one unit's inner
activations). The root unit stays gathered through forward and through backward.

The package is layered one way (each module imports only those above it here):

* ``placement`` (devices and dtypes) and ``choose`` (the ``units=`` policy);
* ``plan``: the units and everything about them, computed once and frozen;
* ``exchange``: a unit's gather and reduction;
* the call, one ``apply``: ``tree``, ``unit_modes``, ``accumulator``, ``prefetch``,
  ``deferred``; ``record`` (what the call was given and what its forward did);
  ``steps``, ``forward``, ``backward`` (functions over the call); ``functions`` (its
  two ``autograd.Function`` s); ``call`` (``ApplyCall``, the holder of its parts);
* ``compose``: what ``shard_params`` does with other model kinds (``with_precision``,
  sharded ones; docs/composing.md);
* ``api``: :class:`ShardedModel` and :func:`shard_params`.

``docs/architecture.md`` walks through one call step by step.

Large-model options:

* ``precision=sf.Precision(...)`` (FSDP2 ``MixedPrecisionPolicy``): each unit's floating
  shards are cast to ``param_dtype`` as they are packed for the all-gather (bf16 halves
  its bytes) and the unit computes in it; the full gradients are reduce-scattered in
  ``reduce_dtype`` (default ``param_dtype``) and come back in the shards' own (master)
  dtype. Floating buffers and 0-dim parameters are cast too, like ``with_precision``.
* ``offload=True`` / ``OffloadPolicy(storage, compute)`` (ZeRO-Offload): shards, their
  gradients and so the optimizer state live on the storage device; a unit's shards are
  copied to the compute device just before its all-gather, gradient shards back after
  the reduce-scatter; bytes are counted in ``sf.comm_stats()`` under ``"h2d"``/``"d2h"``.
* ``remat=policy``: the unit's (and root's) forward records the outputs the policy saves
  (never values computed from the gathered parameters alone) and the backward recomputes
  the rest, replaying them; ``nothing_saveable`` recomputes each unit whole.
* ``ignored_params=`` (FSDP2's): parameters held whole on each rank (their own value per
  rank), handed to their unit as given, never gathered nor reduced: their gradients come
  back as the rank computed them (FSDP x EP keeps each rank's experts so).
* ``model.accumulate_grads(loss_fn, k, mode)``: ``k`` micro-batches per step with one
  reduce-scatter per unit (``"reduce_once"``: full gradients accumulate locally) or
  ``k`` of them (``"reduce_each"``: shard gradients accumulate).

Example:
    >>> fmodel = sf.functional(net)
    >>> model = shard_params(fmodel, mesh, axis="dp", units=Block)
    >>> shards = model.init(0)                       # this rank's shards only
    >>> loss = lambda p, x, y: F.cross_entropy(model.apply(p, x), y)
    >>> grads, value = torch.func.grad_and_value(loss)(shards, x_local, y_local)
    >>> full = sf.gather(shards, model.specs, mesh)  # == fmodel.init(0)
"""

from shardfn.transforms.shard_params.api import ShardedModel, shard_params
from shardfn.transforms.shard_params.choose import UnitPolicy
from shardfn.transforms.shard_params.compose import register
from shardfn.transforms.shard_params.placement import OffloadPolicy

register(ShardedModel, shard_params)  # with_precision(sharded, p): rebuilt with precision=p

__all__ = ["OffloadPolicy", "ShardedModel", "UnitPolicy", "shard_params"]
