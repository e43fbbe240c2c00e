"""A pipeline model's per-process caches, kept outside the frozen model.

A :class:`~.pipeline_model.PipelineModel` is a frozen value: its fields say what it
computes and never change. What its calls keep from one call to the next lives here,
in one :class:`Caches` record per model object, looked up by :func:`caches_of`:

* ``shapes``: the boundary shapes inferred per batch signature (:class:`~.shapes.ShapeCache`);
* ``buffers``: the activation and gradient message buffers kept from step to step
  (:class:`~._buffers.MessageBuffers`);
* ``guard``: one call at a time (:class:`~.guard.CallGuard`).

They are made on the first lookup and dropped with the model (the registry holds the
model weakly). A new model object (``train()``, ``eval()``, ``dataclasses.replace``,
``copy.copy``) starts with empty caches of its own. They are this process's only:
nothing of them is saved, compared or sent.

Example:
    >>> caches_of(pp).shapes is caches_of(pp).shapes     # one record per model object
    True
    >>> caches_of(pp).shapes is caches_of(pp.eval()).shapes
    False
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, NamedTuple

from shardfn.transforms.pipeline._buffers import MessageBuffers
from shardfn.transforms.pipeline.guard import CallGuard
from shardfn.transforms.pipeline.shapes import ShapeCache

__all__ = ["Caches", "caches_of"]


class Caches(NamedTuple):
    """What one pipeline model keeps from call to call, in this process.

    Attributes:
        shapes: batch signature -> the activation shapes a first call inferred.
        buffers: packed message buffers reused by the next ``value_and_grad``.
        guard: refuses a second thread's call while one runs.
    """

    shapes: ShapeCache
    buffers: MessageBuffers
    guard: CallGuard


_CACHES: weakref.WeakKeyDictionary[Any, Caches] = weakref.WeakKeyDictionary()
_MAKING = threading.Lock()  # two threads' first lookups get one record (one guard)


def caches_of(model: Any) -> Caches:
    """``model``'s caches, made empty on its first lookup (keyed by the object, weakly).

    Args:
        model: a pipeline model (any object with identity hashing and weak references).

    Returns:
        Its :class:`Caches`; the same record on every lookup of the same object.

    Example:
        >>> caches_of(pp).buffers.clear()     # the next step allocates fresh buffers
    """
    found = _CACHES.get(model)
    if found is None:
        with _MAKING:
            found = _CACHES.get(model)
            if found is None:
                found = _CACHES[model] = Caches(ShapeCache(), MessageBuffers(), CallGuard())
    return found
