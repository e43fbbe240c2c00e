"""Hypothesis strategies and torch.optim reference runners shared by the optimizer tests."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from shardfn import optim, pytree

STEPS = 20


@st.composite
def tree_shapes(draw, min_leaves: int = 1, max_leaves: int = 5):
    """A nested dict (some groups are lists) of leaf shapes, 1-5 leaves, ranks 0-3."""
    n = draw(st.integers(min_leaves, max_leaves))
    tree: dict = {}
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=3)))
        group = draw(st.sampled_from([None, "block", "head", "layers"]))
        if group is None:
            tree[f"w{i}"] = shape
        elif group == "layers":
            tree.setdefault("layers", []).append(shape)
        else:
            tree.setdefault(group, {})[f"w{i}"] = shape
    return tree


def is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def random_tree(shapes, generator: torch.Generator, scale: float = 1.0):
    """A tree of float32 normal tensors with the given leaf shapes."""
    return pytree.tree_map(
        lambda s: scale * torch.randn(s, generator=generator), shapes, is_leaf=is_shape
    )


def clone_tree(tree):
    return pytree.tree_map(lambda x: x.clone(), tree)


def assert_trees_equal(a, b) -> None:
    """Bitwise equality of two trees (same structure)."""
    for name, x, y in zip(pytree.tree_paths(a), pytree.tree_leaves(a), pytree.tree_leaves(b),
                          strict=True):
        assert torch.equal(x, y), f"leaf {name} changed"


def run_both(opt, make_torch_opt, shapes, seed: int, steps: int = STEPS):
    """Run ``opt`` and a torch.optim optimizer on the same params and gradients.

    Args:
        opt: the shardfn GradientTransformation.
        make_torch_opt: ``f(list of torch params) -> torch.optim.Optimizer`` (the list is
            in ``tree_leaves`` order).
        shapes: tree of leaf shapes.
        seed: seed of params and per-step gradients.

    Returns:
        ``(our final params tree, torch's final params as a list, our final state)``.
    """
    gen = torch.Generator().manual_seed(seed)
    params = random_tree(shapes, gen)
    torch_params = [p.clone().requires_grad_(True) for p in pytree.tree_leaves(params)]
    torch_opt = make_torch_opt(torch_params)
    state = opt.init(params)
    for _ in range(steps):
        grads = random_tree(shapes, gen)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        for p, g in zip(torch_params, pytree.tree_leaves(grads), strict=True):
            p.grad = g.clone()
        torch_opt.step()
    return params, [p.detach() for p in torch_params], state
