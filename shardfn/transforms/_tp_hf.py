"""Tensor parallelism from a Hugging Face model's own plan: ``tensor_split(..., plan="auto")``.

A ``transformers`` model names how it splits: ``config.base_model_tp_plan`` (relative to
the base model: ``"layers.*.self_attn.q_proj": "colwise"``) and the task class's
``_tp_plan`` (``{"lm_head": "colwise_gather_output"}``), merged by ``model.tp_plan``
(transformers >= 5, which also adds ``"embed_tokens": "embedding_rowwise"``). GPT-2 and
BERT ship none in transformers 5: shardfn writes theirs (:data:`KNOWN_PLANS`, Megatron's
split of their blocks, in HF's style names). :func:`hf_tp_plan` reads that plan and
maps each HF style to the shardfn style that computes exactly the same thing
(:data:`HF_STYLES`); a style with no exact equivalent is refused, naming it and the module.

Attention heads come from the model (:func:`split_heads`): a colwise ``q_proj`` /
``k_proj`` / ``v_proj`` (or GPT-2's fused ``c_attn``) under an attention module with a
``head_dim`` holds ``out_features / head_dim`` heads, so the split gives each rank whole
heads (GQA: rank ``r``'s query heads use exactly its key/value heads), and a ``tp`` that
does not divide ``num_attention_heads`` or ``num_key_value_heads`` is refused naming both
numbers. The private skeleton's attention modules get their local head counts
(``num_heads``, GPT-2's ``split_size``) so their reshapes see this rank's heads.

``Conv1D`` (GPT-2): weight ``(in, out)``; colwise splits its columns, rowwise its rows
(:mod:`._tp_styles`); a fused ``c_attn`` (``[q|k|v]`` columns) is a
``FusedLayout(..., dim=1)``.

``transformers`` is never imported here (a model is only a ``PreTrainedModel`` if it is
imported already).

Example:
    >>> tp = sf.tensor_split(sf.functional(llama), mesh, "tp", plan="auto")
    >>> sf.hf_tp_plan(llama)["model.layers.*.self_attn.k_proj"]
    Colwise(gather_output=False, fused=1, n_heads=None, sequence_parallel=False, sequence_dim=-2)
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from collections.abc import Mapping

from torch import nn

from shardfn.spec import FusedLayout, P
from shardfn.transforms._tp_styles import (
    Colwise,
    Replicate,
    Rowwise,
    Style,
    Vocab,
    features,
    is_conv1d,
)

__all__ = ["HF_STYLES", "FusedColumnsLayout", "hf_tp_plan", "split_heads"]

# HF style name -> the shardfn style that computes the same values and gradients
HF_STYLES: dict[str, Style] = {
    "colwise": Colwise(),                      # input replicated, output split on features
    "colwise_rep": Colwise(gather_output=True),
    "colwise_gather_output": Colwise(gather_output=True),
    "rowwise": Rowwise(),                      # input split, output all-reduced
    "rowwise_split_input": Rowwise(split_input=True),
    "rowwise_rep": Rowwise(split_input=True),  # same DTensor layouts as rowwise_split_input
    "embedding_rowwise": Vocab(),              # vocabulary rows split, lookups summed
    "packed_colwise": Colwise(fused=2),        # [gate|up]: rank r holds gate[r] | up[r]
    "replicate": Replicate(),
    "replicated_with_grad_allreduce": Replicate(sum_grads=True),
}
_REFUSED = {
    "embedding_colwise": "splits the embedding's hidden dim; shardfn splits an embedding by "
                         "vocabulary only (Vocab)",
    "sequence_parallel": "relies on DTensor re-layouts in the neighbouring modules; write the "
                         "plan with shardfn's sequence-parallel styles (docs/tensor_parallel.md)",
    "packed_rowwise": "splits packed expert weights, which shardfn does not split",
    "all_reduce": "sums a module's partial output, which only the expert styles produce",
    "mla_kv_a_proj": "is DeepSeek's MLA projection, not supported",
    "local_params": "shards a bare parameter, not supported",
}
_OLD = ("local_colwise", "local_rowwise", "local_packed_rowwise", "local", "gather", "isolated")


def _refuse_style(name: object, path: str) -> ValueError:
    if name in _OLD:
        why = ("is an inference style of transformers < 5 whose reduction sits in a parent "
               "'gather' module (not differentiable there)")
    elif name in _REFUSED:
        why = _REFUSED[name]
    else:
        why = "has no exact shardfn equivalent (MoE / expert styles are not supported)"
    return ValueError(f"tensor_split(plan='auto'): the model's plan gives module {path!r} the "
                      f"HF style {name!r}, which {why}; shardfn maps {sorted(HF_STYLES)}. "
                      "Pass a plan dict {glob: style} instead (docs/tensor_parallel.md)")


#: plans for models whose ``transformers`` release ships none (``config.model_type`` ->
#: the base model's plan, in HF's style names, as transformers 5 writes them: its input
#: embedding ``embedding_rowwise`` and the LM head ``colwise_gather_output``, as
#: ``model.tp_plan`` adds them for Llama). BERT's embedding stays whole: its MLM decoder
#: is tied to it and its decoder bias to a module that does not compute with it.
KNOWN_PLANS: dict[str, dict[str, str]] = {
    "gpt2": {"wte": "embedding_rowwise", "h.*.attn.c_attn": "colwise",
             "h.*.attn.c_proj": "rowwise", "h.*.mlp.c_fc": "colwise",
             "h.*.mlp.c_proj": "rowwise"},
    "bert": {"encoder.layer.*.attention.self.query": "colwise",
             "encoder.layer.*.attention.self.key": "colwise",
             "encoder.layer.*.attention.self.value": "colwise",
             "encoder.layer.*.attention.output.dense": "rowwise",
             "encoder.layer.*.intermediate.dense": "colwise",
             "encoder.layer.*.output.dense": "rowwise"},
}
#: the task heads of those models (relative to the task model)
_KNOWN_HEADS: dict[str, dict[str, str]] = {"gpt2": {"lm_head": "colwise_gather_output"}}


def _known_plan(model: nn.Module) -> dict[str, str]:
    """:data:`KNOWN_PLANS`' plan of ``model`` (a task or base model), relative to it."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in KNOWN_PLANS:
        return {}
    base = getattr(model, "base_model", model)
    prefix = next((f"{path}." if path else "" for path, sub in model.named_modules()
                   if sub is base), "")
    plan = {prefix + k: v for k, v in KNOWN_PLANS[model_type].items()}
    if base is not model:
        plan.update(_KNOWN_HEADS.get(model_type, {}))
    return plan


