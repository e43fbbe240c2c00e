"""The background poster: posts in submission order, hands errors to the waiter, keeps nothing.

* many batches in flight between two ranks, each with its own tag and sizes, all
  arrive intact (the order of posting is what matches the ranks' messages);
* a posting that fails raises at ``wait()`` on the caller's thread;
* a waited posting holds no reference to its tensors (the shard_params memory
  bound depends on it).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from shardfn.primitives._poster import submit


def _exchange_many(batches: int):
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    postings, received = [], []
    for b in range(batches):
        out = torch.empty(b + 1)
        received.append(out)
        ops = [dist.P2POp(dist.irecv, out, peer, tag=b),
               dist.P2POp(dist.isend, torch.full((b + 1,), float(10 * rank + b)), peer, tag=b)]
        postings.append(submit(ops))
    for posting in postings:
        for work in posting.wait():
            work.wait()
    return [t.tolist() for t in received]


def test_batches_arrive_in_order(worlds):
    batches = 12
    for rank, received in enumerate(worlds(2).run(_exchange_many, batches)):
        peer = 1 - rank
        assert received == [[float(10 * peer + b)] * (b + 1) for b in range(batches)]


def test_a_failed_posting_raises_at_wait():
    posting = submit(["not a P2POp"])  # batch_isend_irecv rejects it on the poster thread
    with pytest.raises((RuntimeError, TypeError, ValueError)):
        posting.wait()
    # the thread survives: the next submission is posted
    with pytest.raises((RuntimeError, TypeError, ValueError)):
        submit(["again"]).wait()


def _released_after_wait() -> bool:
    peer = 1 - dist.get_rank()
    payload, out = torch.ones(1000), torch.empty(1000)
    ref = weakref.ref(payload)
    posting = submit([dist.P2POp(dist.irecv, out, peer, tag=99),
                      dist.P2POp(dist.isend, payload, peer, tag=99)])
    del payload
    works = posting.wait()
    for work in works:
        work.wait()
    del works, work
    gc.collect()
    return ref() is None


def test_waited_postings_hold_no_tensor(worlds):
    assert all(worlds(2).run(_released_after_wait))
