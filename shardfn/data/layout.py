"""How one global batch is cut over the mesh: which block of it each rank reads.

The global batch of ``global_batch`` samples is cut into one block per *data rank*
(a coordinate along the data axes, e.g. ``"dp"``, or ``("replica", "dp")`` for HSDP),
in the mesh's row-major order: data rank ``i = mesh.index(data_axes)`` reads samples
``[i * local_batch, (i + 1) * local_batch)`` of it. Ranks that differ only on other
axes (``tp``, ``sp``, ``pp``) have the same data index, so they read the same block.
A block holds ``accumulation`` micro-batches of ``microbatch`` samples each:

    global_batch = microbatch x accumulation x data ranks

Example:
    >>> layout = batch_layout(None, global_batch=8, accumulation=2)
    >>> layout.microbatch, layout.local_batch, layout.data_ranks
    (4, 8, 1)
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

from shardfn.mesh import AxisName, Mesh

__all__ = ["BatchLayout", "batch_layout", "split_global_batch"]


class BatchLayout(NamedTuple):
    """This rank's place in the global batch (build it with :func:`batch_layout`).

    Attributes:
        global_batch: samples per optimizer step over all data ranks.
        microbatch: samples per forward/backward on one rank.
        accumulation: micro-batches per optimizer step on one rank.
        data_ranks: the number of distinct batches (the product of the data axes' sizes).
        data_index: this rank's block of the global batch (``mesh.index(data_axes)``).
        data_axes: the mesh axes the batch is split over, in mesh order.
    """

    global_batch: int
    microbatch: int
    accumulation: int
    data_ranks: int
    data_index: int
    data_axes: tuple[str, ...]

    @property
    def local_batch(self) -> int:
        """Samples this rank reads per step: ``microbatch * accumulation``."""
        return self.microbatch * self.accumulation

    @property
    def local_start(self) -> int:
        """Where this rank's block starts inside the global batch."""
        return self.data_index * self.local_batch


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def split_global_batch(global_batch: int, data_ranks: int = 1, data_index: int = 0, *,
                       microbatch: int | None = None, accumulation: int = 1,
                       data_axes: tuple[str, ...] = ()) -> BatchLayout:
    """A checked :class:`BatchLayout` from the numbers alone (no mesh needed).

    Args:
        global_batch: samples per optimizer step over all data ranks.
        data_ranks: how many data ranks share it.
        data_index: this rank's data index, ``0 <= data_index < data_ranks``.
        microbatch: samples per micro-batch; None: ``global_batch / (accumulation *
            data_ranks)``, which must then be a whole number.
        accumulation: micro-batches per step on each rank.
        data_axes: the axes' names, for messages and the record.

    Returns:
        The layout.

    Raises:
        ValueError: when ``global_batch != microbatch * accumulation * data_ranks``
            (the message names all four numbers), or a number is not an int >= 1.

    Example:
        >>> split_global_batch(32, 4, 1, accumulation=2).microbatch
        4
    """
    global_batch = _positive_int("global_batch", global_batch)
    data_ranks = _positive_int("data ranks", data_ranks)
    accumulation = _positive_int("accumulation", accumulation)
    if isinstance(data_index, bool) or not isinstance(data_index, numbers.Integral) or \
            not 0 <= data_index < data_ranks:
        raise ValueError(f"data_index must be an int in [0, {data_ranks}), got {data_index!r}")
    where = f" (the product of the sizes of data axes {data_axes})" if data_axes else ""
    if microbatch is None:
        if global_batch % (accumulation * data_ranks):
            raise ValueError(
                f"global_batch={global_batch} must equal microbatch x accumulation={accumulation}"
                f" x data ranks={data_ranks}{where}, but {global_batch} does not divide by "
                f"{accumulation * data_ranks}; pick a global batch that is a multiple of it")
        microbatch = global_batch // (accumulation * data_ranks)
    microbatch = _positive_int("microbatch", microbatch)
    if microbatch * accumulation * data_ranks != global_batch:
        raise ValueError(
            f"global_batch={global_batch} must equal microbatch={microbatch} x accumulation="
            f"{accumulation} x data ranks={data_ranks}{where} = "
            f"{microbatch * accumulation * data_ranks}")
    return BatchLayout(global_batch, microbatch, accumulation, data_ranks, int(data_index),
                       tuple(data_axes))


def batch_layout(mesh: Mesh | None, data_axes: AxisName = ("dp",), *, global_batch: int,
                 microbatch: int | None = None, accumulation: int = 1) -> BatchLayout:
    """This rank's :class:`BatchLayout` on ``mesh``.

    Args:
        mesh: the mesh; None: one process (one data rank, whatever ``data_axes`` says).
        data_axes: the axis or axes the batch is split over (``"dp"``, or for HSDP the
            replicate and shard axes, ``("replica", "dp")``); every other axis of the
            mesh gets the same batch on each of its ranks. ``()``: all ranks the same.
        global_batch, microbatch, accumulation: as for :func:`split_global_batch`.

    Returns:
        The layout; ``data_index = mesh.index(data_axes)``, ``data_ranks =
        mesh.size(data_axes)``.

    Raises:
        ValueError: a data axis the mesh does not have (naming the mesh's axes), or the
            numbers do not multiply out.

    Example:
        >>> mesh = sf.Mesh({"dp": 2, "tp": 2})                   # on 4 ranks
        >>> batch_layout(mesh, "dp", global_batch=16, accumulation=2).microbatch
        4
    """
    if mesh is None:
        return split_global_batch(global_batch, microbatch=microbatch,
                                  accumulation=accumulation)
    names = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    unknown = [name for name in names if name not in mesh.axis_names]
    if unknown:
        raise ValueError(f"data_axes {names!r}: the mesh has no axis {unknown[0]!r}; its axes "
                         f"are {mesh.axis_names} (say which ones split the batch, e.g. "
                         f"data_axes={mesh.axis_names[:1]!r})")
    axes = mesh.axes(names)
    return split_global_batch(global_batch, mesh.size(axes), mesh.index(axes),
                              microbatch=microbatch, accumulation=accumulation, data_axes=axes)
