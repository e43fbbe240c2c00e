"""A Hugging Face model as pipeline units, keeping the model's own leaf names.

``pipeline_stages(hf_model, mesh, "pp", balance=..., microbatches=...)`` recognises a
``PreTrainedModel`` and cuts it into units (:func:`hf_units`). A decoder (Llama, Qwen2,
Mistral, ... in the order of HF's ``base_model_pp_plan`` where the config has one:
``embed_tokens``, ``layers``, ``norm``; GPT-2's ``wte``/``wpe``/``h``/``ln_f``):

* **embed**: the token embedding (GPT-2: plus the position embedding and dropout); it
  computes, once per micro-batch, what every block needs besides the hidden states: the
  rotary ``(cos, sin)`` (Llama family), the attention masks as the model builds them
  (:mod:`.hf_masks`: the model's own ``create_causal_mask``, and
  ``create_sliding_window_causal_mask`` for sliding-window layers, with the padding of
  ``attention_mask``, in the config's attention implementation) and the position ids;
* one unit per **decoder layer**, taking and returning the boundary tuple
  ``(hidden, cos, sin, *masks, position_ids)`` (one mask per kind of layer, each layer
  taking its own; GPT-2: ``(hidden, mask, position_ids)``); only ``hidden`` gets a
  gradient, the rest travel forward;
* **head**: the final norm and the output projection (``lm_head``): the logits.

An encoder (BERT) is cut by :mod:`.hf_encoder`. The units are made of the model's own
submodules, so their leaves are the model's tensors and the pipeline names them as
``sf.functional(hf_model)`` does (``"model.layers.0.self_attn.q_proj.weight"``):
``pp.gather(params)`` loads into the HF model, ``pp.functional`` *is*
``sf.functional(hf_model)`` and ``init`` follows HF's ``_init_weights``. A tied head
(GPT-2, ``tie_word_embeddings``, BERT's MLM decoder) is held by the first and the last
stage (:mod:`.ties`). A model parameter no unit uses is refused (naming it).

A micro-batch is HF's integer inputs packed into one tensor (:mod:`.hf_batch`); ``labels``
are the targets; the default loss is the model's own over the whole batch.

Example:
    >>> pp = sf.pipeline_stages(llama, mesh, "pp", balance=[2, 2], microbatches=4)
    >>> loss, grads = pp.value_and_grad(pp.init(0), {"input_ids": ids,
    ...                                 "attention_mask": mask, "labels": ids})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardfn._functional_hf import pretrained_model_class
from shardfn.transforms.pipeline.batch import READS_ALL, StageReads
from shardfn.transforms.pipeline.hf_batch import (
    HFLoss,
    causal_lm_loss,
    hf_loss,
    pack_inputs,
    pack_labels,
)
from shardfn.transforms.pipeline.hf_encoder import encoder_units, is_encoder
from shardfn.transforms.pipeline.hf_masks import ModelMasks, given_mask, layer_kinds
from shardfn.transforms.pipeline.stage import ModelUnits
from shardfn.transforms.pipeline.tied_model import TiedPipelineModel

__all__ = ["HFPipelineModel", "causal_lm_loss", "hf_loss", "hf_units", "is_pretrained",
           "pack_inputs", "pack_labels"]

_KEYS = ("input_ids", "attention_mask", "position_ids", "labels")
_ENCODER_KEYS = _KEYS + ("token_type_ids",)


def is_pretrained(model: Any) -> bool:
    """Whether ``model`` is a Hugging Face ``PreTrainedModel`` (transformers imported)."""
    pretrained = pretrained_model_class()
    return pretrained is not None and isinstance(model, pretrained)


class RotaryEmbed(nn.Module):
    """Llama family: token embedding, rotary ``(cos, sin)``, masks and position ids."""

    def __init__(self, embed: nn.Module, rotary: nn.Module | None, masks: ModelMasks) -> None:
        super().__init__()
        self.embed, self.rotary, self.masks = embed, rotary, masks

    def forward(self, batch: torch.Tensor) -> tuple[Any, ...]:
        ids, mask, positions = batch.unbind(1)
        hidden = self.embed(ids)
        cos, sin = (None, None) if self.rotary is None else self.rotary(hidden, positions)
        return (hidden, cos, sin, *self.masks(hidden, given_mask(mask), positions), positions)


class RotaryLayer(nn.Module):
    """Llama family: one decoder layer over the boundary tuple, with mask ``slot``."""

    def __init__(self, layer: nn.Module, slot: int = 0) -> None:
        super().__init__()
        self.layer, self.slot = layer, slot

    def forward(self, x: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, cos, sin, *masks, positions = x
        rotary = None if cos is None else (cos, sin)
        out = self.layer(hidden, attention_mask=masks[self.slot], position_ids=positions,
                         position_embeddings=rotary)
        return ((out[0] if isinstance(out, tuple) else out), cos, sin, *masks, positions)


class LearnedEmbed(nn.Module):
    """GPT-2 family: token plus position embedding, dropout, mask and position ids."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = base.wte, base.wpe, base.drop
        self.masks = ModelMasks(base, ("full_attention",))

    def forward(self, batch: torch.Tensor) -> tuple[Any, ...]:
        ids, mask, positions = batch.unbind(1)
        embeds = self.wte(ids)
        hidden = self.drop(embeds + self.wpe(positions))
        return (hidden, *self.masks(embeds, given_mask(mask), positions), positions)


