"""Attention masks of a Hugging Face model's pipeline, built as the model's own forward builds them.

The embedding unit of a Hugging Face pipeline (:mod:`.hf_units`, :mod:`.hf_encoder`) builds,
once per micro-batch, every attention mask its layers need, with the mask functions the
model's own module imported from ``transformers.masking_utils``:

* ``"full_attention"``: ``create_causal_mask`` (Llama, GPT-2, Qwen2's full layers);
* ``"sliding_attention"``: ``create_sliding_window_causal_mask`` (Mistral with
  ``config.sliding_window``; Qwen2's ``layer_types``);
* ``"bidirectional"``: ``create_bidirectional_mask`` (BERT).

Which layer uses which mask follows the model: ``config.layer_types`` where the config has
them, else all layers sliding when ``config.sliding_window`` is set (Mistral's rule), else
full. Masks are always materialised (``allow_is_causal_skip=False``): a micro-batch without
padding gets the same kind of tensor as one with padding, so every micro-batch sends the
same message between stages. ``attention_mask=None`` (not given) is kept as None, so HF's
packed-sequence detection from ``position_ids`` works as in the model's own forward.

Only the ``"eager"`` and ``"sdpa"`` attention implementations are supported (their masks
are tensors); another is refused naming it.

Example:
    >>> masks = ModelMasks(mistral.model, layer_kinds(mistral.config, 2))
    >>> masks.kinds
    ('sliding_attention',)
    >>> (sliding,) = masks(embeds, attention_mask, position_ids)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["AttentionKind", "ModelMasks", "given_mask", "layer_kinds"]

AttentionKind = Literal["full_attention", "sliding_attention", "bidirectional"]

#: the mask function of ``transformers.masking_utils`` for each kind of attention layer
MASK_FUNCTIONS: dict[str, str] = {"full_attention": "create_causal_mask",
                                  "sliding_attention": "create_sliding_window_causal_mask",
                                  "bidirectional": "create_bidirectional_mask"}
_IMPLEMENTATIONS = ("eager", "sdpa")


def layer_kinds(config: Any, count: int) -> tuple[AttentionKind, ...]:
    """The kind of attention mask each of a decoder's first ``count`` layers takes.

    Args:
        config: the model's config.
        count: the number of layers.

    Returns:
        One :data:`AttentionKind` per layer: ``config.layer_types`` (Qwen2, Qwen3), else
        ``"sliding_attention"`` for every layer when ``config.sliding_window`` is set (and
        ``use_sliding_window`` is not False: Mistral), else ``"full_attention"``.

    Raises:
        TypeError: a layer type other than full or sliding attention (chunked, linear ...).

    Example:
        >>> layer_kinds(transformers.MistralConfig(sliding_window=4), 2)
        ('sliding_attention', 'sliding_attention')
    """
    types = getattr(config, "layer_types", None)
    if types is not None:
        kinds = tuple(types[:count])
    elif getattr(config, "sliding_window", None) is not None and \
            getattr(config, "use_sliding_window", True) is not False:
        kinds = ("sliding_attention",) * count
    else:
        kinds = ("full_attention",) * count
    unknown = sorted({k for k in kinds if k not in ("full_attention", "sliding_attention")})
    if unknown:
        raise TypeError(f"pipeline: config.layer_types has {unknown}; the pipeline units build "
                        "full_attention and sliding_attention masks only")
    return kinds


class ModelMasks:
    """Builds a base model's attention masks as its forward does (see the module docstring).

    Not an ``nn.Module``: kept on a unit it adds no leaves. It holds the model's config and
    the name of its module, whose mask functions it calls.

    Args:
        base: the base model (``LlamaModel``, ``BertModel`` ...).
        kinds: the kinds of mask to build, in order (one per distinct layer kind).

    Raises:
        TypeError: an attention implementation other than eager/sdpa, or a model whose
            module lacks a mask function it needs.

    Example:
        >>> ModelMasks(llama.model, ("full_attention",))(embeds, mask, positions)[0].shape
        torch.Size([2, 1, 7, 7])
    """

    def __init__(self, base: nn.Module, kinds: Sequence[AttentionKind]) -> None:
        self.module, self.config, self.kinds = type(base).__module__, base.config, tuple(kinds)
        name = type(base).__name__
        implementation = getattr(self.config, "_attn_implementation", None) or "eager"
        if implementation not in _IMPLEMENTATIONS:
            raise TypeError(f"pipeline: {name} uses attn_implementation={implementation!r}; the "
                            f"pipeline units support {list(_IMPLEMENTATIONS)} (their masks are "
                            "tensors that travel between stages)")
        for kind in self.kinds:
            if getattr(sys.modules[self.module], MASK_FUNCTIONS[kind], None) is None:
                raise TypeError(f"pipeline: {name}'s module has no {MASK_FUNCTIONS[kind]} for "
                                f"its {kind} layers; this Hugging Face model is not supported "
                                "by pipeline_stages yet")

    def __call__(self, embeds: torch.Tensor, mask: torch.Tensor | None,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """One mask per kind, for one micro-batch.

        Args:
            embeds: the embedded inputs ``(batch, seq, hidden)`` (batch size, length, dtype).
            mask: the 2-D padding mask (1: attend), or None (not given).
            positions: the position ids (decoders), or None.

        Returns:
            The masks, in the order of ``kinds``.
        """
        module = sys.modules[self.module]
        masks = []
        for kind in self.kinds:
            create = getattr(module, MASK_FUNCTIONS[kind])
            if kind == "bidirectional":
                masks.append(create(config=self.config, inputs_embeds=embeds, attention_mask=mask,
                                    allow_is_bidirectional_skip=False))
            else:
                masks.append(create(config=self.config, inputs_embeds=embeds, attention_mask=mask,
                                    cache=None, position_ids=positions,
                                    allow_is_causal_skip=False))
        return tuple(masks)


def given_mask(mask: torch.Tensor) -> torch.Tensor | None:
    """The packed ``attention_mask`` row, or None where it was not given (packed as -1).

    Example:
        >>> given_mask(torch.full((2, 3), -1)) is None
        True
    """
    return None if bool((mask < 0).all()) else mask
