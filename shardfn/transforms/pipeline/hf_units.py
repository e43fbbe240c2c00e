"""A Hugging Face causal LM as pipeline units, keeping the model's own leaf names.

``pipeline_stages(hf_model, mesh, "pp", balance=..., microbatches=...)`` recognises a
``PreTrainedModel`` and cuts it into units (:func:`hf_units`), in the order of HF's
``base_model_pp_plan`` where the config has one (``embed_tokens``, ``layers``, ``norm``):

* **embed**: the token embedding (GPT-2: plus the position embedding and dropout); it
  computes, once per micro-batch, what every block needs besides the hidden states: the
  rotary ``(cos, sin)`` (Llama family), the attention mask as the model builds it
  (``create_causal_mask`` of the model's own module: causal, with the padding of
  ``attention_mask``, in the config's attention implementation) and the position ids;
* one unit per **decoder layer**, taking and returning the boundary tuple
  ``(hidden, cos, sin, mask, position_ids)`` (GPT-2: ``(hidden, mask, position_ids)``);
  only ``hidden`` gets a gradient, the rest travel forward;
* **head**: the final norm and the output projection (``lm_head``): the logits.

The units are made of the model's own submodules, so their leaves are the model's
tensors and the pipeline names them as ``sf.functional(hf_model)`` does
(``"model.layers.0.self_attn.q_proj.weight"``): ``pp.gather(params)`` loads into the HF
model, ``pp.functional`` *is* ``sf.functional(hf_model)`` and ``init`` follows HF's
``_init_weights``. A tied ``lm_head`` (GPT-2, ``tie_word_embeddings``) is held by the
first and the last stage (:mod:`.ties`).

A micro-batch is ``input_ids`` with ``attention_mask`` and ``position_ids`` (defaults:
all ones, ``arange``, as HF's), packed into one ``(batch, 3, seq)`` integer tensor split
on dim 0 like any pipeline input (:func:`pack_inputs`); ``labels`` are the targets.
The default loss (``loss_fn="causal_lm"``) is the model's own ``loss_function`` with
``num_items_in_batch`` the whole batch's count of predicted tokens, so the step's loss
is HF's: the mean over every non-ignored token of the batch, also with padding.

``transformers`` is never imported here: the model's own module (already imported) gives
``create_causal_mask``.

Example:
    >>> pp = sf.pipeline_stages(llama, mesh, "pp", balance=[2, 2], microbatches=4)
    >>> loss, grads = pp.value_and_grad(pp.init(0), {"input_ids": ids,
    ...                                 "attention_mask": mask, "labels": ids})
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from shardfn._functional_hf import pretrained_model_class
from shardfn.transforms.pipeline.stage import ModelUnits
from shardfn.transforms.pipeline.tied_model import TiedPipelineModel

__all__ = ["HFPipelineModel", "causal_lm_loss", "hf_units", "is_pretrained", "pack_inputs",
           "pack_labels"]

_IGNORE = -100  # HF's label for "no prediction here"
_KEYS = ("input_ids", "attention_mask", "position_ids", "labels")


def is_pretrained(model: Any) -> bool:
    """Whether ``model`` is a Hugging Face ``PreTrainedModel`` (transformers imported)."""
    pretrained = pretrained_model_class()
    return pretrained is not None and isinstance(model, pretrained)


class _Base:
    """The base model's config and its module's ``create_causal_mask`` (what the model's
    own forward calls), kept outside the module tree (no leaves)."""

    def __init__(self, base: nn.Module) -> None:
        self.module, self.config = type(base).__module__, base.config
        if getattr(sys.modules[self.module], "create_causal_mask", None) is None:
            raise TypeError(f"pipeline: {type(base).__name__}'s module has no "
                            "create_causal_mask; this Hugging Face model is not supported by "
                            "pipeline_stages yet")

    def mask(self, embeds: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> Any:
        """The attention mask of one micro-batch, as the model builds it."""
        create = sys.modules[self.module].create_causal_mask
        return create(config=self.config, inputs_embeds=embeds, attention_mask=mask, cache=None,
                      position_ids=positions)


class RotaryEmbed(nn.Module):
    """Llama family: token embedding, rotary ``(cos, sin)``, mask and position ids."""

    def __init__(self, base: nn.Module, embed: nn.Module, rotary: nn.Module | None) -> None:
        super().__init__()
        self.embed, self.rotary, self.base = embed, rotary, _Base(base)

    def forward(self, batch: torch.Tensor) -> tuple[Any, ...]:
        ids, mask, positions = batch.unbind(1)
        hidden = self.embed(ids)
        cos, sin = (None, None) if self.rotary is None else self.rotary(hidden, positions)
        return hidden, cos, sin, self.base.mask(hidden, mask, positions), positions


class RotaryLayer(nn.Module):
    """Llama family: one decoder layer over the boundary tuple."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, cos, sin, mask, positions = x
        rotary = None if cos is None else (cos, sin)
        out = self.layer(hidden, attention_mask=mask, position_ids=positions,
                         position_embeddings=rotary)
        return (out[0] if isinstance(out, tuple) else out), cos, sin, mask, positions


