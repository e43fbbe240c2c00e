"""Split backward at the operation level: the input gradient now, the weight gradient later.

Zero-bubble schedules run a stage's backward in two parts: ``B`` (the gradient of
the stage's input, which the previous stage waits for) and ``W`` (the gradients
of the stage's parameters, done when the rank would otherwise idle). ``W`` must
not run again the input-gradient path that ``B`` already ran.

The autograd graph of one stage and micro-batch is analysed once
(:func:`plan_split`). The *input path* is every node whose backward leads to the
stage's input (the nodes that depend on the input in the forward). Walking
forward from each parameter's ``AccumulateGrad``, the first input-path nodes met
are its *intermediates*: there the parameter's path joins the input's. Parameters
sharing an intermediate form one group (a weight used twice joins the groups of
both its uses).

``B`` (:func:`backward_input`) differentiates the outputs with respect to the
input only, with a prehook on every intermediate recording the gradient flowing
into it. ``W`` (:func:`backward_weights`) differentiates, per group, from its
intermediates (``GradientEdge(node, k)`` with the recorded gradient) down to its
parameters: only the parameter branches run (autograd computes the outputs a
node's edges need). When one intermediate of a group lies below another (a tied
weight), the gradient reaching the lower one through the upper one is already in
its recorded gradient, so the lower one's prehook replaces what arrives by the
recording (no double count), as torch.distributed.pipelining does.

What is not split (:func:`plan_split` returns ``None``, and the caller runs one
full backward instead): no input requires a gradient (stage 0 on token ids),
or an output requiring a gradient does not depend on the input.

Example:
    >>> split = plan_split([out], [x], params)
    >>> (gx,), captured = backward_input(split, [out], [g_out], [x])
    >>> backward_weights(split, captured, params)   # summed into each parameter's .grad
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["Group", "Split", "backward_input", "backward_weights", "graph_node", "plan_split"]


class Group(NamedTuple):
    """Parameters whose paths join the input path at the same intermediates.

    Attributes:
        params: indices into the ``params`` given to :func:`plan_split`.
        intermediates: indices into :attr:`Split.intermediates`.
    """

    params: tuple[int, ...]
    intermediates: tuple[int, ...]


class Split(NamedTuple):
    """The analysis of one graph (:func:`plan_split`).

    Attributes:
        intermediates: the input-path nodes where parameter paths join it.
        groups: the parameter groups, each differentiated by one ``autograd.backward``
            in W.
    """

    intermediates: tuple[Node, ...]
    groups: tuple[Group, ...]


def graph_node(t: torch.Tensor) -> Node | None:
    """The autograd node a tensor's gradient enters: its ``grad_fn``, or its
    ``AccumulateGrad`` for a leaf requiring grad; None if it requires no gradient."""
    if not t.requires_grad:
        return None
    return get_gradient_edge(t).node


def _consumers(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """node -> the nodes whose backward feeds it (its consumers in the forward)."""
    found: dict[Node, list[Node]] = collections.defaultdict(list)
    seen = set(roots)
    queue = collections.deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            found[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return found


def _forward_closure(starts: Sequence[Node], consumers: dict[Node, list[Node]],
                     stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reached from ``starts`` going forward (to consumers), not entering ``stop``;
    returns ``(reached, stop nodes met)``."""
    reached, met = set(starts), set()
    queue = collections.deque(starts)
    while queue:
        for nxt in consumers.get(queue.popleft(), ()):
            if nxt in stop:
                met.add(nxt)
            elif nxt not in reached:
                reached.add(nxt)
                queue.append(nxt)
    return reached, met


