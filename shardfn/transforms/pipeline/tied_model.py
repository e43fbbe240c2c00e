"""``TiedPipelineModel``: a pipeline whose leaves several stages may hold, or whose units
were cut from a model and keep its names.

See :mod:`.ties` (the gradient sum between the holders of a tied weight). This model's
``init`` builds each leaf from its owning submodule of the root model (also a copy on a
second holder), and its ``gather`` takes a tied leaf from its owner only.

Example:
    >>> pp = sf.pipeline_stages(llama, mesh, "pp", balance=[2, 2], microbatches=4)
    >>> full = pp.gather(pp.init(0))             # loads into the Hugging Face model
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from shardfn.transforms.pipeline.pipeline_model import PipelineModel

__all__ = ["TiedPipelineModel"]

Params = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True, eq=False)
class TiedPipelineModel(PipelineModel):
    """A :class:`~.pipeline_model.PipelineModel` whose leaves may be held by several stages
    (tied weights across stages) or named by the model the units were cut from.

    Its members are the pipeline's; it differs in ``init`` (each leaf from its owning
    submodule of the root, also on a rank holding a copy) and ``gather`` (a copy is not
    sent: the owner's leaf is the one). ``value_and_grad``'s gradients of a tied leaf are
    summed between its holders (:func:`sum_tied`, in the step).

    Example:
        >>> pp = sf.pipeline_stages(gpt2, mesh, "pp", balance=[3, 3], microbatches=4)
        >>> isinstance(pp, TiedPipelineModel)
        True
    """

    def init(self, seed: int, device: torch.device | str | None = None) -> Params:
        """This rank's leaves, equal to ``self.shard(self.functional.init(seed))``.

        Plain stages build their leaves from the root's submodules; a stage model (named
        as the root, :mod:`.named_stage`) initialises its own (``shard_params``: this
        rank's shards), a tied leaf on every holder alike.

        Example:
            >>> sorted(pp.init(0)) == sorted(pp.names)
            True
        """
        plain = {stage.index for stage in self.stages if stage.index not in self.stage_models}
        leaves = self.plan.stages.init(seed, self.rank, device=device, stages=plain)
        for model in self.stage_models.values():
            leaves.update(model.init(seed) if device is None else model.init(seed, device))
        return {name: leaves[name] for name in self.names}

    def gather(self, tree: Mapping[str, torch.Tensor]) -> Params:
        """The full leaves of every pp rank's leaves, on every pp rank; a leaf several
        stages hold comes from its owner (the first stage holding it).

        Example:
            >>> full = pp.gather(pp.init(0))
        """
        layout = self.layout
        unknown = sorted(n for n in tree if n not in layout)
        owned = {n: t for n, t in tree.items() if n in unknown or layout[n] == self.rank}
        return super().gather(owned)

    def train(self, mode: bool = True) -> TiedPipelineModel:
        """A copy in training (or eval) mode (see :meth:`PipelineModel.train`)."""
        base = super().train(mode)
        return dataclasses.replace(self, plan=base.plan, stage_models=base.stage_models)
