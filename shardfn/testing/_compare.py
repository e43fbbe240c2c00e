"""Leaf-by-leaf comparison of a sharded run with its reference, and hints for typical bugs.

Private to :mod:`shardfn.testing.matches`. Everything here runs in the test
process on CPU tensors: the records of every rank (already gathered to full
tensors) and the reference's records.

A *record* is one ``{key: tree}`` dict: record 0 is the initial state ("init"),
record ``s + 1`` the state and metrics after step ``s``. The first leaf that
differs (in record, key, leaf-path, rank order) raises an ``AssertionError``
naming it, with the errors and, where the pattern is typical, a hint:

* off by exactly ``N`` or ``1/N`` (``N`` a mesh axis size or a product of them);
* ranks disagreeing; their sum or mean equal to the reference; at init;
* a padded size, a shard gathered along the wrong dim, a dim not gathered;
* a block of the result equal to another block of the reference (wrong chunk);
* only the last (uneven) shard's rows wrong, or only one rank's block;
* a value equal to its previous value (a stale state);
* a leaf whose exact gradient is zero, drifting because the optimizer (Adam)
  amplified round-off: reported only when nothing else differs.

Example:
    >>> compare_runs([{"w": torch.ones(2)}], [[{"w": torch.ones(2)}]], keys=("w",),
    ...              tolerance=Tolerance(), mesh_shape={"dp": 1})
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from shardfn import pytree

Record = Mapping[str, Any]


class Tolerance(NamedTuple):
    """``rtol``/``atol`` for ``torch.testing.assert_close`` (None: its dtype-based defaults)."""

    rtol: float | None = None
    atol: float | None = None


class Leaf(NamedTuple):
    """One differing leaf, with what the hints look at."""

    name: str  # "grads['w1']"
    label: str  # "init" or "step 3"
    rank: int
    actual: torch.Tensor  # this rank's value
    expected: torch.Tensor  # the reference's
    ranks: Sequence[torch.Tensor | None]  # every rank's value of this leaf (None: missing)
    previous: torch.Tensor | None  # this rank's value in the record before (None at init)
    previous_expected: torch.Tensor | None
    sizes: tuple[int, ...]  # candidate shard counts: mesh axis sizes > 1 and their products
    grad: torch.Tensor | None = None  # the reference's gradient of this leaf in this record
    grad_scale: float = 0.0  # the largest |gradient| of any leaf in the reference's record


def record_label(index: int) -> str:
    """``"init"`` for record 0, ``"step s"`` for record ``s + 1``."""
    return "init" if index == 0 else f"step {index - 1}"


def shard_counts(mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
    """Products of every non-empty subset of the mesh's axis sizes, > 1, ascending."""
    sizes = list(mesh_shape.values())
    out = {math.prod(c) for k in range(1, len(sizes) + 1)
           for c in itertools.combinations(sizes, k)}
    return tuple(sorted(n for n in out if n > 1))


def flatten(tree: Any) -> dict[str, Any]:
    """``{leaf path: leaf}`` of a pytree (a bare tensor is the path ``""``)."""
    names, leaves, _ = pytree.tree_flatten_with_path(tree)
    return dict(zip(names, leaves, strict=True))


def _as_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> bool:
    try:
        torch.testing.assert_close(actual, expected, rtol=tol.rtol, atol=tol.atol,
                                   equal_nan=True)
    except AssertionError:
        return False
    return True


