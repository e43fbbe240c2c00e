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
import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

__all__ = ["RECORD_KEYWORD", "RecordInside", "call_recording", "hf_collector",
           "inside_pretrained", "no_split_classes", "pretrained_model_class",
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
#: the keyword a unit call passes its unit to record inside it (taken off by the unit's hook)
RECORD_KEYWORD = "_shardfn_record_inside"


def hf_collector() -> dict | None:
    """What Hugging Face's recording hooks append to now: the dict of lists that
    ``capture_outputs`` (``transformers.utils.output_capturing``) sets for a forward that
    asks for ``output_hidden_states`` and the like; None when nothing is recorded (or
    ``transformers`` is not imported).

    Example:
        >>> hf_collector() is None    # outside a recording forward
        True
    """
    capturing = sys.modules.get("transformers.utils.output_capturing")
    var = getattr(capturing, "_active_collector", None)
    collector = var.get() if var is not None else None
    return collector if collector else None


@dataclasses.dataclass(frozen=True)
class RecordInside:
    """What a region of the forward (a ``shard_params`` unit call, a layer's checkpoint)
    records for Hugging Face's collector, so that the region can return it as outputs of
    its own: each list's name and its length when the region was entered, and the hidden
    states selected by index (``output_hidden_states=[0, -1]``). A constant: a recompute
    of the region in backward records the same.

    Example:
        >>> record = RecordInside.of(hf_collector())
        >>> out, recorded = record.run(lambda: layer(x))   # inside the region
        >>> record.extend(hf_collector(), recorded)         # outside, on its outputs
    """

    lengths: tuple[tuple[str, int], ...]
    selected: frozenset[int] | None

    @staticmethod
    def of(collector: Mapping[str, Any]) -> RecordInside:
        """The record of ``collector`` as it is now."""
        lengths = tuple((k, len(v)) for k, v in collector.items() if isinstance(v, list))
        selected = collector.get("_hidden_states_layers")
        return RecordInside(lengths, None if selected is None else frozenset(selected))

    def fresh(self) -> dict[str, Any]:
        """A collector the region's layers append to as they would to the caller's: each
        list as long (placeholders), so ``hidden_states`` counts its layers the same."""
        out: dict[str, Any] = {k: [None] * n for k, n in self.lengths}
        if self.selected is not None:
            out["_hidden_states_layers"] = set(self.selected)
        return out

    def run(self, fn: Callable[[], Any]) -> tuple[Any, tuple[tuple[Any, ...], ...]]:
        """``fn()`` with a :meth:`fresh` collector: ``(its output, what was recorded)``."""
        collector = self.fresh()
        token = _collector_var().set(collector)
        try:
            out = fn()
        finally:
            _collector_var().reset(token)
        return out, self.entries(collector)

    def entries(self, collector: Mapping[str, list]) -> tuple[tuple[Any, ...], ...]:
        """What was appended to ``collector`` (a :meth:`fresh` one), list by list."""
        return tuple(tuple(collector[k][n:]) for k, n in self.lengths)

    def extend(self, collector: Mapping[str, list], recorded: tuple[tuple[Any, ...], ...]
               ) -> None:
        """Append ``recorded`` (:meth:`run`'s, as the region returned it) to ``collector``."""
        for (key, _), values in zip(self.lengths, recorded, strict=True):
            collector[key].extend(values)


def _collector_var() -> Any:
    """``transformers.utils.output_capturing._active_collector``."""
    return sys.modules["transformers.utils.output_capturing"]._active_collector


def call_recording(inner: nn.Module, call: Callable[[tuple, dict], Any], args: tuple,
                   kwargs: dict) -> Any:
    """Run a unit call ``call(args, kwargs)`` of the unit module ``inner`` so that what
    Hugging Face's hooks record inside it reaches the caller's collector as outputs of
    the call: the unit's graph (its backward, its recompute) then carries them.

    Outside a recording forward this is ``call(args, kwargs)``. Inside one, the unit is
    called with :data:`RECORD_KEYWORD` (a :class:`RecordInside`); the hooks
    :func:`_record_inside` puts on ``inner`` take it off, run ``inner`` with a fresh
    collector and return ``(output, recorded)``; the recorded tensors, as the unit call
    returned them (in the caller's graph), go to the caller's collector. Hugging Face
    installs its hooks on the layers inside ``inner`` (``shard_params``' ``UnitCall``
    lists ``inner`` among its children for that).

    Args:
        inner: the unit's module (the one ``call`` runs).
        call: runs the unit on ``(args, kwargs)`` and returns its output.
        args, kwargs: the call's arguments.

    Returns:
        The unit's output.

    Example:
        >>> out = call_recording(layer, lambda a, k: layer(*a, **k), (x,), {})
    """
    collector = hf_collector()
    if collector is None:
        return call(args, kwargs)
    record = RecordInside.of(collector)
    _record_inside(inner)
    out, recorded = call(args, {**kwargs, RECORD_KEYWORD: record})
    if RecordInside.of(collector) != record:  # a hook ran after ours, outside the unit
        raise RuntimeError(
            f"shard_params: a Hugging Face recording hook on {type(inner).__name__} ran after "
            "shardfn's, outside the unit call, so what it recorded would have no gradient "
            "(hooks installed on the unit after its first recording call?)")
    record.extend(collector, recorded)
    return out


def _record_inside(inner: nn.Module) -> None:
    """Put the recording hooks on ``inner`` (once): a pre-hook first of all that takes
    :data:`RECORD_KEYWORD` off the call and sets a fresh collector, and a forward hook that
    sets the caller's back and returns ``(output, recorded)``: after Hugging Face's own on
    ``inner``, which it installed before the forward that first calls this."""
    state = vars(inner)
    if "_shardfn_record_hooks" in state:
        return
    stack: list[tuple[RecordInside, dict, Any] | None] = []

    def before(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        record = kwargs.get(RECORD_KEYWORD)
        if record is None:
            stack.append(None)
            return None
        collector = record.fresh()
        stack.append((record, collector, _collector_var().set(collector)))
        return args, {k: v for k, v in kwargs.items() if k != RECORD_KEYWORD}

    def after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        entry = stack.pop() if stack else None
        if entry is None:
            return None
        record, collector, token = entry
        _collector_var().reset(token)
        return output, record.entries(collector)

    inner.register_forward_pre_hook(before, with_kwargs=True, prepend=True)
    inner.register_forward_hook(after, with_kwargs=True, always_call=True)
    state["_shardfn_record_hooks"] = True


def refuse_recorded_outputs(module: nn.Module, kwargs: Mapping[str, Any], who: str) -> None:
    """Refuse a call of a Hugging Face model that asks for ``output_hidden_states``,
    ``output_attentions`` or ``output_router_logits`` (in ``kwargs`` or its config) where
    ``who`` cannot record them right.

    transformers 5 records them with forward hooks on layers (``LlamaDecoderLayer``,
    ``LlamaAttention``, ``MixtralTopKRouter``) that append to a collector
    (``transformers.utils.output_capturing._active_collector``); ``shard_params`` carries
    them out of its units with :func:`call_recording` (and a layer that checkpoints itself,
    ``gradient_checkpointing_enable()``, out of its checkpoint the same way). Refused: a
    ``transformers`` without that collector.

    Args:
        module: the skeleton the call runs (a ``PreTrainedModel``, else nothing is checked).
        kwargs: the call's keyword arguments.
        who: the transform, for the message.

    Raises:
        ValueError: naming the flags, the reason and what to do instead.

    Example:
        >>> refuse_recorded_outputs(fm.module, {"output_attentions": True}, "shard_params")
        Traceback (most recent call last):
        ValueError: shard_params: output_attentions=True ... come back empty ...
    """
    pretrained = pretrained_model_class()
    config = getattr(module, "config", None)
    if pretrained is None or config is None or not isinstance(module, pretrained):
        return
    asked = [f"{k}={kwargs.get(k, getattr(config, k, False))!r}" for k in _RECORDED
             if kwargs.get(k, getattr(config, k, False))]
    if not asked:
        return
    flags = f"{who}: {', '.join(asked)} (a keyword or {type(config).__name__})"
    capturing = sys.modules.get("transformers.utils.output_capturing")
    if getattr(capturing, "_active_collector", None) is None:
        raise ValueError(
            f"{flags}: this transformers records them in a way {who} cannot carry out of its "
            "units, so they would come back empty. Compute them with sf.functional, sf.remat "
            "or sf.tensor_split of the model, or pass False")


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
