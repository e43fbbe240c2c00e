"""The global order and its layout over data ranks, on one process (no world needed).

For any dataset length, global batch, number of data ranks and seed: every sample of
an epoch is read exactly once (``"drop"``: the whole batches; ``"pad"``: all, the
repeats masked), the data ranks' blocks in index order are the global batch whatever
their number, a position saved at any batch continues the same batches, and the
numbers that do not multiply out are refused with all four named.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, TensorDataset

import shardfn.data as sfd
from shardfn.data.order import batches_left


def _global_batches(num_samples, global_batch, data_ranks, *, seed, epochs=1, shuffle=True,
                    last_batch="drop", accumulation=1):
    """``[(indices of the global batch, its mask)]`` over ``epochs``, from the data
    ranks' samplers joined in data-index order."""
    samplers = [sfd.MeshSampler(num_samples, sfd.split_global_batch(
                    global_batch, data_ranks, i, accumulation=accumulation), seed=seed,
                    shuffle=shuffle, last_batch=last_batch) for i in range(data_ranks)]
    batches = []
    for epoch in range(epochs):
        for s in samplers:
            s.state = s.start_state(epoch)
        for k, pieces in enumerate(zip(*samplers, strict=True)):
            masks = [s.padding_mask(k * global_batch) for s in samplers]
            batches.append((sum(pieces, []), torch.cat(masks)))
    return batches


@settings(max_examples=60, deadline=None)
@given(num_samples=st.integers(1, 40), per_rank=st.integers(1, 4),
       data_ranks=st.sampled_from([1, 2, 3, 4]), seed=st.integers(0, 2**31),
       last_batch=st.sampled_from(["drop", "pad"]), shuffle=st.booleans())
def test_every_sample_once_per_epoch(num_samples, per_rank, data_ranks, seed, last_batch,
                                     shuffle):
    global_batch = per_rank * data_ranks
    if last_batch == "drop" and num_samples < global_batch:
        with pytest.raises(ValueError, match="fewer than one global batch"):
            _global_batches(num_samples, global_batch, data_ranks, seed=seed,
                            last_batch=last_batch)
        return
    epoch_batches = _global_batches(num_samples, global_batch, data_ranks, seed=seed,
                                    shuffle=shuffle, last_batch=last_batch)
    real = [i for indices, mask in epoch_batches
            for i, keep in zip(indices, mask.tolist(), strict=True) if keep]
    counts = Counter(real)
    assert all(c == 1 for c in counts.values())
    expected = num_samples if last_batch == "pad" else num_samples // global_batch * global_batch
    assert len(counts) == expected
    assert all(len(indices) == global_batch for indices, _ in epoch_batches)
    if last_batch == "drop":
        assert all(mask.all() for _, mask in epoch_batches)
    else:  # padding repeats samples of the epoch, only in its last batch
        assert all(mask.all() for _, mask in epoch_batches[:-1])


@settings(max_examples=40, deadline=None)
@given(num_samples=st.integers(24, 60), microbatch=st.integers(1, 3),
       accumulation=st.integers(1, 2), seed=st.integers(0, 2**31),
       last_batch=st.sampled_from(["drop", "pad"]))
def test_global_order_does_not_depend_on_the_number_of_data_ranks(
        num_samples, microbatch, accumulation, seed, last_batch):
    global_batch = 4 * microbatch * accumulation
    runs = {d: _global_batches(num_samples, global_batch, d, seed=seed, epochs=2,
                               last_batch=last_batch, accumulation=accumulation)
            for d in (1, 2, 4)}
    for d in (2, 4):
        assert [b for b, _ in runs[d]] == [b for b, _ in runs[1]]
        assert all(torch.equal(m, m1) for (_, m), (_, m1) in zip(runs[d], runs[1], strict=True))
    order = sfd.epoch_order(num_samples, seed, 0)
    assert runs[1][0][0] == order[:global_batch].tolist()  # batch 0 is the order's head
    # epochs are reshuffled (for lengths where two equal permutations are unlikely)
    if num_samples >= 12:
        assert not torch.equal(order, sfd.epoch_order(num_samples, seed, 1))


@settings(max_examples=40, deadline=None)
@given(num_samples=st.integers(4, 40), global_batch=st.integers(1, 8), seed=st.integers(0, 99),
       last_batch=st.sampled_from(["drop", "pad"]), data=st.data())
def test_loader_resumes_from_any_batch(num_samples, global_batch, seed, last_batch, data):
    dataset = TensorDataset(torch.arange(num_samples))
    make = lambda **kw: sfd.loader(dataset, global_batch=global_batch, seed=seed,  # noqa: E731
                                   last_batch=last_batch, **kw)

    def values(batch):
        return (batch.data[0] if last_batch == "pad" else batch[0]).tolist()

    if last_batch == "drop" and num_samples < global_batch:
        with pytest.raises(ValueError, match=f"fewer than one global batch of {global_batch}"):
            make()
        return
    straight = make()
    reference, states = [], []
    for _ in range(3):  # three epochs; the state after each batch
        for batch in straight:
            reference.append(values(batch))
            states.append(straight.state)
    per_epoch = straight.batches_per_epoch
    assert states[-1] == sfd.DataState(seed, 3, 0, num_samples, True)
    cut = data.draw(st.integers(0, 2 * per_epoch - 1), label="resume after batch")
    resumed = make(state=states[cut])
    rest = [values(b) for b in resumed]  # the rest of the epoch, or the next when it ended
    assert len(rest) == (per_epoch if states[cut].offset == 0 else per_epoch - 1 - cut % per_epoch)
    assert rest == reference[cut + 1:cut + 1 + len(rest)]
    assert resumed.state == sfd.DataState(seed, states[cut].epoch + 1, 0, num_samples, True)


