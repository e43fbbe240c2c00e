"""The batch and the loss of a Hugging Face model's pipeline: HF's keyword inputs packed into
one tensor, and the model's own loss over the whole batch.

A pipeline input is split on dim 0 into micro-batches, so HF's integer inputs travel as one
tensor (:func:`pack_inputs`): ``(batch, 3, seq)`` for a decoder (``input_ids``,
``attention_mask``, ``position_ids``), ``(batch, 4, seq)`` for an encoder (and
``token_type_ids``). An ``attention_mask`` not given is packed as -1 and reaches the mask
functions as None, as in the model's own forward (HF then detects packed sequences from
``position_ids``).

The default loss (:func:`hf_loss`) is the model's own ``loss_function``:

* ``"causal_lm"`` (a model with an LM head): HF's ``ForCausalLMLoss``, labels shifted by one;
* ``"masked_lm"`` (``...ForMaskedLM``): HF's ``ForMaskedLMLoss``, labels not shifted;
* ``"sequence_classification"`` (``...ForSequenceClassification``): HF's
  ``ForSequenceClassificationLoss`` (regression, single- or multi-label, by the labels'
  dtype and ``num_labels``, as the model decides).

The two token losses are HF's mean over every non-ignored (``-100``) token of the *whole*
batch: the labels carry the batch's token count in two extra columns (:func:`pack_labels`),
given as ``num_items_in_batch``, so micro-batches with different counts (padding, masking)
still give HF's loss. The classification loss is a mean over rows, which the pipeline's
row weighting of micro-batches makes the whole batch's.

Example:
    >>> pack_inputs(torch.zeros(2, 5, dtype=torch.long)).shape
    torch.Size([2, 3, 5])
    >>> loss_fn, kind = hf_loss(bert_mlm, None)
    >>> kind
    'masked_lm'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["HFLoss", "causal_lm_loss", "classification_loss", "hf_loss", "pack_inputs",
           "pack_labels"]

IGNORE = -100  # HF's label for "no prediction here"
HFLoss = Literal["causal_lm", "masked_lm", "sequence_classification"]
_LOSS_TYPES: dict[str, str] = {"masked_lm": "ForMaskedLM",
                               "sequence_classification": "ForSequenceClassification"}


def pack_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One micro-batchable integer tensor of a HF model's inputs.

    Args:
        input_ids: ``(batch, seq)`` token ids.
        attention_mask: ``(batch, seq)``, 1 for tokens to attend to; not given: packed as -1
            (the mask functions get None, as HF's forward does).
        position_ids: ``(batch, seq)`` or ``(1, seq)`` (default: ``arange(seq)`` per row, as
            HF's).
        token_type_ids: ``(batch, seq)``, an encoder's segment ids; given: a fourth row.

    Returns:
        ``stack([input_ids, attention_mask, position_ids(, token_type_ids)], 1)`` as int64:
        ``(batch, 3, seq)`` or ``(batch, 4, seq)``.

    Example:
        >>> pack_inputs(torch.zeros(2, 5, dtype=torch.long)).shape
        torch.Size([2, 3, 5])
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"pipeline: input_ids must be a (batch, seq) tensor, got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    rows, seq = input_ids.shape
    mask = torch.full_like(input_ids, -1) if attention_mask is None else attention_mask
    positions = torch.arange(seq, device=input_ids.device).expand(rows, seq) \
        if position_ids is None else position_ids.expand(rows, seq)
    columns = [("attention_mask", mask), ("position_ids", positions)]
    if token_type_ids is not None:
        columns.append(("token_type_ids", token_type_ids))
    for name, value in columns:
        if tuple(value.shape) != (rows, seq):
            raise ValueError(f"pipeline: {name} has shape {tuple(value.shape)}, but input_ids "
                             f"has {(rows, seq)}")
    return torch.stack([input_ids] + [value.to(input_ids.dtype) for _, value in columns], 1)


def pack_labels(labels: torch.Tensor, shift: bool = True) -> torch.Tensor:
    """``labels`` with two columns more: the batch's predicted-token count and its rows.

    What :func:`causal_lm_loss` needs to give HF's loss over the whole batch from one
    micro-batch at a time (columns are split with the rows, so every micro-batch has them).

    Args:
        labels: ``(batch, seq)``, ``-100`` where nothing is predicted.
        shift: a causal LM's count (token ``t`` predicts ``t + 1``: the first column is never
            a target); False: a masked LM's (every non-ignored label).

    Example:
        >>> pack_labels(torch.tensor([[1, 2, -100]]))
        tensor([[   1,    2, -100,    1,    1]])
    """
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        raise ValueError(f"pipeline: labels must be a (batch, seq) tensor, got "
                         f"{getattr(labels, 'shape', type(labels).__name__)}")
    counted = ((labels[:, 1:] if shift else labels) != IGNORE).sum()
    extra = torch.stack([counted, torch.tensor(labels.shape[0], device=labels.device)])
    return torch.cat([labels, extra.to(labels.dtype).expand(labels.shape[0], 2)], dim=1)


def causal_lm_loss(loss_function: Callable, vocab_size: int) -> Callable:
    """``loss_fn(logits, packed_labels)``: a HF token loss (``ForCausalLMLoss``,
    ``ForMaskedLMLoss``) with the whole batch's token count (``num_items_in_batch``),
    rescaled so the pipeline's per-micro-batch row weighting gives HF's loss over the batch.

    Example:
        >>> loss_fn = causal_lm_loss(llama.loss_function, llama.config.vocab_size)
    """
    def loss_fn(logits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        labels, count, rows = packed[:, :-2].contiguous(), packed[0, -2], packed[0, -1]
        loss = loss_function(logits=logits, labels=labels, vocab_size=vocab_size,
                             num_items_in_batch=count.clamp(min=1))
        return loss * (rows / labels.shape[0])  # the pipeline weighs it by rows / batch

    return loss_fn


def classification_loss(loss_function: Callable, config: Any) -> Callable:
    """``loss_fn(logits, labels)``: HF's ``ForSequenceClassificationLoss`` (a mean over the
    micro-batch's rows; the pipeline weighs micro-batches by rows).

    Example:
        >>> loss_fn = classification_loss(bert_cls.loss_function, bert_cls.config)
    """
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_function(labels=labels, pooled_logits=logits, config=config)

    return loss_fn


def default_loss(model: nn.Module) -> HFLoss | None:
    """The loss a HF model computes from ``labels`` (by HF's ``loss_type``), or None."""
    loss_type = getattr(model, "loss_type", None)
    for kind, name in _LOSS_TYPES.items():
        if loss_type == name:
            return kind  # type: ignore[return-value]
    has_head = getattr(model, "get_output_embeddings", lambda: None)() is not None
    return "causal_lm" if has_head and loss_type in (None, "ForCausalLM") else None


def hf_loss(model: nn.Module, loss_fn: Any) -> tuple[Callable, HFLoss | None]:
    """A HF model's pipeline ``loss_fn`` and the kind of labels it takes.

    Args:
        model: the ``PreTrainedModel``.
        loss_fn: None (the model's own loss), one of :data:`HFLoss` (the model's, checked
            against it), or a callable ``(out, targets) -> scalar`` (used as given).

    Returns:
        ``(loss_fn, kind)``: ``kind`` says how ``labels`` are prepared (None: as given).

    Raises:
        ValueError: no own loss (a base model without a head), or a named loss that is not
            the model's.

    Example:
        >>> hf_loss(llama, None)[1]
        'causal_lm'
    """
    if callable(loss_fn) and not isinstance(loss_fn, str):
        return loss_fn, None
    own, name = default_loss(model), type(model).__name__
    if loss_fn is not None and loss_fn not in ("causal_lm", "masked_lm",
                                               "sequence_classification"):
        raise ValueError(f"pipeline_stages: unknown loss_fn {loss_fn!r}; for a Hugging Face "
                         "model 'causal_lm', 'masked_lm', 'sequence_classification' or a "
                         "callable (out, targets) -> scalar")
    if own is None or (loss_fn is not None and loss_fn != own):
        what = "no loss of its own" if own is None else f"its own loss is {own!r}"
        raise ValueError(f"pipeline_stages: {name} has {what} (loss_type "
                         f"{getattr(model, 'loss_type', None)!r}), so there is no "
                         f"{(loss_fn or 'default')!r} loss: pass loss_fn=(out, targets) -> "
                         "scalar")
    if own == "sequence_classification":
        return classification_loss(model.loss_function, model.config), own
    vocab = getattr(model.config, "vocab_size", None)
    if vocab is None:
        raise ValueError(f"pipeline_stages: {name}'s config has no vocab_size for its "
                         f"{own!r} loss: pass loss_fn=(out, targets) -> scalar")
    return causal_lm_loss(model.loss_function, vocab), own
