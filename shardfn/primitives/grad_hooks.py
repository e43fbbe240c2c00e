"""The shared frame of ``with overlap(params):`` blocks: one gradient hook per leaf.

``data_parallel.overlap`` and ``shard_opt_state``'s ``overlap`` both register a
post-accumulate-grad hook on every parameter, accept exactly one gradient per
leaf per block, launch bucket collectives as buckets fill, and must wait for
every point-to-point exchange still in flight when a block ends with an error
(a pending receive would take the next step's message with the same tag). This
base class holds that frame; subclasses say what a gradient arrival does
(:meth:`_on_grad`) and what is in flight (:meth:`_drain`).

Example:
    >>> class Count(GradHooks):
    ...     def _on_grad(self, i, param): self.count += 1
    ...     def _drain(self): pass
"""

from __future__ import annotations

import torch

from shardfn import pytree

__all__ = ["GradHooks"]


class GradHooks:
    """Hooks on every leaf of ``params``; each leaf may receive one gradient per block.

    Args:
        params: a pytree of leaf tensors that require grad.

    Raises:
        ValueError: naming a leaf that is not a leaf tensor requiring grad.
    """

    def __init__(self, params):
        self.names, self.leaves, self.treedef = pytree.tree_flatten_with_path(params)
        for name, leaf in zip(self.names, self.leaves, strict=True):
            if not (isinstance(leaf, torch.Tensor) and leaf.is_leaf and leaf.requires_grad):
                raise ValueError(f"overlap: leaf {name!r} must be a leaf tensor that requires grad")
        self.hooks: list = []
        self.seen = [False] * len(self.leaves)

    # ---- for subclasses -----------------------------------------------------------
    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        """Leaf ``i``'s gradient has been accumulated into ``param.grad``."""
        raise NotImplementedError

    def _drain(self) -> None:
        """Wait for (and forget) every exchange still in flight."""
        raise NotImplementedError

    def _register(self) -> None:
        """Start a block: forget which leaves were seen and hook every leaf."""
        self.seen = [False] * len(self.leaves)
        self.hooks = [leaf.register_post_accumulate_grad_hook(self._hook_for(i))
                      for i, leaf in enumerate(self.leaves)]

    def _check_all_arrived(self) -> None:
        """Raise naming leaves that got no gradient in this block nor hold one from before."""
        missing = [self.names[i] for i, leaf in enumerate(self.leaves)
                   if not self.seen[i] and leaf.grad is None]
        if missing:
            raise RuntimeError(f"overlap: no gradient arrived for {missing[:5]}; every leaf "
                               "passed to overlap() must take part in the loss")

    # ---- the frame --------------------------------------------------------------------
    def __exit__(self, exc_type, *exc) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        if exc_type is not None:
            self._drain()

    def _hook_for(self, i: int):
        def hook(param):
            if self.seen[i]:
                raise RuntimeError(f"overlap: leaf {self.names[i]!r} received a second gradient "
                                   "inside one `with overlap(...)` block; run one backward per "
                                   "block (accumulate micro-batches before it)")
            self.seen[i] = True
            self._on_grad(i, param)

        return hook
