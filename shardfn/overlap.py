"""Inductor options that let a compiled step run its collectives beside its compute.

shardfn's compiled steps put every collective's issue before its wait, each issue
where its input comes to exist (the gradient buckets of ``data_parallel`` and
``shard_opt_state`` as the backward makes them, ``shard_params``' unit gathers before
the forward's compute, the reduce-scatters of its backward). Whether inductor keeps
them apart is its scheduler's choice, and its default peak-memory reordering
(``reorder_for_peak_memory``) counts a collective's output buffer as live from the
issue to the first read: it moves most out-of-place collectives (all-gather,
reduce-scatter, and the all-to-all gloo runs them as) next to their waits, one at a
time, because that order holds the least memory. An all-reduce
writes in place and keeps its overlap with the defaults.

:func:`overlap_options` turns on the passes that torch's inductor configuration
recommends for this (``reorder_for_compute_comm_overlap`` with
``reorder_communication_preserving_peak_memory``, ``sink_waits_iterative``,
``reorder_communication_preserving_peak_memory``): they move collectives earlier and
waits later as long as the estimated peak memory does not grow. torch lets them swap two
collectives too, which is unsafe here: every rank compiles its own graph (its own ZeRO
pieces), so their estimates, and then the order in which the ranks issue collectives,
could differ (gloo aborted on mismatched sizes in our ZeRO-1 test; equal sizes would mix
the data). The passes here keep the collectives in the graph's order (the program's
order, the same on every rank) and move only compute and waits around them. What they cost is
compile time (a runtime estimate per node); the values are the same kernels in
another order.

Example:
    >>> compiled = torch.compile(step, fullgraph=True, options=sf.overlap_options())
"""

from __future__ import annotations

from typing import Any

from shardfn._torch_internals import InOrderCommPass

__all__ = ["OVERLAP_PASSES", "overlap_options"]

#: The passes, in order (the list that inductor's own config module recommends).
OVERLAP_PASSES: tuple[str, ...] = (
    "reorder_communication_preserving_peak_memory",
    "sink_waits_iterative",
    "reorder_communication_preserving_peak_memory",
)


def overlap_options() -> dict[str, Any]:
    """Inductor options for ``torch.compile(..., options=...)`` that overlap collectives.

    Returns:
        A new dict: ``reorder_for_compute_comm_overlap`` on, with :data:`OVERLAP_PASSES`,
        each run with the collectives kept in the graph's order (the same on every rank).
        Merge your own options into it. For ``backend="inductor"`` (the default);
        aot_autograd backends such as ``"aot_eager"`` ignore them with a warning.

    Example:
        >>> options = {**sf.overlap_options(), "max_autotune": False}
        >>> compiled = torch.compile(step, fullgraph=True, options=options)
    """
    return {"reorder_for_compute_comm_overlap": True,
            "reorder_for_compute_comm_overlap_passes": [InOrderCommPass(name)
                                                        for name in OVERLAP_PASSES]}