def _loose_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Close in float64 with tolerances loose enough for the sums the hints try."""
    if a.shape != b.shape:
        return False
    a, b = a.double(), b.double()
    scale = max(float(b.abs().max()) if b.numel() else 0.0, 1e-12)
    return bool(torch.allclose(a, b, rtol=1e-3, atol=1e-5 * scale))


def _leaf_name(key: str, path: str) -> str:
    return key if path in ("", "<root>") else f"{key}[{path!r}]"


# --- hints -------------------------------------------------------------------------------


def _shape_hints(actual: torch.Size, expected: torch.Size, sizes: tuple[int, ...]) -> list[str]:
    if len(actual) != len(expected):
        return [f"the result has {len(actual)} dims, the reference {len(expected)}: a stacked "
                "(untiled) all_gather, or a leaf returned unsharded/unsqueezed"]
    dims = [d for d in range(len(actual)) if actual[d] != expected[d]]
    hints = []
    for d in dims:
        a, e = actual[d], expected[d]
        if any(n * math.ceil(e / n) == a and a != e for n in sizes):
            hints.append(f"dim {d} has the padded size {a} of {e} rows split over "
                         f"{[n for n in sizes if n * math.ceil(e / n) == a][0]} ranks: padding "
                         "leaked into the result (an uneven-shard bug: gather with Layouts, "
                         "e.g. model.specs or sf.layout_of, so the padding is cut off)")
        elif any(a * n == e or math.ceil(e / n) == a for n in sizes) and len(dims) == 1:
            hints.append(f"dim {d} is {a}, a 1/{e / a:g} shard of {e}: this leaf was not gathered "
                         f"along dim {d} (a spec missing the sharded dim)")
    if len(dims) == 2:
        i, j = dims
        for n in sizes:
            for small, big in ((i, j), (j, i)):
                if (math.ceil(expected[small] / n) == actual[small]
                        and actual[big] == expected[big] * n):
                    hints.append(f"dim {small} is 1/{n} of the reference's and dim {big} {n} "
                                 f"times it: a wrong spec dim (sharded along dim {small}, "
                                 f"gathered along dim {big})")
    return hints[:1] or ["the shapes differ: the sharded step and the reference compute "
                         "different things (compare the spec of this leaf with its shards)"]


def _ratio_hint(actual: torch.Tensor, expected: torch.Tensor, sizes: tuple[int, ...]) -> list:
    a, e = actual.double(), expected.double()
    big = e.abs() > 1e-6 * max(float(e.abs().max()), 1e-30)
    if not bool(big.any()) or not bool(torch.allclose(a[~big], torch.zeros_like(a[~big]),
                                                       atol=1e-6 * float(e.abs().max()))):
        return []
    ratio = a[big] / e[big]
    for n in sizes:
        if bool(torch.allclose(ratio, torch.full_like(ratio, float(n)), rtol=1e-3)):
            return [f"the result is exactly {n} times the reference: a double-counted psum "
                    "(a psum where pmean belongs, or a psum whose backward sums again; use "
                    "pmean / psum_invariant)"]
        if bool(torch.allclose(ratio, torch.full_like(ratio, 1.0 / n), rtol=1e-3)):
            return [f"the result is exactly 1/{n} of the reference: a missing psum (or a "
                    "mean taken twice, e.g. pmean of an already averaged value)"]
    return []


def _ranks_hint(leaf: Leaf) -> list[str]:
    values = [v for v in leaf.ranks if v is not None and v.shape == leaf.expected.shape]
    if len(values) < 2 or all(_loose_close(v, values[0]) for v in values[1:]):
        return []
    if leaf.label == "init":
        return ["the ranks disagree already at init: a rank-dependent seed (every rank must "
                "initialise the replicated state from the same seed)"]
    total = sum(v.double() for v in values)
    if _loose_close(total, leaf.expected):
        return ["the ranks disagree and their sum equals the reference: each rank holds a "
                "partial sum, a psum is missing in backward (a forgotten pvary where a "
                "replicated value enters per-rank work, or pmean_invariant where pmean belongs)"]
    if _loose_close(total / len(values), leaf.expected):
        return ["the ranks disagree and their mean equals the reference: a missing gradient "
                "mean (pmean over the data-parallel axis)"]
    return ["the ranks disagree with each other: a missing reduction, or a rank-dependent "
            "seed (dropout, init)"]


def _stale_hint(leaf: Leaf, wrong: torch.Tensor) -> list[str]:
    prev, prev_exp = leaf.previous, leaf.previous_expected
    if prev is None or prev_exp is None or prev.shape != leaf.actual.shape:
        return []
    if prev_exp.shape != leaf.expected.shape or not bool(torch.equal(leaf.actual[wrong],
                                                                     prev[wrong])):
        return []
    if bool(torch.equal(leaf.expected[wrong], prev_exp[wrong])):
        return []
    part = "the leaf" if bool(wrong.all()) else f"its {int(wrong.sum())} wrong elements"
    return [f"{part} kept their value from the record before ({_previous(leaf.label)}) while "
            "the reference changed: a stale state (an optimizer state shard not written back, "
            "or an update applied to a copy)"]


def _previous(label: str) -> str:
    if label == "step 0":
        return "init"
    return f"step {int(label.split()[1]) - 1}"


def _blocks_hint(leaf: Leaf, wrong: torch.Tensor) -> list[str]:
    actual, expected = leaf.actual, leaf.expected
    for dim in range(actual.dim()):
        rows = wrong.movedim(dim, 0).reshape(actual.shape[dim], -1).any(1)
        for n in leaf.sizes:
            size = actual.shape[dim]
            if size < n:
                continue
            block = math.ceil(size / n)
            starts = list(range(0, size, block))
            bad = [i for i, s in enumerate(starts) if bool(rows[s:s + block].any())]
            if not bad:
                continue
            for i in bad:
                mine = actual.narrow(dim, starts[i], min(block, size - starts[i]))
                for j, s in enumerate(starts):
                    theirs = expected.narrow(dim, s, min(block, size - s))
                    if j != i and theirs.shape == mine.shape and _loose_close(mine, theirs):
                        return [f"block {i} of {n} along dim {dim} equals block {j} of the "
                                "reference: a shard landed at another rank's place (a "
                                "reduce-scatter or gather of the wrong chunk)"]
            if size % n and bad == [len(starts) - 1]:
                return [f"only the last of {n} blocks along dim {dim} (rows {starts[-1]}.."
                        f"{size - 1} of an uneven split of {size}) is wrong: an uneven-shard "
                        "bug (padding counted, or the last shard's size mistaken)"]
            if len(bad) == 1 and n == max(leaf.sizes):
                return [f"only block {bad[0]} of {n} along dim {dim} is wrong: one rank's "
                        "shard is off"]
    return []


ROUNDOFF_EPS = 1e3  # a gradient under this many eps of the record's largest one is round-off
AMPLIFIED = 100.0  # an update this many times its gradient: the optimizer normalised it


def zero_grad_drift(leaf: Leaf) -> str | None:
    """The hint for a leaf that drifts only because its exact gradient is zero; else None.

    That is: the reference's gradient of the leaf in this step is round-off (at most
    ``ROUNDOFF_EPS`` eps of the record's largest gradient), yet the reference moved the
    leaf by ``AMPLIFIED`` times more. An optimizer that normalises the gradient (Adam)
    turns round-off into lr-sized steps whose sign is noise, so the sharded run and the
    reference part ways with no sharding bug (an attention key bias: softmax is
    invariant to it). Needs a ``grads`` record with the leaf's path (``loss_trainer``'s).
    """
    grad, before, expected = leaf.grad, leaf.previous_expected, leaf.expected
    if (grad is None or before is None or not grad.is_floating_point() or leaf.grad_scale <= 0
            or not grad.numel() or grad.shape != expected.shape
            or before.shape != expected.shape or leaf.actual.shape != expected.shape):
        return None
    size = float(grad.abs().max())
    update = float((expected.double() - before.double()).abs().max())
    if size > ROUNDOFF_EPS * torch.finfo(grad.dtype).eps * leaf.grad_scale or (
            update == 0 or update < AMPLIFIED * size):
        return None
    times = f"{update / size:.2g} times its gradient" if size else "with a zero gradient"
    return (f"{leaf.name} has an exact gradient of zero: the reference's gradient of it is "
            f"round-off (max |grad| {size:.3g} at {leaf.label}, the largest gradient "
            f"{leaf.grad_scale:.3g}) yet the reference moved it by up to {update:.3g}, "
            f"{times}. An optimizer that normalises the gradient (Adam) amplifies round-off "
            "into lr-sized steps of random sign (e.g. an attention key bias, to which softmax "
            "is invariant), so the two runs part ways without a sharding bug. Compare with "
            "SGD (sf.optim.sgd), keep this leaf out of the update (sf.optim.masked) or out of "
            "the model, or compare the gradients before the update: compare=(\"loss\", "
            "\"grads\")")


def diagnose(leaf: Leaf) -> list[str]:
    """The hints for one differing leaf (possibly none)."""
    if leaf.actual.shape != leaf.expected.shape:
        return _shape_hints(leaf.actual.shape, leaf.expected.shape, leaf.sizes)
    if not (leaf.actual.is_floating_point() or leaf.actual.is_complex()):
        return []
    drift = zero_grad_drift(leaf)
    if drift is not None:
        return [drift]
    wrong = ~torch.isclose(leaf.actual.double(), leaf.expected.double(), rtol=1e-5, atol=1e-8)
    for hint in (_ranks_hint(leaf), _ratio_hint(leaf.actual, leaf.expected, leaf.sizes),
                 _stale_hint(leaf, wrong), _blocks_hint(leaf, wrong)):
        if hint:
            return hint
    return []


# --- the report --------------------------------------------------------------------------


def _errors(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> str:
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)}, the reference's {tuple(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype}, the reference's {expected.dtype}"
    if actual.numel() == 0:
        return "empty tensors differ"
    diff = (actual.double() - expected.double()).abs()
    rel = diff / expected.double().abs().clamp_min(1e-30)
    flat = int(diff.nan_to_num(math.inf).argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    wrong = int((~torch.isclose(actual.double(), expected.double(), rtol=1e-5,
                                atol=1e-8)).sum())
    tols = "defaults for the dtype" if tol == Tolerance() else f"rtol={tol.rtol}, atol={tol.atol}"
    got, want = float(actual.reshape(-1)[flat]), float(expected.reshape(-1)[flat])
    return (f"max abs error {float(diff.max()):.3g} at index {where} (got {got:.6g}, "
            f"expected {want:.6g})"
            f", max rel error {float(rel.max()):.3g}; {wrong} of {diff.numel()} elements "
            f"differ (tolerance: {tols})")


def fail(leaf: Leaf, tol: Tolerance, n_ranks: int, mesh_shape: Mapping[str, int],
         drifting: Leaf | None = None) -> None:
    """Raise the AssertionError for ``leaf`` (noting ``drifting``, a zero-gradient leaf that
    drifted before, see :func:`zero_grad_drift`)."""
    hints = diagnose(leaf)
    text = (f"assert_sharded_matches: {leaf.name} differs from the reference at {leaf.label} "
            f"on rank {leaf.rank} (of {n_ranks}, mesh {dict(mesh_shape)}):\n  "
            f"{_errors(leaf.actual, leaf.expected, tol)}")
    text += "".join(f"\n  hint: {h}" for h in hints)
    if drifting is not None:
        text += (f"\n  note: {drifting.name} differs too (from {drifting.label} on rank "
                 f"{drifting.rank}), but its gradient is zero up to round-off: that may be "
                 "only round-off the optimizer amplified")
    raise AssertionError(text)


def _grads(record: Record) -> tuple[dict[str, torch.Tensor], float]:
    """The record's floating gradient leaves by path, and the largest |gradient| among them."""
    grads = {path: leaf for path, leaf in flatten(record.get("grads", {})).items()
             if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()}
    scale = max((float(g.abs().max()) for g in grads.values() if g.numel()), default=0.0)
    return grads, scale