class LearnedLayer(nn.Module):
    """GPT-2 family: one block over ``(hidden, mask, position_ids)``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, mask, positions = x
        out = self.layer(hidden, None, mask, position_ids=positions)
        return (out[0] if isinstance(out, tuple) else out), mask, positions


class Head(nn.Module):
    """The final norm and the output projection: the logits (or the normed hidden states
    of a model without a head)."""

    def __init__(self, norm: nn.Module, head: nn.Module | None) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, x: tuple[Any, ...]) -> torch.Tensor:
        hidden = self.norm(x[0])
        return hidden if self.head is None else self.head(hidden)


def hf_units(model: nn.Module) -> ModelUnits:
    """A Hugging Face model (decoder, its base model, or BERT) as pipeline units.

    Args:
        model: a ``PreTrainedModel`` of the Llama family (``embed_tokens``, ``layers``,
            ``norm``, ``rotary_emb``: Llama, Qwen2, Mistral, ...), of GPT-2's (``wte``,
            ``wpe``, ``h``, ``ln_f``), or BERT (:func:`~.hf_encoder.encoder_units`).

    Returns:
        :class:`~.stage.ModelUnits`: ``[embed, layer 0, ..., layer n-1, head]`` over
        ``model``'s own submodules.

    Raises:
        TypeError: a model of another layout (naming what was looked for), an attention
            kind or implementation the units do not build masks for, or a parameter of the
            model that no unit uses.

    Example:
        >>> [type(u).__name__ for u in hf_units(llama).units]
        ['RotaryEmbed', 'RotaryLayer', 'RotaryLayer', 'Head']
    """
    base = getattr(model, "base_model", model)
    if is_encoder(model):
        return _covered(ModelUnits(model, tuple(encoder_units(model))))
    config = model.config
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    plan = dict(getattr(config, "base_model_pp_plan", None) or {})
    embed, layers, norm = (plan and list(plan)) or ("embed_tokens", "layers", "norm")
    if all(hasattr(base, n) for n in (embed, layers, norm)):
        blocks = list(getattr(base, layers))[:getattr(config, "num_hidden_layers",
                                                      len(getattr(base, layers)))]
        kinds = layer_kinds(config, len(blocks))
        distinct = tuple(dict.fromkeys(kinds))
        units: list[nn.Module] = [RotaryEmbed(getattr(base, embed),
                                              getattr(base, "rotary_emb", None),
                                              ModelMasks(base, distinct))]
        units += [RotaryLayer(block, distinct.index(kind))
                  for block, kind in zip(blocks, kinds, strict=True)]
    elif all(hasattr(base, n) for n in ("wte", "wpe", "h", "ln_f")):
        units, norm = [LearnedEmbed(base)] + [LearnedLayer(block) for block in base.h], "ln_f"
    else:
        raise TypeError(f"pipeline: {type(model).__name__} is not a model pipeline_stages can "
                        "cut into units yet: it looks for base_model_pp_plan's modules (or "
                        f"{embed!r}, {layers!r}, {norm!r}), GPT-2's wte/wpe/h/ln_f or BERT's "
                        f"embeddings/encoder in {type(base).__name__}; give the units "
                        "yourself: ModelUnits(model, units) of shardfn.transforms.pipeline.stage")
    return _covered(ModelUnits(model, tuple(units) + (Head(getattr(base, norm), head),)))


def _covered(units: ModelUnits) -> ModelUnits:
    """``units``, checked to use every parameter of the model (else the pipeline would
    silently leave it out of ``names``, gradients and ``gather``)."""
    used = {id(p) for unit in units.units for p in unit.parameters()}
    missing = [n for n, p in units.root.named_parameters() if id(p) not in used]
    if missing:
        raise TypeError(f"pipeline: {type(units.root).__name__}'s units do not use "
                        f"{missing[:4]}{' ...' if len(missing) > 4 else ''}: this head or "
                        "layout is not one pipeline_stages cuts into units; give the units "
                        "yourself: ModelUnits(model, units) of shardfn.transforms.pipeline.stage")
    return units


@dataclasses.dataclass(frozen=True, eq=False)
class HFPipelineModel(TiedPipelineModel):
    """The pipeline of a Hugging Face model (see the module docstring).

    ``value_and_grad`` and ``apply`` take the batch as HF's keyword inputs: a dict with
    ``input_ids`` and optionally ``attention_mask``, ``position_ids``, ``labels`` (and an
    encoder's ``token_type_ids``), or ``input_ids`` alone (and the labels as ``targets``).

    Attributes:
        counts_tokens: the model's own loss (:data:`~.hf_batch.HFLoss`) whose labels
            :meth:`batch` prepares (``"causal_lm"``, ``"masked_lm"``: packed with the
            batch's token count, shifted or not; ``"sequence_classification"``: checked
            for ignored rows), or None (a given ``loss_fn``: labels as given).
    """

    counts_tokens: HFLoss | None = None

    @property
    def reads(self) -> StageReads:
        """The whole batch on every pp rank: :meth:`batch` packs the inputs and labels (and
        checks them) on every rank before the step, so none may be None here
        (``sf.data.stage_reads`` of this model loads everything everywhere)."""
        return READS_ALL

    @property
    def input_keys(self) -> tuple[str, ...]:
        """The keyword inputs this model's batch takes."""
        return _ENCODER_KEYS if is_encoder(self.functional.module) else _KEYS

    def batch(self, inputs: Any, targets: Any = None) -> tuple[torch.Tensor, Any]:
        """``(packed inputs, targets)`` of a batch given as HF's keyword inputs.

        Example:
            >>> x, y = pp.batch({"input_ids": ids, "labels": ids})
        """
        encoder = is_encoder(self.functional.module)
        if not isinstance(inputs, Mapping):
            inputs = {"input_ids": inputs}
        unknown = sorted(set(inputs) - set(self.input_keys))
        if unknown:
            raise ValueError(f"pipeline batch: unknown keys {unknown}; the pipeline of "
                             f"{type(self.functional.module).__name__} takes "
                             f"{list(self.input_keys)}")
        if "labels" in inputs and targets is not None:
            raise ValueError("pipeline batch: labels given twice (in the batch and as targets)")
        targets = inputs.get("labels", targets)
        ids = inputs.get("input_ids")
        types = inputs.get("token_type_ids")
        if encoder and types is None and isinstance(ids, torch.Tensor):
            types = torch.zeros_like(ids)  # BERT's default segment: 0
        packed = pack_inputs(ids, inputs.get("attention_mask"), inputs.get("position_ids"),
                             types)
        if targets is not None and self.counts_tokens in ("causal_lm", "masked_lm"):
            targets = pack_labels(targets, shift=self.counts_tokens == "causal_lm")
        if targets is not None and self.counts_tokens == "sequence_classification" and \
                not targets.is_floating_point() and bool((targets < 0).any()):
            raise ValueError("pipeline batch: sequence-classification labels with ignored rows "
                             "(-100): HF's loss is the mean over the kept rows, which the "
                             "pipeline's row weighting of micro-batches would not give; "
                             "drop those rows")
        return packed, targets

    def value_and_grad(self, params: Mapping[str, torch.Tensor], inputs: Any,
                       targets: Any = None, *, report: bool = False, mutable: bool = False
                       ) -> tuple[Any, ...]:
        """One pipelined step (:meth:`PipelineModel.value_and_grad`) on HF inputs.

        Example:
            >>> loss, grads = pp.value_and_grad(params, {"input_ids": ids, "labels": ids})
        """
        inputs, targets = self.batch(inputs, targets)
        if targets is None:
            raise ValueError("pipeline value_and_grad: no labels: pass them in the batch "
                             "({'input_ids': ..., 'labels': ...}) or as targets")
        return super().value_and_grad(params, inputs, targets, report=report, mutable=mutable)

    def apply(self, params: Mapping[str, torch.Tensor], inputs: Any, *,
              mutable: bool = False) -> Any:
        """Inference: the logits on every pp rank (:meth:`PipelineModel.apply`).

        Example:
            >>> logits = pp.eval().apply(params, {"input_ids": ids})
        """
        if isinstance(inputs, Mapping):
            inputs = {k: v for k, v in inputs.items() if k != "labels"}
        return super().apply(params, self.batch(inputs)[0], mutable=mutable)