class LearnedEmbed(nn.Module):
    """GPT-2 family: token plus position embedding, dropout, mask and position ids."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop, self.base = base.wte, base.wpe, base.drop, _Base(base)

    def forward(self, batch: torch.Tensor) -> tuple[Any, ...]:
        ids, mask, positions = batch.unbind(1)
        embeds = self.wte(ids)
        hidden = self.drop(embeds + self.wpe(positions))
        return hidden, self.base.mask(embeds, mask, positions), positions


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
    """A Hugging Face decoder model (``...ForCausalLM`` or its base model) as pipeline units.

    Args:
        model: a ``PreTrainedModel`` of the Llama family (``embed_tokens``, ``layers``,
            ``norm``, ``rotary_emb``: Llama, Mistral without sliding window, ...) or of
            GPT-2's (``wte``, ``wpe``, ``h``, ``ln_f``).

    Returns:
        :class:`~.stage.ModelUnits`: ``[embed, layer 0, ..., layer n-1, head]`` over
        ``model``'s own submodules.

    Raises:
        TypeError: a model of another layout (naming what was looked for).

    Example:
        >>> [type(u).__name__ for u in hf_units(llama).units]
        ['RotaryEmbed', 'RotaryLayer', 'RotaryLayer', 'Head']
    """
    base = getattr(model, "base_model", model)
    config = model.config
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise TypeError(f"pipeline: {type(model).__name__} uses sliding-window attention "
                        f"(config.sliding_window={config.sliding_window}), whose masks the "
                        "pipeline units do not build yet; set config.sliding_window=None")
    plan = dict(getattr(config, "base_model_pp_plan", None) or {})
    embed, layers, norm = (plan and list(plan)) or ("embed_tokens", "layers", "norm")
    if all(hasattr(base, n) for n in (embed, layers, norm)):
        count = getattr(config, "num_hidden_layers", len(getattr(base, layers)))
        units: list[nn.Module] = [RotaryEmbed(base, getattr(base, embed),
                                              getattr(base, "rotary_emb", None))]
        units += [RotaryLayer(layer) for layer in list(getattr(base, layers))[:count]]
    elif all(hasattr(base, n) for n in ("wte", "wpe", "h", "ln_f")):
        units, norm = [LearnedEmbed(base)] + [LearnedLayer(block) for block in base.h], "ln_f"
    else:
        raise TypeError(f"pipeline: {type(model).__name__} is not a decoder pipeline_stages can "
                        "cut into units yet: it looks for base_model_pp_plan's modules (or "
                        f"{embed!r}, {layers!r}, {norm!r}) or GPT-2's wte/wpe/h/ln_f in "
                        f"{type(base).__name__}; give the units yourself: ModelUnits(model, "
                        "units) of shardfn.transforms.pipeline.stage")
    return ModelUnits(model, tuple(units) + (Head(getattr(base, norm), head),))


def pack_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One micro-batchable tensor ``(batch, 3, seq)`` of a causal LM's integer inputs.

    Args:
        input_ids: ``(batch, seq)`` token ids.
        attention_mask: ``(batch, seq)``, 1 for tokens to attend to (default: all ones).
        position_ids: ``(batch, seq)`` (default: ``arange(seq)`` per row, as HF's).

    Returns:
        ``stack([input_ids, attention_mask, position_ids], 1)`` as int64.

    Example:
        >>> pack_inputs(torch.zeros(2, 5, dtype=torch.long)).shape
        torch.Size([2, 3, 5])
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"pipeline: input_ids must be a (batch, seq) tensor, got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    rows, seq = input_ids.shape
    ones = torch.ones_like(input_ids)
    mask = ones if attention_mask is None else attention_mask
    positions = torch.arange(seq, device=input_ids.device).expand(rows, seq) \
        if position_ids is None else position_ids.expand(rows, seq)
    for name, value in (("attention_mask", mask), ("position_ids", positions)):
        if tuple(value.shape) != (rows, seq):
            raise ValueError(f"pipeline: {name} has shape {tuple(value.shape)}, but input_ids "
                             f"has {(rows, seq)}")
    return torch.stack([input_ids, mask.to(input_ids.dtype), positions.to(input_ids.dtype)], 1)


def pack_labels(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` with two columns more: the batch's predicted-token count and its rows.

    What :func:`causal_lm_loss` needs to give HF's loss over the whole batch from one
    micro-batch at a time (columns are split with the rows, so every micro-batch has them).

    Example:
        >>> pack_labels(torch.tensor([[1, 2, -100]]))
        tensor([[   1,    2, -100,    1,    1]])
    """
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        raise ValueError(f"pipeline: labels must be a (batch, seq) tensor, got "
                         f"{getattr(labels, 'shape', type(labels).__name__)}")
    counted = (labels[:, 1:] != _IGNORE).sum()  # shifted: token t predicts t + 1
    extra = torch.stack([counted, torch.tensor(labels.shape[0], device=labels.device)])
    return torch.cat([labels, extra.to(labels.dtype).expand(labels.shape[0], 2)], dim=1)


