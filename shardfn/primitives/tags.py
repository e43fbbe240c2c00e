"""Message tags for point-to-point exchanges: one allocator, disjoint blocks per user.

gloo matches a receive to a send by (peer, tag): two exchanges in flight between
the same ranks with the same tag can swap their messages. Every user of tagged
point-to-point messages takes its tags from its own :class:`TagBlock` here, so
no two users can collide, and within a block ``tag(i)`` cycles through the
block's range.

Example:
    >>> BUCKETS.tag(3)
    3
    >>> UNITS.tag(0) == UNITS.start
    True
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["BUCKETS", "UNITS", "TagBlock"]


class TagBlock(NamedTuple):
    """A contiguous range of tags owned by one kind of exchange.

    Attributes:
        name: who owns it (for messages).
        start: the first tag.
        size: how many tags; ``tag(i)`` wraps around after that many exchanges in flight.
    """

    name: str
    start: int
    size: int

    def tag(self, i: int) -> int:
        """The ``i``-th tag of the block (``i`` wraps modulo the block size)."""
        return self.start + i % self.size


#: data_parallel and shard_opt_state buckets (a reduction and a gather per bucket)
BUCKETS = TagBlock("data_parallel / shard_opt_state buckets", 0, 1 << 12)
#: shard_params unit all-gathers and reduce-scatters
UNITS = TagBlock("shard_params unit exchanges", BUCKETS.start + BUCKETS.size, 1 << 20)
