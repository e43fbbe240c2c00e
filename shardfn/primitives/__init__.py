"""Differentiable collectives over named mesh axes, and communication counters."""

from shardfn.primitives.all_to_all_v import all_to_all_v
from shardfn.primitives.collectives import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    broadcast,
    pmean,
    pmean_invariant,
    ppermute,
    psum,
    psum_invariant,
    psum_scatter,
    pvary,
)
from shardfn.primitives.stats import CommStats, comm_stats, in_flight, reset_comm_stats

__all__ = ["CommStats", "all_gather", "all_to_all", "all_to_all_v", "axis_index", "axis_size",
           "broadcast",
           "comm_stats", "in_flight", "pmean", "pmean_invariant", "ppermute", "psum",
           "psum_invariant", "psum_scatter", "pvary", "reset_comm_stats"]