def _find_config(module: nn.Module) -> object | None:
    return next((getattr(m, "config", None) for _, m in module.named_modules()
                 if getattr(m, "config", None) is not None), None)


def _model_plan(model: nn.Module) -> dict[str, str]:
    """One HF model's merged plan, relative to it (``model.tp_plan``, else class + config,
    else shardfn's :data:`KNOWN_PLANS`)."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, Mapping) and plan:
        return dict(plan)
    out: dict[str, str] = {}
    for path, sub in model.named_modules():  # transformers < 5: assemble it as HF did
        prefix = f"{path}." if path else ""
        if isinstance(getattr(type(sub), "_tp_plan", None), Mapping):
            out.update({prefix + k: v for k, v in type(sub)._tp_plan.items()})
        base_plan = getattr(getattr(sub, "config", None), "base_model_tp_plan", None)
        if getattr(sub, "base_model", None) is sub and isinstance(base_plan, Mapping):
            out.update({prefix + k: v for k, v in base_plan.items()})
    return out or _known_plan(model)


def read_hf_plan(module: nn.Module) -> dict[str, str]:
    """``{glob over module paths of module: HF style name}``, from the top-most HF models
    inside ``module`` (``module`` itself, or a user's wrapper's ``.model``).

    Raises:
        ValueError: no HF model inside, or a model without a plan (its config class named).
    """
    from shardfn._functional_hf import pretrained_model_class

    pretrained = pretrained_model_class()
    plan: dict[str, str] = {}
    models: list[str] = []
    for path, sub in module.named_modules():
        if pretrained is None or not isinstance(sub, pretrained):
            continue
        if any(m == "" or path.startswith(f"{m}.") for m in models):
            continue  # inside a model read already
        models.append(path)
        prefix = f"{path}." if path else ""
        plan.update({prefix + k: v for k, v in _model_plan(sub).items()})
    if plan:
        return plan
    config = _find_config(module)
    if not models or config is None:
        raise ValueError(f"tensor_split(plan='auto') reads a Hugging Face model's own tensor "
                         f"parallel plan, but {type(module).__name__} is not (and holds no) "
                         "transformers PreTrainedModel; pass a plan dict {glob: style}")
    raise ValueError(f"tensor_split(plan='auto'): {type(config).__name__} has no "
                     f"base_model_tp_plan (and {type(module).__name__} no _tp_plan): this model "
                     "has no tensor-parallel plan in this transformers version, nor does "
                     f"shardfn know one (it does for {sorted(KNOWN_PLANS)}); pass a plan "
                     "dict, e.g. {'layers.*.attn.q_proj': 'colwise', 'layers.*.attn.o_proj': "
                     "'rowwise', ...} (docs/tensor_parallel.md)")


def hf_tp_plan(model: nn.Module) -> dict[str, Style]:
    """A Hugging Face model's own tensor-parallel plan, as a shardfn plan.

    Patterns of the model's plan that match no module of this instance are dropped (as
    transformers only warns about them: a layer kind a small config does not build).

    Args:
        model: a ``transformers`` model (or a module holding one), or a functional model
            of one (``sf.functional(model)``: its ``module`` is read).

    Returns:
        ``{glob over module paths: style}``, what ``tensor_split(..., plan="auto")`` uses;
        edit it and pass it as ``plan`` (e.g. ``"lm_head": "colwise"`` for vocab-parallel
        logits with :func:`~shardfn.vocab_parallel_causal_lm_loss`).

    Raises:
        ValueError: no plan (the config class named), or an HF style with no exact
            shardfn equivalent (the style and the module named).

    Example:
        >>> plan = {**sf.hf_tp_plan(llama), "lm_head": "colwise"}
        >>> tp = sf.tensor_split(sf.functional(llama), mesh, "tp", plan)
    """
    module = getattr(model, "module", model) if not isinstance(model, nn.Module) else model
    paths = [p for p, _ in module.named_modules(remove_duplicate=False) if p]
    out: dict[str, Style] = {}
    for pattern, name in read_hf_plan(module).items():
        matched = [p for p in paths if fnmatch.fnmatchcase(p, pattern)]
        if not matched:
            continue
        if name not in HF_STYLES:
            raise _refuse_style(name, matched[0])
        style = HF_STYLES[name]
        kinds = {type(module.get_submodule(p)) for p in matched}
        if nn.Embedding in kinds and name in ("colwise", "rowwise"):  # transformers < 5 names
            if name == "colwise":
                raise _refuse_style("embedding_colwise", matched[0])
            style = Vocab()
        out[pattern] = style
    return out


# ---------------------------------------------------------------- heads


def _heads_field(config: object, n: int) -> str:
    kv = getattr(config, "num_key_value_heads", None)
    heads = getattr(config, "num_attention_heads", None)
    if kv == n and kv != heads:
        return "num_key_value_heads"
    return "num_attention_heads" if heads == n else "heads"


def _check_heads(n: int, tp: int, axis: str, path: str, config: object) -> None:
    field = _heads_field(config, n)
    where = f"{type(config).__name__}.{field} = {n}, module {path!r}"
    fits = [d for d in range(1, n + 1) if n % d == 0]
    if tp > n:
        raise ValueError(f"tensor_split: tp = {tp} (size of axis {axis!r}) is larger than "
                         f"{field} = {n} ({where}): each rank needs whole heads; use a tp "
                         f"in {fits}")
    if n % tp:
        raise ValueError(f"tensor_split: {field} = {n} is not divisible by tp = {tp} (size of "
                         f"axis {axis!r}; {where}): each rank needs whole heads; use a tp "
                         f"in {fits}")


_HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads")
_HEAD_WIDTHS = ("split_size", "all_head_size")


def split_heads(styles: dict[str, Style], skeleton: nn.Module, tp: int, axis: str) -> None:
    """Give the colwise projections of HF attention modules their head counts (in place).

    For each module with a ``config`` (``num_attention_heads``) and an int ``head_dim``
    whose children are split colwise: sets ``n_heads`` (and ``fused`` for GPT-2's
    ``c_attn``: ``out = 3 * split_size``) on their styles, refuses a ``tp`` that does not
    divide the head counts, and sets the skeleton's own head counts and widths
    (``num_heads``, ``num_key_value_heads``, ``split_size``, ...) to this rank's.

    Raises:
        ValueError: naming the config field, its value, ``tp`` and the module.
    """
    by_parent: dict[str, list[str]] = {}
    for path, style in styles.items():
        if isinstance(style, Colwise) and not style.gather_output and "." in path:
            by_parent.setdefault(path.rpartition(".")[0], []).append(path)
    for parent_path, children in by_parent.items():
        attention = skeleton.get_submodule(parent_path)
        head_dim = getattr(attention, "head_dim", None)
        if head_dim is None:  # BERT-style attention
            head_dim = getattr(attention, "attention_head_size", None)
        config = getattr(attention, "config", None)
        if not isinstance(head_dim, int) or head_dim <= 0 or \
                not isinstance(getattr(config, "num_attention_heads", None), int):
            continue
        counts: set[int] = set()
        for path in children:
            module, style = skeleton.get_submodule(path), styles[path]
            if not (type(module) is nn.Linear or is_conv1d(module)):
                continue  # leaf_specs refuses it, naming it
            out, fused = features(module)[1], style.fused
            split_size = getattr(attention, "split_size", None)
            if fused == 1 and isinstance(split_size, int) and split_size > 0 and \
                    out % split_size == 0 and out // split_size in (2, 3):
                fused = out // split_size  # GPT-2's c_attn: [q|k|v] (cross attention: [k|v])
            if (out // fused) % head_dim:
                continue  # not a projection onto heads
            n = out // fused // head_dim
            _check_heads(n, tp, axis, path, config)
            counts.add(n)
            if style.n_heads is None:
                styles[path] = dataclasses.replace(style, fused=fused, n_heads=n)
        widths = {n * head_dim for n in counts}
        for name in _HEAD_COUNTS + _HEAD_WIDTHS:
            value = attention.__dict__.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and \
                    value in (counts if name in _HEAD_COUNTS else widths):
                setattr(attention, name, value // tp)


# ---------------------------------------------------------------- fused Conv1D columns


@dataclasses.dataclass(frozen=True)
class FusedColumnsLayout(FusedLayout):
    """Deprecated: ``sf.FusedLayout(axis, parts, shape, dim=1)``, the same layout (a fused
    colwise ``Conv1D`` weight, GPT-2's ``c_attn``: rank ``r`` holds the columns
    ``q[r] | k[r] | v[r]``). ``tensor_split`` makes ``FusedLayout(..., dim=1)`` itself;
    this subclass only keeps old code that builds one working (with a DeprecationWarning).

    Example:
        >>> sf.FusedLayout("tp", 3, (32, 96), dim=1).local_shape(sf.Mesh({"tp": 2}))
        (32, 48)
    """

    dim: int = 1

    def __post_init__(self) -> None:
        warnings.warn("sf.FusedColumnsLayout is deprecated: use sf.FusedLayout(axis, parts, "
                      "shape, dim=1)", DeprecationWarning, stacklevel=3)
        super().__post_init__()


def fused_layout(spec: P, axis: str, parts: int, shape: tuple[int, ...]) -> FusedLayout:
    """The layout of a leaf of a fused colwise module: ``FusedLayout`` on dim 1 for a
    ``Conv1D`` weight (split on its columns, ``spec == P(None, axis)``), on dim 0 for an
    ``nn.Linear`` weight and any bias.

    Example:
        >>> fused_layout(P(None, "tp"), "tp", 3, (32, 96))
        FusedLayout(axis='tp', parts=3, shape=(32, 96), dim=1)
    """
    return FusedLayout(axis, parts, tuple(shape), dim=1 if spec == P(None, axis) else 0)