def compare_runs(reference: Sequence[Record], per_rank: Sequence[Sequence[Record]], *,
                 keys: Sequence[str], tolerance: Tolerance, mesh_shape: Mapping[str, int],
                 strict: bool = True) -> None:
    """Compare every rank's records with the reference's, leaf by leaf; raise on the first miss.

    A leaf that drifts only because its exact gradient is zero (:func:`zero_grad_drift`)
    is reported last: the first other miss, if any, is raised instead (noting the drift).

    Args:
        reference: the reference's records (init, then one per step).
        per_rank: for every rank, its records (the same number, full tensors).
        keys: the record keys to compare, in this order (absent from the reference: skipped).
        strict: a key the reference has but a sharded record lacks fails; else it is
            skipped (the default keys: compare what both sides report).
        tolerance: for ``torch.testing.assert_close``.
        mesh_shape: the mesh, for the message and the candidate shard counts.

    Raises:
        AssertionError: naming the first differing leaf, record, rank, errors and a hint;
            or a key / leaf path the sharded record lacks or adds.
    """
    drifting = None
    for leaf in _misses(reference, per_rank, keys, tolerance, shard_counts(mesh_shape), strict):
        if zero_grad_drift(leaf) is None:
            fail(leaf, tolerance, len(per_rank), mesh_shape, drifting)
        if drifting is None:
            drifting = leaf
    if drifting is not None:
        fail(drifting, tolerance, len(per_rank), mesh_shape)


