"""Hugging Face ``transformers`` models in :func:`shardfn.functional`: their own init and units.

What shardfn follows of a ``PreTrainedModel``:

* **initialisation**: ``init(seed)`` runs the model's ``_init_weights`` (embedding and
  linear weights ``normal(0, config.initializer_range)``, norms ones, GPT-2's scaled
  residual projections, rotary frequencies from the config) as ``post_init`` does, on
  top of each module's ``reset_parameters`` (:func:`run_init_weights`);
* **units**: ``_no_split_modules`` (``{"LlamaDecoderLayer"}``) are the classes
  ``shard_params`` gathers as one unit by default, as Hugging Face's FSDP auto-wrap does
  (:func:`no_split_classes`);
* **no KV cache** by default: the functional model's copy of the config has
  ``use_cache=False`` (:func:`without_kv_cache`), so a forward returns no ``DynamicCache``
  that it filled in place (which a ``shard_params`` unit could not recompute); the
  values are the same, and ``apply(..., use_cache=True)`` still asks for one;
* **no input-grad hooks**: the forward hooks of ``enable_input_require_grads()`` (which
  ``gradient_checkpointing_enable()`` and PEFT add; they call ``requires_grad_`` on the
  embeddings' output, which ``torch.func`` refuses) are removed from the skeleton
  (:func:`without_input_grad_hooks`): a pure ``apply`` differentiates whatever it is
  given, and layers' own checkpointing runs as ``sf.remat``.

``transformers`` is never imported here: a module can only be a ``PreTrainedModel`` if
``transformers`` is imported already, so shardfn imports and runs without it.

Example:
    >>> fm = sf.functional(transformers.LlamaForCausalLM(config))
    >>> fm.init(0)["model.embed_tokens.weight"].std()     # config.initializer_range
    tensor(0.0201)
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["inside_pretrained", "no_split_classes", "pretrained_model_class",
           "refuse_recorded_outputs", "run_init_weights", "user_config",
           "without_input_grad_hooks", "without_kv_cache"]


def pretrained_model_class() -> type | None:
    """``transformers.PreTrainedModel`` if ``transformers`` is imported, else None.

    Example:
        >>> pretrained_model_class() is None or pretrained_model_class().__name__
        'PreTrainedModel'
    """
    modeling = sys.modules.get("transformers.modeling_utils")
    return getattr(modeling, "PreTrainedModel", None)


def inside_pretrained(skeleton: nn.Module, path: str) -> bool:
    """Whether the submodule at ``path`` is, or is inside, a ``PreTrainedModel``: whether
    :func:`run_init_weights` initialises it.

    Example:
        >>> inside_pretrained(sf.functional(llama).module, "model.layers.0.mlp")
        True
    """
    pretrained = pretrained_model_class()
    if pretrained is None:
        return False
    module = skeleton
    for name in [""] + (path.split(".") if path else []):
        module = module._modules[name] if name else module
        if isinstance(module, pretrained):
            return True
    return False


def run_init_weights(skeleton: nn.Module, path: str, work: nn.Module) -> None:
    """Run Hugging Face's ``_init_weights`` on ``work``, standing in for the submodule at ``path``.

    As ``PreTrainedModel.initialize_weights`` does, post-order: first the module itself,
    then each ancestor (whose ``_init_weights`` may write its children's leaves: GPT-2's
    attention scales ``c_proj.weight``), each by the ``_init_weights`` of its nearest
    ``PreTrainedModel`` (itself included). Ancestors are shallow views of ``skeleton``
    with ``work`` in the place of the submodule, so only ``work``'s materialised leaves
    change; writes to any other leaf land on the meta device (no value, no RNG draw), so
    a leaf's value depends only on its owner's seed, never on which others are built.
    Modules outside any ``PreTrainedModel`` (a user's wrapper) are left alone.

    Args:
        skeleton: the functional model's meta-device module (not modified).
        path: the submodule's path in ``skeleton`` (``""``: the root).
        work: a private copy of that submodule with its own leaves materialised.

    Returns:
        None; ``work``'s leaves are written in place (the caller seeded the RNG).

    Example:
        >>> run_init_weights(fm.module, "model.embed_tokens", work)   # work.weight ~ N(0, 0.02)
    """
    pretrained = pretrained_model_class()
    if pretrained is None:
        return
    names = path.split(".") if path else []
    chain = [skeleton]
    for name in names:
        chain.append(chain[-1]._modules[name])
    init_model, owners = None, []
    for module in chain:
        if isinstance(module, pretrained):
            init_model = module
        owners.append(init_model)
    if owners[-1] is None:
        return
    views, standing = [work], work
    for module, name in zip(reversed(chain[:-1]), reversed(names), strict=True):
        view = copy.copy(module)  # shares the skeleton's (meta) leaves and other children
        view._modules = dict(module._modules)
        view._modules[name] = standing
        views.append(view)
        standing = view
    for view, owner in zip(views, reversed(owners), strict=True):
        if owner is not None:
            owner._init_weights(view)


def no_split_classes(module: nn.Module) -> frozenset[str]:
    """The class names of every ``PreTrainedModel``'s ``_no_split_modules`` inside ``module``.

    Hugging Face's own union over sub-models (``_get_no_split_modules``); empty for a
    module without any.

    Args:
        module: any module (a functional model's skeleton).

    Returns:
        Class names such as ``{"LlamaDecoderLayer"}``.

    Example:
        >>> no_split_classes(transformers.LlamaForCausalLM(config))
        frozenset({'LlamaDecoderLayer'})
    """
    pretrained = pretrained_model_class()
    if pretrained is None:
        return frozenset()
    names: set[str] = set()
    for sub in module.modules():
        if isinstance(sub, pretrained):
            names.update(getattr(sub, "_no_split_modules", None) or ())
    return frozenset(names)


def without_kv_cache(skeleton: nn.Module) -> None:
    """Set ``config.use_cache = False`` on every ``PreTrainedModel`` inside ``skeleton``.

    Only for the functional model's own deep copy (its skeleton): the user's model and
    config are not touched.

    Args:
        skeleton: the meta-device copy ``sf.functional`` keeps.

    Returns:
        None.

    Example:
        >>> sf.functional(llama).module.config.use_cache, llama.config.use_cache
        (False, True)
    """
    pretrained = pretrained_model_class()
    if pretrained is None:
        return
    for module in skeleton.modules():
        config = getattr(module, "config", None) if isinstance(module, pretrained) else None
        if config is not None and getattr(config, "use_cache", None):
            config.use_cache = False
            module._shardfn_user_use_cache = True  # for user_config (kept by deepcopy)


def without_input_grad_hooks(skeleton: nn.Module) -> None:
    """Remove Hugging Face's ``enable_input_require_grads`` hooks from ``skeleton``.

    ``model.enable_input_require_grads()`` (called by ``gradient_checkpointing_enable()``
    and by PEFT) registers a forward hook on each input embedding that calls
    ``output.requires_grad_(True)``, so reentrant checkpointing sees a differentiable
    input. Under ``torch.func.grad`` that call raises, and a ``deepcopy`` of a skeleton
    whose embedding a transform replaced fails on the hook's dead handle. A pure ``apply``
    needs neither: gradients reach the leaves it is given, and layers that checkpoint
    themselves run as ``sf.remat``. Only the functional model's own copy is changed;
    the user's model keeps its hooks.

    Args:
        skeleton: the meta-device copy ``sf.functional`` keeps.

    Returns:
        None.

    Example:
        >>> llama.enable_input_require_grads()
        >>> sf.functional(llama).module._require_grads_hooks
        []
    """
    for module in skeleton.modules():
        state = vars(module)
        handles = list(state.get("_require_grads_hooks") or ())
        single = state.get("_require_grads_hook")
        if not handles and single is None:
            continue
        for handle in handles + [single]:
            if handle is not None:
                handle.remove()
        module._require_grads_hooks = []
        state.pop("_require_grads_hook", None)


#: the outputs a Hugging Face model records with forward hooks on its layers
_RECORDED = ("output_hidden_states", "output_attentions", "output_router_logits")


def refuse_recorded_outputs(module: nn.Module, kwargs: Mapping[str, Any], who: str) -> None:
    """Refuse a call of a Hugging Face model that asks for ``output_hidden_states``,
    ``output_attentions`` or ``output_router_logits`` (in ``kwargs`` or its config) where
    its layers do not run in place.

    transformers 5 records those outputs with forward hooks on the layer classes
    (``LlamaDecoderLayer``, ``LlamaAttention``, ``MixtralTopKRouter``); under
    ``shard_params`` a unit's layer runs inside the unit's gathered call, so the hooks
    never see it and the output would come back with an empty ``hidden_states`` tuple
    (an MoE model's auxiliary loss would read no router logits): a wrong value, refused
    instead.

    Args:
        module: the skeleton the call runs (a ``PreTrainedModel``, else nothing is checked).
        kwargs: the call's keyword arguments.
        who: the transform, for the message.

    Raises:
        ValueError: naming the flags and what computes them.

    Example:
        >>> refuse_recorded_outputs(fm.module, {"output_hidden_states": True}, "shard_params")
        Traceback (most recent call last):
        ValueError: shard_params: output_hidden_states=True ...
    """
    pretrained = pretrained_model_class()
    config = getattr(module, "config", None)
    if pretrained is None or config is None or not isinstance(module, pretrained):
        return
    asked = [f"{k}={kwargs.get(k, getattr(config, k, False))!r}" for k in _RECORDED
             if kwargs.get(k, getattr(config, k, False))]
    if asked:
        raise ValueError(
            f"{who}: {', '.join(asked)} (a keyword or {type(config).__name__}): Hugging Face "
            f"records these with forward hooks on {type(module).__name__}'s layers, which "
            f"run inside {who}'s units here, so they would come back empty. Compute them with "
            "sf.functional, sf.remat or sf.tensor_split of the model, or pass False")


def user_config(module: nn.Module):
    """A copy of a skeleton's ``config`` as the user's model had it (``use_cache`` back).

    What an export writes as ``config.json`` (``sf.functional`` turned the skeleton's
    ``use_cache`` off, :func:`without_kv_cache`).

    Args:
        module: a functional model's skeleton (a ``PreTrainedModel``).

    Returns:
        A deep copy of ``module.config`` with the user's ``use_cache``; None without a config.

    Example:
        >>> user_config(sf.functional(llama).module).use_cache
        True
    """
    config = getattr(module, "config", None)
    if config is None:
        return None
    config = copy.deepcopy(config)
    if getattr(module, "_shardfn_user_use_cache", False):
        config.use_cache = True
    return config
