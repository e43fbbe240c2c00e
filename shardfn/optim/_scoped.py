"""A value set for the length of a ``with`` block, readable by the code inside it.

Eager code keeps it in a ``contextvars.ContextVar`` (right per thread and per
asyncio task). ``torch.compile`` cannot trace ``ContextVar.set``/``get``, so
while dynamo traces (``torch.compiler.is_compiling()``) the value lives on a
plain stack that the traced block pushes and pops: dynamo follows that list
like any local state, and nothing stays behind between calls. A block opened
in eager code is not seen by compiled code it calls (and the other way round):
each world reads its own.

Example:
    >>> SCALE = Scoped("scale", 1.0)
    >>> with SCALE.bound(2.0):
    ...     SCALE.get()
    2.0
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Generic, TypeVar

from shardfn.primitives._compiled import tracing

__all__ = ["Scoped"]

T = TypeVar("T")


class Scoped(Generic[T]):
    """A named value with a default, set for a block with :meth:`bound`.

    Args:
        name: the ContextVar's name.
        default: what :meth:`get` returns outside every block.
    """

    def __init__(self, name: str, default: T):
        self._var: contextvars.ContextVar[T] = contextvars.ContextVar(name, default=default)
        self._default = default
        self._traced: list[T] = []  # the blocks open in code dynamo is tracing

    def get(self) -> T:
        """The value of the innermost enclosing block (the default outside every block)."""
        if tracing():
            return self._traced[-1] if self._traced else self._default
        return self._var.get()

    @contextlib.contextmanager
    def bound(self, value: T) -> Iterator[None]:
        """Within this block :meth:`get` returns ``value``.

        Example:
            >>> with SCALE.bound(3.0):
            ...     assert SCALE.get() == 3.0
        """
        if tracing():
            self._traced.append(value)
            try:
                yield
            finally:
                self._traced.pop()
            return
        token = self._var.set(value)
        try:
            yield
        finally:
            self._var.reset(token)
