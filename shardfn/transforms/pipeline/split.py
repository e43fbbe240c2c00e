"""``pipeline_split``: a model's units cut into per-stage functional models.

The torchtitan way of composing pipeline parallelism with the other model
transforms: split first, transform each stage, then pipeline the stage models.

    >>> split = sf.pipeline_split(units, balance=[2, 3])      # one FunctionalModel per stage
    >>> stage_mesh = mesh.submesh(["dp"])                      # this rank's slice, no "pp"
    >>> stages = [sf.shard_params(s, stage_mesh, "dp") for s in split]
    >>> pp = sf.pipeline_stages(stages, mesh, "pp", schedule="1f1b", microbatches=4,
    ...                         loss_fn=mse, dp_axis="dp")

Stage ``s``'s model is ``sf.functional`` of an ``nn.Sequential`` of its units under
their indices in the whole model, so its leaves keep the full model's names
(``"3.fc1.weight"``) and its ``init`` gives exactly those leaves of the full model's.
Units cut from a model (a Hugging Face model, :class:`~.stage.ModelUnits`) or sharing a
weight across stages get the model's tree cut down to the stage instead
(:func:`~.named_stage.named_stage_module`): the same names, init and paths as the model.
``pipeline_stages`` finds the split again from the stage models' ``functional``
(:func:`find_split`): each must be the matching stage of one split, in stage order.

Example:
    >>> split = pipeline_split([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1)], [2, 1])
    >>> split[1].names, split.balance
    (('2.weight', '2.bias'), (2, 1))
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, overload

from torch import nn

from shardfn.functional import FunctionalModel, functional
from shardfn.mesh import Mesh
from shardfn.transforms.pipeline.balance import BalanceBy
from shardfn.transforms.pipeline.hf_units import hf_units, is_pretrained
from shardfn.transforms.pipeline.named_stage import named_stage_module
from shardfn.transforms.pipeline.pipeline_model import PipelineModel
from shardfn.transforms.pipeline.stage import (
    ModelUnits,
    StagePlan,
    model_units,
    place_stages,
    plan_stages,
    resolve_balance,
    stage_module,
)

__all__ = ["PipelineSplit", "find_split", "functional_of", "pipeline_split"]


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineSplit(Sequence[FunctionalModel]):
    """The stage models of one model: a sequence of FunctionalModels, one per stage.

    Attributes:
        full: ``sf.functional(nn.Sequential(*units))``, the unsplit model.
        unit_models: ``sf.functional(unit)`` per unit (what a plain stage runs).
        balance: units per stage.
        models: stage ``s``'s FunctionalModel (also ``split[s]``).
        unit_leaves: per unit, its leaf name -> the full name (:func:`~.stage.unit_leaf_names`).
        hf: cut from a Hugging Face model (:func:`~.hf_units.hf_units`): its pipeline takes
            HF's inputs and loss.
    """

    full: FunctionalModel
    unit_models: tuple[FunctionalModel, ...]
    balance: tuple[int, ...]
    models: tuple[FunctionalModel, ...]
    unit_leaves: tuple[Mapping[str, str], ...] = ()
    hf: bool = False

    @property
    def named_by_root(self) -> bool:
        """Whether the units were cut from a model (:class:`~.stage.ModelUnits`, its own leaf
        names, e.g. Hugging Face's) rather than given as plain units."""
        return any(any(full != f"{u}.{name}" for name, full in names.items())
                   for u, names in enumerate(self.unit_leaves))

    def tied_across(self) -> dict[str, tuple[int, ...]]:
        """Leaves that more than one stage holds (tied weights across stages) -> the stages."""
        held: dict[str, list[int]] = {}
        for s, stage in enumerate(self.plan(len(self.balance)).stages):
            for name in stage.names:
                held.setdefault(name, []).append(s)
        return {n: tuple(stages) for n, stages in held.items() if len(stages) > 1}

    def __len__(self) -> int:
        return len(self.models)

    @overload
    def __getitem__(self, index: int) -> FunctionalModel: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[FunctionalModel, ...]: ...

    def __getitem__(self, index: int | slice) -> Any:
        return self.models[index]

    def plan(self, n_ranks: int) -> StagePlan:
        """The stages placed looped over ``n_ranks`` pp ranks (stage ``s`` on ``s % n_ranks``)."""
        return place_stages(self.full, self.unit_models, self.balance, n_ranks,
                            self.unit_leaves)

    def __repr__(self) -> str:
        return f"PipelineSplit(balance={list(self.balance)}, {self.full!r})"


class _Origin(NamedTuple):
    """Where a stage FunctionalModel comes from (never holds the stage model itself)."""

    full: FunctionalModel
    unit_models: tuple[FunctionalModel, ...]
    balance: tuple[int, ...]
    index: int
    unit_leaves: tuple[Mapping[str, str], ...] = ()
    hf: bool = False


#: stage FunctionalModel -> its origin: how ``pipeline_stages`` finds the split of the
#: models it is given (weak: a stage model no one holds is forgotten)
_ORIGINS: weakref.WeakKeyDictionary[FunctionalModel, _Origin] = weakref.WeakKeyDictionary()


def pipeline_split(model: nn.Sequential | Sequence[nn.Module] | ModelUnits | nn.Module,
                   balance: Sequence[int] | BalanceBy, *, n_stages: int | None = None,
                   sample: Any = None, mesh: Mesh | None = None) -> PipelineSplit:
    """Split ``model``'s units into per-stage functional models, to transform one by one.

    Pass the result, or one model built from each entry (``sf.shard_params``,
    ``sf.tensor_split``, FSDP x TP, ``sf.with_precision``, ``sf.remat``), to
    :func:`~shardfn.pipeline_stages`. Nothing is materialised: each stage model keeps
    a meta-device skeleton, as ``sf.functional`` does.

    Args:
        model: an ``nn.Sequential`` (its children are the units) or a list of modules;
            or :class:`~.stage.ModelUnits` (units cut from a model, keeping its leaf names);
            or a Hugging Face causal LM (cut by :func:`~.hf_units.hf_units`; stage ``s`` is
            then named, initialised and planned like the HF model: ``shard_params``' default
            units, ``tensor_split(plan="auto")``).
        balance: units per stage (positive counts summing to the number of units), or
            ``"params"`` / ``"time"`` (by parameter count / measured time on ``sample``,
            with ``n_stages``).
        n_stages: the stage count for ``"params"`` / ``"time"`` (``p * virtual`` of the
            pipeline); with a list, if given, it must be its length.
        sample: the input ``balance="time"`` times the units with.
        mesh: with ``balance="time"``, the mesh whose index 0's timings every rank uses.

    Returns:
        A :class:`PipelineSplit`: ``split[s]`` is ``sf.functional`` of stage ``s``'s units,
        named as in the full model, with that slice of its ``init``; ``split.full`` is
        the unsplit model. A weight tied across stages is a leaf of every stage using it.

    Raises:
        TypeError / ValueError: not units, a bad balance (naming what would be valid).

    Example:
        >>> split = sf.pipeline_split([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)], [2, 1])
        >>> [sf.with_precision(s, sf.Precision(torch.bfloat16)) for s in split]
        >>> [sf.shard_params(s, stage_mesh, "dp") for s in sf.pipeline_split(llama, [2, 3])]
    """
    hf = is_pretrained(model)
    given = hf_units(model) if hf else model_units(model, "pipeline_split")
    units = given.units
    if n_stages is None:
        if isinstance(balance, str):
            raise TypeError(f"pipeline_split: balance={balance!r} needs n_stages= (the "
                            "pipeline's pp size x virtual)")
        n_stages = len(balance) if isinstance(balance, Sequence) else 0
    counts = resolve_balance(balance, units, n_stages, sample, mesh)
    planned = plan_stages(given, counts, 1)
    split = PipelineSplit(planned.full, planned.unit_models, counts, (), planned.unit_leaves, hf)
    if split.named_by_root or split.tied_across():  # the root's tree, cut to each stage
        modules = [named_stage_module(given, stage.units, stage.names, planned.full.owners)
                   for stage in planned.stages]
    else:
        modules = [stage_module(units, stage) for stage in planned.stages]
    models = tuple(functional(module) for module in modules)
    for index, stage_model in enumerate(models):
        _ORIGINS[stage_model] = _Origin(planned.full, planned.unit_models, counts, index,
                                        planned.unit_leaves, hf)
    return dataclasses.replace(split, models=models)


def functional_of(model: Any) -> Any:
    """The unsharded FunctionalModel a stage model computes (its ``functional``).

    Args:
        model: a FunctionalModel or any model kind.

    Returns:
        ``model.functional`` followed down to a FunctionalModel, or None.

    Example:
        >>> functional_of(sf.shard_params(split[0], stage_mesh, "dp")) is split[0]
        True
    """
    for _ in range(8):  # wrappers of wrappers
        if isinstance(model, FunctionalModel):
            return model
        # kinds without ``functional`` yet: TensorSplitModel (fmodel), FsdpTpModel (tp)
        found = next((getattr(model, attr) for attr in ("functional", "fmodel", "tp", "inner")
                      if getattr(model, attr, None) is not None), None)
        if found is None or found is model:
            return None
        model = found
    return None


def find_split(models: Sequence[Any]) -> PipelineSplit:
    """The :class:`PipelineSplit` whose stages ``models`` compute, one per stage, in order.

    Args:
        models: stage models: ``split[s]`` or a model built from it.

    Returns:
        The split (its ``models`` are the given models' FunctionalModels).

    Raises:
        TypeError: a model that is a pipeline, or has no ``functional``.
        ValueError: a model whose ``functional`` is not a stage of a
            :func:`pipeline_split`, stages of two splits, stages out of order or
            missing (naming the stage and what would be valid).

    Example:
        >>> find_split([sf.shard_params(s, stage_mesh, "dp") for s in split]).balance
        (2, 1)
    """
    hint = ("build them from one split: pipeline_stages([transform(s) for s in "
            "sf.pipeline_split(model, balance)], mesh, 'pp', ...)")
    origins = []
    for index, model in enumerate(models):
        if isinstance(model, PipelineModel):
            raise TypeError(f"pipeline_stages: stage model {index} is a PipelineModel; a stage "
                            "cannot be a pipeline. Pipeline once, over stage models: "
                            f"split first, then transform each stage, then pipeline: {hint}")
        fmodel = functional_of(model)
        if fmodel is None:
            raise TypeError(f"pipeline_stages: stage model {index} is a {type(model).__name__} "
                            "with no functional (the unsharded FunctionalModel it computes); "
                            f"stage models are pipeline_split's models or models of them: {hint}")
        origin = _ORIGINS.get(fmodel)
        if origin is None:
            raise ValueError(f"pipeline_stages: stage model {index}'s functional ({fmodel!r}) "
                             "is not a stage of a pipeline_split (a copy made by .train()/"
                             ".eval() is not one either: call pp.train()/pp.eval() on the "
                             f"pipeline instead); {hint}")
        if index and origin.full is not origins[0][0].full:
            raise ValueError(f"pipeline_stages: stage model {index} is a stage of another "
                             f"pipeline_split than stage model 0; {hint}")
        if origin.index != index:
            raise ValueError(f"pipeline_stages: stage model {index} computes stage "
                             f"{origin.index} of its split (units {_units(origin)}); give "
                             "one model per stage, in stage order")
        origins.append((origin, fmodel))
    if not origins:
        raise ValueError(f"pipeline_stages: no stage models; {hint}")
    first = origins[0][0]
    if len(origins) != len(first.balance):
        raise ValueError(f"pipeline_stages: {len(origins)} stage models, but their split has "
                         f"{len(first.balance)} stages (balance {list(first.balance)}): give "
                         "one model per stage")
    return PipelineSplit(first.full, first.unit_models, first.balance,
                         tuple(fmodel for _, fmodel in origins), first.unit_leaves, first.hf)


def _units(origin: _Origin) -> list[int]:
    start = sum(origin.balance[:origin.index])
    return list(range(start, start + origin.balance[origin.index]))