def plan_split(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
               params: Sequence[torch.Tensor]) -> Split | None:
    """Find each parameter's intermediates in the graph of ``outputs``.

    Args:
        outputs: the tensors the backward starts from (a stage's outputs, or its loss).
        inputs: the tensors whose gradient ``B`` computes (leaves requiring grad).
        params: the leaves whose gradient ``W`` computes.

    Returns:
        The :class:`Split`, or None when the graph cannot be split: no input or no
        output requires a gradient, or an output requiring one does not depend on
        the inputs (its parameters would have no intermediate).
    """
    out_nodes = [n for n in map(graph_node, outputs) if n is not None]
    in_nodes = [n for n in map(graph_node, inputs) if n is not None]
    if not out_nodes or not in_nodes:
        return None
    consumers = _consumers(out_nodes)
    input_path, _ = _forward_closure(in_nodes, consumers, set())
    if any(n not in input_path for n in out_nodes):
        return None
    param_nodes = tuple(graph_node(p) for p in params)
    met: dict[int, set[Node]] = {}
    for k, node in enumerate(param_nodes):
        if node is not None and node in consumers:  # else unused: no gradient
            met[k] = _forward_closure([node], consumers, input_path)[1]
    intermediates = tuple(dict.fromkeys(n for k in sorted(met) for n in met[k]))
    return Split(intermediates, _components(met, intermediates))


def _components(met: dict[int, set[Node]], intermediates: tuple[Node, ...]
                ) -> tuple[Group, ...]:
    """Groups: parameters joined when they share an intermediate (connected components)."""
    where = {node: i for i, node in enumerate(intermediates)}
    owner = list(range(len(intermediates)))  # union-find over intermediates

    def root(i: int) -> int:
        while owner[i] != i:
            owner[i] = owner[owner[i]]
            i = owner[i]
        return i

    for nodes in met.values():
        ids = [where[n] for n in nodes]
        for i in ids[1:]:
            owner[root(i)] = root(ids[0])
    params: dict[int, list[int]] = collections.defaultdict(list)
    for k in sorted(met):
        if met[k]:
            params[root(where[next(iter(met[k]))])].append(k)
    return tuple(Group(tuple(ks), tuple(i for i in range(len(intermediates)) if root(i) == r))
                 for r, ks in params.items())


Captured = list  # per intermediate: the gradients into it (a tuple, None entries allowed)


def backward_input(split: Split, outputs: Sequence[torch.Tensor],
                   grad_outputs: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor]
                   ) -> tuple[tuple[torch.Tensor | None, ...], Captured]:
    """``B``: the inputs' gradients, recording the gradients into the intermediates.

    Args:
        split: :func:`plan_split` of this graph.
        outputs: the tensors to differentiate (those requiring grad are used).
        grad_outputs: their gradients (None: ones, for a scalar loss).
        inputs: the leaves to differentiate with respect to.

    Returns:
        ``(input gradients, captured)``; the graph is retained for :func:`backward_weights`.
    """
    captured: Captured = [None] * len(split.intermediates)

    def recorder(k: int):
        def hook(grads):
            captured[k] = grads
        return hook

    handles = [node.register_prehook(recorder(k)) for k, node in enumerate(split.intermediates)]
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if o.requires_grad]
    try:
        found = torch.autograd.grad([o for o, _ in pairs], list(inputs),
                                    grad_outputs=[g for _, g in pairs], retain_graph=True,
                                    allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return found, captured


def backward_weights(split: Split, captured: Captured,
                     params: Sequence[torch.Tensor]) -> None:
    """``W``: every parameter's gradient, from the gradients ``B`` recorded, summed into
    its ``.grad`` (autograd's accumulation: the first gradient is taken over, later
    ones are added in place, so no step allocates a second full-size gradient).

    One ``autograd.backward`` per group, from its intermediates' edges to its
    parameters. The graph is released as the groups are done (the last call frees
    what is left).

    Args:
        split: :func:`plan_split` of this graph.
        captured: what :func:`backward_input` recorded.
        params: the leaves :func:`plan_split` was given, in the same order.
    """
    for n_group, group in enumerate(split.groups):
        edges, seeds = [], []
        for k in group.intermediates:
            for nr, g in enumerate(captured[k] or ()):
                if g is not None:
                    edges.append(GradientEdge(split.intermediates[k], nr))
                    seeds.append(g)
        if not edges:
            continue
        clamps = []
        if len(group.intermediates) > 1:  # one below another: keep its recorded total
            clamps = [split.intermediates[k].register_prehook(
                lambda _, saved=captured[k]: saved) for k in group.intermediates]
        try:
            torch.autograd.backward(edges, grad_tensors=seeds,
                                    inputs=[params[k] for k in group.params],
                                    retain_graph=n_group < len(split.groups) - 1)
        finally:
            for handle in clamps:
                handle.remove()
