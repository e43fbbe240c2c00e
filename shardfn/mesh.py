"""Mesh: named axes laid row-major over the ranks of a torch.distributed world.

A mesh ``Mesh({"dp": 2, "tp": 2})`` on 4 ranks places rank ``r`` at coordinates
``(r // 2, r % 2)``; ranks that differ only along ``"tp"`` form a ``"tp"`` group.
Every axis (and every combination of axes a collective names) maps to one
process group per slice, created once and cached per process, so building the
same mesh twice costs nothing.

A world of one process needs no process group: a mesh whose axes all have size
1 works without ``torch.distributed`` being initialised, and its collectives are
identities. Under a launcher (``WORLD_SIZE > 1`` in the environment, as torchrun
sets it) a mesh refuses to be built before the process group exists: call
``sf.distributed.initialize()`` first, or each process would silently train alone.

Collectives find the mesh from ``with mesh:`` or :func:`set_mesh` (like
``jax.set_mesh``); an explicit ``mesh=`` keyword overrides it.

Example:
    >>> mesh = Mesh({"dp": 1})
    >>> mesh.size("dp"), mesh.index("dp")
    (1, 0)
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

AxisName = str | tuple[str, ...]

__all__ = ["AxisName", "Mesh", "forget_groups", "get_mesh", "reset_state", "set_mesh"]

_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
_MESH_STACK: list[Mesh] = []


class Mesh:
    """Named axes over the ranks of the current torch.distributed world.

    Args:
        axes: ordered mapping ``axis name -> size``; the product must equal the
            number of ranks (the world size, or ``len(ranks)``).
        ranks: the global ranks the mesh spans, in row-major order (default: all
            ranks of the default group, or ``[0]`` with no process group).

    Example:
        >>> mesh = Mesh({"dp": 1, "tp": 1})
        >>> mesh.axis_names
        ('dp', 'tp')
    """

    def __init__(self, axes: Mapping[str, int], *, ranks: Iterable[int] | None = None):
        if not isinstance(axes, Mapping) or not axes:
            raise TypeError(f"Mesh takes a non-empty dict of axis name -> size, got {axes!r}")
        for name, size in axes.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"mesh axis names must be non-empty strings, got {name!r}")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {name!r} has size {size!r}; sizes are ints >= 1")
        self._axes: dict[str, int] = dict(axes)
        _check_launched()
        world_ranks = list(ranks) if ranks is not None else _world_ranks()
        if any(a >= b for a, b in zip(world_ranks, world_ranks[1:], strict=False)):
            raise ValueError(f"mesh ranks must be strictly increasing, got {world_ranks}")
        if math.prod(self._axes.values()) != len(world_ranks):
            raise ValueError(_size_mismatch(self._axes, len(world_ranks), ranks is not None))
        self._ranks = tuple(world_ranks)
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        if self._rank not in self._ranks:
            raise ValueError(f"rank {self._rank} is not part of the mesh ranks {self._ranks}")
        self._coords = dict(
            zip(self.axis_names, _unravel(self._ranks.index(self._rank), self.shape), strict=True)
        )
        self._groups: dict[tuple[str, ...], dist.ProcessGroup | None] = {}
        for count in range(1, len(self._axes) + 1):
            for combo in itertools.combinations(self.axis_names, count):
                self._groups[combo] = self._make_groups(combo)

    def __copy__(self) -> Mesh:
        return self

    def __deepcopy__(self, memo: dict) -> Mesh:
        """A mesh is an immutable handle on process groups (which cannot be copied): copies
        of a module or a model that hold one share it."""
        return self

    # ---- shape -----------------------------------------------------------------
    @property
    def axis_names(self) -> tuple[str, ...]:
        """The axis names in layout order."""
        return tuple(self._axes)

    @property
    def shape(self) -> tuple[int, ...]:
        """The axis sizes in layout order."""
        return tuple(self._axes.values())

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global ranks of the mesh in row-major order."""
        return self._ranks

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self._rank

    @property
    def device(self) -> torch.device:
        """The device collectives run on: CUDA for NCCL, else CPU."""
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def axes(self, axis: AxisName) -> tuple[str, ...]:
        """Normalise ``axis`` (a name or tuple of names) to a checked tuple in mesh order.

        A tuple of axes always means their product, major to minor in the mesh's
        own axis order (so ``("tp", "dp")`` is the same as ``("dp", "tp")``).

        Raises:
            ValueError: for unknown or repeated axis names.
        """
        names = (axis,) if isinstance(axis, str) else tuple(axis)
        for name in names:
            if name not in self._axes:
                raise ValueError(
                    f"unknown mesh axis {name!r}; this mesh has axes {self.axis_names}"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"axis names repeat in {names!r}")
        return tuple(a for a in self.axis_names if a in names)

    def size(self, axis: AxisName | None = None) -> int:
        """Number of ranks along ``axis`` (a product for a tuple; all ranks for None)."""
        if axis is None:
            return len(self._ranks)
        return math.prod([self._axes[a] for a in self.axes(axis)])

    def index(self, axis: AxisName) -> int:
        """This rank's coordinate along ``axis`` (row-major over a tuple of axes)."""
        index = 0
        for a in self.axes(axis):
            index = index * self._axes[a] + self._coords[a]
        return index

    def group(self, axis: AxisName) -> dist.ProcessGroup | None:
        """The process group of this rank's slice along ``axis`` (None if it has one rank)."""
        return self._groups[self.axes(axis)]

    def group_ranks(self, axis: AxisName) -> list[int]:
        """Global ranks of this rank's slice along ``axis``, ordered by :meth:`index`."""
        names = self.axes(axis)
        return self._slice_ranks(names, self._coords)

    def submesh(self, axes: Iterable[str]) -> Mesh:
        """The mesh of this rank's slice over ``axes`` (other coordinates fixed)."""
        names = self.axes(tuple(axes))
        return Mesh({a: self._axes[a] for a in names}, ranks=self._slice_ranks(names, self._coords))

    # ---- context ---------------------------------------------------------------
    def __enter__(self) -> Mesh:
        _MESH_STACK.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _MESH_STACK.remove(self)

    def __repr__(self) -> str:
        return f"Mesh({self._axes}, rank={self._rank})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Mesh) and (self._axes, self._ranks) == (other._axes, other._ranks)

    def __hash__(self) -> int:
        return hash((tuple(self._axes.items()), self._ranks))

    # ---- internals -------------------------------------------------------------
    def _slice_ranks(self, names: tuple[str, ...], coords: Mapping[str, int]) -> list[int]:
        ranks = []
        for values in itertools.product(*(range(self._axes[a]) for a in names)):
            point = dict(coords, **dict(zip(names, values, strict=True)))
            flat = 0
            for a in self.axis_names:
                flat = flat * self._axes[a] + point[a]
            ranks.append(self._ranks[flat])
        return ranks

    def _make_groups(self, names: tuple[str, ...]) -> dist.ProcessGroup | None:
        """This rank's group along ``names``; only the slice's members take part."""
        if self.size(names) == 1:
            return None
        return _group_for(tuple(self._slice_ranks(names, self._coords)))


