"""sf.data.loader on the local world: every rank reads its block of the one-process order.

Over meshes dp, dp x tp (either axis major), replica x dp x tp (HSDP x TP) and pp x dp
on 1 to 4 ranks: each rank's batches are its data index's block of the global batches
that ``loader(dataset)`` gives on one process, so the ranks of one data index (tp, pp
peers) read the same samples, the data ranks together read every sample of an epoch
exactly once, and the order does not depend on the mesh. DataLoader workers run inside
a rank and change nothing.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

#: (mesh axes, data axes): world sizes 1 to 4
MESHES = [
    ({"dp": 1}, ("dp",)), ({"dp": 2}, ("dp",)), ({"dp": 3}, ("dp",)), ({"dp": 4}, ("dp",)),
    ({"dp": 2, "tp": 2}, ("dp",)), ({"tp": 2, "dp": 2}, ("dp",)), ({"dp": 1, "tp": 2}, ("dp",)),
    ({"replica": 2, "dp": 1, "tp": 2}, ("replica", "dp")),
    ({"replica": 1, "dp": 2, "tp": 2}, ("replica", "dp")),
    ({"replica": 2, "dp": 2, "tp": 1}, ("replica", "dp")),
    ({"pp": 2, "dp": 2}, ("dp",)), ({"pp": 2, "dp": 1}, ("dp",)), ({"pp": 3, "dp": 1}, ("dp",)),
]


def _read_epochs(axes, data_axes, num_samples, global_batch, accumulation, seed, last_batch,
                 batches):
    """On every rank: its coordinates and the sample ids (and masks) of ``batches`` batches
    from the start (past an epoch's end), read from a loader over ``arange(num_samples)``."""
    import shardfn as sf
    from shardfn import data as sfd

    mesh = sf.Mesh(axes)
    data = sfd.loader(TensorDataset(torch.arange(num_samples)), mesh, data_axes=data_axes,
                      global_batch=global_batch, accumulation=accumulation, seed=seed,
                      last_batch=last_batch)
    out = []
    while len(out) < batches:
        for batch in data:
            (ids,), mask = (batch.data, batch.mask) if last_batch == "pad" else (batch, None)
            out.append((ids.tolist(), None if mask is None else mask.tolist()))
            if len(out) == batches:
                break
    coords = {a: mesh.index(a) for a in mesh.axis_names}
    return coords, data.layout, out, data.state


def _reference(num_samples, global_batch, seed, last_batch, batches):
    from shardfn import data as sfd

    data = sfd.loader(TensorDataset(torch.arange(num_samples)), global_batch=global_batch,
                      seed=seed, last_batch=last_batch)
    out = []
    while len(out) < batches:
        for batch in data:
            ids, mask = (batch.data[0], batch.mask) if last_batch == "pad" else \
                (batch[0], torch.ones(global_batch, dtype=torch.bool))
            out.append((ids.tolist(), mask.tolist()))
            if len(out) == batches:
                break
    return out


@settings(max_examples=14, deadline=None)
@given(mesh=st.sampled_from(MESHES), num_samples=st.integers(5, 40),
       microbatch=st.integers(1, 3), accumulation=st.integers(1, 2), seed=st.integers(0, 99),
       last_batch=st.sampled_from(["drop", "pad"]))
def test_each_rank_reads_its_block_of_the_one_process_order(worlds, mesh, num_samples,
                                                            microbatch, accumulation, seed,
                                                            last_batch):
    axes, data_axes = mesh
    size = 1
    for n in axes.values():
        size *= n
    data_ranks = 1
    for a in data_axes:
        data_ranks *= axes[a]
    local = microbatch * accumulation
    global_batch = local * data_ranks
    if last_batch == "drop":
        num_samples = max(num_samples, global_batch)
    per_epoch = num_samples // global_batch if last_batch == "drop" else \
        -(-num_samples // global_batch)
    batches = per_epoch + 1  # into the second epoch
    results = worlds(size).run(_read_epochs, axes, data_axes, num_samples, global_batch,
                               accumulation, seed, last_batch, batches)
    reference = _reference(num_samples, global_batch, seed, last_batch, batches)
    by_data_index = defaultdict(list)
    for rank, (coords, layout, got, state) in enumerate(results):
        index = 0
        for a in data_axes:  # row-major over the data axes, in mesh order
            index = index * axes[a] + coords[a]
        assert (layout.data_index, layout.data_ranks, layout.local_batch) == \
            (index, data_ranks, local), rank
        for (ids, mask), (ref_ids, ref_mask) in zip(got, reference, strict=True):
            block = slice(index * local, (index + 1) * local)
            assert ids == ref_ids[block], (rank, coords)
            if last_batch == "pad":
                assert mask == ref_mask[block], (rank, coords)
        by_data_index[index].append(got)
        assert (state.epoch, state.offset) == ((1, global_batch) if per_epoch > 1 else (2, 0))
    assert sorted(by_data_index) == list(range(data_ranks))
    for index, copies in by_data_index.items():  # tp / pp peers: the same batches
        assert all(c == copies[0] for c in copies), index
    # the data ranks together read each sample of the first epoch once
    real = Counter(i for index in by_data_index
                   for ids, mask in by_data_index[index][0][:per_epoch]
                   for i, keep in zip(ids, mask or [True] * len(ids), strict=True) if keep)
    assert set(real.values()) == {1}
    assert len(real) == (num_samples if last_batch == "pad" else per_epoch * global_batch)


def _with_workers(path, seq_len, context):
    import shardfn as sf
    from shardfn import data as sfd

    mesh = sf.Mesh({"dp": 2})
    tokens = sfd.TokenFile(path, seq_len)
    kwargs = dict(global_batch=4, seed=5, last_batch="pad")
    workers = sfd.loader(tokens, mesh, num_workers=2, multiprocessing_context=context, **kwargs)
    plain = sfd.loader(tokens, mesh, **kwargs)
    got = [(b.data[0].clone(), b.mask.clone()) for b in workers]
    want = [(b.data[0].clone(), b.mask.clone()) for b in plain]
    return got, want, workers.state == plain.state


def test_workers_inside_a_rank_read_the_same_batches(worlds, tmp_path):
    from shardfn import data as sfd

    path = tmp_path / "tokens.bin"
    sfd.write_tokens(path, torch.randint(0, 50_000, (4 * 11 + 1,),
                                         generator=torch.Generator().manual_seed(0)))
    reference = [(b.data[0], b.mask) for b in sfd.loader(sfd.TokenFile(path, 4),
                                                         global_batch=4, seed=5,
                                                         last_batch="pad")]
    assert len(reference) == 3 and reference[-1][1].tolist() == [True] * 3 + [False]
    # "fork": a rank is a spawned process, so its default start method is "spawn", whose
    # workers import shardfn anew (seconds each; tests/testing/test_local_world_issue22.py
    # runs that default); torchrun's processes on Linux fork by default
    results = worlds(2).run(_with_workers, path, 4, "fork")
    for rank, (got, want, same_state) in enumerate(results):
        assert same_state and len(got) == len(want) == 3
        for (x, mask), (x_plain, mask_plain), (x_ref, mask_ref) in zip(got, want, reference,
                                                                       strict=True):
            assert torch.equal(x, x_plain) and torch.equal(mask, mask_plain)
            assert torch.equal(x, x_ref[2 * rank:2 * rank + 2])
            assert torch.equal(mask, mask_ref[2 * rank:2 * rank + 2])