def causal_lm_loss(loss_function: Callable, vocab_size: int) -> Callable:
    """``loss_fn(logits, packed_labels)``: HF's ``loss_function`` with the whole batch's
    token count (``num_items_in_batch``), rescaled so the pipeline's per-micro-batch row
    weighting gives HF's loss over the whole batch.

    Example:
        >>> loss_fn = causal_lm_loss(llama.loss_function, llama.config.vocab_size)
    """
    def loss_fn(logits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        labels, count, rows = packed[:, :-2], packed[0, -2], packed[0, -1]
        loss = loss_function(logits=logits, labels=labels, vocab_size=vocab_size,
                             num_items_in_batch=count.clamp(min=1))
        return loss * (rows / labels.shape[0])  # the pipeline weighs it by rows / batch

    return loss_fn


@dataclasses.dataclass(frozen=True, eq=False)
class HFPipelineModel(TiedPipelineModel):
    """The pipeline of a Hugging Face causal LM (see the module docstring).

    ``value_and_grad`` and ``apply`` take the batch as HF's keyword inputs: a dict with
    ``input_ids`` and optionally ``attention_mask``, ``position_ids`` and ``labels``, or
    ``input_ids`` alone (and the labels as ``targets``).

    Attributes:
        counts_tokens: the loss is ``"causal_lm"`` (labels are packed with the token count).
    """

    counts_tokens: bool = False

    def batch(self, inputs: Any, targets: Any = None) -> tuple[torch.Tensor, Any]:
        """``(packed inputs, targets)`` of a batch given as HF's keyword inputs.

        Example:
            >>> x, y = pp.batch({"input_ids": ids, "labels": ids})
        """
        if isinstance(inputs, Mapping):
            unknown = sorted(set(inputs) - set(_KEYS))
            if unknown:
                raise ValueError(f"pipeline batch: unknown keys {unknown}; the pipeline of a "
                                 f"Hugging Face model takes {list(_KEYS)}")
            if "labels" in inputs and targets is not None:
                raise ValueError("pipeline batch: labels given twice (in the batch and as "
                                 "targets)")
            targets = inputs.get("labels", targets)
            inputs = pack_inputs(inputs.get("input_ids"), inputs.get("attention_mask"),
                                 inputs.get("position_ids"))
        else:
            inputs = pack_inputs(inputs)
        if targets is not None and self.counts_tokens:
            targets = pack_labels(targets)
        return inputs, targets

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
