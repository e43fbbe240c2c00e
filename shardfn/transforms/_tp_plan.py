"""Reading a ``tensor_split`` plan: which module gets which style, and the plan's checks.

* :func:`match_plan`: globs over module paths -> styles (every pattern must match,
  no module twice, except where Hugging Face's reading of ``*`` decides: see below);
* :func:`detect_fused`: a plain ``"colwise"`` on a module named ``qkv`` is a fused
  ``[q|k|v]`` projection;
* :func:`check_tied` / :func:`check_sequence_parallel`: refuse plans that would give a
  silently wrong gradient (a tied weight split differently in two places, a
  replicated leaf on sequence chunks with no sequence-parallel style).

Example:
    >>> match_plan({"fc*": "colwise"}, ["", "fc1", "fc2"]).keys()
    dict_keys(['fc1', 'fc2'])
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping

from torch import nn

from shardfn.functional import FunctionalModel
from shardfn.spec import P
from shardfn.transforms._tp_styles import (
    Colwise,
    Replicate,
    Rowwise,
    SequenceParallel,
    Style,
    as_style,
)

__all__ = ["check_sequence_parallel", "check_tied", "detect_fused", "match_plan"]


def match_plan(plan: Mapping[str, object], paths: list[str]) -> dict[str, Style]:
    """``{module path: style}`` for every module a pattern matches.

    The pattern ``""`` is the root module (as torch's ``parallelize_module``); a glob
    (``"*"``) matches submodules only. A ``*`` may span dots (``fnmatch``), so a Hugging
    Face style plan can match one module twice: ``"layer.*.output.dense"`` also matches
    ``"layer.0.attention.output.dense"``. Where exactly one of the two patterns matches
    with each ``*`` inside one path component (Hugging Face's reading: ``*`` is a layer
    index), that pattern wins; otherwise the module is refused.

    Raises:
        ValueError: a pattern that matches no module (the paths listed), a module
            matched by two patterns that the rule above does not separate (both named),
            a value that is not a style.

    Example:
        >>> match_plan({"layer.*.output.dense": "rowwise",
        ...             "layer.*.attention.output.dense": "rowwise"},
        ...            ["layer.0.output.dense", "layer.0.attention.output.dense"]).keys()
        dict_keys(['layer.0.output.dense', 'layer.0.attention.output.dense'])
    """
    styles: dict[str, Style] = {}
    owner: dict[str, str] = {}
    for pattern, value in plan.items():
        style = as_style(value, pattern)
        matched = [""] if pattern == "" else \
            [p for p in paths if p and fnmatch.fnmatchcase(p, pattern)]
        if not matched:
            raise ValueError(f"tensor_split: plan pattern {pattern!r} matches no module; "
                             f"module paths are {[p for p in paths if p]} (and '' for the "
                             "root module)")
        for path in matched:
            if path in owner:
                winner = _by_component(path, owner[path], pattern)
                if winner is None:
                    raise ValueError(f"tensor_split: module {path!r} is matched by both "
                                     f"{owner[path]!r} and {pattern!r}")
                if winner == owner[path]:
                    continue
            owner[path], styles[path] = pattern, style
    return styles


def _within_components(path: str, pattern: str) -> bool:
    """Whether ``pattern`` matches ``path`` with every ``*`` / ``?`` inside one component."""
    path_parts, pattern_parts = path.split("."), pattern.split(".")
    return len(path_parts) == len(pattern_parts) and all(
        fnmatch.fnmatchcase(part, glob) for part, glob in zip(path_parts, pattern_parts,
                                                               strict=True))


def _by_component(path: str, first: str, second: str) -> str | None:
    """The one of two patterns matching ``path`` that matches it component by component
    (None: both or neither, an ambiguity to refuse)."""
    first_fits, second_fits = _within_components(path, first), _within_components(path, second)
    if first_fits == second_fits:
        return None
    return first if first_fits else second


def detect_fused(style: Style, path: str, skeleton: nn.Module) -> Style:
    """A plain ``Colwise()`` on a module named ``qkv`` is a fused ``[q|k|v]``: ``fused=3``, with
    ``n_heads`` from the parent's ``head_dim`` when it has one (as ``shardfn.models.GPT``)."""
    plain = dataclasses.replace(style, sequence_parallel=False, sequence_dim=-2) \
        if isinstance(style, Colwise) else style
    if plain != Colwise() or path.rpartition(".")[2] != "qkv":
        return style
    parent = skeleton.get_submodule(path.rpartition(".")[0])
    head_dim = getattr(parent, "head_dim", None)
    rows = getattr(skeleton.get_submodule(path), "out_features", None)
    if not isinstance(rows, int):
        return style
    if isinstance(head_dim, int) and head_dim > 0 and rows % (3 * head_dim) == 0:
        return dataclasses.replace(style, fused=3, n_heads=rows // (3 * head_dim))
    return dataclasses.replace(style, fused=3)


def check_tied(alias: str, owner_name: str, split: dict, axis: str) -> None:
    """Tied names must be split alike by every module that uses them (or by none)."""
    use_alias, use_owner = split.get(alias), split.get(owner_name)
    spec_alias = use_alias[0] if use_alias else P()
    spec_owner = use_owner[0] if use_owner else P()
    fused = any(use and isinstance(use[2], Colwise) and use[2].fused > 1
                for use in (use_alias, use_owner))
    if spec_alias != spec_owner or fused:
        where = {n: (u[1] if u else "not in the plan") for n, u in
                 ((alias, use_alias), (owner_name, use_owner))}
        raise ValueError(f"tensor_split: {alias!r} is tied to {owner_name!r}, but they are split "
                         f"differently over {axis!r}: {alias!r} {spec_alias} (module "
                         f"{where[alias]}), {owner_name!r} {spec_owner} (module "
                         f"{where[owner_name]}); tied weights need the same split in every "
                         "module that uses them (e.g. 'vocab' embedding + 'colwise' head)")


def _is_sp(style: Style) -> bool:
    return isinstance(style, SequenceParallel) or getattr(style, "sequence_parallel", False)


def check_sequence_parallel(fmodel: FunctionalModel, styles: Mapping[str, Style],
                             split: Mapping[str, tuple]) -> None:
    """With sequence parallelism, a replicated trainable leaf must be in a module that says how
    it is used: ``SequenceParallel`` (on chunks: its gradient is summed over the axis), a
    sequence-parallel ``Rowwise`` (its bias), or an explicit ``Replicate`` (on replicated
    activations). Otherwise its gradient would silently be this rank's chunk's part."""
    if not any(_is_sp(style) for style in styles.values()):
        return
    for name in fmodel.trainable_names:
        path = name.rpartition(".")[0]
        style = styles.get(path)
        if name in split or isinstance(style, SequenceParallel | Replicate) or (
                isinstance(style, Rowwise) and style.sequence_parallel):
            continue
        raise ValueError(
            f"tensor_split: the plan is sequence parallel, but the replicated leaf {name!r} "
            f"(module {path!r}: {style or 'not in the plan'}) has no sequence-parallel style; "
            "if it runs on sequence chunks its gradient would be only this rank's part: give "
            f"{path!r} SequenceParallel(), or Replicate() if it runs on replicated activations")
