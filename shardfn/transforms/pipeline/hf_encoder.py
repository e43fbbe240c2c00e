"""A Hugging Face BERT encoder as pipeline units, keeping the model's own leaf names.

``pipeline_stages(bert, mesh, "pp", balance=..., microbatches=...)`` cuts a
``BertForMaskedLM``, ``BertForSequenceClassification`` or ``BertModel`` into units
(:func:`encoder_units`):

* **embed** (:class:`EncoderEmbed`): the model's own ``embeddings`` module (word, position
  and token-type embeddings, ``LayerNorm``, dropout) and the attention mask as
  ``BertModel`` builds it (``create_bidirectional_mask`` of the model's module: the
  padding of ``attention_mask``, in the config's attention implementation, eager or sdpa);
* one unit per **``BertLayer``** (:class:`EncoderLayer`), over ``(hidden, mask)``; only
  ``hidden`` gets a gradient, the mask travels forward;
* **head**: ``cls`` (the MLM head: transform, then the decoder whose weight is the word
  embedding's, tied across the first and the last stage as GPT-2's, :mod:`.ties`), or the
  pooler, dropout and classifier (sequence classification), or the last hidden state (and
  the pooled output) of a bare ``BertModel``.

A micro-batch is ``(batch, 4, seq)``: ``input_ids``, ``attention_mask``, ``position_ids`` and
``token_type_ids`` packed by :func:`~.hf_batch.pack_inputs` (defaults: no mask, ``arange``,
zeros: BERT's own defaults). The loss is the model's own (:func:`~.hf_batch.hf_loss`).

Refused, naming what is missing: other encoders (``model_type`` not ``"bert"``), BERT as a
decoder (``is_decoder``, cross attention), and BERT heads other than these three.

Example:
    >>> pp = sf.pipeline_stages(bert_mlm, mesh, "pp", balance=[2, 2], microbatches=2)
    >>> loss, grads = pp.value_and_grad(pp.init(0), {"input_ids": ids,
    ...                                 "token_type_ids": types, "labels": labels})
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardfn.transforms.pipeline.hf_masks import ModelMasks, given_mask

__all__ = ["EncoderEmbed", "EncoderHead", "EncoderLayer", "encoder_units", "is_encoder"]

_SUPPORTED = ("BertForMaskedLM", "BertForSequenceClassification", "BertModel")


def is_encoder(model: Any) -> bool:
    """Whether ``model`` (a ``PreTrainedModel``) has an encoder's layout: ``embeddings`` and
    ``encoder`` in its base model (BERT, RoBERTa, ...).

    Example:
        >>> is_encoder(bert_mlm), is_encoder(llama)
        (True, False)
    """
    base = getattr(model, "base_model", model)
    return hasattr(base, "embeddings") and hasattr(base, "encoder")


class EncoderEmbed(nn.Module):
    """The model's embeddings and the bidirectional attention mask of one micro-batch."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.embeddings, self.masks = base.embeddings, ModelMasks(base, ("bidirectional",))

    def forward(self, batch: torch.Tensor) -> tuple[Any, ...]:
        if batch.dim() != 3 or batch.shape[1] != 4:
            raise ValueError("pipeline: an encoder's micro-batch is (batch, 4, seq): "
                             "input_ids, attention_mask, position_ids, token_type_ids "
                             f"(pack_inputs(..., token_type_ids=...)); got {tuple(batch.shape)}")
        ids, mask, positions, types = batch.unbind(1)
        hidden = self.embeddings(input_ids=ids, token_type_ids=types, position_ids=positions)
        return (hidden, *self.masks(hidden, given_mask(mask)))


class EncoderLayer(nn.Module):
    """One encoder layer over ``(hidden, mask)``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, mask = x
        out = self.layer(hidden, mask)
        return (out[0] if isinstance(out, tuple) else out), mask


class EncoderHead(nn.Module):
    """The head over the last hidden state: ``head(hidden)``, or for sequence classification
    ``classifier(dropout(pooler(hidden)))``, or (a bare base model) the hidden state and the
    pooled output."""

    def __init__(self, head: nn.Module | None = None, pooler: nn.Module | None = None,
                 dropout: nn.Module | None = None) -> None:
        super().__init__()
        self.head, self.pooler, self.dropout = head, pooler, dropout

    def forward(self, x: tuple[Any, ...]) -> Any:
        hidden = x[0]
        if self.pooler is None:
            return hidden if self.head is None else self.head(hidden)
        pooled = self.pooler(hidden)
        if self.head is None:
            return hidden, pooled
        return self.head(self.dropout(pooled))


def encoder_units(model: nn.Module) -> list[nn.Module]:
    """A Hugging Face BERT model as pipeline units ``[embed, layer 0, ..., head]``.

    Args:
        model: a ``BertForMaskedLM``, ``BertForSequenceClassification`` or ``BertModel``.

    Returns:
        The units, made of ``model``'s own submodules (the same tensors).

    Raises:
        TypeError: another encoder, BERT as a decoder, or another BERT head.

    Example:
        >>> [type(u).__name__ for u in encoder_units(bert_mlm)]
        ['EncoderEmbed', 'EncoderLayer', 'EncoderLayer', 'EncoderHead']
    """
    base, config, name = model.base_model, model.config, type(model).__name__
    if getattr(config, "model_type", None) != "bert":
        raise TypeError(f"pipeline: {name} is an encoder of model_type "
                        f"{getattr(config, 'model_type', None)!r}; pipeline_stages cuts BERT "
                        f"({', '.join(_SUPPORTED)}) into units: give the units yourself: "
                        "ModelUnits(model, units) of shardfn.transforms.pipeline.stage")
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise TypeError(f"pipeline: {name} is BERT as a decoder (config.is_decoder / "
                        "add_cross_attention); pipeline_stages supports BERT as an encoder")
    if model is base:
        head = EncoderHead(pooler=base.pooler)
    elif name.endswith("ForMaskedLM") and hasattr(model, "cls"):
        head = EncoderHead(model.cls)
    elif name.endswith("ForSequenceClassification") and getattr(base, "pooler", None) is not None:
        head = EncoderHead(model.classifier, base.pooler, model.dropout)
    else:
        raise TypeError(f"pipeline: {name}'s head is not one pipeline_stages cuts into units "
                        f"(it does {', '.join(_SUPPORTED)}): give the units yourself: "
                        "ModelUnits(model, units) of shardfn.transforms.pipeline.stage")
    count = config.num_hidden_layers
    return [EncoderEmbed(base), *[EncoderLayer(layer) for layer in base.encoder.layer[:count]],
            head]