def _group_for(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """One process group per ordered rank tuple, cached for the process's lifetime."""
    if ranks not in _GROUPS:
        world = dist.get_world_size()
        if len(ranks) == world and list(ranks) == list(range(world)):
            _GROUPS[ranks] = dist.group.WORLD
        else:
            _GROUPS[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _GROUPS[ranks]


def _world_ranks() -> list[int]:
    return list(range(dist.get_world_size())) if dist.is_initialized() else [0]


def _check_launched() -> None:
    """Refuse a mesh in a launched process (WORLD_SIZE > 1) that has no process group yet."""
    if dist.is_initialized():
        return
    value = os.environ.get("WORLD_SIZE", "")
    try:
        launched = int(value) if value else 1
    except ValueError:
        raise ValueError(f"WORLD_SIZE={value!r} in the environment is not an integer") from None
    if launched > 1:
        raise RuntimeError(
            f"WORLD_SIZE={launched} in the environment (torchrun?) but torch.distributed is not "
            "initialised: call sf.distributed.initialize() first (without it each of the "
            f"{launched} processes would run alone as a world of one)"
        )


def _size_mismatch(axes: dict[str, int], count: int, explicit: bool) -> str:
    """The message for axis sizes whose product is not the number of ranks."""
    positions = math.prod(axes.values())
    where = (f"the {count} ranks given in ranks=" if explicit else
             f"the torch.distributed world of {count} ranks" if dist.is_initialized() else
             "a world of one process (torch.distributed is not initialised)")
    target = "len(ranks)" if explicit else "the world size"
    message = (f"mesh {axes} has {positions} positions but spans {where}; axis sizes must "
               f"multiply to {target} ({count})")
    if len(axes) == 1:
        message += f", e.g. Mesh({{{next(iter(axes))!r}: {count}}})"
    if not explicit and not dist.is_initialized():
        message += (f". For {positions} ranks launch {positions} processes (torchrun "
                    f"--nproc-per-node {positions} script.py) and call "
                    "sf.distributed.initialize() before building the mesh, or run the "
                    f"function on sf.testing.local_world({positions})")
    return message


def forget_groups() -> None:
    """Drop the cached process groups (``sf.distributed.shutdown`` calls this).

    After ``torch.distributed.destroy_process_group`` the cached groups are dead;
    meshes built afterwards (on a new group) make fresh ones.
    """
    _GROUPS.clear()


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    coords = []
    for size in reversed(shape):
        coords.append(flat % size)
        flat //= size
    return list(reversed(coords))


def set_mesh(mesh: Mesh | None) -> None:
    """Make ``mesh`` the current mesh outside any ``with`` block (None clears it)."""
    _MESH_STACK.clear()
    if mesh is not None:
        _MESH_STACK.append(mesh)


def get_mesh(mesh: Mesh | None = None) -> Mesh:
    """Return ``mesh`` if given, else the current one.

    Raises:
        ValueError: when no mesh is given and none is current.
    """
    if mesh is not None:
        return mesh
    if not _MESH_STACK:
        raise ValueError("no mesh: pass mesh=..., use `with mesh:` or call sf.set_mesh(mesh)")
    return _MESH_STACK[-1]


def reset_state() -> None:
    """Clear the current-mesh context (the local world calls this after each run)."""
    _MESH_STACK.clear()