def test_the_position_counts_batches_handed_out_not_prefetched():
    dataset = TensorDataset(torch.arange(12))
    data = sfd.loader(dataset, global_batch=3, seed=4, shuffle=False, num_workers=2)
    assert len(data) == data.batches_per_epoch == 4
    batches = iter(data)
    next(batches)
    assert data.state.offset == 3 and len(data) == 3   # workers have prefetched more
    (second,) = next(batches)
    assert second.tolist() == [3, 4, 5] and data.state.offset == 6
    fresh = iter(data)                                  # retires the first iterator
    with pytest.raises(RuntimeError, match="retired"):
        next(batches)
    assert [b.tolist() for (b,) in fresh] == [[6, 7, 8], [9, 10, 11]]
    assert data.state == sfd.DataState(4, 1, 0, 12, False)


def test_persistent_workers_continue_a_broken_off_epoch():
    dataset = TensorDataset(torch.arange(24))
    plain = sfd.loader(dataset, global_batch=4, seed=3)
    reference = [b.tolist() for _ in range(2) for (b,) in plain]  # two epochs
    data = sfd.loader(dataset, global_batch=4, seed=3, num_workers=2, persistent_workers=True)
    batches = iter(data)
    got = [next(batches)[0].tolist() for _ in range(2)]           # break off after 2
    for _ in range(2):                                             # the rest, then epoch 1
        got += [b.tolist() for (b,) in data]
    assert got == reference and data.state == plain.state


def test_the_loader_leaves_torchs_global_rng_alone():
    # a DataLoader without a generator draws its workers' base seed from the global RNG
    # at every iter(): a resumed run's dropout masks would then differ
    rng = torch.get_rng_state()
    data = sfd.loader(TensorDataset(torch.arange(8)), global_batch=2, seed=0)
    for _ in range(2):
        list(data)
    assert torch.equal(torch.get_rng_state(), rng)
    list(torch.utils.data.DataLoader(TensorDataset(torch.arange(8)), batch_size=2))
    assert not torch.equal(torch.get_rng_state(), rng)  # the check can fail


def test_the_four_numbers_are_checked():
    with pytest.raises(ValueError, match=r"global_batch=10 must equal microbatch=2 x "
                                         r"accumulation=2 x data ranks=3 = 12"):
        sfd.split_global_batch(10, 3, 0, microbatch=2, accumulation=2)
    with pytest.raises(ValueError, match=r"global_batch=10 must equal microbatch x "
                                         r"accumulation=2 x data ranks=3"):
        sfd.split_global_batch(10, 3, 0, accumulation=2)
    layout = sfd.split_global_batch(12, 3, 2, accumulation=2)
    assert (layout.microbatch, layout.local_batch, layout.local_start) == (2, 4, 8)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="global_batch must be an int >= 1"):
            sfd.split_global_batch(bad)
    with pytest.raises(ValueError, match=r"data_index must be an int in \[0, 2\)"):
        sfd.split_global_batch(4, 2, 2)
    assert sfd.batch_layout(None, "tp", global_batch=6, accumulation=3).microbatch == 2


def test_states_of_another_order_are_refused():
    dataset = TensorDataset(torch.arange(10))
    data = sfd.loader(dataset, global_batch=2, seed=3)
    next(iter(data))
    saved = data.state
    assert sfd.loader(dataset, global_batch=2, seed=3, state=saved._asdict()).state == saved
    for kwargs, field in (({"seed": 4}, "seed"), ({"shuffle": False}, "shuffle")):
        with pytest.raises(ValueError, match=f"{field}=.* was saved, but this loader has"):
            sfd.loader(dataset, global_batch=2, **{"seed": 3, **kwargs}, state=saved)
    with pytest.raises(ValueError, match="num_samples=10 was saved"):
        sfd.loader(TensorDataset(torch.arange(11)), global_batch=2, seed=3, state=saved)
    with pytest.raises(ValueError, match="offset=11 is past the end"):
        sfd.loader(dataset, global_batch=2, seed=3, state=saved._replace(offset=11))
    with pytest.raises(ValueError, match="epoch must be an int >= 0"):
        data.load_state(saved._replace(epoch=-1))
    with pytest.raises(TypeError, match="lacks"):
        data.load_state({"seed": 3})
    # a different global batch continues the same order from the same sample
    other = sfd.loader(dataset, global_batch=4, seed=3, state=saved)
    assert next(iter(other))[0].tolist() == sfd.epoch_order(10, 3, 0)[2:6].tolist()
    assert batches_left(saved, 4, "drop") == 2


def test_loader_refuses_what_it_cannot_lay_out():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(4)

    class NoLength(Dataset):
        def __getitem__(self, i):
            return i

    for dataset in (Stream(), NoLength()):
        with pytest.raises(TypeError, match="map-style dataset"):
            sfd.loader(dataset, global_batch=2)
    dataset = TensorDataset(torch.arange(8))
    with pytest.raises(TypeError, match=r"sets the DataLoader's \['batch_size', 'drop_last'\]"):
        sfd.loader(dataset, global_batch=2, batch_size=2, drop_last=True)
    with pytest.raises(ValueError, match="last_batch must be 'drop' or 'pad'"):
        sfd.loader(dataset, global_batch=2, last_batch="keep")
