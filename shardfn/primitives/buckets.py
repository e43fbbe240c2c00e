"""The bucket scheduler of ``with overlap(params):`` blocks, and its constants.

``data_parallel.overlap`` and ``shard_opt_state``'s ``overlap`` both cut the
gradients into buckets, launch a bucket's reduction as soon as backward has
produced every gradient it holds, in a fixed order (the same on every rank, so
the point-to-point messages pair up), and *settle* an older bucket once a
newer one is launched: by then it has had a bucket's worth of backward to
arrive, so little is left to wait for at the end. :class:`BucketSchedule` is
that bookkeeping; the transforms say what launching and settling a bucket do.
Each bucket's messages use the tags :func:`reduce_tag` / :func:`gather_tag`,
from :data:`shardfn.primitives.tags.BUCKETS`.

Example:
    >>> schedule = BucketSchedule(members=[[1], [0]], order=[0, 1], unsettled=1,
    ...                           launch=print, settle=lambda b: print("settle", b))
    >>> schedule.start(); schedule.arrived(1); schedule.arrived(0)
    0
    1
    settle 0
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shardfn.primitives.tags import BUCKETS

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "IN_FLIGHT",
    "BucketSchedule",
    "by_bytes",
    "gather_tag",
    "reduce_tag",
]

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""Bytes per bucket (DDP's default)."""

IN_FLIGHT = 2
"""Buckets whose exchanges may be outstanding in backward before the oldest is settled."""


def reduce_tag(bucket: int) -> int:
    """The message tag of bucket ``bucket``'s reduce-scatter."""
    return BUCKETS.tag(2 * bucket)


def gather_tag(bucket: int) -> int:
    """The message tag of bucket ``bucket``'s all-gather."""
    return BUCKETS.tag(2 * bucket + 1)


def by_bytes(leaves: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Whole leaves grouped into buckets of at most ``bucket_bytes`` (a larger leaf alone),
    in reverse tree order: the order in which backward usually produces gradients.

    Example:
        >>> by_bytes([torch.zeros(2), torch.zeros(2), torch.zeros(4)], 16)
        [[2], [1, 0]]
    """
    members: list[list[int]] = []
    size = 0
    for i in reversed(range(len(leaves))):
        nbytes = leaves[i].numel() * leaves[i].element_size()
        if not members or size + nbytes > bucket_bytes:
            members.append([])
            size = 0
        members[-1].append(i)
        size += nbytes
    return members


class BucketSchedule:
    """Launch buckets in a fixed order as their leaves arrive; settle the oldest behind.

    Args:
        members: ``members[b]``: the leaf numbers bucket ``b`` holds (a leaf may be in
            several buckets).
        order: the order buckets are launched in, the same on every rank.
        unsettled: how many launched buckets stay unsettled; launching one more settles
            the oldest.
        launch: ``launch(b)``: every leaf of bucket ``b`` has arrived.
        settle: ``settle(b)``: finish bucket ``b`` (called once per launched bucket, in
            launch order).
    """

    def __init__(self, members: Sequence[Sequence[int]], order: Sequence[int], unsettled: int,
                 launch: Callable[[int], None], settle: Callable[[int], None]):
        self.members, self.order, self.unsettled = members, list(order), unsettled
        self.launch, self.settle = launch, settle
        self.buckets_of: dict[int, list[int]] = {}
        for b, leaves in enumerate(members):
            for i in leaves:
                self.buckets_of.setdefault(i, []).append(b)
        self.start()

    def start(self) -> None:
        """Begin a block: no leaf has arrived, nothing is launched."""
        self.pending = [len(m) for m in self.members]
        self.next = 0  # position in order of the next bucket to launch
        self.launched: list[int] = []  # launched, not yet settled, oldest first

    def arrived(self, i: int) -> None:
        """Leaf ``i``'s gradient is there: launch every bucket that is now ready, in order."""
        for b in self.buckets_of.get(i, ()):
            self.pending[b] -= 1
        self._launch_ready()

    def finish(self) -> None:
        """Launch what is ready (a bucket with no leaves too), then settle every launched
        bucket still unsettled, oldest first."""
        self._launch_ready()
        while self.launched:
            self.settle(self.launched.pop(0))

    def _launch_ready(self) -> None:
        while self.next < len(self.order) and self.pending[self.order[self.next]] == 0:
            b = self.order[self.next]
            self.next += 1
            self.launch(b)
            self.launched.append(b)
            if len(self.launched) > self.unsettled:
                self.settle(self.launched.pop(0))
