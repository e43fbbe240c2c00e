"""Remat inside `shard_params` units: the recording and replay modes, adapted to units.

:class:`UnitRecorder` / :class:`UnitReplayer` are the dispatch modes of
:mod:`shardfn.transforms.recording` (shared with ``remat``) with two changes:
values computed from the gathered parameters alone are never saved (so a policy
never keeps a unit's parameters alive between forward and backward), and either
mode can be paused while a nested unit runs (the root's mode must not see a
unit's ops).

Example:
    >>> recorder = UnitRecorder(policy, full_params)
    >>> with recorder:
    ...     out = run_unit(full_params, x)
    >>> with UnitReplayer(recorder.finish()):
    ...     out_again = run_unit(full_params, x)   # the saved ops are not run again
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shardfn._torch_internals import torch_tree_flatten
from shardfn.transforms.recording import Policy, Recorder, Replayer, base_tensor, storage_ptr

__all__ = ["UnitRecorder", "UnitReplayer"]


def _storages(tensors) -> set[int]:
    return {storage_ptr(base_tensor(t)) for t in tensors if isinstance(t, torch.Tensor)}


class _Pausable:
    """A dispatch mode that a nested unit can switch off for the length of a block."""

    paused = False

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Let the ops of this block (a nested unit's) through untouched and uncounted."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


class UnitRecorder(_Pausable, Recorder):
    """Forward of a unit (or the root): keeps the outputs ``policy`` saves.

    Outputs of ops whose tensor inputs are all parameters or values computed from
    parameters alone (or that have no tensor inputs) are never saved: they are
    recomputed from the parameters gathered again in backward, so no policy keeps a
    unit's full parameters (or a copy of them) alive between forward and backward.
    """

    def __init__(self, policy: Policy, params: Mapping[str, torch.Tensor]):
        self.user_policy = policy
        self.param_only = False
        super().__init__(lambda op, name: not self.param_only and self.user_policy(op, name), [])
        self.param_storages = _storages(params.values())  # alive throughout the call
        self.derived = WeakIdKeyDictionary()  # outputs computed from parameters alone

    def check_closure(self, func, args, kwargs) -> None:
        """Accept every tensor: parameters and inputs reach a unit through
        the module skeleton they are swapped into, not as arguments, so remat's closure
        check does not apply."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        tensors = [t for t in torch_tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self.param_only = all(t in self.derived or storage_ptr(t) in self.param_storages
                              for t in tensors)
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            param_only, self.param_only = self.param_only, False
        if param_only:  # derived from parameters alone (w.t().contiguous(), w * 2): the same
            for t in torch_tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.derived[t] = True
        return out


class UnitReplayer(_Pausable, Replayer):
    """Backward recompute of a unit (or the root): saved ops return their saved outputs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)