def _misses(reference: Sequence[Record], per_rank: Sequence[Sequence[Record]],
            keys: Sequence[str], tolerance: Tolerance, sizes: tuple[int, ...],
            strict: bool) -> Iterator[Leaf]:
    """Every differing leaf (record, key, leaf path, rank order); raises on a missing key or
    leaf path (see :func:`compare_runs`)."""
    for index, ref_record in enumerate(reference):
        label = record_label(index)
        ref_grads, grad_scale = _grads(ref_record)
        for key in keys:
            if key not in ref_record or (not strict and any(key not in records[index]
                                                             for records in per_rank)):
                continue
            expected_leaves = flatten(ref_record[key])
            rank_leaves = []
            for rank, records in enumerate(per_rank):
                if key not in records[index]:
                    raise AssertionError(f"assert_sharded_matches: the sharded step reports no "
                                         f"{key!r} at {label} on rank {rank} (the reference "
                                         f"does; it reports {sorted(records[index])})")
                leaves = flatten(records[index][key])
                if set(leaves) != set(expected_leaves):
                    raise AssertionError(
                        f"assert_sharded_matches: {key} at {label} on rank {rank} has leaves "
                        f"missing {sorted(set(expected_leaves) - set(leaves))} and extra "
                        f"{sorted(set(leaves) - set(expected_leaves))} against the reference")
                rank_leaves.append(leaves)
            previous = [flatten(records[index - 1].get(key, {})) if index else {}
                        for records in per_rank]
            prev_ref = flatten(reference[index - 1].get(key, {})) if index else {}
            for path, expected in expected_leaves.items():
                expected = _as_tensor(expected)
                values = [_as_tensor(leaves[path]) for leaves in rank_leaves]
                grad = ref_grads.get(path) if key != "grads" else None
                for rank, actual in enumerate(values):
                    if actual.shape == expected.shape and _close(actual, expected, tolerance):
                        continue
                    before = previous[rank].get(path)
                    yield Leaf(_leaf_name(key, path), label, rank, actual, expected, values,
                               None if before is None else _as_tensor(before),
                               None if path not in prev_ref else _as_tensor(prev_ref[path]),
                               sizes, grad, grad_scale)
